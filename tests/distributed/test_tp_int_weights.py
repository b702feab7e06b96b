"""Tensor parallelism over packed integer weights (model/int_weights.py), checkpoints written
by benchmarks/quantize_int.py: compressed-tensors with zero points, GPTQ with desc_act (g_idx
on the row-parallel o_proj and down_proj, whose ranks keep every group), and
compressed-tensors whose down_proj the two ranks split inside a group (each rank keeps every
group and a g_idx of its own columns).

- Two gloo ranks give one process's logits on the exact path (the dequantizing reference);
  in the CPU's fast mode (each rank's layers on the native int8-activation kernels,
  model/int_native.py: a row-parallel rank's share of desc_act groups padded to whole
  blocks) they stay within the activations' int8 rounding of it.
- `LLM(tensor_parallel_size=2)` runs such a checkpoint end to end through its workers and
  gives TP=1's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.quantize_int import quantize_folder
from pagedserve.entrypoints.llm import LLM
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.model import int_weights
from pagedserve.model.int_weights import IntScheme
from pagedserve.sampling_params import SamplingParams
from tests.distributed.harness import (assert_ranks_equal_reference, paged_logits,
                                       tiny_checkpoint, tp_logits)
from tests.distributed.ranks import run_on_ranks

# (AWQ loads to the same layout as asymmetric compressed-tensors: tests/model covers it)
# case -> (intermediate size, format, options). 704 = 2 x 352: each rank's half of
# down_proj's input is 11 whole groups of 32; 688 = 2 x 344 cuts group 10 between the ranks
FORMATS = {"ct-asym-g32": (704, "compressed-tensors", dict(group=32, symmetric=False,
                                                           dtype=torch.bfloat16)),
           "gptq-desc_act-g32": (704, "gptq", dict(group=32, act_order=True)),
           "ct-sym-g32-cut": (688, "compressed-tensors", dict(group=32))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-int")
    floats, folders = {}, {}
    for case, (intermediate, fmt, options) in FORMATS.items():
        if intermediate not in floats:
            (root / str(intermediate)).mkdir()
            floats[intermediate] = Path(tiny_checkpoint(
                root / str(intermediate), "tiny-llama3", intermediate_size=intermediate))
        quantize_folder(floats[intermediate], root / case, fmt, **options)
        folders[case] = str(root / case)
    return folders


def exact_and_fast(folders: list[str]) -> tuple[list, list]:
    """Each folder's logits on the exact path and in the fast mode (one group for both)."""
    return tp_logits(folders), tp_logits(folders, quantized=True)


def test_tp2_logits_equal_tp1_on_packed_weights(checkpoints):
    folders = [checkpoints[c] for c in FORMATS]
    ranks = run_on_ranks(exact_and_fast, folders, size=2)
    for i, (case, folder) in enumerate(zip(FORMATS, folders)):
        want = paged_logits(folder)
        assert_ranks_equal_reference(case, [exact[i] for exact, _ in ranks], want)
        fast0, fast1 = (fast[i] for _, fast in ranks)
        for w, g0, g1 in zip(want, fast0, fast1):
            assert torch.equal(g0, g1), f"{case}: ranks disagree on the gathered logits"
            # the int8 rounding of the activations (tests/model/test_int_native.py): a
            # wrong layout or a rank's wrong groups are of the logits' own size
            assert 0 < (g0 - w).abs().max() < 0.05 * w.abs().max(), case


def test_tp2_engine_gives_tp1_tokens_on_packed_weights(checkpoints):
    """Through the engine's workers (GPTQ desc_act: g_idx on row-parallel layers); the exact
    path, so that the tokens must be equal."""
    folder = checkpoints["gptq-desc_act-g32"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM.from_engine(LLMEngine.from_options(
            folder, device="cpu", dtype="float32", tensor_parallel_size=tp, seed=0,
            kv_cache_memory=8 << 20))
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        tokens.append([o.outputs[0].token_ids for o in outputs])
    assert [len(t) for t in tokens[1]] == [12, 12, 12]
    assert tokens[1] == tokens[0]


def test_a_rank_split_inside_a_group_keeps_every_group_with_its_columns_groups():
    """Rank 1 of down_proj with 688 inputs starts at column 344, inside group 10 of 32: the
    loader gives it every group and a g_idx of its columns (`splits_groups`), as with
    desc_act; a slice of whole groups would be wrong, so take_shard refuses one."""
    scheme = IntScheme("compressed-tensors", 4, 32, True, False)
    rows = (1, list(range(344, 688)))
    assert int_weights.splits_groups(scheme, rows[1])
    assert not int_weights.splits_groups(scheme, list(range(352, 704)))
    scales = torch.ones(256, 22)
    with pytest.raises(ValueError, match="not a boundary of the quantization groups"):
        int_weights.take_shard("scales", scales, rows, scheme, act_order=False)
    assert int_weights.take_shard("scales", scales, rows, scheme, act_order=True) is scales
