"""The Triton decode (v1, v2) and prefill kernels with sliding windows and score caps, against
dense float64 attention under TRITON_INTERPRET=1 (conftest): windows of 1 token, ending inside
and at block and tile boundaries, wider than the context; the blocks a window left behind are
the null block, never written (NaN), so reading one fails the test."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.triton.attention import (DecodeConfig, PrefillConfig, paged_decode_v1,
                                          paged_decode_v2, paged_prefill, store_kv)
from pagedserve.attention.triton_backend import TritonBackend
from tests.attention.paged_case import make_case

DECODES = [(0, 1), (14, 1), (15, 1), (16, 1), (40, 1), (70, 1)]
PREFILLS = [(0, 33), (17, 30), (45, 3)]
WINDOWS = [1, 7, 16, 33, 200]
TOL = dict(atol=1e-5, rtol=1e-5)
SMALL_DECODE = DecodeConfig(block_n=16, partition=32)
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16)


def _run_decode(version, case):
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    if version == "v1":
        paged_decode_v1(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        case.scale, out, SMALL_DECODE, case.window, case.softcap)
    else:
        paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                        m.max_seq_len, case.scale, out, SMALL_DECODE, case.window,
                        case.softcap)
    return out


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_decode_matches_dense(version, window):
    case = make_case(DECODES, 8, 2, 16, 8, seed=window, window=window)
    torch.testing.assert_close(_run_decode(version, case).double(), case.expected, **TOL)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("window", [None, 9])
def test_capped_decode_matches_dense(version, window):
    case = make_case(DECODES, 4, 4, 16, 8, seed=5, window=window, softcap=0.8)
    torch.testing.assert_close(_run_decode(version, case).double(), case.expected, **TOL)


@pytest.mark.parametrize("window,softcap", [(w, None) for w in WINDOWS] + [(None, 0.8),
                                                                          (12, 0.8)])
def test_windowed_prefill_matches_dense(window, softcap):
    case = make_case([(3, 1)] + PREFILLS, 4, 2, 16, 8, seed=7, prefix_hit_rows=2,
                     window=window, softcap=softcap)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    m = case.meta
    paged_prefill(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                  m.query_start_loc, 1, len(PREFILLS), m.max_query_len, case.scale, out,
                  SMALL_PREFILL, window, softcap)
    torch.testing.assert_close(out[1:].double(), case.expected[1:], **TOL)


def test_backend_passes_window_and_cap():
    case = make_case(DECODES + PREFILLS, 8, 4, 16, 8, seed=9, window=10, softcap=1.5)
    out = TritonBackend(SMALL_DECODE, SMALL_PREFILL).forward(
        case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, window=10,
        softcap=1.5)
    torch.testing.assert_close(out.double(), case.expected, **TOL)
