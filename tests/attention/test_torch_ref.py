"""The PyTorch reference backend against dense causal attention on the contiguous sequence."""

import pytest
import torch

from pagedserve.attention.backend import (AttentionBackend, consecutive_runs,
                                          get_forward_context, set_forward_context)
from pagedserve.attention.selector import get_attention_backend
from pagedserve.attention.torch_ref import TorchRefBackend
from tests.attention.paged_case import make_case

# (cached prefix, new tokens): decodes first, crossing block boundaries (block 16 / 32)
MIXED = [(0, 1), (15, 1), (16, 1), (40, 1), (0, 7), (16, 16), (33, 20), (5, 1 + 31)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size):
    seed = torch.seed() % 2**31
    case = make_case(MIXED, num_heads, num_kv_heads, 32, block_size, seed=seed,
                     prefix_hit_rows=2)
    out = TorchRefBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache,
                                    case.meta, case.scale)
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


def test_stores_new_rows_and_skips_slot_minus_one():
    case = make_case([(3, 1), (20, 9)], 4, 2, 16, 16, seed=1, prefix_hit_rows=3)
    TorchRefBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                              case.scale)
    flat_k = case.k_cache.view(-1, 2, 16)
    slots = case.meta.slot_mapping
    written = slots >= 0
    torch.testing.assert_close(flat_k[slots[written]], case.k[written])
    # the three slot -1 rows carried garbage (1e4); the cache kept the true prefix rows
    assert (~written).sum() == 3
    assert flat_k.nan_to_num().abs().max() < 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_and_prefill(dtype):
    case = make_case([(30, 1), (0, 17), (17, 5)], 8, 2, 64, 16, dtype=dtype, seed=2)
    out = TorchRefBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache,
                                    case.meta, case.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), case.expected, atol=2e-2, rtol=2e-2)


def test_copy_and_swap_blocks():
    backend = TorchRefBackend()
    caches = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    backend.copy_blocks(caches, torch.tensor([[1, 4], [2, 5]]))
    for (k, v), (k0, v0) in zip(caches, before):
        torch.testing.assert_close(k[4], k0[1])
        torch.testing.assert_close(v[5], v0[2])
        torch.testing.assert_close(k[:4], k0[:4])
    host = torch.zeros(3, 4, 2, 8)
    backend.swap_blocks([caches[0]], [(host, torch.zeros_like(host))],
                        torch.tensor([[3, 0], [1, 2]]))
    torch.testing.assert_close(host[0], caches[0][0][3])
    torch.testing.assert_close(host[2], caches[0][0][1])
    assert host[1].abs().sum() == 0


@pytest.mark.parametrize("ids, runs", [
    ([5], [(0, 1, 5)]),
    ([0, 1, 2, 7, 8, 3], [(0, 3, 0), (3, 5, 7), (5, 6, 3)]),
    ([4, 3, 2], [(0, 1, 4), (1, 2, 3), (2, 3, 2)]),  # descending ids are runs of one
])
def test_swap_out_copies_runs_of_consecutive_blocks(ids, runs):
    assert consecutive_runs(ids) == runs
    flat = [first + j for start, stop, first in consecutive_runs(ids)
            for j in range(stop - start)]
    assert flat == ids  # the runs cover every destination, in order


def test_backend_selection_and_forward_context():
    assert get_attention_backend(None, torch.device("cpu")).name in ("cpu", "torch")
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    case = make_case([(4, 1)], 2, 1, 8, 16)
    backend: AttentionBackend = TorchRefBackend()
    with set_forward_context(case.meta, backend):
        ctx = get_forward_context()
        assert ctx.meta is case.meta and ctx.backend is backend
    with pytest.raises(RuntimeError):
        get_forward_context()
