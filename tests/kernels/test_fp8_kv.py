"""The FP8 KV cache in every kernel and in the PyTorch reference, under TRITON_INTERPRET=1.

Each case's expected output is float64 attention over the K/V as an FP8 cache holds them
(quantized with per-head scales, dequantized: `paged_case`), so only the kernels' own
arithmetic is compared, not FP8's rounding. The scales differ per KV head and one head's is
small enough that large values saturate at 448. Caches start NaN-filled (in e4m3 too), block
tables pad with the null block, outputs start NaN. Fresh seeds each run.
"""

from dataclasses import replace

import pytest
import torch

from pagedserve.attention import kv_quant, torch_ref
from pagedserve.kernels import fp8_format
from pagedserve.kernels.triton.attention import decode
from pagedserve.kernels.triton.attention import (PrefillConfig, copy_blocks, paged_decode_v1,
                                          paged_decode_v2, paged_prefill, store_kv)
from pagedserve.attention.triton_backend import TritonBackend
from tests.attention.paged_case import make_case
from tests.kernels.test_kernels import DECODE_CTX, SMALL_DECODE, SMALL_PREFILL, fresh_seed

PREFILLS = [(0, 17), (16, 16), (45, 3), (5, 28)]  # (cached, new): across blocks and tiles

TOL = {"atol": 1e-5, "rtol": 1e-5}


def scales(num_kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) scales [Hkv]: 0.004-0.03, the first K head's 0.004 (randn values past 1.8
    saturate)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (0.004 + 0.026 * torch.rand(num_kv_heads, generator=gen) for _ in range(2))
    k[0] = 0.004
    return k, v


def test_store_rounds_every_e4m3_value_and_tie_as_torch():
    """The store kernel's rounding against torch's cast: every e4m3 value, every midpoint
    between two (ties go to the even one) and its neighbours, random values, both signs."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8_format.FP8_DTYPE).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1),
                   torch.randn(512) * 50, torch.randn(512) * 0.01])
    x = torch.cat([x, -x])[None, None]  # one token, one head: [T=1, Hkv=1, D]
    k_cache = torch.full((1, 1, 1, x.shape[2]), float("nan"), dtype=fp8_format.FP8_DTYPE)
    ones = torch.ones(1)
    store_kv(x, x, k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int64), (ones, ones))
    expected = x.clamp(-448, 448).to(fp8_format.FP8_DTYPE).view(torch.uint8)
    assert torch.equal(k_cache.view(-1).view(torch.uint8), expected.view(-1))


def test_store_kv_quantizes_per_head_saturates_and_skips_minus_one():
    seed = fresh_seed()
    case = make_case([(5, 1), (0, 20), (40, 9)], 4, 2, 16, 16, seed=seed, prefix_hit_rows=3,
                     kv_scales=scales(2, seed))
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    torch_ref.store_kv(case.k, case.v, ref_k, ref_v, case.meta.slot_mapping, case.kv_scales)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, case.kv_scales)
    for got, ref in ((case.k_cache, ref_k), (case.v_cache, ref_v)):  # bit for bit, NaN too
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), f"seed {seed}"
    slots = case.meta.slot_mapping
    written = case.k_cache.view(-1, 2, 16)[slots[slots >= 0]]
    k = case.k[slots >= 0].double()
    k_scale = case.kv_scales[0].double()[:, None]
    # round to nearest e4m3: within half a unit of 3 mantissa bits, or the saturated value
    clamped = (k / k_scale).clamp(-448, 448)
    assert ((written.double() - clamped).abs() <= clamped.abs() / 16 + 2 ** -10).all()
    assert (written.double().abs() == 448).any(), "the small K scale should saturate"


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
def test_decode_reads_fp8_cache(version, num_heads, num_kv_heads):
    seed = fresh_seed()
    case = make_case([(c, 1) for c in DECODE_CTX], num_heads, num_kv_heads, 32, 16, seed=seed,
                     kv_scales=scales(num_kv_heads, seed))
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, case.kv_scales)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    if version == "v1":
        paged_decode_v1(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        case.scale, out, SMALL_DECODE, kv_scales=case.kv_scales)
    else:
        paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        m.max_seq_len, case.scale, out, SMALL_DECODE, kv_scales=case.kv_scales)
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_decode_fp16_dot_on_fp8_cache(version):
    """`DecodeConfig.fp16_dot`: the dot products in float16 (q rounded to it, the cache's
    values exact in it), float32 accumulation; a query past float16's range clamps, not inf."""
    seed = fresh_seed()
    case = make_case([(c, 1) for c in DECODE_CTX], 8, 2, 32, 16, seed=seed,
                     kv_scales=scales(2, seed))
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, case.kv_scales)
    cfg = replace(SMALL_DECODE, fp16_dot=True)
    m = case.meta
    for q, expected in ((case.q, case.expected), (case.q * 1e6, None)):
        out = torch.full_like(q, float("nan"))
        if version == "v1":
            paged_decode_v1(q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                            case.scale, out, cfg, kv_scales=case.kv_scales)
        else:
            paged_decode_v2(q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                            m.max_seq_len, case.scale, out, cfg, kv_scales=case.kv_scales)
        if expected is not None:
            torch.testing.assert_close(out.double(), expected, atol=3e-3, rtol=3e-3,
                                       msg=f"seed {seed}")
        else:
            assert out.isfinite().all(), f"seed {seed}"


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("fp16_dot,bits_k", [(False, True), (True, True), (True, False)])
def test_decode_reads_fp8_cache_by_bits(version, fp16_dot, bits_k):
    """`DecodeConfig.bits_k/bits_v`: e4m3 rows read by bit moves (`e4m3.e4m3_bits`) into
    the query's 16-bit dtype (K's too or only V's), with and without float16 dot products."""
    seed = fresh_seed()
    case = make_case([(c, 1) for c in DECODE_CTX], 8, 2, 32, 16, dtype=torch.float16,
                     seed=seed, kv_scales=scales(2, seed))
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, case.kv_scales)
    cfg = replace(SMALL_DECODE, bits_k=bits_k, bits_v=True, fp16_dot=fp16_dot)
    m = case.meta
    out = torch.full_like(case.q, float("nan"))
    if version == "v1":
        paged_decode_v1(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        case.scale, out, cfg, kv_scales=case.kv_scales)
    else:
        paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        m.max_seq_len, case.scale, out, cfg, kv_scales=case.kv_scales)
    torch.testing.assert_close(out.double(), case.expected, atol=3e-3, rtol=3e-3,
                               msg=f"seed {seed}")


@pytest.mark.parametrize("num_sms", [1, 64])
def test_decode_with_the_fp8_launch_settings(num_sms):
    """paged_decode's own choice for an FP8 cache (`decode.FP8_DECODE`): v1 where the SMs
    are few, v2 split into partitions where they are many; contexts end inside and past a
    tile. A float32 query keeps float32 dot products (float16 ones would round it)."""
    seed = fresh_seed()
    case = make_case([(c, 1) for c in (0, 130, 700, 1100)], 4, 2, 32, 16, seed=seed,
                     kv_scales=scales(2, seed))
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, case.kv_scales)
    m = case.meta
    assert decode.use_v2(4, 2, m.max_seq_len, num_sms) == (num_sms == 64)
    out = torch.full_like(case.q, float("nan"))
    decode.paged_decode(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        m.max_seq_len, case.scale, out, num_sms, kv_scales=case.kv_scales)
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")


def test_fp8_launch_settings_hold_bf16s_bytes_per_step():
    """An FP8 cache's v2 partitions are twice bf16's in tokens (the same bytes), its tiles
    as bf16's in tokens (half the bytes, double-buffered); bf16's stay as they were."""
    fp8_cache = torch.empty(2, 16, 8, 128, dtype=fp8_format.FP8_DTYPE)
    bf16 = decode.default_config(fp8_cache.to(torch.bfloat16))
    fp8 = decode.default_config(fp8_cache)
    assert bf16 == decode.DecodeConfig() and fp8 == decode.FP8_DECODE
    assert fp8.block_n == bf16.block_n and fp8.partitions == tuple(
        2 * p for p in bf16.partitions)
    # many long sequences: the largest partition with two programs per SM
    assert decode.choose_v2_config(32, 8, 16384, 132, bf16).partition == 1024
    assert decode.choose_v2_config(32, 8, 16384, 132, fp8).partition == 2048
    # batch 1 at 1k: the small-grid tiles, twice bf16's too
    small = decode.choose_v2_config(1, 8, 1024, 132, fp8)
    assert (small.block_n, small.num_stages) == (2 * 32, decode.SMALL_GRID_STAGES)
    assert small.partition % small.block_n == 0


@pytest.mark.parametrize("num_heads,num_kv_heads,window", [(4, 4, None), (8, 2, 24),
                                                          (8, 1, None)])
def test_prefill_reads_fp8_cache(num_heads, num_kv_heads, window):
    seed = fresh_seed()
    case = make_case([(3, 1), (20, 1)] + PREFILLS, num_heads, num_kv_heads, 32, 16, seed=seed,
                     prefix_hit_rows=2, window=window, kv_scales=scales(num_kv_heads, seed))
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping, case.kv_scales)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    paged_prefill(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                  m.query_start_loc, 2, len(PREFILLS), m.max_query_len, case.scale, out,
                  PrefillConfig(block_m=16, block_n=16), window, kv_scales=case.kv_scales)
    torch.testing.assert_close(out[2:].double(), case.expected[2:], **TOL, msg=f"seed {seed}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_backends_on_fp8_cache(backend, softcap):
    """A mixed step (decodes, prefills with prefix hits) through a whole backend, fp16 q."""
    seed = fresh_seed()
    seqs = [(0, 1), (30, 1), (70, 1), (0, 18), (33, 5)]
    case = make_case(seqs, 8, 2, 64, 16, dtype=torch.float16, seed=seed, prefix_hit_rows=2,
                     softcap=softcap, kv_scales=scales(2, seed))
    impl = (TritonBackend(SMALL_DECODE, SMALL_PREFILL) if backend == "triton"
            else torch_ref.TorchRefBackend())
    out = impl.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                       case.scale, softcap=softcap, kv_scales=case.kv_scales)
    torch.testing.assert_close(out.double(), case.expected, atol=3e-3, rtol=3e-3,
                               msg=f"seed {seed}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_copy_and_swap_blocks_move_fp8_bytes(backend):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)

    def cache():
        return (torch.randn(9, 16, 2, 8, generator=gen) * 50).to(fp8_format.FP8_DTYPE)

    caches = [(cache(), cache()) for _ in range(2)]
    expected = [(k.view(torch.uint8).clone(), v.view(torch.uint8).clone()) for k, v in caches]
    pairs = torch.tensor([[1, 5], [2, 6], [1, 8]])
    impl = TritonBackend() if backend == "triton" else torch_ref.TorchRefBackend()
    impl.copy_blocks(caches, pairs)
    for k, v in expected:
        k[[5, 6, 8]], v[[5, 6, 8]] = k[[1, 2, 1]], v[[1, 2, 1]]
    for (k, v), (ek, ev) in zip(caches, expected):
        assert torch.equal(k.view(torch.uint8), ek) and torch.equal(v.view(torch.uint8), ev)
    swapped = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    impl.swap_blocks(caches, swapped, torch.tensor([[5, 0], [6, 3]]))
    for (k, v), (sk, sv) in zip(caches, swapped):
        assert torch.equal(sk[[0, 3]].view(torch.uint8), k[[5, 6]].view(torch.uint8))
        assert torch.equal(sv[[0, 3]].view(torch.uint8), v[[5, 6]].view(torch.uint8))


def test_kv_scales_from_checkpoint_or_ones():
    k, v = kv_quant.kv_scales(2, None, [0, 1], torch.device("cpu"))
    assert k.tolist() == v.tolist() == [1.0, 1.0] and k.dtype == torch.float32
    k, v = kv_quant.kv_scales(2, (torch.tensor(0.5), torch.tensor([0.25])), [0, 1], "cpu")
    assert k.tolist() == [0.5, 0.5] and v.tolist() == [0.25, 0.25]
    per_head = torch.tensor([0.1, 0.2, 0.3, 0.4])
    k, _ = kv_quant.kv_scales(2, (per_head, per_head), [2, 3], "cpu")  # a rank's heads
    assert k.tolist() == pytest.approx([0.3, 0.4])
    with pytest.raises(ValueError, match="one per KV head"):
        kv_quant.kv_scales(4, (per_head[:2], per_head[:2]), [0, 1, 2, 3], "cpu")
    with pytest.raises(ValueError, match="finite and positive"):
        kv_quant.kv_scales(2, (torch.tensor(0.0), torch.tensor(1.0)), [0, 1], "cpu")


def test_an_fp8_cache_without_scales_is_refused():
    case = make_case([(5, 1)], 2, 2, 16, 16, kv_scales=scales(2, 0))
    with pytest.raises(AssertionError, match="needs its scales"):
        store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
