"""The step's block tables: each row holds its request's blocks and the null block past them,
whatever wider or other rows earlier steps wrote into the same host buffer, although only the
step's needed columns are copied and only the stale ones cleared."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.device.input_batch import StepBuffers


def test_block_tables_are_null_padded_after_wider_and_longer_steps():
    seed = torch.seed() % 2**31  # fresh each run, reported on failure
    rng = np.random.default_rng(seed)
    max_seqs, max_blocks = 16, 40
    buffers = StepBuffers(64, max_seqs, max_blocks, torch.device("cpu"))
    table = np.zeros((2 * max_seqs, max_blocks), dtype=np.int32)
    for step in range(200):
        num_seqs = int(rng.integers(1, max_seqs + 1))
        rows = int(rng.integers(num_seqs, max_seqs + 1))  # padded rows, as for a graph
        table_rows = rng.permutation(2 * max_seqs)[:num_seqs]
        lengths = rng.integers(1, max_blocks + 1, size=num_seqs)
        for row, length in zip(table_rows, lengths):
            table[row] = 0
            table[row, :length] = rng.integers(1, 1000, size=length)
        width = int(lengths.max())
        buffers.fill_block_tables(table, table_rows, rows, width)
        want = np.zeros((rows, max_blocks), dtype=np.int32)
        want[:num_seqs] = table[table_rows]
        np.testing.assert_array_equal(buffers.block_tables.np[:rows], want,
                                      err_msg=f"seed {seed}, step {step}")
