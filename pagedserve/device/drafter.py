"""The proposers that run on the device: a smaller model with the target's vocabulary
(`draft_model`) or EAGLE-3 heads over the target's hidden states (`eagle3`). Once a step's
tokens are known, the drafter drafts greedily up to k tokens ahead for the requests the
scheduler asked (`SchedulerOutput.num_lookahead_tokens`); the next step verifies them.

Its KV lives in the target's pool: caches of its own layers with as many blocks as the
target's, addressed by the same block ids through the same block tables. One allocator then
serves both, so the pool's invariants, prefix caching, chunked prefill and preemption need
nothing of their own (a block's copies to swap space and the offload tiers take the draft's
layers with the target's), and a block that the prefix cache hands to another request holds
the draft's KV of the same tokens. That holds because the draft runs over every chunk the
target computes, in the same step (`propose`): the tokens the target kept (a verify's
accepted part only), so the positions past them are written again when their tokens are
known, as the target's are. The cost: each block is larger by the draft's share
(`block_bytes`) and the draft prefills every prompt. A pool of its own would have needed a
second allocator, prefix index and preemption policy kept in step with the first. (EAGLE-3's
row at a position reads the token after it, so the last position of a prefix hit keeps the
row of the token that followed it where it was cached; and a target with a sliding window
nulls the table entries of blocks out of its window, which a draft without one would read as
zeros. Either can only lower acceptance, never change the output.)

A drafting request's positions past its known tokens are allocated with its step (the
scheduler's lookahead) and given back after it. The single-token draft steps (every draft
after a request's first) go through step buffers of their own and, on CUDA, replay captured
graphs (`cuda_graphs.StepGraphs`, sized up to disable_by_batch_size requests): a draft
model's forward, or the EAGLE-3 head's, which reads the hidden states of the step before
from a buffer of its own. The first draft comes from the forward over the step's chunks,
eager (its lengths vary). Drafts are the draft's argmax: a deterministic
proposer, which the verify treats as one-hot (`rejection.py`), exact for any sampling of the
target.

Under tensor parallelism the draft runs inside every rank, sharded as the target (its layers
are the decoder's, built for the rank's group; EAGLE-3 heads shard their layer's projections
and keep the rest whole: `model/eagle3.py`), so each rank keeps its share of the draft's KV
heads in its blocks. Each draft step's tokens are rank 0's (one broadcast, as the runner
does for sampled tokens): every rank feeds the same drafts to its next draft step.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from pagedserve.attention.backend import AttentionBackend, AttentionShape, set_forward_context
from pagedserve.attention.selector import get_attention_backend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import EngineConfig
from pagedserve.device.cuda_graphs import StepGraphs
from pagedserve.device.input_batch import CachedRequestState, StepBuffers
from pagedserve.device.loading import engine_ops
from pagedserve.kernels.penalties import to_device
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.model import parallel
from pagedserve.model.eagle3 import Eagle3Head, eagle3_config, load_eagle3
from pagedserve.model.loader import load_model, read_model_config
from pagedserve.spec.config import SpeculativeConfig


@dataclass
class DraftStep:
    """A launched step as the drafter reads it once the step's tokens are known: taken at
    the launch, so that it stays the step as it ran while later steps are prepared before
    its tokens come back (async scheduling: a finished request's state and block-table row
    are gone by then, and a row may hold another request's blocks)."""

    states: list[CachedRequestState]  # the runner's, by object: they receive the tokens
    starts: list[int]  # each request's first computed position (its num_computed_tokens)
    num_scheduled: list[int]
    num_lookahead: dict[str, int]  # the requests to draft for, each with how many drafts
    aux: Tensor | None  # eagle3: the target's captured hidden states, a row per token
    table: np.ndarray  # a block-table row per request (a copy), as wide as the draft reads


def draft_step(states: list[CachedRequestState], starts: list[int], num_scheduled: list[int],
               num_lookahead: dict[str, int], aux: Tensor | None, table: np.ndarray,
               rows: np.ndarray, block_size: int) -> DraftStep:
    """The step's `DraftStep`, its block-table rows copied out of the runner's `table` as
    far as the draft writes: each chunk and its drafts' positions."""
    ends = [start + num + num_lookahead.get(state.req_id, 0)
            for state, start, num in zip(states, starts, num_scheduled)]
    width = min(table.shape[1], -(-max(ends, default=0) // block_size))
    return DraftStep(states, starts, num_scheduled, num_lookahead, aux,
                     table[rows, :width].copy())


@dataclass
class _Chunk:
    """One sequence of a draft forward: its block-table row, first position, token ids
    and (EAGLE-3) the hidden rows it reads; `count`: the drafts it makes (0: none)."""

    req_id: str
    row: int
    start: int
    token_ids: list[int]
    hidden: slice | None
    count: int


class Drafter(abc.ABC):
    """What the runner calls: the draft's KV size and allocation, and `propose`."""

    capture: tuple[int, ...] = ()  # target layers whose hidden states the drafter reads

    def __init__(self, layers: list[nn.Module], config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, block_size: int, backend: AttentionBackend) -> None:
        self.layers, self.config, self.dtype = layers, config, dtype
        self.device, self.block_size, self.backend = device, block_size, backend
        self.kv_caches: list[tuple[Tensor, Tensor]] = []
        self.buffers: StepBuffers | None = None  # the single-token draft steps' (`setup`)
        self.graphs: StepGraphs | None = None

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank keeps (tensor parallelism shards the draft's as the
        target's)."""
        return self.layers[0].num_kv_heads

    @property
    def block_bytes(self) -> int:
        """One block of the draft's K and V over its layers, on this rank (kept in the
        activation dtype: the draft's KV is not quantized)."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return (2 * len(self.layers) * self.block_size * self.num_kv_heads
                * self.config.head_dim * element)

    def allocate(self, num_blocks: int) -> None:
        """Caches of `num_blocks` blocks (the target pool's count), bound to the draft's
        layers; the null block zeroed as the target's is."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.config.head_dim)
        self.kv_caches = []
        for attention in self.layers:
            k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            k_cache[0].zero_()
            v_cache[0].zero_()
            attention.k_cache, attention.v_cache, attention.kv_scales = k_cache, v_cache, None
            self.kv_caches.append((k_cache, v_cache))

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        """Run the draft over what the step's target kept (writing its KV), then draft;
        once the step's tokens are appended to its states. Its inputs go up through pinned
        memory without waiting (`to_device`): under async scheduling the run over a step
        that drafts for none comes while the next step runs, which a blocking copy would
        wait for."""
        chunks, first, table = [], 0, step.table
        for row, (state, start, num) in enumerate(zip(step.states, step.starts,
                                                      step.num_scheduled)):
            # the chunk's tokens the target kept (a verify's accepted part): every token but
            # the last known one, which a sampling row has just appended
            kept = min(num, len(state.all_token_ids) - start - 1)
            chunks.append(self._chunk(state, row, start, kept, first,
                                      step.num_lookahead.get(state.req_id, 0)))
            first += num
        chunks.sort(key=lambda c: len(c.token_ids) != 1)  # single-token sequences first
        drafting = [c for c in chunks if c.count]
        ids = to_device(torch.tensor([t for c in chunks for t in c.token_ids]), self.device)
        hidden = None
        if step.aux is not None:
            hidden = torch.cat([step.aux[c.hidden] for c in chunks])
        positions, meta = self._batch(table, chunks, [len(c.token_ids) for c in chunks])
        last = np.cumsum([len(c.token_ids) for c in chunks]) - 1
        last_rows = to_device(torch.tensor([last[i] for i, c in enumerate(chunks) if c.count],
                                           dtype=torch.long), self.device)
        tokens, hidden = self._draft(ids, positions, meta, hidden, last_rows)
        if not drafting:
            return {}
        tokens = parallel.broadcast_(tokens)
        drafts, before = [tokens], drafting  # `tokens` has a row for each of `before`
        for j in range(1, max(c.count for c in drafting)):
            still = [i for i, c in enumerate(before) if c.count > j]
            if len(still) < len(before):  # fewer drafts were asked of some: they stop
                index = to_device(torch.tensor(still, dtype=torch.long), self.device)
                tokens = tokens.index_select(0, index)
                hidden = hidden.index_select(0, index) if hidden is not None else None
            before = [before[i] for i in still]
            step_chunks = [_Chunk(c.req_id, c.row, self._next_position(c, j), [], None, 0)
                           for c in before]
            tokens, hidden = self._decode(table, step_chunks, tokens, hidden)
            drafts.append(parallel.broadcast_(tokens))
        return self._collect(drafting, drafts)

    def setup(self, max_batch: int, max_model_len: int, graphs: bool) -> None:
        """Step buffers for the single-token draft steps and, on CUDA, their graphs (as the
        target's decode steps: a draft step is mostly launches at small batch). `max_batch`:
        the most requests drafted for at once; `graphs`: CUDA graphs allowed."""
        max_blocks = -(-max_model_len // self.block_size)
        self.buffers = StepBuffers(max_batch, max_batch, max_blocks, self.device)
        if graphs and self.backend.capturable:
            self.graphs = StepGraphs(self._step_forward, self.backend, self.buffers,
                                     max_batch, max_model_len)
            self.graphs.capture()

    def _decode(self, table: np.ndarray, chunks: list[_Chunk], tokens: Tensor,
                hidden: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """A draft step of one token per chunk (`tokens`, at each chunk's start), through
        the step buffers (and a graph of the smallest captured size that holds it, padded
        with rows that write nothing) where they hold it."""
        b, n, bs = self.buffers, len(chunks), self.block_size
        if b is None or n > b.seq_lens.np.shape[0]:
            positions, meta = self._batch(table, chunks, [1] * n)
            every = torch.arange(n, device=self.device)
            return self._draft(tokens, positions, meta, hidden, every)
        size = self.graphs.padded_size(n) if self.graphs is not None else n
        positions = np.array([c.start for c in chunks], dtype=np.int64)
        b.wait_for_uploads()
        b.fill_block_tables(table, np.array([c.row for c in chunks]), size,
                            -(-int(positions.max() + 1) // bs))
        b.positions.np[:n] = positions
        b.slot_mapping.np[:n] = (b.block_tables.np[np.arange(n), positions // bs]
                                 .astype(np.int64) * bs + positions % bs)
        b.seq_lens.np[:n] = positions + 1
        b.query_start_loc.np[:n + 1] = np.arange(n + 1)
        b.pad_rows(n, n, size, 1)  # padding rows write nothing
        meta = AttentionMetadata(
            num_decodes=size, num_decode_tokens=size, slot_mapping=b.slot_mapping.upload(size),
            block_tables=b.block_tables.upload(size), seq_lens=b.seq_lens.upload(size),
            query_start_loc=b.query_start_loc.upload(size + 1), max_query_len=1,
            max_seq_len=int(positions.max() + 1))
        ids, step_positions = b.input_ids.device[:size], b.positions.upload(size)
        b.mark_uploaded()
        ids[n:].zero_()
        ids[:n].copy_(tokens)
        self._stage(hidden, n, size)
        if self.graphs is not None:
            out = self.graphs.replay(size)
        else:
            with set_forward_context(meta, self.backend):
                out = self._step_forward(ids, step_positions)
        return self._step_output(out, n)

    def _stage(self, hidden: Tensor | None, n: int, size: int) -> None:
        """Write a draft step's inputs beyond its token ids (EAGLE-3: the hidden states it
        reads) into buffers of the drafter's own, which the step's graph reads."""

    @abc.abstractmethod
    def _step_forward(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """A single-token draft step's forward over the step buffers, as a graph captures
        it (no host work, fixed addresses)."""

    @abc.abstractmethod
    def _step_output(self, out: tuple[Tensor, ...], n: int) -> tuple[Tensor, Tensor | None]:
        """The greedy tokens of a draft step's first `n` rows and what the next step reads
        there (see `_draft`), from `_step_forward`'s output."""

    def profile(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                aux: Tensor | None, max_num_seqs: int) -> None:
        """The memory-profiling batch through the draft (its peak counts against the KV
        budget as the target's does): the target's batch as one chunk, drafting from its
        last max_num_seqs rows."""
        rows = torch.arange(max(0, ids.shape[0] - max_num_seqs), ids.shape[0],
                            device=ids.device)
        # the batch may reach the target's whole context: within the draft's RoPE table
        positions = positions.clamp(max=self.config.max_model_len - 1)
        self._draft(ids, positions, meta, aux, rows)

    @staticmethod
    def _collect(drafting: list[_Chunk], drafts: list[Tensor]) -> dict[str, list[int]]:
        """Each drafting request's drafts in order (the j-th step's tensor holds a row for
        each request still drafting then, in `drafting` order)."""
        rows = [d.tolist() for d in drafts]
        result: dict[str, list[int]] = {c.req_id: [] for c in drafting}
        for j, row in enumerate(rows):
            for c, token in zip([c for c in drafting if c.count > j], row):
                result[c.req_id].append(token)
        return result

    def _batch(self, table: np.ndarray, chunks: list[_Chunk], lengths: list[int]
               ) -> tuple[Tensor, AttentionMetadata]:
        """Positions and attention metadata of a draft forward over `chunks`, each its
        `lengths` tokens from its start (single-token sequences first, as backends want)."""
        bs = self.block_size
        num = np.array(lengths, dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(num, out=query_start[1:])
        seq = np.repeat(np.arange(len(chunks)), num)
        positions = np.arange(int(num.sum())) - query_start[seq] + starts[seq]
        seq_lens = starts + num
        width = -(-int(seq_lens.max()) // bs)
        tables = table[np.array([c.row for c in chunks]), :width]
        slots = tables[seq, positions // bs].astype(np.int64) * bs + positions % bs
        num_decodes = int(np.argmax(num != 1)) if (num != 1).any() else len(chunks)

        def upload(values: np.ndarray, dtype: torch.dtype) -> Tensor:
            return to_device(torch.from_numpy(np.ascontiguousarray(values)).to(dtype),
                             self.device)

        meta = AttentionMetadata(
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            slot_mapping=upload(slots, torch.int64), block_tables=upload(tables, torch.int32),
            seq_lens=upload(seq_lens, torch.int32),
            query_start_loc=upload(query_start, torch.int32),
            max_query_len=int(num.max()), max_seq_len=int(seq_lens.max()))
        return upload(positions, torch.int64), meta

    @abc.abstractmethod
    def _chunk(self, state: CachedRequestState, row: int, start: int, kept: int,
               first_row: int, count: int) -> _Chunk:
        """The rows of the step's chunk of `state` that the draft forward reads."""

    @staticmethod
    def _next_position(chunk: _Chunk, j: int) -> int:
        """Where the j-th draft sits when it is read (j >= 1): past the chunk's last row."""
        return chunk.start + len(chunk.token_ids) - 1 + j

    @abc.abstractmethod
    def _draft(self, ids: Tensor, positions: Tensor, meta: AttentionMetadata,
               hidden: Tensor | None, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        """A draft forward: the greedy next token at `rows`, and what the next draft step
        reads at those rows (EAGLE-3: the head's pre-norm output; a draft model: None)."""


class DraftModel(Drafter):
    """A smaller decoder of the target's vocabulary, through the same decoder code: its row
    at a position is that position's token, as the target's."""

    def __init__(self, model: Decoder, device: torch.device, block_size: int,
                 backend: AttentionBackend) -> None:
        super().__init__(model.attention_layers(), model.config,
                         model.embed_tokens.weight.dtype, device, block_size, backend)
        self.model = model

    def _step_forward(self, ids, positions):
        return (self.model(ids, positions),)

    def _step_output(self, out, n):
        return self.model.compute_logits(out[0][:n]).argmax(-1), None

    def _chunk(self, state, row, start, kept, first_row, count):
        # a drafting request's new token too: the first draft follows it
        end = start + kept + (1 if count else 0)
        return _Chunk(state.req_id, row, start, state.all_token_ids[start:end], None, count)

    def _draft(self, ids, positions, meta, hidden, rows):
        with set_forward_context(meta, self.backend):
            out = self.model(ids, positions)
        return self.model.compute_logits(out[rows]).argmax(-1), None


class Eagle3Drafter(Drafter):
    """EAGLE-3 heads: the row at position p reads the target's hidden states there and the
    token after p, and predicts the one after that."""

    def __init__(self, head: Eagle3Head, capture: tuple[int, ...], device: torch.device,
                 block_size: int, backend: AttentionBackend) -> None:
        super().__init__(head.attention_layers(), head.config, head.fc.weight.dtype, device,
                         block_size, backend)
        self.head, self.capture = head, capture
        self.hidden: Tensor | None = None  # a draft step's input states (`setup`)

    def setup(self, max_batch: int, max_model_len: int, graphs: bool) -> None:
        """Also the buffer of the hidden states a draft step reads (the head's pre-norm
        output of the step before), which its graphs read in place."""
        self.hidden = torch.zeros(max_batch, self.config.hidden_size, dtype=self.dtype,
                                  device=self.device)
        super().setup(max_batch, max_model_len, graphs)

    def _stage(self, hidden, n, size):
        self.hidden[:n].copy_(hidden)
        self.hidden[n:size].zero_()  # padding rows: finite inputs, whose outputs are unread

    def _step_forward(self, ids, positions):
        return self.head(ids, positions, self.hidden[:ids.shape[0]])

    def _step_output(self, out, n):
        normed, prenorm = out
        # a copy: a graph's output buffer is overwritten by its next replay
        return self.head.draft_tokens(normed[:n]), prenorm[:n].clone()

    def _chunk(self, state, row, start, kept, first_row, count):
        tokens = state.all_token_ids[start + 1:start + kept + 1]
        return _Chunk(state.req_id, row, start, tokens, slice(first_row, first_row + kept),
                      count)

    def _draft(self, ids, positions, meta, hidden, rows):
        with set_forward_context(meta, self.backend):
            normed, prenorm = self.head(ids, positions, hidden)
        return self.head.draft_tokens(normed[rows]), prenorm[rows]


def make_drafter(config: EngineConfig, target: Decoder, target_config: ModelConfig,
                 device: torch.device) -> Drafter | None:
    """The configured proposer on the device, loaded; None for none or a host proposer. A
    draft of another vocabulary, or heads made for another target, is a ValueError here,
    at start-up. Its attention backend is chosen for its own heads (`attention_backend`)."""
    spec = config.speculative_config
    if spec is None or not spec.on_device:
        return None
    dtype = target.embed_tokens.weight.dtype
    ops = engine_ops(config, device, dtype)
    if spec.method == "eagle3":
        head, capture = load_eagle3(spec.model, target_config, target.embed_tokens, dtype,
                                    device, ops, _context(config, target_config))
        _check_context(head.config, config, target_config, "the EAGLE-3 head's")
        return Eagle3Drafter(head, capture, device, config.block_size, attention_backend(
            config.attention_backend, device, head.config, head.fc.weight.dtype))
    # the engine's load_format holds for its draft ("dummy": random weights for both)
    model, draft_config, _ = load_model(spec.model, dtype, device,
                                        load_format=config.load_format, ops=ops)
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary "
                         f"({draft_config.vocab_size} tokens) is not the target's "
                         f"({target_config.vocab_size}); a draft model must share the "
                         "target's tokenizer")
    _check_context(draft_config, config, target_config, "the draft's")
    return DraftModel(model, device, config.block_size, attention_backend(
        config.attention_backend, device, draft_config, dtype))


def attention_backend(name: str, device: torch.device, config: ModelConfig,
                      dtype: torch.dtype) -> AttentionBackend:
    """The backend for a draft's attention, whose heads may be shaped unlike the target's
    (its KV cache is in the activation dtype): this rank's heads."""
    return get_attention_backend(name, device, AttentionShape(
        dtype, dtype, len(parallel.local_q_heads(config)),
        len(parallel.local_kv_heads(config)), config.head_dim, config.attn_softcap))


def check_shardable(spec: SpeculativeConfig | None, size: int) -> None:
    """A ValueError now, before any worker starts, for a draft or EAGLE-3 head that `size`
    ranks cannot split (its heads and intermediate size, as the target's)."""
    if spec is None or not spec.on_device or size == 1:
        return
    config = (eagle3_config(spec.model) if spec.method == "eagle3"
              else read_model_config(spec.model))
    try:
        parallel.check_shardable(config, size)
    except ValueError as error:
        raise ValueError(f"speculative_config.model: {error}") from None


def _check_context(draft: ModelConfig, config: EngineConfig, target: ModelConfig,
                   whose: str) -> None:
    """The draft runs at every position the target does: its RoPE table must reach the
    engine's max_model_len."""
    wanted = _context(config, target)
    if draft.max_model_len < wanted:
        raise ValueError(f"speculative_config.model: {whose} context ({draft.max_model_len} "
                         f"positions) is shorter than max_model_len ({wanted}); lower "
                         "max_model_len")


def _context(config: EngineConfig, target: ModelConfig) -> int:
    """The positions the engine may reach: max_model_len, at most the target's."""
    return min(config.max_model_len or target.max_model_len, target.max_model_len)
