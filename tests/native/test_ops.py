"""The native float32 decoder ops (kernels/native/ops.c) against float64 references and the eager
PyTorch ops they replace (model/ops.py), and the choice between the two (`select_ops`).

Fresh seeds each run (printed on failure); token counts 1 to 300 (300 splits rows over
threads); hidden sizes and head sizes that are no multiple of 8 (scalar tails); GQA ratios 1 to
8; positions up to the last row of the RoPE table; row-strided views; in-place semantics.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.native import build
from pagedserve.kernels.native import ops as native
from pagedserve.model import ops
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import RotaryEmbedding

pytestmark = pytest.mark.skipif(build.library() is None, reason="native kernels unavailable")

EPS = 1e-6
TOL = dict(atol=1e-6, rtol=1e-6)
TOKENS = [1, 5, 16, 300]


def fresh_generator() -> tuple[torch.Generator, str]:
    seed = torch.seed() % 2**31
    return torch.Generator().manual_seed(seed), f"seed {seed}"


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_tables(head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig(family="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8,
                         num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
                         rms_norm_eps=EPS, rope_theta=10000.0, max_model_len=max_len,
                         tie_word_embeddings=True)
    return RotaryEmbedding(config).tables(torch.device("cpu"), torch.float32)


# --- add + RMSNorm --------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [36, 100, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(tokens, hidden, with_residual):
    gen, msg = fresh_generator()
    x = 2 * torch.randn(tokens, hidden, generator=gen)
    residual = 3 * torch.randn(tokens, hidden, generator=gen) if with_residual else None
    weight = 1 + 0.3 * torch.randn(hidden, generator=gen)
    x_before, weight_before = x.clone(), weight.clone()
    eager_res = None if residual is None else residual.clone()
    eager_out, eager_sum = ops.eager_fused_add_rms_norm(x.clone(), eager_res, weight, EPS)

    out, total = native.fused_add_rms_norm(x, residual, weight, EPS)

    assert total is (x if residual is None else residual)  # the stream, updated in place
    assert torch.equal(total, eager_sum), msg  # one float32 add per element, as eager
    assert torch.equal(x, x_before) and torch.equal(weight, weight_before), msg
    assert out.shape == (tokens, hidden) and out.is_contiguous()
    torch.testing.assert_close(out.double(), rms_norm64(eager_sum, weight, EPS), **TOL, msg=msg)
    torch.testing.assert_close(out, eager_out, **TOL, msg=msg)


def test_add_rms_norm_on_row_strided_views():
    """Rows of a wider buffer (stride > H), as a view into a larger activation would be."""
    gen, msg = fresh_generator()
    x_buf, res_buf = torch.randn(7, 130, generator=gen), torch.randn(7, 120, generator=gen)
    x, residual = x_buf[:, 2:102], res_buf[:, 10:110]
    weight = torch.randn(100, generator=gen)
    res_before = res_buf.clone()
    expected_sum = residual + x
    out, total = native.fused_add_rms_norm(x, residual, weight, EPS)
    assert total is residual and torch.equal(residual, expected_sum), msg
    assert torch.equal(res_buf[:, :10], res_before[:, :10]), "wrote outside residual"
    assert torch.equal(res_buf[:, 110:], res_before[:, 110:]), "wrote outside residual"
    torch.testing.assert_close(out.double(), rms_norm64(expected_sum, weight, EPS), **TOL,
                               msg=msg)


# --- q/k RMSNorm + RoPE ---------------------------------------------------------------------


def rotate64(qkv, positions, cos, sin, hq, hkv, q_weight, k_weight, eps) -> torch.Tensor:
    """The rotated q and k heads [T, hq + hkv, D] in float64."""
    q, k = qkv[:, :hq].double(), qkv[:, hq : hq + hkv].double()
    if q_weight is not None:
        q, k = rms_norm64(q, q_weight, eps), rms_norm64(k, k_weight, eps)
    cos, sin = cos.double()[positions][:, None], sin.double()[positions][:, None]
    qk = torch.cat([q, k], dim=1)
    return qk * cos + torch.roll(qk, qk.shape[-1] // 2, dims=-1) * sin


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 20])  # 20: halves of 10, a scalar tail
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotate_qk(tokens, head_dim, num_heads, num_kv_heads, qk_norm):
    gen, msg = fresh_generator()
    max_len = 4096
    cos, sin = rope_tables(head_dim, max_len)
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    positions[0] = max_len - 1  # the table's last row
    heads = num_heads + 2 * num_kv_heads
    # A token stride wider than the row, as a view of a larger buffer would have.
    buffer = torch.randn(tokens, heads + 1, head_dim, generator=gen)
    qkv = buffer[:, 1:]
    weights = [1 + 0.3 * torch.randn(head_dim, generator=gen) for _ in range(2)] if qk_norm \
        else [None, None]
    eager = qkv.clone()
    ops.eager_rotate_qk_(eager, positions, cos, sin, num_heads, num_kv_heads, *weights, EPS)
    before = [t.clone() for t in (buffer, positions, cos, sin)]
    expected = rotate64(qkv, positions, cos, sin, num_heads, num_kv_heads, *weights, EPS)

    native.rotate_qk_(qkv, positions, cos, sin, num_heads, num_kv_heads, *weights, EPS)

    rotated = num_heads + num_kv_heads
    torch.testing.assert_close(qkv[:, :rotated].double(), expected, **TOL, msg=msg)
    if qk_norm:
        torch.testing.assert_close(qkv, eager, **TOL, msg=msg)
    else:  # both products rounded before the add, as eager: the same bits
        assert torch.equal(qkv, eager), msg
    assert torch.equal(qkv[:, rotated:], before[0][:, 1 + rotated:]), "v must be left alone"
    assert torch.equal(buffer[:, 0], before[0][:, 0]), "wrote outside qkv"
    for t, b in zip((positions, cos, sin), before[1:]):
        assert torch.equal(t, b), "an input was modified"


def test_rotate_qk_rejects_positions_past_the_table_without_writing():
    cos, sin = rope_tables(64, 10)
    qkv = torch.randn(3, 6, 64)
    before = qkv.clone()
    with pytest.raises(IndexError, match="position 10 of token 1"):
        native.rotate_qk_(qkv, torch.tensor([2, 10, 0]), cos, sin, 2, 2)
    assert torch.equal(qkv, before)
    with pytest.raises(IndexError):
        native.rotate_qk_(qkv, torch.tensor([0, -1, 0]), cos, sin, 2, 2)


def test_rotate_qk_rejects_mismatched_shapes():
    cos, sin = rope_tables(64, 10)
    qkv, positions = torch.randn(3, 6, 64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError):
        native.rotate_qk_(qkv, positions, cos, sin, 3, 2)  # 3 + 2 x 2 != 6 heads
    with pytest.raises(ValueError):
        native.rotate_qk_(qkv, positions[:2], cos, sin, 2, 2)
    with pytest.raises(ValueError):
        native.rotate_qk_(qkv, positions, cos, sin, 2, 2, torch.ones(64), None)
    with pytest.raises(ValueError):
        native.rotate_qk_(qkv, positions, cos[:, :32], sin[:, :32], 2, 2)


# --- SiLU * up ------------------------------------------------------------------------------


def silu_and_mul64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inner", [36, 100, 1536])
def test_silu_and_mul(tokens, inner):
    gen, msg = fresh_generator()
    gate_up = 3 * torch.randn(tokens, 2 * inner, generator=gen)
    before = gate_up.clone()
    out = native.silu_and_mul(gate_up)
    assert out.shape == (tokens, inner) and out.is_contiguous()
    assert torch.equal(gate_up, before), "the input was modified"
    torch.testing.assert_close(out.double(), silu_and_mul64(gate_up), **TOL, msg=msg)
    torch.testing.assert_close(out, ops.eager_silu_and_mul(gate_up), **TOL, msg=msg)


def test_silu_over_the_whole_float_range():
    """exp over a million gates from tiny to overflowing, and the special values: within
    float32 rounding of float64, as close as torch's own."""
    gen, msg = fresh_generator()
    gate = torch.cat([torch.randn(250_000, generator=gen) * scale for scale in (1, 10, 40, 100)]
                     + [torch.tensor([0.0, -0.0, 88.0, 88.8, -88.0, -88.8, -103.0, -110.0,
                                      float("inf"), -float("inf"), float("nan")])])
    gate_up = torch.stack([gate, torch.ones_like(gate)], dim=0).view(1, -1)  # up = 1
    out = native.silu_and_mul(gate_up)[0]
    expected = torch.nn.functional.silu(gate)
    torch.testing.assert_close(out, expected, atol=1e-30, rtol=1e-6, equal_nan=True, msg=msg)
    finite = gate.isfinite()
    reference = silu_and_mul64(gate_up)[0][finite]
    ours = (out.double()[finite] - reference).abs()
    torchs = (expected.double()[finite] - reference).abs()
    assert (ours <= torchs + 2 * 2**-24 * reference.abs() + 1e-44).all(), msg


def test_silu_and_mul_on_row_strided_view():
    gen, msg = fresh_generator()
    buffer = torch.randn(6, 250, generator=gen)
    gate_up = buffer[:, 25:225]
    torch.testing.assert_close(native.silu_and_mul(gate_up).double(), silu_and_mul64(gate_up),
                               **TOL, msg=msg)


# --- threads, empty inputs, routing -----------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_result_for_any_thread_count(threads):
    """Rows are split between threads whole, so the thread count changes nothing."""
    gen, _ = fresh_generator()
    x, res = torch.randn(300, 576, generator=gen), torch.randn(300, 576, generator=gen)
    weight, gate_up = torch.randn(576, generator=gen), torch.randn(300, 3072, generator=gen)
    cos, sin = rope_tables(64, 512)
    qkv, positions = torch.randn(300, 15, 64, generator=gen), torch.randint(0, 512, (300,))

    def run():
        qkv_out = qkv.clone()
        native.rotate_qk_(qkv_out, positions, cos, sin, 9, 3, weight[:64], weight[64:128], EPS)
        norm_out, total = native.fused_add_rms_norm(x, res.clone(), weight, EPS)
        return norm_out, total, qkv_out, native.silu_and_mul(gate_up)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(threads)
        for a, b in zip(run(), one):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def test_no_tokens():
    out, total = native.fused_add_rms_norm(torch.empty(0, 64), torch.empty(0, 64),
                                           torch.ones(64), EPS)
    assert out.shape == total.shape == (0, 64)
    cos, sin = rope_tables(64, 4)
    native.rotate_qk_(torch.empty(0, 3, 64), torch.empty(0, dtype=torch.int64), cos, sin, 1, 1)
    assert native.silu_and_mul(torch.empty(0, 64)).shape == (0, 32)


def test_writes_bump_the_version_counter():
    """As an in-place torch op would, so that autograd notices a tensor it saved changed."""
    residual, qkv = torch.randn(2, 64), torch.randn(2, 3, 64)
    versions = residual._version, qkv._version
    native.fused_add_rms_norm(torch.randn(2, 64), residual, torch.ones(64), EPS)
    cos, sin = rope_tables(64, 4)
    native.rotate_qk_(qkv, torch.tensor([0, 3]), cos, sin, 1, 1)
    assert residual._version > versions[0] and qkv._version > versions[1]


def test_refuses_what_the_kernels_cannot_take():
    """Columns that are not contiguous, another dtype, or a tensor autograd records raise
    instead of being misread (or losing their gradient); outside autograd they run."""
    x = torch.randn(4, 64)
    weight = torch.nn.Parameter(torch.ones(64))
    with torch.no_grad():
        for bad in (x.t().contiguous().t(), x.to(torch.bfloat16)):
            with pytest.raises(ValueError, match="float32 tensors with a contiguous last dim"):
                native.silu_and_mul(bad)
    with pytest.raises(ValueError, match="requiring grad"):
        native.fused_add_rms_norm(x, None, weight, EPS)  # autograd records the weight
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            native.fused_add_rms_norm(x, None, weight, EPS)
            native.fused_add_rms_norm(x, None, x[0], EPS)  # rows of any stride


def test_select_ops_takes_the_kernels_for_float32_cpu():
    """model/ops.py's choice: the kernels for float32 on the CPU, the eager references for
    other dtypes; the references stay differentiable and take any strides."""
    gen, msg = fresh_generator()
    x = torch.randn(5, 64, generator=gen)
    weight = torch.nn.Parameter(1 + 0.3 * torch.randn(64, generator=gen))
    chosen = ops.select_ops("cpu", torch.float32)
    assert chosen.fused_add_rms_norm is native.fused_add_rms_norm
    assert ops.select_ops("cpu", torch.bfloat16).fused_add_rms_norm is (
        ops.eager_fused_add_rms_norm)
    with torch.inference_mode():
        native_out, _ = chosen.fused_add_rms_norm(x, None, weight, EPS)
        assert torch.equal(native_out, native.fused_add_rms_norm(x, None, weight, EPS)[0])
    out, _ = ops.TORCH_OPS.fused_add_rms_norm(x, None, weight, EPS)  # differentiable
    assert out.grad_fn is not None
    out.sum().backward()
    assert weight.grad is not None
    torch.testing.assert_close(out.detach(), native_out, **TOL, msg=msg)

    strided = torch.randn(64, 5, generator=gen).t()  # [5, 64], columns not contiguous
    with torch.no_grad():
        torch.testing.assert_close(ops.TORCH_OPS.silu_and_mul(strided),
                                   chosen.silu_and_mul(strided.contiguous()), **TOL, msg=msg)
