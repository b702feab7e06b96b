"""The model on its device: the device and dtype an engine option names, and the weights,
config and tokenizer loaded there (`LoadedModel`, shareable by engines in one process;
`load_on_device` also serves a tensor-parallel rank, which loads its own shard)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from pagedserve.config import EngineConfig
from pagedserve.kernels.native.build import cpu_flags, has_bf16_compute
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.model.loader import load_model, load_tokenizer, tokenizer_source
from pagedserve.model.ops import Ops, select_ops


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when there is one; an unavailable device is a ValueError up front
    (a clear message instead of torch's failure deep inside the model's loading)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} is not available: this torch "
                             f"({torch.__version__}) has no CUDA or sees no GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} is not available: "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _check_cpu_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """bfloat16 weights on the CPU only where it computes in bfloat16 (AVX-512-BF16 or AMX;
    torch's oneDNN kernels use them); elsewhere refuse, rather than run slower than float32."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not has_bf16_compute(cpu_flags()):
        raise ValueError("--dtype bfloat16 on the CPU needs AVX-512-BF16 or AMX, which this CPU "
                         "does not report; use --dtype auto (a GGUF's fast mode) or float32")


Timer = Callable[[str], AbstractContextManager]


def _untimed(_: str) -> AbstractContextManager:
    return nullcontext()


@dataclasses.dataclass
class LoadedModel:
    """Weights, their config and tokenizer; shareable by several engines (read-only)."""

    model: Decoder
    model_config: ModelConfig
    # the transformers tokenizer, or a TokenizerRef (`read_tokenizer`)
    tokenizer: object
    tokenizer_source: str | None = None  # what `tokenizer` was loaded from, for another process

    @classmethod
    def load(cls, config: EngineConfig, timed: Timer = _untimed,
             read_tokenizer: Callable[[str], object] = load_tokenizer) -> LoadedModel:
        """`timed(phase)`: a context that times each part (`load_on_device`'s, "tokenizer").
        `read_tokenizer(source)`: `TokenizerRef.read` for an engine core that needs only
        the tokenizer's size and EOS id (it then does not import transformers)."""
        model, model_config, _ = load_on_device(config, resolve_device(config.device), timed)
        source = tokenizer_source(config.model, config.tokenizer)
        with timed("tokenizer"):
            tokenizer = read_tokenizer(source)
        return cls(model, model_config, tokenizer, source)


def engine_ops(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Ops:
    """The kernels the engine's options choose (`select_ops` with --no-dense-gemv and
    --no-gguf-int8-activations), for the model and for its speculative draft alike."""
    return select_ops(device, dtype, dense_gemv=config.dense_gemv,
                      gguf_int8_activations=config.gguf_int8_activations)


def load_on_device(config: EngineConfig, device: torch.device,
                   timed: Timer = _untimed) -> tuple[Decoder, ModelConfig, str]:
    """The model on `device` (this rank's shard under tensor parallelism), its config and
    tokenizer source. `timed` times its parts apart, so a slow start-up says where it went:
    "device init" (a GPU's context), "kernels" (importing the ones that will run),
    "weights"."""
    dtype = resolve_dtype(config.dtype, device)
    _check_cpu_dtype(dtype, device)
    with timed("device init"):
        if device.type == "cuda":
            torch.zeros(1, device=device)  # the context and allocator, made here
    with timed("kernels"):
        ops = engine_ops(config, device, dtype)
    with timed("weights"):
        # "auto" on the CPU is the fast mode for a GGUF (its quantized blocks); an explicit
        # "float32" keeps the exact path.
        return load_model(config.model, dtype, device, quantized=config.dtype == "auto",
                          quantization=config.quantization, load_format=config.load_format,
                          ops=ops)
