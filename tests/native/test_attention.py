"""The native paged-decode kernel and the CPU backend against dense float64 attention and the
PyTorch reference backend: GQA ratios 1-8, head dims 32/64/128, block sizes 16/32, ragged
lengths around block and chunk boundaries, NaN-filled caches (any read past a sequence's end
poisons the result), mixed decode + prefill batches with prefix-hit rows, thread counts,
float32 and bfloat16 caches."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedserve.attention import cpu_backend
from pagedserve.attention.backend import AttentionShape
from pagedserve.attention.cpu_backend import CpuBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.attention.torch_ref import TorchRefBackend, paged_prefills
from pagedserve.kernels.native import attention as native
from tests.attention.paged_case import PagedCase, make_case

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")

HEADS = [(4, 4), (8, 4), (9, 3), (12, 3), (16, 4), (16, 2)]  # GQA ratios 1, 2, 3, 4, 4, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def boundary_lengths(block_size: int) -> list[int]:
    """Context lengths (incl. the new token) of 1 token, ending at and just past block
    boundaries, and across several of the kernel's 16-token chunks."""
    return [1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size,
            2 * block_size + 1, 63, 64, 65, 129, 300]


def decode_case(lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, seed: int) -> PagedCase:
    return make_case([(n - 1, 1) for n in lengths], num_heads, num_kv_heads, head_dim,
                     block_size, seed=seed)


def run_kernel(case: PagedCase) -> torch.Tensor:
    """Store the step's rows and decode every sequence, straight through the wrapper."""
    meta = case.meta
    indices = native.StepIndices.check(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                       *case.k_cache.shape[:2])
    out = torch.full_like(case.q, float("nan"))
    native.store_and_decode(case.q, case.k, case.v, case.k_cache, case.v_cache, indices,
                            case.scale, out)
    return out


def run_backends(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """CpuBackend and TorchRefBackend on copies of the same caches (both write them)."""
    outs = []
    for backend in (CpuBackend(), TorchRefBackend()):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        outs.append(backend.forward(case.q, case.k, case.v, k_cache, v_cache,
                                    fresh_meta(case), case.scale))
    return outs[0], outs[1]


def fresh_meta(case: PagedCase) -> AttentionMetadata:
    """The case's metadata without the per-step state a backend derived and left on it."""
    return replace(case.meta, derived={})


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_dense_and_reference(num_heads, num_kv_heads, head_dim, block_size):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    lengths = boundary_lengths(block_size) + torch.randint(1, 200, (4,), generator=gen).tolist()
    case = decode_case(lengths, num_heads, num_kv_heads, head_dim, block_size, seed)
    ref = TorchRefBackend().forward(case.q, case.k, case.v, case.k_cache.clone(),
                                    case.v_cache.clone(), fresh_meta(case), case.scale)
    out = run_kernel(case)
    assert not out.isnan().any(), f"seed {seed}: NaN leaked from outside a context"
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")
    torch.testing.assert_close(out, ref, **TOL, msg=f"seed {seed}")


@pytest.mark.parametrize("lengths", [[1], [700], [5, 333], [40, 17, 16]])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 4), (9, 3), (4, 1)])
def test_kernel_with_few_sequences(lengths, num_heads, num_kv_heads):
    """Too few sequences to keep the threads busy: the kernel splits their kv heads."""
    seed = torch.seed() % 2**31
    case = decode_case(lengths, num_heads, num_kv_heads, 64, 16, seed)
    out = run_kernel(case)
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_backend_mixed_batch_with_prefix_hits(num_heads, num_kv_heads, block_size):
    """Decodes then prefills and chunks, some new rows already cached (slot -1, garbage k/v)."""
    seed = torch.seed() % 2**31
    seqs = [(0, 1), (15, 1), (16, 1), (31, 1), (32, 1), (100, 1),
            (0, 7), (16, 16), (33, 20), (5, 1 + 31), (70, 3)]
    case = make_case(seqs, num_heads, num_kv_heads, 64, block_size, seed=seed,
                     prefix_hit_rows=2)
    out, ref = run_backends(case)
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")
    torch.testing.assert_close(out, ref, **TOL, msg=f"seed {seed}")


def test_backend_prefills_only():
    seed = torch.seed() % 2**31
    case = make_case([(0, 9), (20, 12), (16, 1 + 16)], 9, 3, 64, 16, seed=seed,
                     prefix_hit_rows=3)
    assert case.meta.num_decodes == 0
    out, ref = run_backends(case)
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")
    torch.testing.assert_close(out, ref, **TOL, msg=f"seed {seed}")


@pytest.mark.parametrize("longest", ["short", "long"])
def test_backend_prefill_routes(longest, monkeypatch):
    """Prefills up to MAX_NATIVE_PREFILL_LEN run per token through the kernel; a step with a
    longer one leaves its prefills to the reference. Both agree with the dense answer."""
    seed = torch.seed() % 2**31
    limit = 256  # the rule, at a length the dense float64 reference handles quickly
    monkeypatch.setattr(cpu_backend, "MAX_NATIVE_PREFILL_LEN", limit)
    last = (limit - 10, 10) if longest == "short" else (limit - 9, 10)
    case = make_case([(40, 1), (7, 1), (0, 23), (16, 5), last], 9, 3, 64, 16, seed=seed,
                     prefix_hit_rows=2)
    calls = []
    monkeypatch.setattr(cpu_backend, "paged_prefills",
                        lambda *a: calls.append(1) or paged_prefills(*a))
    out, ref = run_backends(case)
    assert bool(calls) == (longest == "long")
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")
    torch.testing.assert_close(out, ref, **TOL, msg=f"seed {seed}")


def test_store_matches_reference_and_skips_slot_minus_one():
    case = make_case([(3, 1), (40, 1), (20, 9)], 9, 3, 64, 16, seed=3, prefix_hit_rows=3)
    caches = []
    for backend in (CpuBackend(), TorchRefBackend()):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend.forward(case.q, case.k, case.v, k_cache, v_cache, fresh_meta(case),
                        case.scale)
        caches.append((k_cache, v_cache))
    (k_cpu, v_cpu), (k_ref, v_ref) = caches
    assert torch.equal(k_cpu.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cpu.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert k_cpu.nan_to_num().abs().max() < 100  # the 1e4 garbage of slot -1 rows stayed out


def test_strided_q_from_a_fused_projection():
    """The model passes q/k/v as split views of one [T, Hq + 2 Hkv, D] tensor."""
    case = make_case([(50, 1), (17, 1), (0, 5)], 9, 3, 64, 16, seed=4)
    fused = torch.cat([case.q[:, :, None], torch.zeros(case.q.shape[0], 9, 1, 64)], 2)
    q = fused[:, :, 0]
    assert not q.is_contiguous()
    out = CpuBackend().forward(q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                               case.scale)
    torch.testing.assert_close(out.double(), case.expected, **TOL)


@pytest.mark.parametrize("num_seqs", [1, 2, 13])
def test_same_result_for_one_and_two_threads(num_seqs):
    """Each kv head of a sequence is computed by one thread in token order, however the
    kernel splits the work (with one or two sequences, the split depends on the threads)."""
    seed = torch.seed() % 2**31
    lengths = torch.randint(1, 300, (num_seqs,), generator=torch.Generator().manual_seed(seed))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(run_kernel(decode_case(lengths.tolist(), 9, 3, 64, 16, seed)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]), f"seed {seed}"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bfloat16_caches_match_dense(num_heads, num_kv_heads, head_dim):
    """bfloat16 caches are read as they are (widened exactly) with float32 q and arithmetic:
    the float64 attention over the same bfloat16 values within float32 rounding; the step's
    rows land in the cache bit for bit, NaN rows past a context are never read."""
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    lengths = boundary_lengths(16) + torch.randint(1, 200, (3,), generator=gen).tolist()
    case = make_case([(n - 1, 1) for n in lengths], num_heads, num_kv_heads, head_dim, 16,
                     dtype=torch.bfloat16, seed=seed)
    meta = case.meta
    indices = native.StepIndices.check(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                       *case.k_cache.shape[:2])
    out = torch.full(case.q.shape, float("nan"))
    native.store_and_decode(case.q.float(), case.k, case.v, case.k_cache, case.v_cache,
                            indices, case.scale, out)
    assert not out.isnan().any(), f"seed {seed}"
    torch.testing.assert_close(out.double(), case.expected, **TOL, msg=f"seed {seed}")
    rows = case.k_cache.view(-1, num_kv_heads, head_dim)[meta.slot_mapping]
    assert torch.equal(rows.view(torch.int16), case.k.view(torch.int16))


def test_bfloat16_backend_runs_the_kernel(monkeypatch):
    """A bfloat16 model's layer (decodes, a prefill with a cached prefix) goes through the
    kernel and comes back in bfloat16, as close to the dense float64 result as bfloat16
    rounding of the output allows; the reference in bfloat16 is no closer."""
    calls = []
    kernel = native.store_and_decode
    monkeypatch.setattr(native, "store_and_decode", lambda *a, **kw: calls.append(1) or
                        kernel(*a, **kw))
    case = make_case([(30, 1), (100, 1), (0, 17), (17, 5)], 8, 2, 64, 16,
                     dtype=torch.bfloat16, seed=9)
    out, ref = run_backends(case)
    assert calls and out.dtype == torch.bfloat16
    err, ref_err = ((x.double() - case.expected).abs().max() for x in (out, ref))
    assert err <= 2 ** -8 * case.expected.abs().max() and err <= ref_err


def test_wrapper_rejects_what_the_kernel_cannot_take():
    case = decode_case([5, 20], 4, 2, 32, 16, seed=6)
    meta, geometry = case.meta, case.k_cache.shape[:2]
    indices = native.StepIndices.check(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                       *geometry)

    def call(q=case.q, k_cache=case.k_cache, out=None):
        out = torch.empty_like(case.q) if out is None else out
        native.store_and_decode(q, case.k, case.v, k_cache, case.v_cache, indices, case.scale,
                                out)

    with pytest.raises(ValueError, match="float32 or bfloat16"):
        call(k_cache=case.k_cache.double())
    with pytest.raises(ValueError, match="of one dtype"):
        call(k_cache=case.k_cache.bfloat16())
    with pytest.raises(ValueError, match="float32"):
        call(q=case.q.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        call(k_cache=case.k_cache.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="must both be"):
        call(k_cache=case.k_cache[1:])
    with pytest.raises(ValueError, match=r"\[>= 2, 4, 32\]"):
        call(q=case.q[:1])
    with pytest.raises(ValueError, match="contiguous"):
        call(out=torch.empty(4, 2, 32).transpose(0, 1))
    with pytest.raises(ValueError, match="int32"):
        native.StepIndices.check(meta.slot_mapping, meta.block_tables.long(), meta.seq_lens,
                                 *geometry)
    with pytest.raises(ValueError, match="int64"):
        native.StepIndices.check(meta.slot_mapping.int(), meta.block_tables, meta.seq_lens,
                                 *geometry)


def test_indices_outside_the_cache_are_rejected():
    case = decode_case([5, 20], 4, 2, 32, 16, seed=7)
    meta = case.meta
    num_blocks, block_size = case.k_cache.shape[:2]
    bad_blocks = meta.block_tables.clone()
    bad_blocks[1, 0] = num_blocks
    too_long = torch.tensor([5, block_size * meta.block_tables.shape[1] + 1], dtype=torch.int32)
    for slots, tables, lens in [
        (torch.tensor([0, num_blocks * block_size]), meta.block_tables, meta.seq_lens),
        (torch.tensor([0, -2]), meta.block_tables, meta.seq_lens),
        (meta.slot_mapping, bad_blocks, meta.seq_lens),
        (meta.slot_mapping, meta.block_tables, too_long),
        (meta.slot_mapping, meta.block_tables, torch.tensor([0, 3], dtype=torch.int32)),
    ]:
        with pytest.raises(ValueError):
            native.StepIndices.check(slots, tables, lens, num_blocks, block_size)
    bad_meta = fresh_meta(case)
    bad_meta.block_tables = bad_blocks
    with pytest.raises(ValueError, match="block table entries"):
        CpuBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, bad_meta,
                             case.scale)


def test_auto_picks_the_cpu_backend():
    assert isinstance(get_attention_backend("auto", "cpu"), CpuBackend)
    assert isinstance(get_attention_backend(None, torch.device("cpu")), CpuBackend)
    assert get_attention_backend("cpu", "cpu").name == "cpu"
    with pytest.raises(ValueError, match="cpu attention backend"):
        get_attention_backend("cpu", "meta")


@pytest.mark.parametrize("shape, reason", [
    (AttentionShape(torch.float16, torch.float16, 8, 2, 64), "float32 or bfloat16"),
    (AttentionShape(torch.float32, torch.float8_e4m3fn, 8, 2, 64), "KV cache of one dtype"),
    (AttentionShape(torch.float32, torch.float32, 8, 3, 64), "does not take 8 query heads"),
    (AttentionShape(torch.float32, torch.float32, 4, 2, 12), "KV heads of dimension 12"),
    (AttentionShape(torch.float32, torch.float32, 8, 2, 64, softcap=50.0), "score cap"),
])
def test_a_model_the_kernel_does_not_take_gets_the_reference_at_load(shape, reason):
    """The choice is made once, from the model's attention shape: auto falls back to the
    reference; the cpu backend asked for by name is refused, saying why."""
    assert get_attention_backend("auto", "cpu", shape).name == "torch"
    with pytest.raises(ValueError, match=reason):
        get_attention_backend("cpu", "cpu", shape)
    fits = AttentionShape(torch.float32, torch.float32, 8, 2, 64)
    assert isinstance(get_attention_backend("auto", "cpu", fits), CpuBackend)
