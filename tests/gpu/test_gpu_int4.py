"""Integer weight-only layers on CUDA (CI skips this file): the compiled GEMV and GEMM against
the dequantizing reference at the Llama-3-8B projection shapes and ragged ones, bf16 and
fp16; then tiny compressed-tensors / GPTQ / AWQ checkpoints (benchmarks/quantize_int.py)
loaded on CUDA give the CPU reference's logits (float32: same dequantized weights)."""

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


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 64])
@pytest.mark.parametrize("group,zeros", [(128, False), (32, True), (256, False)])
def test_prepared_weights_take_torchs_int4_kernel_for_a_few_rows(rows, group, zeros):
    """`prepare` gives a 4-bit weight in column order its copy in torch's int4 layout; up to
    `int4pack_max_rows` rows run there, more on the Triton kernels, all within bf16's noise
    of the reference. A weight it cannot read (g_idx, 8 bits, float16 scales) is unchanged."""
    from pagedserve.kernels.triton.int_linear import linear, prepare
    from tests.kernels.test_int_linear import random_weight

    gen = torch.Generator().manual_seed(rows + group)
    k, n = 4096, 1024 + 8
    w = random_weight(n, k, 4, group, zeros, False, torch.bfloat16, gen)
    w = type(w)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v)
                   for f, v in vars(w).items()})
    prepared = prepare(w)
    assert prepared.int4pack is not None
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    expected = x.float() @ w.dequantize().float().t() + bias.float()
    got = linear(x, prepared, bias).float()
    bound = (x.float().abs() @ w.dequantize().float().abs().t()) * 2**-7 + 1e-2
    assert ((got - expected).abs() <= bound).all()
    for other in (random_weight(n, k, 4, 128, True, True, torch.bfloat16, gen),
                  random_weight(n, k, 8, 128, False, False, torch.bfloat16, gen),
                  random_weight(n, k, 4, 128, False, False, torch.float16, gen)):
        other = type(other)(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v)
                               for f, v in vars(other).items()})
        assert prepare(other).int4pack is None
