"""MoE experts kept quantized on CUDA (CI skips this file): the compiled fused MoE kernels
on packed experts (integer formats, GGUF blocks) against a torch reference on the same
dequantized weights, at a few thousand features, ragged tokens per expert, at token counts
that take each of the kernel paths (`moe.MoeConfig`: the per-pair GEMV up to 8 tokens, the
grouped GEMM unpacking tiles at 16, the experts dequantized first from 128); tiny quantized
Mixtral / Qwen3-MoE checkpoints and a MoE GGUF loaded on CUDA give the CPU's logits
(float32); a quantized MoE engine's greedy tokens under CUDA graphs equal eager mode's. The
GGUF cases need the `gguf` package (skipped without it)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E, TOP_K = 8, 2


def dequantized(experts, dtype):
    return torch.stack([w.dequantize(dtype) for w in experts.experts])


def reference(x, gate, up, down, weights, ids):
    """Each token through its experts in float32 on the weights the kernel multiplies (the
    dequantized values rounded to x's dtype), weighted and summed."""
    g, u, d = (dequantized(w, x.dtype).float() for w in (gate, up, down))
    xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(g.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            h = F.silu(xf[token] @ g[e].T) * (xf[token] @ u[e].T)
            out.index_add_(0, token, (h @ d[e].T) * weights[token, slot, None].float())
    return out


def check(gate, up, down, num_tokens, dtype=torch.bfloat16):
    from pagedserve.kernels.triton.moe import fused_moe
    from pagedserve.model.moe import route

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hidden = gate.shape[2]
    x = (torch.randn(num_tokens, hidden, device="cuda", generator=gen) * 0.5).to(dtype)
    logits = torch.randn(num_tokens, E, device="cuda", generator=gen)
    logits[:, 0] += 2.0  # ragged: one expert takes most tokens
    weights, ids = route(logits, TOP_K, renormalize=True, weights_dtype=None)
    got = fused_moe(x, (gate, up), down, weights, ids).float()
    expected = reference(x, gate, up, down, weights, ids)
    # bf16 activations and intermediate: within a percent of the output's scale
    assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()


def stacked_int(n, k, bits, group, zeros, g_idx, gen, rows=None):
    from pagedserve.kernels.weight_formats import IntWeight, stacked
    from tests.kernels.test_int_linear import random_weight

    experts = [random_weight(n, k, bits, group, zeros, g_idx, torch.bfloat16, gen)
               for _ in range(E)]
    stack = {f: None if getattr(experts[0], f) is None
             else torch.stack([getattr(w, f) for w in experts]).cuda()
             for f in ("qweight", "scales", "zeros", "g_idx")}
    lo, hi = rows or (0, n)
    return stacked(IntWeight(stack["qweight"][e, lo:hi], stack["scales"][e, lo:hi],
                             None if not zeros else stack["zeros"][e, lo:hi],
                             None if not g_idx else stack["g_idx"][e], bits, group, k)
                   for e in range(E))


@pytest.mark.parametrize("num_tokens", [1, 5, 8, 16, 128, 300])
@pytest.mark.parametrize("bits,group,zeros,g_idx", [(4, 128, True, False),
                                                    (4, 128, True, True),
                                                    (8, 1 << 20, False, False)])
def test_fused_moe_on_packed_int_experts(num_tokens, bits, group, zeros, g_idx):
    hidden, inter = 1024, 768
    gen = torch.Generator().manual_seed(bits * 10 + g_idx)
    gate = stacked_int(2 * inter, hidden, bits, group, zeros, g_idx, gen, (0, inter))
    up = stacked_int(2 * inter, hidden, bits, group, zeros, g_idx, gen, (inter, 2 * inter))
    down = stacked_int(hidden, inter, bits, group, zeros, g_idx, gen)
    check(gate, up, down, num_tokens)


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q8_0", "Q4_0")])
def test_fused_moe_on_gguf_experts(num_tokens, types):
    pytest.importorskip("gguf")
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from pagedserve.kernels.gguf_format import GgufWeight
    from pagedserve.kernels.weight_formats import stacked
    from tests.kernels.test_gguf_kernel import random_blocks

    hidden, inter = 1024, 512
    rng = np.random.default_rng(num_tokens)

    def experts(qtype, n, k):
        blocks = torch.from_numpy(np.stack([random_blocks(int(T[qtype]), n, k, rng)
                                            for _ in range(E)])).cuda()
        return stacked(GgufWeight(b, int(T[qtype]), k) for b in blocks)

    check(experts(types[0], inter, hidden), experts(types[1], inter, hidden),
          experts(types[2], hidden, inter), num_tokens)


def _same_logits(path, prompt: list[int], reference_ops=None) -> None:
    from pagedserve.model import load_model
    from pagedserve.model.moe import QuantizedExperts
    from tests.model.paged import PagedDriver

    cpu, _, _ = load_model(path, torch.float32, "cpu", ops=reference_ops)
    gpu, _, _ = load_model(path, torch.float32, "cuda")
    assert isinstance(gpu.layers[0].mlp.experts, QuantizedExperts)
    drivers = [PagedDriver(model, block_size=4) for model in (cpu, gpu)]
    with torch.no_grad():
        for feed in (prompt, [5], [17]):  # a prefill, then decode steps
            expected, got = (d.step({"a": feed})["a"].float().cpu() for d in drivers)
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("case", ["mixtral-gptq-desc_act", "qwen3moe-ct-w8-channel"])
def test_quantized_moe_checkpoints_on_cuda_give_the_cpu_logits(case, tmp_path):
    from tests.model.test_int_weights import MOE, quantized

    make, fmt_case = MOE[case]
    _, folder = quantized(tmp_path, fmt_case, make)
    _same_logits(folder, list(range(3, 40)))


@pytest.mark.parametrize("case", ["mixtral", "qwen3moe"])
def test_moe_gguf_with_experts_in_blocks_on_cuda_gives_the_cpu_logits(case, tmp_path,
                                                                       monkeypatch):
    pytest.importorskip("gguf")
    from pagedserve.model.ops import TORCH_OPS
    from tests.kernels.test_gguf_model_blocks import write_moe_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE", "0")
    path = write_moe_gguf(case, tmp_path, tmp_path / "model.gguf")
    _same_logits(path, [3, 1, 4, 1, 5, 9, 2], reference_ops=TORCH_OPS)


@torch.inference_mode()
def test_quantized_moe_engine_under_cuda_graphs_equals_eager(tmp_path):
    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
    from pagedserve.sampling_params import SamplingParams
    from tests.model.test_int_weights import MOE, quantized

    make, fmt_case = MOE["qwen3moe-ct-asym-actorder"]
    _, folder = quantized(tmp_path, fmt_case, make)
    loaded = LoadedModel.load(EngineConfig(model=str(folder), device="cuda",
                                           dtype="float32"))
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(5, 40))] for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        engine = LLMEngine(EngineConfig(device="cuda", dtype="float32", max_model_len=128,
                                        max_num_seqs=16, kv_cache_memory=64 << 20,
                                        enforce_eager=eager), loaded)
        assert (engine.model_runner.graphs is None) == eager
        outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in outs]
        del engine
    assert tokens[False] == tokens[True]
