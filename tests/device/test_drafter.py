"""A proposer on the device drafts what the same draft computes over the whole sequence at
once: the runner's drafts after each step (`ModelRunnerOutput.draft_token_ids`) equal a
dense rollout of a separate copy of the target and the drafter over the request's tokens
as they stand. That holds only if the drafter's KV in the target's blocks is that of the
request's tokens at every position (chunked prefill, rejected drafts overwritten) and its
rows sit where they should; EAGLE-3's rows also read the right hidden states of the target.
Driven through the scheduler and the runner's three calls, one request at a time."""

from __future__ import annotations

import torch

from pagedserve.attention.backend import set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.model import load_model
from pagedserve.model.eagle3 import load_eagle3
from pagedserve.model.ops import select_ops
from tests.engine.test_async_scheduling import greedy, loaded, prompts  # noqa: F401
from tests.engine.test_speculative_models import make, models  # noqa: F401 (fixtures)

K = 3


class Dense:
    """One sequence through a module's own paged caches, fed a range of positions at a time
    (what a plain causal forward over the sequence computes)."""

    def __init__(self, layers, block_size: int = 16, num_blocks: int = 16) -> None:
        for layer in layers:
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.block_size, self.num_blocks = block_size, num_blocks

    def __call__(self, start: int, n: int):
        """The forward context and positions of tokens [start, start + n)."""
        meta = AttentionMetadata(
            num_decodes=int(n == 1), num_decode_tokens=int(n == 1),
            slot_mapping=torch.arange(start, start + n) + self.block_size,
            block_tables=torch.arange(1, self.num_blocks, dtype=torch.int32)[None],
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n,
            max_seq_len=start + n)
        return set_forward_context(meta, TorchRefBackend()), torch.arange(start, start + n)


@torch.no_grad()
def eagle3_rollout(target, head, capture, tokens: list[int]) -> list[int]:
    """Drafts after `tokens` (the last one not yet computed by the target)."""
    n = len(tokens) - 1
    context, positions = Dense(target.attention_layers())(0, n)
    with context:
        _, streams = target.forward_capturing(torch.tensor(tokens[:n]), positions, capture)
    dense = Dense(head.attention_layers())
    context, positions = dense(0, n)  # row p: the token after p, the target's state at p
    with context:
        normed, hidden = head(torch.tensor(tokens[1:]), positions, streams)
    drafts, hidden = [int(head.draft_tokens(normed[-1:]))], hidden[-1:]
    for j in range(1, K):
        context, positions = dense(n - 1 + j, 1)
        with context:
            normed, hidden = head(torch.tensor(drafts[-1:]), positions, hidden)
        drafts.append(int(head.draft_tokens(normed)))
    return drafts


@torch.no_grad()
def draft_rollout(draft, tokens: list[int]) -> list[int]:
    dense = Dense(draft.attention_layers())
    context, positions = dense(0, len(tokens))
    with context:
        hidden = draft(torch.tensor(tokens), positions)
    drafts = [int(draft.compute_logits(hidden[-1:]).argmax(-1))]
    for j in range(1, K):
        context, positions = dense(len(tokens) - 1 + j, 1)
        with context:
            hidden = draft(torch.tensor(drafts[-1:]), positions)
        drafts.append(int(draft.compute_logits(hidden).argmax(-1)))
    return drafts


def drive(engine, prompt: list[int], max_tokens: int):
    """Step one request by hand: schedule, the runner's three calls, place the tokens.
    Yields (the request's tokens after the step, the step's drafts for it)."""
    core = engine.engine_core
    engine.add_request("r", None, greedy(max_tokens), prompt_token_ids=prompt)
    runner, tokens = core.model_runner, list(prompt)
    while core.scheduler.has_unfinished_requests():
        out = core.scheduler.schedule()
        result = runner.sample_tokens(runner.launch(runner.prepare_step(out))).result()
        core.scheduler.update_from_output(out, result)
        for row, req_id in enumerate(result.req_ids):
            accepted = result.accepted_token_ids[row] if result.accepted_token_ids else []
            tokens += [*accepted, result.sampled_token_ids[row]]
            yield list(tokens), (result.draft_token_ids or {}).get(req_id)


def test_eagle3_drafts_are_a_dense_rollouts(loaded, models):
    target, config, _ = load_model(loaded.tokenizer_source, torch.float32, "cpu")
    head, capture = load_eagle3(models["eagle3"], config, target.embed_tokens, torch.float32,
                                torch.device("cpu"), select_ops("cpu", torch.float32),
                                config.max_model_len)
    engine = make(loaded, {"method": "eagle3", "model": models["eagle3"],
                           "num_speculative_tokens": K}, draft_layers=1)
    steps = list(drive(engine, prompts(3, [70])[0], 16))  # a chunked prefill, then verifies
    drafted = [(tokens, drafts) for tokens, drafts in steps if drafts]
    assert len(drafted) >= 3
    for tokens, drafts in drafted:
        assert drafts == eagle3_rollout(target, head, capture, tokens)[:len(drafts)]


def test_draft_model_drafts_are_a_dense_rollouts(loaded, models):
    draft, _, _ = load_model(models["draft"], torch.float32, "cpu")
    engine = make(loaded, {"model": models["draft"], "num_speculative_tokens": K},
                  draft_layers=1)
    drafted = [(t, d) for t, d in drive(engine, prompts(4, [70])[0], 16) if d]
    assert len(drafted) >= 3
    for tokens, drafts in drafted:
        assert drafts == draft_rollout(draft, tokens)[:len(drafts)]
