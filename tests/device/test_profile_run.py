"""The memory-profiling batch stays inside the model's context (issue 27: a 16k-token profile
prompt read RoPE rows past a 4k model's table, an out-of-bounds read on the GPU)."""

import torch
from hypothesis import given, settings, strategies as st

from pagedserve.device.profile_run import profile_batch


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(1, 5000), max_len=st.integers(1, 2048),
       block_size=st.sampled_from([1, 16, 32]))
def test_profile_batch_is_prompts_within_the_context(num_tokens, max_len, block_size):
    ids, positions, meta = profile_batch(num_tokens, max_len, block_size, torch.device("cpu"))
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    assert ids.shape == positions.shape == (num_tokens,)
    assert starts[0] == 0 and starts[-1] == num_tokens
    assert all(1 <= n <= max_len for n in lens)
    assert [b - a for a, b in zip(starts, starts[1:])] == lens  # prompts: no cached prefix
    for start, n in zip(starts, lens):
        assert positions[start:start + n].tolist() == list(range(n))
    assert int(positions.max()) < max_len and meta.max_seq_len == max(lens)
    assert meta.block_tables.shape[1] * block_size >= max(lens)
    assert (meta.block_tables == 0).all() and (meta.slot_mapping == -1).all()
