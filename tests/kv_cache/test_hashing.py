import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.kv_cache.hashing import get_hash_fn

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(params=["sha256", "xxhash"])
def hash_fn(request):
    return get_hash_fn(request.param)


def test_chained_hash_separates_same_block_under_different_parents(hash_fn):
    ab = hash_fn(None, [1, 2])
    xy = hash_fn(None, [7, 8])
    assert hash_fn(ab, [3, 4]) != hash_fn(xy, [3, 4])
    assert hash_fn(ab, [3, 4]) == hash_fn(hash_fn(None, [1, 2]), [3, 4])


def test_extra_keys_never_share(hash_fn):
    keys = [None, (None, "tenant-a"), (None, "tenant-b"), (1, None), (2, None), (1,), ("1",)]
    hashes = {hash_fn(None, [5, 6, 7], k) for k in keys}
    assert len(hashes) == len(keys)


def test_serialization_is_unambiguous(hash_fn):
    # token boundaries, negative and large ids and the extra-keys boundary all matter
    cases = [[1, 2], [1, 2, 0], [258], [0, 1], [2**40], [-1], [1]]
    assert len({hash_fn(None, c) for c in cases}) == len(cases)
    assert hash_fn(None, [1], (2,)) != hash_fn(None, [1, 2])


def test_parent_from_another_algorithm_is_rejected():
    sha_parent = get_hash_fn("sha256")(None, [1])
    with pytest.raises(ValueError):
        get_hash_fn("xxhash")(sha_parent, [2])
    with pytest.raises(ValueError):
        get_hash_fn("md5")


def test_seed_makes_hashes_reproducible_and_changes_the_root():
    """`set_hash_algo` changes the whole process's default, so it runs in an interpreter of
    its own: the engines of this test process keep their root."""
    code = """
from pagedserve.kv_cache.hashing import hash_block_tokens, set_hash_algo
set_hash_algo("sha256", seed=7)
first = hash_block_tokens(None, [1, 2, 3])
set_hash_algo("sha256", seed=7)
assert hash_block_tokens(None, [1, 2, 3]) == first
set_hash_algo("sha256", seed=8)
assert hash_block_tokens(None, [1, 2, 3]) != first
set_hash_algo("sha256")
random_root = hash_block_tokens(None, [1, 2, 3])
set_hash_algo("sha256")
assert hash_block_tokens(None, [1, 2, 3]) != random_root
set_hash_algo("xxhash", seed=7)
fast = hash_block_tokens(None, [1, 2, 3])
assert isinstance(fast, bytes) and len(fast) == 16
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_chain_equals_block_by_block_hashing(algo):
    hasher = get_hash_fn(algo)
    tokens = list(range(100, 112))
    extras = [(3, "salt"), (3,), (3,)]
    expected, parent = [], None
    for i, extra in enumerate(extras):
        parent = hasher(parent, tokens[i * 4:(i + 1) * 4], extra)
        expected.append(parent)
    assert hasher.chain(None, tokens, 4, extras) == expected
    assert hasher.chain(expected[0], tokens[4:], 4, extras[1:]) == expected[1:]
    with pytest.raises(ValueError, match="not 2 blocks"):
        hasher.chain(None, tokens, 4, extras[:2])
    with pytest.raises(ValueError, match="64-bit"):
        hasher(None, [2**70])


def _hash_in_fresh_process(algo: str, seed: str | None) -> str:
    """First block's hash computed by a new interpreter, as a replica would."""
    code = ("import sys; from pagedserve.kv_cache.hashing import get_hash_fn; "
            "seed = sys.argv[2] if len(sys.argv) > 2 else None; "
            "print(get_hash_fn(sys.argv[1], seed)(None, [1, 2, 3, 4]).hex())")
    args = [algo] + ([seed] if seed is not None else [])
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, text=True,
                         capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    return out.stdout.strip()


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_a_hash_seed_gives_replicas_equal_hashes(algo):
    """Two processes agree on block hashes exactly when they share a seed; a seeded hasher
    ignores the process-wide root, so engines in one process keep their own seeds."""
    replica = _hash_in_fresh_process(algo, "fleet-1")
    assert replica == get_hash_fn(algo, "fleet-1")(None, [1, 2, 3, 4]).hex()
    assert replica != _hash_in_fresh_process(algo, "fleet-2")
    assert _hash_in_fresh_process(algo, None) != _hash_in_fresh_process(algo, None)
    assert get_hash_fn(algo, 7)(None, [1]) == get_hash_fn(algo, "7")(None, [1])


def test_kv_cache_manager_uses_its_seed():
    from pagedserve.kv_cache.kv_cache_manager import KVCacheManager

    a, b = (KVCacheManager(8, 4, hash_seed="s") for _ in range(2))
    assert a.block_pool.hash_fn(None, [1, 2, 3, 4]) == b.block_pool.hash_fn(None, [1, 2, 3, 4])
    assert KVCacheManager(8, 4).block_pool.hash_fn(None, [1, 2, 3, 4]) != \
        a.block_pool.hash_fn(None, [1, 2, 3, 4])
