"""Throughput of the block manager on a 100k-block pool: is it ever visible next to a GPU step?

Run from the repo root: `python -m benchmarks.allocator [--num-blocks 100000] [--repeats 5]`.
Every figure is the median over `--repeats` timed loops (time.perf_counter). Cases:
  alloc+free      BlockPool.get_new_blocks(256) then free_blocks (no hashing)
  hash prompt     the 256 chained block hashes of a 4k-token prompt: ours (packed once with
                  struct, sliced per block) vs a per-block pickle baseline
  admit cold      get_computed_blocks (miss) + allocate_slots for a fresh 4k-token prompt
                  (hashes and caches its 256 blocks; evicts cached blocks once the pool fills)
                  + free
  admit warm      same, but the prompt's 255 full prefix blocks are cached: lookup, touch,
                  one new block, free
  decode step     allocate_slots(request, 1) after appending one token (hashes when a block
                  fills)
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.hashing import get_hash_fn
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 16
PROMPT_LEN = 4096
VOCAB = 32000


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def timed(fn: Callable[[], None], iters: int, repeats: int) -> float:
    """Median seconds per call of `fn` over `repeats` loops of `iters` calls."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - start) / iters)
    return statistics.median(runs)


def bench_pool(num_blocks: int, repeats: int) -> float:
    pool = BlockPool(num_blocks)

    def op() -> None:
        pool.free_blocks(reversed(pool.get_new_blocks(256)))

    return timed(op, 200, repeats)


def pickle_chain(tokens: list[int]) -> None:
    """Baseline: hash each block's (parent, tuple(tokens)) through pickle."""
    parent = None
    for i in range(0, len(tokens), BLOCK_SIZE):
        parent = hashlib.sha256(
            pickle.dumps((parent, tuple(tokens[i:i + BLOCK_SIZE])))).digest()


def bench_hash(algo: str, repeats: int) -> float:
    tokens = [random.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    if algo == "pickle":
        return timed(lambda: pickle_chain(tokens), 200, repeats)
    hasher = get_hash_fn(algo)
    extras = [None] * (PROMPT_LEN // BLOCK_SIZE)
    return timed(lambda: hasher.chain(None, tokens, BLOCK_SIZE, extras), 200, repeats)


def bench_admit(num_blocks: int, algo: str, warm: bool, repeats: int) -> float:
    mgr = KVCacheManager(num_blocks, BLOCK_SIZE, hash_algo=algo)
    base = [random.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    counter = iter(range(10**9))

    def op() -> None:
        i = next(counter)
        tokens = list(base) if warm else [i] + base[1:]
        req = Req(f"r{i}", tokens)
        hit, num_hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit) is not None
        assert (num_hit > 0) == (warm and i > 0)
        mgr.free(req)

    op()  # warm: populates the cache
    return timed(op, 100, repeats)


def bench_decode(num_blocks: int, algo: str, repeats: int) -> float:
    mgr = KVCacheManager(num_blocks, BLOCK_SIZE, hash_algo=algo)
    req = Req("d", [random.randrange(VOCAB) for _ in range(PROMPT_LEN)])
    mgr.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens

    def op() -> None:
        req.all_token_ids.append(7)
        mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1

    return timed(op, 20000, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    random.seed(0)
    n, r = args.num_blocks, args.repeats
    rows = [("alloc+free 256 blocks", "-", bench_pool(n, r), 256)]
    for algo, label in [("sha256", "sha256"), ("xxhash", "xxhash"),
                        ("pickle", "sha256 of pickle (baseline)")]:
        rows.append(("hash 4k prompt (256 blocks)", label, bench_hash(algo, r), 256))
    for algo in ("sha256", "xxhash"):
        rows.append(("admit cold 4k prompt + free", algo, bench_admit(n, algo, False, r), 256))
        rows.append(("admit warm 4k prompt + free", algo, bench_admit(n, algo, True, r), 256))
        rows.append(("decode step (allocate_slots 1)", algo, bench_decode(n, algo, r), 1))
    print(f"pool {n} blocks of {BLOCK_SIZE}, prompt {PROMPT_LEN} tokens, median of {r}\n")
    print("| operation | hash | time per op | ops/s | blocks/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for op, algo, sec, blocks in rows:
        print(f"| {op} | {algo} | {sec * 1e6:,.1f} us | {1 / sec:,.0f} | {blocks / sec:,.0f} |")


if __name__ == "__main__":
    main()
