"""Split-KV decode (v2) in one launch, under TRITON_INTERPRET=1 (conftest), against the dense
float64 reference.

v2's last partition of each (sequence, KV head) to arrive merges every partial, so these
cases make many partitions (several merge chunks), mix sequences of one partition (merged
nowhere: written directly) with long ones, use GQA ratios 1-8 and a non-power-of-two one,
NaN-filled caches with null-block padding, and NaN-poisoned outputs. The arrival counters
must be left zero: CUDA-graph replays rely on it.
"""

import pytest
import torch

from pagedserve.kernels.triton.arrivals import arrival_counters
from pagedserve.kernels.triton.attention import DecodeConfig, decode, paged_decode_v2, store_kv
from pagedserve.kernels.triton.attention.decode import choose_v2_config
from tests.attention.paged_case import make_case

# (context, 1 new token): 1 to 17 partitions of 16, crossing block and partition edges
RAGGED = [(0, 1), (14, 1), (15, 1), (47, 1), (130, 1), (255, 1), (270, 1)]
TINY = DecodeConfig(block_n=16, partition=16)


def fresh_seed() -> int:
    return torch.seed() % 2**31


def decode_v2(case, cfg: DecodeConfig) -> torch.Tensor:
    """Store the step's K/V, then v2 into a NaN-poisoned output."""
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                    m.max_seq_len, case.scale, out, cfg)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2), (8, 1), (6, 2)])
def test_v2_merges_many_partitions(num_heads, num_kv_heads, monkeypatch):
    """8 merge rows: every GQA ratio merges its 17 partitions in several chunks (the other
    tests run the default, one chunk at these sizes)."""
    monkeypatch.setattr(decode, "MERGE_ROWS", 8)
    seed = fresh_seed()
    case = make_case(RAGGED, num_heads, num_kv_heads, 16, 16, seed=seed)
    out = decode_v2(case, TINY)
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


@pytest.mark.parametrize("split_short", [True, False])
@pytest.mark.parametrize("grid", [1, 4])
@pytest.mark.parametrize("block_size,partition", [(16, 32), (32, 64)])
def test_v2_grid_sized_past_the_longest_sequence(block_size, partition, grid, split_short):
    """The engine captures v2 with max_seq_len = max_model_len (here `grid` times the longest
    sequence): programs past a sequence's end must neither write nor be counted as arrivals.
    With `split_short` every sequence spreads over all of the grid's partitions, in whole
    16-token tiles (a 272-token one over 9 of 32 tokens at grid 1, over 17 of 16 at grid 4),
    else over its first few of `partition` tokens."""
    seed = fresh_seed()
    case = make_case(RAGGED[::2], 4, 2, 16, block_size, seed=seed)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                    grid * m.max_seq_len, case.scale, out,
                    DecodeConfig(block_n=16, partition=partition, split_short=split_short))
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


def test_v2_block_table_rows_without_padding():
    """Each program loads its first tile's block ids before it knows the sequence length,
    bounded by the row's end only: rows exactly as long as the longest sequence (a column
    slice of a wider table whose other columns hold ids far past the cache) with tiles that
    run past a row's end must still read every block id the sequence has."""
    seed = fresh_seed()
    case = make_case(RAGGED[-3:], 4, 2, 16, 16, seed=seed)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    m = case.meta
    needed = -(-m.max_seq_len // 16)
    wide = torch.full((len(RAGGED[-3:]), needed + 8), 10**6, dtype=torch.int32)
    wide[:, :needed] = m.block_tables[:, :needed]
    out = torch.full_like(case.q, float("nan"))
    paged_decode_v2(case.q, case.k_cache, case.v_cache, wide[:, :needed], m.seq_lens,
                    m.max_seq_len, case.scale, out, DecodeConfig(block_n=64, partition=128))
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


def test_v2_leaves_arrival_counters_zero_for_the_next_launch():
    seed = fresh_seed()
    case = make_case(RAGGED, 4, 2, 16, 16, seed=seed)
    first = decode_v2(case, TINY)
    counters = arrival_counters(len(RAGGED) * 2, case.q.device)
    assert not counters.any(), "a replayed launch would merge at the wrong arrival"
    second = decode_v2(case, TINY)
    torch.testing.assert_close(second, first, atol=0, rtol=0, msg=f"seed {seed}")
    torch.testing.assert_close(first.double(), case.expected, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


def test_v2_fp16_head_dim_128():
    seed = fresh_seed()
    case = make_case(RAGGED[-3:], 8, 2, 128, 16, dtype=torch.float16, seed=seed)
    out = decode_v2(case, DecodeConfig(block_n=32, partition=64))
    torch.testing.assert_close(out.double(), case.expected, atol=3e-3, rtol=3e-3,
                               msg=f"seed {seed}")


def test_dispatch_double_buffers_only_grids_that_underfill_the_sms():
    """Batch 1 up to 8k tokens makes fewer than two programs per SM even at the smallest
    partition: those get the double-buffered tiles; grids that fill the SMs keep the default."""
    default = DecodeConfig()
    for batch, context in ((1, 1024), (1, 8192), (4, 2048)):
        cfg = choose_v2_config(batch, 8, context, 132)
        assert (cfg.partition, cfg.block_n, cfg.num_stages) == (256, 32, 5), (batch, context)
        assert cfg.partition % cfg.block_n == 0
    for batch, context, partition in ((1, 32768, 512), (16, 2048, 512), (32, 16384, 1024)):
        cfg = choose_v2_config(batch, 8, context, 132)
        assert cfg == DecodeConfig(block_n=default.block_n, partition=partition,
                                   num_warps=default.num_warps,
                                   num_stages=default.num_stages), (batch, context)
