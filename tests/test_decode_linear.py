"""blocks.linear: the CPU decoding product (a batch of weight row slices, one per thread) computes
what F.linear computes, forward and backward, and is the one decoding takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfcli.models import blocks


@pytest.fixture
def two_threads(monkeypatch):
    """Two threads, and the sliced product for weights of any size (these are tiny)."""
    monkeypatch.setattr(blocks, "SLICED_MIN_WEIGHT", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(1, 24), (1, 1, 24), (3, 2, 24), (32, 24), (33, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_f_linear_forward_and_backward(two_threads, shape, bias):
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(10, 24, requires_grad=True)
    b = torch.randn(10, requires_grad=True) if bias else None
    ours = blocks.linear(x, w, b)
    grads_ours = torch.autograd.grad(ours.square().sum(), [x, w] + ([b] if bias else []))
    ref = F.linear(x, w, b)
    grads_ref = torch.autograd.grad(ref.square().sum(), [x, w] + ([b] if bias else []))
    assert ours.shape == ref.shape == (*shape[:-1], 10)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads_ours, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_few_rows_take_the_sliced_product_and_many_rows_or_one_thread_do_not(two_threads, monkeypatch):
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(a[1].shape) or real_bmm(*a, **k))
    w = torch.randn(10, 24)
    blocks.linear(torch.randn(1, 24), w)
    assert calls == [(2, 24, 5)]  # two slices of 5 output rows each, read as (D_in, 5) views
    blocks.linear(torch.randn(blocks.FEW_ROWS + 1, 24), w)
    blocks.linear(torch.randn(1, 24), torch.randn(9, 24))  # 9 outputs do not split in two
    monkeypatch.setattr(blocks, "SLICED_MIN_WEIGHT", w.numel() + 1)
    blocks.linear(torch.randn(1, 24), w)  # too small to be worth slicing
    torch.set_num_threads(1)
    blocks.linear(torch.randn(1, 24), w)
    assert len(calls) == 1


def test_the_block_linears_are_blocks_linear_with_nn_linears_state_dict():
    attn = blocks.Attention(16, 2, n_kv_head=1)
    mlp = blocks.MLP(16, 32, activation="silu", gated=True)
    assert all(isinstance(m, blocks.Linear) for m in (attn.qkv, attn.out, mlp.up, mlp.gate, mlp.down))
    plain = torch.nn.Linear(16, 32)
    mlp.up.load_state_dict(plain.state_dict())
    assert set(mlp.up.state_dict()) == {"weight", "bias"}


@pytest.mark.slow
def test_torch_compile_traces_the_block_linears_in_one_graph():
    """The thread count is read outside compiled code only: under torch.compile every linear is F.linear,
    so a block compiles to one graph (reading it broke the graph at each linear)."""
    mlp = blocks.MLP(16, 32, activation="silu", gated=True)
    explained = torch._dynamo.explain(mlp)(torch.randn(2, 8, 16))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
