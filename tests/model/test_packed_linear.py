"""`PackedWeight`: prepacked CPU float32 linears (the native kernel, and oneDNN where the kernel
is unavailable) agree with F.linear at every row count, follow writes to the weight, and leave
autograd to F.linear; `select_packing` leaves other dtypes to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.native import linear as native_linear
from pagedserve.model.decoder import Linear
from pagedserve.model.packed import NATIVE, ONEDNN, PackedWeight, select_packing

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch built without oneDNN")


@pytest.fixture(params=["native", "onednn"])
def packing(request):
    """Run a test on both packed paths."""
    if request.param == "native" and not native_linear.available():
        pytest.skip("native kernels unavailable")
    return NATIVE if request.param == "native" else ONEDNN


def packed_linear(in_features: int, out_features: int, packing, bias: bool = True) -> Linear:
    return Linear(in_features, out_features, bias=bias, matmul=PackedWeight(packing))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias, packing):
    torch.manual_seed(rows)
    layer = packed_linear(96, 200, packing, bias=bias).requires_grad_(False)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = layer(x)
    packed = layer.matmul._packed
    assert packed is not None  # the packed path ran, on the kernel's own layout or oneDNN's
    width = native_linear.panel()  # 24 columns, 48 in the AVX-512 build
    assert (packed.shape == (-(-200 // width), 96, width)) == (packing is NATIVE)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_follows_weight_writes(packing):
    torch.manual_seed(0)
    layer = packed_linear(32, 48, packing, bias=False).requires_grad_(False)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), -2.0 * before, atol=1e-5, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.zeros(48, 32), requires_grad=False)
    with torch.inference_mode():
        assert not layer(x).any()


def test_autograd_and_other_dtypes_take_f_linear(packing):
    layer = packed_linear(8, 8, packing)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()  # the packed op has no backward
    assert x.grad is not None and layer.weight.grad is not None
    assert layer.matmul._packed is None
    cpu = torch.device("cpu")
    assert select_packing(cpu, torch.float16) is None
    assert select_packing(torch.device("meta"), torch.float32) is None
    with torch.inference_mode():  # a weight made here has no version counter to watch
        made_here = packed_linear(8, 8, packing)
        torch.testing.assert_close(made_here(x.detach()), F.linear(x.detach(), made_here.weight,
                                                                   made_here.bias))
    assert made_here.matmul._packed is None


@pytest.mark.parametrize("rows", [1, 16, 17, 300])
def test_bfloat16_packs_where_the_kernel_is(rows):
    """A bfloat16 model's linears take the native kernel where it is available (AMX), else
    F.linear (oneDNN packs float32 only); either way F.linear's result within bfloat16
    rounding."""
    torch.manual_seed(rows)
    packing = select_packing(torch.device("cpu"), torch.bfloat16)
    native = native_linear.available(torch.bfloat16)
    assert packing is (NATIVE if native else None)
    matmul = F.linear if packing is None else PackedWeight(packing)
    layer = Linear(96, 200, matmul=matmul).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    assert (getattr(layer.matmul, "_packed", None) is not None) == native
    assert out.dtype == torch.bfloat16
    exact = x.double() @ layer.weight.double().T + layer.bias.double()
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-4)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=2**-7,
                               atol=1e-4)


def test_matmul_into_writes_the_product_into_the_given_tensor(packing):
    """`ops.matmul_into`, how a tensor-parallel layer puts its partial product in peer
    memory: F.linear's (torch.mm into it) and a packed weight's (copied in) equal the
    matmul's own product, in the tensor given; no tensor: the matmul's own."""
    from pagedserve.model.ops import matmul_into

    x, weight = torch.randn(3, 48), torch.randn(40, 48)
    for matmul in (F.linear, PackedWeight(packing)):
        want = matmul(x, weight, None)
        out = torch.full((3, 40), float("nan"))
        got = matmul_into(matmul, x, weight, out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, want)
        assert torch.equal(matmul_into(matmul, x, weight, None), want)
