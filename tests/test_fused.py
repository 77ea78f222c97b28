"""models/fused.py: RMSNorm and rotary positions in fewer passes over memory compute what the plain
ops compute, forward and backward, and are the ones the blocks take (eagerly, on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfcli import adapters
from tfcli.models import blocks, fused
from tfcli.recipe import AdapterConfig


def plain_rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_function_is_rms_norm_forward_and_backward(with_weight):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 64, requires_grad=True)
    w = (torch.rand(64) + 0.5).requires_grad_(True) if with_weight else None
    g = torch.randn(3, 7, 64)
    ours = fused.RMSNormFunction.apply(x, w, 1e-5)
    theirs = F.rms_norm(x, (64,), w, 1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    inputs = (x, w) if with_weight else (x,)
    torch.testing.assert_close(
        torch.autograd.grad(ours, inputs, g), torch.autograd.grad(theirs, inputs, g), rtol=1e-5, atol=1e-5
    )
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True) if with_weight else None
    assert torch.autograd.gradcheck(lambda a, b: fused.RMSNormFunction.apply(a, b, 1e-5), (x64, w64))


def test_the_rotation_and_its_transpose_are_the_plain_rotations():
    """cos and sin with unequal halves (the blocks' have equal ones), so a transpose that swapped the
    wrong halves of sin would fail the gradient check."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(1, 5, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(fused.rotate(x, cos, sin), plain_rotate(x, cos, sin))
    assert torch.autograd.gradcheck(lambda a: fused.rotate(a, cos, sin), (x,))
    assert type(fused.rotate(x, cos, sin).grad_fn).__name__ == "RotaryFunctionBackward"


def test_the_blocks_rms_norm_is_nn_rms_norm_through_the_function_on_the_cpu_in_float32():
    norm = blocks.make_norm("rmsnorm", 16, 1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and set(norm.state_dict()) == {"weight"}
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, 16, requires_grad=True)
    y = norm(x)
    assert type(y.grad_fn).__name__ == "RMSNormFunctionBackward"
    torch.testing.assert_close(y, F.rms_norm(x, (16,), norm.weight, 1e-6))
    half = norm.to(torch.bfloat16)(x.bfloat16())  # other dtypes: the plain ops
    assert half.grad_fn is not None and type(half.grad_fn).__name__ != "RMSNormFunctionBackward"


def test_a_lora_linears_graph_copies_no_output_sized_gradient():
    """The update is added out of place: in place into the base's output, autograd's CopySlices would
    copy the output's gradient twice in backward."""
    base = torch.nn.Linear(16, 24)
    lora = adapters.LoRALinear(base, (("up", 24),), ("up",), AdapterConfig(rank=4, alpha=8))
    torch.nn.init.normal_(lora.lora_b)
    x = torch.randn(2, 3, 16, requires_grad=True)
    out = lora(x)
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack += [f for f, _ in fn.next_functions]
    assert "CopySlices" not in {type(f).__name__ for f in seen}
    torch.testing.assert_close(out, base(x) + 2.0 * (x @ lora.lora_a[0].t()) @ lora.lora_b.t())


def test_without_gradients_the_plain_ops_run_with_the_same_forward_bit_for_bit():
    """Decoding and frozen passes take the plain ops (an autograd function costs per call); the fused
    forward is theirs to the bit, so a model computes the same with gradients or without."""
    torch.manual_seed(0)
    norm = blocks.make_norm("rmsnorm", 64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 9, 64)
    cos, sin = torch.randn(1, 9, 64).chunk(2, -1)[0].repeat(1, 1, 2), torch.randn(1, 9, 32).repeat(1, 1, 2)
    q = torch.randn(4, 3, 9, 64)
    with torch.no_grad():
        plain_norm, plain_rot = norm(x), fused.rotate(q, cos, sin)
    fused_norm, fused_rot = norm(x.requires_grad_(True)), fused.rotate(q.requires_grad_(True), cos, sin)
    assert type(fused_norm.grad_fn).__name__ == "RMSNormFunctionBackward"
    assert torch.equal(fused_norm, plain_norm) and torch.equal(fused_rot, plain_rot)
    assert torch.equal(plain_rot, plain_rotate(q, cos, sin))
    g = torch.randn_like(q)  # and the rotation's backward is autograd's of the plain ops, bit for bit
    assert torch.equal(torch.autograd.grad(fused_rot, q, g)[0], torch.autograd.grad(plain_rotate(q, cos, sin), q, g)[0])
