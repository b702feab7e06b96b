"""Tensor parallelism over packed integer weights (model/int_weights.py): two gloo ranks
give the logits of one process for compressed-tensors and GPTQ with desc_act (g_idx on the
row-parallel o_proj and down_proj, whose ranks keep every group) checkpoints written by
benchmarks/quantize_int.py; a split through a quantization group is refused."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from benchmarks.quantize_int import quantize_folder
from pagedserve.model import int_weights
from pagedserve.model.int_weights import IntScheme
from tests.distributed.ranks import run_on_ranks
from tests.distributed.test_tp_logits import CONFIGS, tp_logits, paged_logits

# (AWQ loads to the same layout as asymmetric compressed-tensors: tests/model covers it)
FORMATS = {"ct-asym-g32": ("compressed-tensors", dict(group=32, symmetric=False)),
           "gptq-desc_act-g32": ("gptq", dict(group=32, act_order=True))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-int")
    config = json.loads((CONFIGS / "tiny-llama3.json").read_text())
    # 704 = 2 x 352: each rank's half of down_proj's input is 11 whole groups of 32
    config.update(vocab_size=2001, num_hidden_layers=2, intermediate_size=704,
                  initializer_range=0.1)
    (root / "config.json").write_text(json.dumps(config))
    make_checkpoint(root / "config.json", root / "float", torch.float32, seed=0,
                    tokenizer="bytes")
    folders = {}
    for case, (fmt, options) in FORMATS.items():
        quantize_folder(root / "float", root / case, fmt, **options)
        folders[case] = str(root / case)
    return folders


def test_tp2_logits_equal_tp1_on_packed_weights(checkpoints):
    folders = [checkpoints[c] for c in FORMATS]
    rank0, rank1 = run_on_ranks(tp_logits, folders, size=2)
    for case, folder, got0, got1 in zip(FORMATS, folders, rank0, rank1):
        want = paged_logits(folder)
        for step, (w, g0, g1) in enumerate(zip(want, got0, got1)):
            assert not w.isnan().any()
            assert torch.equal(g0, g1), f"{case}: ranks disagree on the gathered logits"
            torch.testing.assert_close(g0, w, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{case} output {step}: {m}")


def test_a_rank_split_inside_a_group_is_refused():
    """Rank 1 of down_proj with 688 inputs starts at column 344, inside group 10 of 32."""
    scheme = IntScheme("compressed-tensors", 4, 32, True, False)
    scales = torch.ones(256, 22)
    rows = (1, list(range(344, 688)))
    with pytest.raises(ValueError, match="not a boundary of the quantization groups"):
        int_weights.take_shard("scales", scales, rows, scheme, act_order=False)
    # with g_idx a column may take any group: every group is kept, whatever the split
    assert int_weights.take_shard("scales", scales, rows, scheme, act_order=True) is scales
