"""The fused output-projection cross-entropy against the plain logits -> F.cross_entropy path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfcli.objectives import losses
from tfcli.objectives.losses import IGNORE, linear_cross_entropy


@pytest.mark.parametrize("chunk", [7, 1000])  # several chunks, and one
def test_loss_gradients_and_accuracy_match_materialised_logits(monkeypatch, chunk):
    monkeypatch.setattr(losses, "_chunk_rows", lambda vocab: chunk)
    torch.manual_seed(0)
    hidden = torch.randn(4, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (4, 9))
    targets[0, :3] = IGNORE  # ignored positions cost nothing and get no gradient
    targets[2, -1] = IGNORE

    loss, correct = linear_cross_entropy(hidden, weight, targets, with_accuracy=True)
    (2.5 * loss).backward()  # a scaled upstream gradient reaches both inputs
    fused = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    logits = hidden @ weight.t()
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    (2.5 * reference).backward()
    valid = targets != IGNORE
    assert torch.allclose(loss, reference, atol=1e-6)
    assert torch.allclose(fused[0], hidden.grad, atol=1e-6)
    assert torch.allclose(fused[1], weight.grad, atol=1e-6)
    assert fused[0][0, :3].abs().max() == 0
    assert int(correct) == int(((logits.argmax(-1) == targets) & valid).sum())
