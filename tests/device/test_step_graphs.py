"""What the CPU can check of the CUDA graphs' steps (capturing needs CUDA: the outputs of
graphs against enforce_eager are tests/gpu/test_gpu_speculative.py's): the rule that picks a
captured graph for a step (`cuda_graphs.graph_shape`), and a step padded to a graph's shape
(`StepBuffers.pad_rows`, read through `cuda_graphs.graph_metadata` as a graph reads it)
attending through the Triton backend a graph captures, under TRITON_INTERPRET=1 (conftest),
as the unpadded step does through the reference backend: the same output rows and the same
cache (padding writes nothing)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.attention.triton_backend import TritonBackend
from pagedserve.device.cuda_graphs import batch_size_ladder, graph_shape, graph_metadata
from pagedserve.device.input_batch import StepBuffers

K = 4  # drafts a verify checks: its requests have K + 1 tokens
LADDERS = {1: batch_size_ladder(16), K + 1: batch_size_ladder(8)}


def shape(num_new: list[int], num_drafts: list[int]) -> tuple[int, int] | None:
    return graph_shape(np.array(num_new), np.array(num_drafts), LADDERS)


def test_decodes_run_in_the_smallest_decode_graph_that_holds_them():
    assert shape([1], [0]) == (1, 1)
    assert shape([1] * 3, [0] * 3) == (1, 4)
    assert shape([1] * 9, [0] * 9) == (1, 16)
    assert shape([1] * 17, [0] * 17) is None  # past the largest graph


def test_verifies_of_k_drafts_run_in_a_verify_graph():
    assert shape([K + 1], [K]) == (K + 1, 1)
    assert shape([K + 1] * 3, [K] * 3) == (K + 1, 4)
    assert shape([K + 1] * 8, [K] * 8) == (K + 1, 8)
    assert shape([K + 1] * 9, [K] * 9) is None  # above disable_by_batch_size: no graph


@pytest.mark.parametrize("num_new, num_drafts", [
    ([1, K + 1], [0, K]),  # a decode beside a verify
    ([K + 1, 7], [K, 0]),  # a verify beside a prefill chunk
    ([K + 1, K + 1], [K, 0]),  # a prefill chunk of K + 1 tokens is no verify
    ([K, K], [K - 1, K - 1]),  # verifies of fewer drafts: no graph of their length
    ([1, 1], [0, 1]),  # (inconsistent: a one-token row with a draft)
    ([], []),
])
def test_steps_of_mixed_or_other_query_lengths_run_eagerly(num_new, num_drafts):
    assert shape(num_new, num_drafts) is None


def step_buffers_for(contexts: list[int], query_len: int, size: int, table: np.ndarray,
                     block_size: int) -> StepBuffers:
    """A step of one request per context (its query_len new tokens after it) written into
    fresh buffers as the runner writes them, then padded to `size` requests."""
    n, tokens = len(contexts), len(contexts) * query_len
    b = StepBuffers(64, 8, table.shape[1], torch.device("cpu"))
    b.fill_block_tables(table, np.arange(n), size, table.shape[1])
    b.query_start_loc.np[:n + 1] = query_len * np.arange(n + 1)
    positions = np.concatenate([np.arange(c, c + query_len) for c in contexts])
    b.positions.np[:tokens] = positions
    seq = np.repeat(np.arange(n), query_len)
    b.slot_mapping.np[:tokens] = (table[seq, positions // block_size].astype(np.int64)
                                  * block_size + positions % block_size)
    b.seq_lens.np[:n] = np.array(contexts) + query_len
    assert b.pad_rows(n, tokens, size, query_len) == size * query_len
    return b


# the step's buffers are CPU tensors here, which Triton reads only under its interpreter (set
# by tests/conftest.py where no GPU is): on a GPU machine the compiled backend is what
# tests/gpu runs, on device buffers
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through Triton need the interpreter")
@pytest.mark.parametrize("query_len", [1, K + 1])
def test_a_padded_graph_step_attends_as_the_unpadded_step(query_len):
    torch.manual_seed(0)
    block_size, heads, kv_heads, head_dim, max_model_len = 16, 4, 2, 16, 128
    contexts, size = [3, 17, 40], 4
    n, tokens = len(contexts), len(contexts) * query_len
    # each request its own blocks (the null block 0 is no one's), the rest of its row null
    table = np.zeros((n, max_model_len // block_size), dtype=np.int32)
    table[:, :4] = 1 + np.random.default_rng(0).permutation(3 * 4).reshape(n, 4)
    b = step_buffers_for(contexts, query_len, size, table, block_size)
    # what the graph's fixed grid needs: every request, padding too, of query_len tokens
    np.testing.assert_array_equal(b.query_start_loc.np[:size + 1],
                                  query_len * np.arange(size + 1))
    np.testing.assert_array_equal(b.seq_lens.np[n:size], query_len)
    assert (b.slot_mapping.np[tokens:size * query_len] == -1).all()

    cache = torch.randn(2, 16, block_size, kv_heads, head_dim)
    cache[:, 0] = 0  # the null block, zeroed as the runner's
    q, k, v = (torch.randn(size * query_len, h, head_dim) for h in (heads, kv_heads, kv_heads))
    decodes = n if query_len == 1 else 0
    eager_meta = AttentionMetadata(
        num_decodes=decodes, num_decode_tokens=decodes,
        slot_mapping=b.slot_mapping.device[:tokens], block_tables=b.block_tables.device[:n],
        seq_lens=b.seq_lens.device[:n], query_start_loc=b.query_start_loc.device[:n + 1],
        max_query_len=query_len, max_seq_len=max(contexts) + query_len)
    eager_cache = cache.clone()
    want = TorchRefBackend().forward(q[:tokens], k[:tokens], v[:tokens], *eager_cache,
                                     eager_meta, head_dim ** -0.5)
    graph_cache = cache.clone()
    got = TritonBackend().forward(q, k, v, *graph_cache,
                                  graph_metadata(b, size, query_len, max_model_len),
                                  head_dim ** -0.5)
    torch.testing.assert_close(got[:tokens], want, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(got[tokens:]).all()  # padding rows: finite, unread
    assert torch.equal(graph_cache, eager_cache)  # padding rows wrote nothing
