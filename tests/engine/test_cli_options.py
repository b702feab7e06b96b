"""The CLI's engine flags reach EngineConfig under their own names (a typo in either place
would silently drop an option or crash `pagedserve` at start-up)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.cli import build_parser, engine_options


def _options(*argv: str) -> dict:
    args = ["generate", "hello", *argv]
    return engine_options(build_parser(args).parse_args(args))


def test_every_engine_flag_is_an_engine_config_field():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(_options()) <= fields
    EngineConfig(**_options())  # defaults validate


@pytest.mark.parametrize("flag, expected", [([], None), (["--async-scheduling"], True),
                                            (["--no-async-scheduling"], False)])
def test_async_scheduling_flag(flag, expected):
    options = _options(*flag)
    assert options["async_scheduling"] is expected
    assert EngineConfig(**options).async_scheduling is expected


def test_flags_carry_their_values():
    options = _options("--block-size", "32", "--max-num-seqs", "8", "--preemption-mode", "swap",
                       "--kv-cache-memory", "64M", "--no-prefix-caching", "--enforce-eager")
    assert (options["block_size"], options["max_num_seqs"], options["preemption_mode"]) == (
        32, 8, "swap")
    assert options["kv_cache_memory"] == 64 << 20
    assert options["enable_prefix_caching"] is False and options["enforce_eager"] is True
