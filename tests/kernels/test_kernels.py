"""Every Triton kernel against the PyTorch reference, under TRITON_INTERPRET=1 (conftest).

Fresh seeds each run (printed on failure), ragged lengths crossing block, tile and partition
boundaries, GQA ratios 1-8, NaN-filled caches and null-block padding (any read outside a
context poisons the result) and NaN-poisoned outputs (any unwritten element fails).
Tiles are small (16) so short sequences still cross tile and partition boundaries.
The interpreter's bf16 tl.dot is broken, so attention runs in fp32 and fp16 here; bf16 is
checked on the GPU by benchmarks/kernels.py.
"""

import pytest
import torch

from pagedserve.attention import torch_ref
from pagedserve.attention.selector import get_attention_backend
from pagedserve.kernels.triton.attention import (DecodeConfig, PrefillConfig, choose_partition,
                                          longest_first, paged_decode, paged_decode_v1,
                                          paged_decode_v2, paged_prefill, store_kv, use_v2)
from pagedserve.attention.triton_backend import TritonBackend
from tests.attention.paged_case import make_case

GQA = [(2, 2), (4, 2), (8, 2), (8, 1)]  # ratios 1, 2, 4, 8
DECODE_CTX = [0, 14, 15, 16, 31, 32, 63, 100]  # + 1 new token each
SMALL_DECODE = DecodeConfig(block_n=16, partition=32)
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16)


def fresh_seed() -> int:
    return torch.seed() % 2**31


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-3,
                                                                         "rtol": 3e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_matches_reference_and_skips_minus_one(dtype, block_size):
    seed = fresh_seed()
    case = make_case([(5, 1), (0, 20), (40, 9)], 4, 2, 16, block_size, dtype=dtype, seed=seed,
                     prefix_hit_rows=3)
    assert (case.meta.slot_mapping < 0).any()
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    torch_ref.store_kv(case.k, case.v, ref_k, ref_v, case.meta.slot_mapping)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    torch.testing.assert_close(case.k_cache, ref_k, equal_nan=True, atol=0, rtol=0,
                               msg=f"seed {seed}")
    torch.testing.assert_close(case.v_cache, ref_v, equal_nan=True, atol=0, rtol=0,
                               msg=f"seed {seed}")


def decode_case(num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    return make_case([(c, 1) for c in DECODE_CTX], num_heads, num_kv_heads, head_dim,
                     block_size, dtype=dtype, seed=seed)


def run_decode(version, case, cfg=SMALL_DECODE):
    """Store the step's K/V, then decode into a NaN-poisoned output."""
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    if version.startswith("v1"):  # "v1 longest first": programs dispatched by that order
        order = longest_first(m.seq_lens) if version.endswith("first") else None
        paged_decode_v1(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        case.scale, out, cfg, order=order)
    else:
        paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        m.max_seq_len, case.scale, out, cfg)
    return out


@pytest.mark.parametrize("version", ["v1", "v1 longest first", "v2"])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(version, num_heads, num_kv_heads, block_size):
    seed = fresh_seed()
    case = decode_case(num_heads, num_kv_heads, 32, block_size, torch.float32, seed)
    out = run_decode(version, case)
    torch.testing.assert_close(out.double(), case.expected, **tolerance(torch.float32),
                               msg=f"seed {seed}")


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_fp16_head_dims(version, head_dim):
    seed = fresh_seed()
    case = decode_case(8, 2, head_dim, 16, torch.float16, seed)
    out = run_decode(version, case, DecodeConfig(block_n=32, partition=64))
    torch.testing.assert_close(out.double(), case.expected, **tolerance(torch.float16),
                               msg=f"seed {seed}")


# (cached prefix, new tokens): fresh prompts, prefix hits and chunks, crossing 16/32 boundaries
PREFILLS = [(0, 1 + 16), (0, 33), (16, 16), (17, 30), (45, 3), (5, 1 + 40)]


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(num_heads, num_kv_heads, block_size):
    seed = fresh_seed()
    # two leading decodes so the kernel's first_seq offset is exercised
    case = make_case([(3, 1), (20, 1)] + PREFILLS, num_heads, num_kv_heads, 32, block_size,
                     seed=seed, prefix_hit_rows=2)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    cfg = SMALL_PREFILL if block_size == 16 else PrefillConfig(block_m=32, block_n=16)
    paged_prefill(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                  m.query_start_loc, 2, len(PREFILLS), m.max_query_len, case.scale, out, cfg)
    assert out[:2].isnan().all(), "decode rows belong to the decode kernel"
    torch.testing.assert_close(out[2:].double(), case.expected[2:], atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float16, 128)])
def test_backend_matches_torch_reference(dtype, head_dim):
    seed = fresh_seed()
    seqs = [(0, 1), (30, 1), (70, 1), (0, 18), (33, 5)]
    cases = [make_case(seqs, 8, 2, head_dim, 16, dtype=dtype, seed=seed, prefix_hit_rows=2)
             for _ in range(2)]
    triton_backend = TritonBackend(SMALL_DECODE, SMALL_PREFILL)
    outs = []
    for backend, c in zip([triton_backend, torch_ref.TorchRefBackend()], cases):
        outs.append(backend.forward(c.q, c.k, c.v, c.k_cache, c.v_cache, c.meta, c.scale))
    torch.testing.assert_close(outs[0], outs[1], **tolerance(dtype), msg=f"seed {seed}")
    torch.testing.assert_close(cases[0].k_cache, cases[1].k_cache, equal_nan=True)
    torch.testing.assert_close(outs[0].double(), cases[0].expected, **tolerance(dtype))


def test_triton_backend_selectable_on_cpu():
    backend = get_attention_backend("triton", "cpu")
    assert isinstance(backend, TritonBackend)


def test_dispatch_splits_only_long_contexts_that_underfill_the_gpu():
    assert use_v2(1, 8, 32768, 132)
    assert not use_v2(1, 8, 512, 132)  # two partitions at most: nothing worth splitting
    assert not use_v2(64, 8, 4096, 132)  # 512 programs already make ~4 waves
    # enough programs for two per SM, with as few partitions as possible
    assert choose_partition(1, 8, 32768, 132) == 512
    assert choose_partition(16, 8, 2048, 132) == 512
    assert choose_partition(1, 8, 4096, 132) == 256


def test_dispatched_decode_matches_reference():
    seed = fresh_seed()
    case = make_case([(1500, 1), (700, 1)], 8, 2, 32, 16, seed=seed)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    assert use_v2(2, 2, m.max_seq_len, num_sms=132)
    paged_decode(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, m.max_seq_len,
                 case.scale, out, 132, DecodeConfig(block_n=64))
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


def test_copy_blocks_kernel_matches_torch():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(9, 16, 2, 8, generator=gen), torch.randn(9, 16, 2, 8, generator=gen))
              for _ in range(2)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    pairs = torch.tensor([[1, 5], [2, 6], [1, 8]])
    torch_ref.TorchRefBackend().copy_blocks(expected, pairs)
    TritonBackend().copy_blocks(caches, pairs)
    for (k, v), (ek, ev) in zip(caches, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev), f"seed {seed}"
    assert not torch.equal(caches[0][0][5], caches[1][0][5])  # layers copied independently
