"""What the tensor-parallel tests share: tiny random checkpoints from benchmarks/configs
(two layers, an odd vocabulary: the last rank's rows padded) and the logits of a fixed paged
schedule, run in one process or on every rank of a group (`ranks.run_on_ranks`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.model import load_model
from tests.model.paged import PagedDriver

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def tiny_checkpoint(root: Path, case: str, lm_head_scale: float | None = None,
                    **overrides) -> str:
    """benchmarks/configs/`case`.json with two layers and vocabulary 2001 (and `overrides`)
    as a float32 folder with a byte tokenizer under `root`; weights drawn wide enough
    (initializer_range 0.1) to tell the ranks' errors apart. `lm_head_scale`: see
    `make_checkpoint`."""
    config = json.loads((CONFIGS / f"{case}.json").read_text())
    config.update(vocab_size=2001, num_hidden_layers=2, initializer_range=0.1, **overrides)
    (root / f"{case}.json").write_text(json.dumps(config))
    make_checkpoint(root / f"{case}.json", root / case, torch.float32, seed=0,
                    tokenizer="bytes", lm_head_scale=lm_head_scale)
    return str(root / case)


def paged_logits(folder: str, load_format: str = "auto", quantization: str | None = None,
                 quantized: bool = False) -> list[torch.Tensor]:
    """Every fed token's logits through a fixed mix of prefill, chunked prefill and decode
    (`quantized`: the CPU's fast mode, see `load_model`)."""
    model, config, _ = load_model(folder, torch.float32, "cpu", load_format=load_format,
                                  quantization=quantization, quantized=quantized)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (11, 14))
    driver = PagedDriver(model)
    out = []
    schedule = [{"a": a, "b": b[:5]}, {"a": [7], "b": b[5:10]}, {"a": [9], "b": b[10:]},
                {"a": [3], "b": [5]}]
    for feeds in schedule:
        logits = driver.step(feeds)
        out += [logits["a"], logits["b"]]
    return out


def tp_logits(folders: list[str], load_format: str = "auto", quantization: str | None = None,
              quantized: bool = False) -> list[list[torch.Tensor]]:
    return [paged_logits(folder, load_format, quantization, quantized) for folder in folders]


def tp_logits_mixed(runs: list[tuple[str, str | None]]) -> list[list[torch.Tensor]]:
    """paged_logits of each (folder, quantization), one group for all."""
    return [paged_logits(folder, quantization=q) for folder, q in runs]


def assert_ranks_equal_reference(case: str, ranks: list[list[torch.Tensor]],
                                 want: list[torch.Tensor]) -> None:
    """Every rank's gathered logits are the same, and one process's within 1e-4, with its
    argmax."""
    for step, (w, *got) in enumerate(zip(want, *ranks)):
        assert not w.isnan().any()
        for g in got[1:]:
            assert torch.equal(got[0], g), f"{case}: ranks disagree on the gathered logits"
        torch.testing.assert_close(got[0], w, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{case} output {step}: {m}")
        assert torch.equal(got[0].argmax(-1), w.argmax(-1))
