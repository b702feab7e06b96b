"""Integer weight-only layers on CUDA (CI skips this file): the compiled GEMV and GEMM against
the dequantizing reference at the Llama-3-8B projection shapes and ragged ones, bf16 and
fp16; torch's int4 layout (the emulated packing against the real one, the Triton
dequantization from it, the row counts on each side of `int4pack_max_rows` and
`int4pack_gemm_max_rows`, the fused GEMM on it for decode batches); then tiny
compressed-tensors / GPTQ / AWQ checkpoints (benchmarks/quantize_int.py) loaded on CUDA give
the CPU reference's logits (float32: same dequantized weights)."""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")



@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (328, 40)])
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group,zeros,g_idx", [(4, 128, False, False),
                                                    (4, 128, True, True),
                                                    (8, 64, False, False)])
def test_int_linear_matches_the_reference_on_cuda(k, n, rows, dtype, bits, group, zeros,
                                                  g_idx):
    from pagedserve.kernels.triton.int_linear import linear
    from tests.kernels.test_int_linear import random_weight

    gen = torch.Generator().manual_seed(k + n + rows)
    w = random_weight(n, k, bits, group, zeros, g_idx, dtype, gen)
    w = type(w)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v)
                   for f, v in vars(w).items()})
    x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
    expected = (x.float() @ w.dequantize().float().t())
    got = linear(x, w).float()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-2 * scale


@pytest.mark.parametrize("fmt,options", [
    ("compressed-tensors", dict(bits=4, group=32, symmetric=False, act_order=True)),
    ("gptq", dict(bits=4, group=32, act_order=True)),
    ("awq", dict(bits=4, group=32, symmetric=False)),
    ("gptq", dict(bits=8, group=0)),
])
def test_quantized_checkpoints_on_cuda_give_the_cpu_logits(fmt, options, tmp_path):
    from transformers import Qwen3Config

    from pagedserve.model import load_model
    from tests.model.paged import PagedDriver
    from tests.model.test_decoder import TINY, make_checkpoint

    from benchmarks.quantize_int import quantize_folder

    make_checkpoint(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False),
                    tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / "q", fmt, **options)
    prompt = {"a": list(range(3, 40))}
    cpu, _, _ = load_model(tmp_path / "q", torch.float32, "cpu")
    gpu, _, _ = load_model(tmp_path / "q", torch.float32, "cuda")
    assert gpu.quantization == cpu.quantization
    expected = PagedDriver(cpu).step(prompt)["a"]
    got = PagedDriver(gpu).step(prompt)["a"].cpu()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def _cuda(w):
    return type(w)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v)
                      for f, v in vars(w).items()})


@pytest.mark.parametrize("n,k", [(1032, 4096), (8, 128), (4096, 14336)])
def test_pack_reference_is_cudas_int4_layout_bit_for_bit(n, k):
    """tests/kernels/test_int4pack.py's emulation of `_convert_weight_to_int4pack` (from
    int4mm.cu) is the real CUDA conversion, and `int4pack.unpack_reference` inverts it."""
    from pagedserve.kernels import int4pack
    from tests.kernels.test_int4pack import pack_reference, pairs_of

    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    real = torch.ops.aten._convert_weight_to_int4pack(pairs_of(codes).cuda(),
                                                      int4pack.INNER_K_TILES).cpu()
    assert torch.equal(real, pack_reference(pairs_of(codes)))
    assert torch.equal(int4pack.unpack_reference(real, n, k), codes.int())


@pytest.mark.parametrize("group,zeros", [(128, False), (32, True), (256, True)])
def test_triton_dequant_of_torchs_layout_is_the_reference(group, zeros):
    """`int_linear.dequantize` of a weight `prepare` converted (the real CUDA layout) equals
    the reference dequantization of that layout, float32 and bfloat16, bit for bit (both
    round once, to nearest); a symmetric weight's float32 values are the original
    `IntWeight`'s exactly."""
    from pagedserve.kernels.int4pack import Int4Weight
    from pagedserve.kernels.triton.int_linear import dequantize, prepare
    from tests.kernels.test_int_linear import random_weight

    gen = torch.Generator().manual_seed(group)
    w = _cuda(random_weight(1024 + 8, 4096, 4, group, zeros, False, torch.bfloat16, gen))
    prepared = prepare(w)
    assert isinstance(prepared, Int4Weight)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(prepared, dtype), prepared.dequantize(dtype))
    if not zeros:
        assert torch.equal(dequantize(prepared, torch.float32), w.dequantize(torch.float32))


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 8, 16, 17, 64, 256, 257])
@pytest.mark.parametrize("group,zeros", [(128, False), (32, True), (256, False)])
def test_prepared_weights_take_torchs_int4_kernel_for_a_few_rows(rows, group, zeros):
    """`for_layer` converts a 4-bit weight in column order to torch's int4 layout (its only
    copy) with `int4pack_linear`: up to `int4pack_max_rows` rows run on torch's kernel, up to
    `int4pack_gemm_max_rows` on the fused GEMM, more on the weight dequantized from that
    layout, all within bf16's noise of the reference. A weight torch's kernel cannot read
    (g_idx, 8 bits, float16 scales) is returned unchanged, with `linear`."""
    from pagedserve.kernels.int4pack import Int4Weight
    from pagedserve.kernels.triton.int_linear import for_layer, linear
    from tests.kernels.test_int_linear import random_weight

    gen = torch.Generator().manual_seed(rows + group)
    k, n = 4096, 1024 + 8
    w = random_weight(n, k, 4, group, zeros, False, torch.bfloat16, gen)
    w = type(w)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v)
                   for f, v in vars(w).items()})
    matmul, prepared = for_layer(w)
    assert isinstance(prepared, Int4Weight)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    expected = x.float() @ w.dequantize().float().t() + bias.float()
    got = matmul(x, prepared, bias).float()
    bound = (x.float().abs() @ w.dequantize().float().abs().t()) * 2**-7 + 1e-2
    assert ((got - expected).abs() <= bound).all()
    for other in (random_weight(n, k, 4, 128, True, True, torch.bfloat16, gen),
                  random_weight(n, k, 8, 128, False, False, torch.bfloat16, gen),
                  random_weight(n, k, 4, 128, False, False, torch.float16, gen)):
        other = type(other)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v)
                               for f, v in vars(other).items()})
        matmul, kept = for_layer(other)
        assert matmul is linear and kept is other


def test_a_bf16_checkpoint_on_cuda_keeps_its_4bit_weights_in_torchs_layout_alone(tmp_path):
    """A 4-bit checkpoint whose every projection torch's int4 kernel reads, loaded in bf16 on
    CUDA: the packed int32 parameters are gone (the converted weight is the only copy) and
    the logits of a prefill (rows past `int4pack_max_rows`: the fused GEMM), a decode step
    and a short prefill (torch's kernel) are the CPU reference's within bf16's noise."""
    from transformers import Qwen3Config

    from pagedserve.model import load_model
    from tests.model.paged import PagedDriver
    from tests.model.test_decoder import TINY, make_checkpoint

    from benchmarks.quantize_int import quantize_folder

    config = {**TINY, "hidden_size": 128, "intermediate_size": 256}
    make_checkpoint(Qwen3Config(**config, head_dim=32, tie_word_embeddings=False),
                    tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / "q", "compressed-tensors", bits=4,
                    group=32)
    cpu, _, _ = load_model(tmp_path / "q", torch.float32, "cpu")
    gpu, _, _ = load_model(tmp_path / "q", torch.bfloat16, "cuda")
    assert not [name for name, p in gpu.named_parameters() if p.dtype == torch.int32]
    cpu_driver, gpu_driver = PagedDriver(cpu), PagedDriver(gpu)
    for feeds in ({"a": list(range(3, 40))}, {"a": [7]}, {"b": list(range(50, 55))}):
        expected = cpu_driver.step(feeds)
        got = gpu_driver.step(feeds)
        for seq, logits in expected.items():
            err = (got[seq].float().cpu() - logits).abs().max()
            assert err <= 0.05 * logits.abs().max() + 0.02, (feeds.keys(), float(err))


@torch.inference_mode()
def test_an_engine_on_4bit_weights_in_torchs_layout_alone_gives_the_reference_logprobs(
        tmp_path):
    """The engine (CUDA graphs on) serving a bf16 4-bit checkpoint kept in torch's int4
    layout alone: 20 greedy requests of different lengths, so decode batches run past
    `int4pack_max_rows` (the fused GEMM on the layout, inside a graph) and, as requests
    finish, below it (torch's kernel in a graph). Each generated token's logprob is
    the float32 CPU reference's at that position (the prompt and the tokens before it fed
    whole), and the token is the reference's argmax within bf16's noise."""
    import random

    from transformers import Qwen3Config

    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
    from pagedserve.model import load_model
    from pagedserve.sampling_params import SamplingParams
    from tests.model.paged import PagedDriver
    from tests.model.test_decoder import TINY, make_checkpoint

    from benchmarks.quantize_int import quantize_folder

    config = {**TINY, "hidden_size": 128, "intermediate_size": 256}
    make_checkpoint(Qwen3Config(**config, head_dim=32, tie_word_embeddings=False),
                    tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / "q", "compressed-tensors", bits=4,
                    group=32)
    loaded = LoadedModel.load(EngineConfig(model=str(tmp_path / "q"), device="cuda",
                                           dtype="bfloat16"))
    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_model_len=128,
                                    max_num_seqs=32, kv_cache_memory=64 << 20), loaded)
    assert engine.model_runner.graphs is not None
    rng = random.Random(5)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(3, 30))] for _ in range(20)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True, logprobs=0)
              for i in range(20)]
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    cpu, _, _ = load_model(tmp_path / "q", torch.float32, "cpu")
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens, logprobs = list(out.outputs[0].token_ids), out.outputs[0].logprobs
        assert len(tokens) == 4 + i and len(logprobs) == len(tokens)
        fed = PagedDriver(cpu).step({"r": prompt + tokens[:-1]})["r"][len(prompt) - 1:]
        reference = torch.log_softmax(fed, dim=-1)
        tol = 0.1 * fed.abs().max(dim=-1).values + 0.04  # twice the logits' bf16 bound
        for j, token in enumerate(tokens):
            got = logprobs[j][token].logprob
            assert abs(got - float(reference[j, token])) <= tol[j], (i, j)
            assert reference[j, token] >= reference[j].max() - tol[j], (i, j)


@pytest.mark.parametrize("rows", [17, 48, 100, 256])
@pytest.mark.parametrize("group,zeros", [(128, False), (32, True), (64, False)])
def test_fused_gemm_on_torchs_layout_is_x_times_its_dequantization(rows, group, zeros):
    """`int4pack_gemm.matmul` (the tiles of its rule: split-K at 17 rows) on a weight
    `prepare` converted (the real CUDA layout) is x @ the reference dequantization in bf16
    (the weight the kernel's tl.dot takes, rounded once) + bias, to float32 summation order
    and the output's one rounding; N is past the last 64- and 128-row tile."""
    from pagedserve.kernels.triton.int4pack_gemm import matmul
    from pagedserve.kernels.triton.int_linear import prepare
    from tests.kernels.test_int_linear import random_weight

    gen = torch.Generator().manual_seed(rows + group)
    k, n = 4096, 1024 + 8
    prepared = prepare(_cuda(random_weight(n, k, 4, group, zeros, False, torch.bfloat16, gen)))
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    w = prepared.dequantize(torch.bfloat16).float()
    expected = x.float() @ w.t() + bias.float()
    bound = expected.abs() * 2**-8 + (x.float().abs() @ w.abs().t()) * 2**-14 + 1e-6
    got = matmul(x, prepared, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert ((got.float() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_gemm_tile_configurations_give_the_same_products(dtype):
    """Tile configurations of the kinds benchmarks/int4.py sweeps (split-K 2 and 4,
    BLOCK_K 256, 4 and 8 warps, M tiles of 16 to 128) on the real layout, K and N ragged
    against the tiles, bf16 and fp16 activations: x @ the dequantized weight rounded to the
    activation dtype, + bias (added in the kernel without split-K, after the sum with it)."""
    from pagedserve.kernels.triton.int4pack_gemm import Int4GemmConfig, matmul
    from pagedserve.kernels.triton.int_linear import prepare
    from tests.kernels.test_int_linear import random_weight

    gen = torch.Generator().manual_seed(7)
    k, n, rows = 128 * 11, 200, 37
    prepared = prepare(_cuda(random_weight(n, k, 4, 128, True, False, torch.bfloat16, gen)))
    x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
    bias = torch.randn(n, generator=gen).to(dtype).cuda()
    w = prepared.dequantize(torch.float32).to(dtype).float()
    expected = x.float() @ w.t() + bias.float()
    bound = expected.abs() * 2**-8 + (x.float().abs() @ w.abs().t()) * 2**-14 + 1e-6
    for config in (Int4GemmConfig(16, 64, 128, 2, 4, 4), Int4GemmConfig(16, 64, 256, 4, 4, 3),
                   Int4GemmConfig(32, 128, 128, 1, 4, 3), Int4GemmConfig(64, 256, 128, 1, 8, 3),
                   Int4GemmConfig(128, 128, 128, 1, 8, 4)):
        got = matmul(x, prepared, bias, config)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert ((got.float() - expected).abs() <= bound).all(), config
