"""The engine flags: one group, shared by every command, reaching EngineConfig under their own
names, each with help and its default, and the README's list generated from the same table."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.entrypoints import engine_args
from pagedserve.entrypoints.cli import build_parser, cli_engine_options, main
from pagedserve.entrypoints.engine_args import (ENGINE_ARGS, NOT_FLAGS, engine_options,
                                                format_size, parse_size)

README = Path(__file__).resolve().parents[2] / "README.md"
COMMANDS = {"generate": ["generate", "hello"], "chat": ["chat"], "bench": ["bench"],
            "serve": ["serve"]}


def _parse(command: str, *argv: str) -> argparse.Namespace:
    args = [*COMMANDS[command], *argv]
    return build_parser(args).parse_args(args)


def test_every_engine_config_field_has_a_flag_or_a_reason():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    flagged = [arg.field for arg in ENGINE_ARGS]
    assert len(flagged) == len(set(flagged))
    assert set(flagged) | set(NOT_FLAGS) == fields
    assert not set(flagged) & set(NOT_FLAGS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_the_whole_group_and_defaults_validate(command):
    options = engine_options(_parse(command))
    assert set(options) == {arg.field for arg in ENGINE_ARGS}
    defaults = EngineConfig()
    assert options == {name: getattr(defaults, name) for name in options}


# non-default values, spelled as a user would (the options the issue found missing on serve
# included); a flag not listed gets one from its type (`_other_value`)
NON_DEFAULT = [
    ("--model", "m.gguf", "model", "m.gguf"), ("--tokenizer", "t", "tokenizer", "t"),
    ("--dtype", "bfloat16", "dtype", "bfloat16"), ("--device", "cpu", "device", "cpu"),
    ("--block-size", "32", "block_size", 32),
    ("--kv-cache-memory", "64M", "kv_cache_memory", 64 << 20),
    ("--gpu-memory-utilization", "0.5", "gpu_memory_utilization", 0.5),
    ("--cpu-kv-cache-fraction", "0.1", "cpu_kv_cache_fraction", 0.1),
    ("--cpu-kv-cache-cap", "1G", "cpu_kv_cache_cap", 1 << 30),
    ("--no-prefix-caching", None, "enable_prefix_caching", False),
    ("--prefix-caching-hash-algo", "xxhash", "prefix_caching_hash_algo", "xxhash"),
    ("--prefix-caching-hash-seed", "fleet", "prefix_caching_hash_seed", "fleet"),
    ("--kv-events-endpoint", "tcp://*:5557", "kv_events_endpoint", "tcp://*:5557"),
    ("--max-num-seqs", "8", "max_num_seqs", 8),
    ("--max-num-batched-tokens", "512", "max_num_batched_tokens", 512),
    ("--max-model-len", "1024", "max_model_len", 1024),
    ("--preemption-mode", "swap", "preemption_mode", "swap"),
    ("--swap-space", "512M", "swap_space", 512 << 20),
    ("--kv-offload-memory", "2G", "kv_offload_memory", 2 << 30),
    ("--kv-offload-path", "/tmp/kv", "kv_offload_path", "/tmp/kv"),
    ("--kv-offload-disk", "100G", "kv_offload_disk", 100 << 30),
    ("--attention-backend", "torch", "attention_backend", "torch"),
    ("--enforce-eager", None, "enforce_eager", True),
    ("--no-async-scheduling", None, "async_scheduling", False),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
     "speculative_config", '{"method": "ngram", "num_speculative_tokens": 2}'),
]


def _other_value(arg: engine_args.EngineArg) -> tuple[list[str], object]:
    """Command-line words giving `arg` a value other than its default, and that value."""
    default = getattr(EngineConfig(), arg.field)
    hint = typing.get_type_hints(EngineConfig)[arg.field]  # `int | None` -> int
    kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if kind is bool:
        return ([f"--no-{arg.option[2:]}"] if default else [arg.option]), not default
    if arg.choices:
        value = next(c for c in arg.choices if c != default)
        return [arg.option, value], value
    if arg.parse is parse_size:
        return [arg.option, "3M"], 3 << 20
    value = {int: 8 if default != 8 else 4, float: 0.5 if default != 0.5 else 0.25}.get(
        kind, "x")
    return [arg.option, str(value)], value


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_reaches_engine_config(command):
    """Every engine flag, on every command, arrives in EngineConfig with its value."""
    listed = {name: ([flag, text] if text else [flag], value)
              for flag, text, name, value in NON_DEFAULT}
    chosen = {arg.field: listed.get(arg.field) or _other_value(arg) for arg in ENGINE_ARGS}
    argv = [word for words, _ in chosen.values() for word in words]
    options = engine_options(_parse(command, *argv))
    assert options == {name: value for name, (_, value) in chosen.items()}
    defaults = EngineConfig()
    assert all(options[name] != getattr(defaults, name) for name in options)
    EngineConfig(**options)


@pytest.mark.parametrize("flag, expected", [([], None), (["--async-scheduling"], True),
                                            (["--no-async-scheduling"], False)])
def test_async_scheduling_flag(flag, expected):
    options = engine_options(_parse("serve", *flag))
    assert options["async_scheduling"] is expected
    assert EngineConfig(**options).async_scheduling is expected


def test_command_seed_also_seeds_the_engine():
    assert cli_engine_options(_parse("generate", "--seed", "5"))["seed"] == 5
    assert "seed" not in cli_engine_options(_parse("generate"))
    assert _parse("serve", "--seed", "3").seed == 3


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_option_shows_help_and_default(command, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser(COMMANDS[command]).parse_args([*COMMANDS[command], "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    section = text.split("engine options:", 1)[1].split("\n\n", 1)[0]
    listed = {line.split()[0].rstrip(",") for line in section.splitlines()
              if line.startswith("  -")}
    assert listed == {arg.option for arg in ENGINE_ARGS}
    for arg in ENGINE_ARGS:
        assert f"(default: {engine_args.shown_default(arg)})" in " ".join(text.split())


def test_auto_defaults_show_their_meaning():
    """A None default is shown as what it means ("auto" unless told), never as "None"."""
    for arg in ENGINE_ARGS:
        assert engine_args.shown_default(arg) != "None"
    seed = next(a for a in ENGINE_ARGS if a.field == "prefix_caching_hash_seed")
    assert "random" in engine_args.shown_default(seed)


def test_readme_lists_exactly_the_engine_options():
    block = engine_args.readme_block(README.read_text())
    assert block is not None, "README lost its generated engine-options block"
    assert block == engine_args.markdown(), (
        "README's engine options are stale: run "
        "`python -m pagedserve.entrypoints.engine_args --readme README.md`")


@pytest.mark.parametrize("text, size", [("536870912", 512 << 20), ("512M", 512 << 20),
                                        ("2G", 2 << 30), ("2GiB", 2 << 30), ("1.5g", 3 << 29),
                                        ("64k", 64 << 10), ("100B", 100)])
def test_sizes(text, size):
    assert parse_size(text) == size
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize("text", ["", "lots", "2X", "-1G", "1e9"])
def test_bad_sizes_are_argparse_errors(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse("serve", f"--kv-cache-memory={text}")
    assert exit_.value.code == 2
    assert "not a size" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("pagedserve ") and len(out.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_only_torch_is_one_line(device, capsys):
    assert main(["generate", "hi", "--device", device]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("pagedserve: error:") and device in err and "no CUDA" in err


def test_unknown_device_is_one_line(capsys):
    assert main(["generate", "hi", "--device", "gpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown device 'gpu'" in err
