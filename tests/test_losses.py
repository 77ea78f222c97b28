"""The fused output-projection cross-entropy against the plain logits -> F.cross_entropy path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tfcli.engine.compiling import keep_out_of_compiled_graphs
from tfcli.objectives import losses
from tfcli.objectives.losses import IGNORE, linear_cross_entropy


@pytest.mark.parametrize("chunk", [7, 1000])  # several chunks, and one
def test_loss_gradients_and_accuracy_match_materialised_logits(monkeypatch, chunk):
    monkeypatch.setattr(losses, "_chunk_rows", lambda vocab, rows=0: chunk)
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


def test_the_reused_cpu_chunk_buffer_gives_every_call_its_own_exact_result(monkeypatch):
    """The CPU path writes each chunk's logits into one buffer kept between calls: calls of other
    shapes (the buffer grown, then partly used) still match the materialised logits exactly, and a
    later call never changes what an earlier one returned."""
    monkeypatch.setattr(losses, "_chunk_rows", lambda vocab, rows=0: 5)
    monkeypatch.setattr(losses, "_cpu_chunk", {"logits": torch.empty(0)})
    torch.manual_seed(0)
    results = []
    for rows, vocab in ((12, 40), (7, 90), (12, 40)):
        hidden = torch.randn(rows, 8, requires_grad=True)
        weight = torch.randn(vocab, 8, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,))
        loss, _ = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        reference = F.cross_entropy(hidden.detach() @ weight.detach().t(), targets)
        assert torch.allclose(loss, reference, atol=1e-6)
        results.append((loss.detach().clone(), hidden.grad, hidden.grad.clone()))
    assert losses._cpu_chunk["logits"].numel() == 5 * 90  # grown once, reused after
    for _, grad, copy in results:
        assert torch.equal(grad, copy)


def test_a_chunk_buffer_larger_than_the_kept_size_is_given_back_before_the_backward_pass(monkeypatch):
    """A 262k vocabulary's 512-row chunk is 512 MB: kept between calls it stays held through the
    backward pass and the optimizer's step, the training step's peak. Chunks of at most
    CHUNK_ELEMENTS keep their buffer (reused, no page faults); larger ones give it back when the
    loss's forward is done, with the loss and gradients unchanged."""
    monkeypatch.setattr(losses, "_chunk_rows", lambda vocab, rows=0: 6)
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 6 * 40)
    torch.manual_seed(0)
    for vocab, kept in ((40, 6 * 40), (41, 0)):
        monkeypatch.setattr(losses, "_cpu_chunk", {"logits": torch.empty(0)})
        hidden = torch.randn(12, 8, requires_grad=True)
        weight = torch.randn(vocab, 8, requires_grad=True)
        targets = torch.randint(0, vocab, (12,))
        loss, _ = linear_cross_entropy(hidden, weight, targets)
        assert losses._cpu_chunk["logits"].numel() == kept
        loss.backward()
        logits = hidden @ weight.t()
        hidden.grad, reference_grad = None, hidden.grad
        F.cross_entropy(logits, targets).backward()
        assert torch.allclose(hidden.grad, reference_grad, atol=1e-6)


def test_a_frozen_head_gets_no_weight_gradient_and_the_hidden_gradient_is_unchanged(monkeypatch):
    """LoRA and probes freeze the LM head: its (V, D) gradient is not computed at all (a third of the
    head's FLOPs), and the gradient that flows back into the model is the one a trainable head gives."""
    counted = []  # the products that write a (V, D) weight gradient
    real_addmm, real_mm = torch.Tensor.addmm_, torch.mm

    def mm(a, b, **k):
        out = real_mm(a, b, **k)
        counted.extend([1] if out.shape == (40, 16) else [])
        return out

    def addmm_(self, *a, **k):
        counted.extend([1] if self.shape == (40, 16) else [])
        return real_addmm(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    monkeypatch.setattr(torch, "mm", mm)
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(40, 16)
    targets = torch.randint(0, 40, (3, 5))
    linear_cross_entropy(hidden, weight, targets)[0].backward()
    frozen_grad, frozen_products = hidden.grad.clone(), len(counted)
    hidden.grad = None
    trainable = weight.clone().requires_grad_(True)
    linear_cross_entropy(hidden, trainable, targets)[0].backward()
    assert frozen_products == 0 and len(counted) > 0  # the weight-gradient product ran only for a trainable head
    assert torch.allclose(frozen_grad, hidden.grad, atol=1e-6)  # the vocabulary in tiles: the same gradient
    assert weight.grad is None and trainable.grad is not None


def test_once_a_run_compiles_the_chunked_losses_run_outside_the_compiled_graph():
    """engine/compiling.py's eager: the chunked losses are kept out of torch.compile's graphs (dynamo cannot trace their
    in-place gradient accumulation) by torch.compiler.disable, applied only when a run compiles."""
    h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    t = torch.randint(0, 11, (2, 3))

    def step(h, w, t):
        return linear_cross_entropy(h * 2, w, t)[0] + 1

    keep_out_of_compiled_graphs()  # what trainer.compiled() calls before torch.compile
    explained = torch._dynamo.explain(step)(h, w, t)
    assert explained.graph_break_count >= 1  # the loss is a break between two graphs, not traced into
    assert torch.allclose(torch.compile(step, backend="eager")(h, w, t), step(h, w, t))


def test_no_rows_give_a_zero_weight_gradient():
    """The first chunk's product writes the weight gradient; with no rows at all nothing does, and it is
    zero (not whatever the uninitialised buffer held)."""
    weight = torch.randn(40, 16, requires_grad=True)
    hidden = torch.randn(0, 16, requires_grad=True)
    loss, _ = linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_the_vocabulary_in_tiles_gives_the_materialised_logits_results(monkeypatch, softcap):
    """A frozen head, an evaluation and the token log-probabilities take the vocabulary in tiles with an
    online log-sum-exp (several row blocks, several tiles, a last tile narrower): the loss, accuracy,
    hidden-state gradient and token log-probabilities (tempered, capped) and both their gradients are
    those of the whole logits."""
    monkeypatch.setattr(losses, "ROW_BLOCK", 8)
    monkeypatch.setattr(losses, "MIN_COLUMNS", 7)
    monkeypatch.setattr(losses, "TILE_ELEMENTS", 8 * 7)  # 8 rows x 7 columns: 3 row blocks, 8 tiles
    torch.manual_seed(0)
    hidden = torch.randn(2, 10, 16, requires_grad=True)
    weight = torch.randn(53, 16) * 2
    targets = torch.randint(0, 53, (2, 10))
    targets[0, :3] = IGNORE

    def capped(x):
        return softcap * torch.tanh(x / softcap) if softcap else x

    loss, correct = linear_cross_entropy(hidden, weight, targets, with_accuracy=True, softcap=softcap)
    (3.0 * loss).backward()
    tiled = hidden.grad.clone()
    hidden.grad = None
    logits = capped(hidden @ weight.t())
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    (3.0 * reference).backward()
    valid = targets != IGNORE
    assert torch.allclose(loss, reference, atol=1e-5) and torch.allclose(tiled, hidden.grad, atol=1e-6)
    assert int(correct) == int(((logits.argmax(-1) == targets) & valid).sum())
    hidden.grad = None
    trained = weight.clone().requires_grad_(True)
    upstream = torch.randn(2, 10)
    ours = losses.token_logprobs(hidden, trained, targets, softcap=softcap, temperature=0.7)
    grads = torch.autograd.grad((ours * upstream).sum(), (hidden, trained))
    want = torch.log_softmax(capped(hidden @ trained.t()) / 0.7, -1).gather(-1, targets.clamp(min=0)[..., None])
    want = want.squeeze(-1) * valid
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, trained))
    assert torch.allclose(ours, want, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, want_grads))
    # with stats (TRL's DPO metrics): each trained position's entropy, mean logit and argmax hit, from
    # the same tiles, and the same log-probabilities and gradients
    again, stats = losses.token_logprobs(hidden, trained, targets, softcap=softcap, temperature=0.7, stats=True)
    tempered = capped(hidden @ trained.t()).detach() / 0.7
    entropy = -(tempered.softmax(-1) * tempered.log_softmax(-1)).sum(-1)
    scale = tempered.abs().amax()  # entropies and mean logits of this size, summed in another order
    assert torch.allclose(stats.entropy, entropy * valid, atol=1e-5 * scale)
    assert torch.allclose(stats.mean_logit, tempered.mean(-1) * valid, atol=1e-5 * scale)
    assert torch.equal(stats.is_top1, ((tempered.argmax(-1) == targets) & valid).float())
    assert torch.equal(again, ours) and not stats.entropy.requires_grad
    assert all(
        torch.equal(a, b) for a, b in zip(torch.autograd.grad((again * upstream).sum(), (hidden, trained)), grads)
    )


def test_a_trained_heads_chunks_are_as_large_as_products_need_and_equal():
    """A 262k vocabulary's 128 MB chunk was 128 rows, whose products ran 25% slower a row than 512
    rows' on a 2-core EPYC: a chunk has at least EFFICIENT_ROWS rows, CHUNK_ELEMENTS' worth where that
    is more (a 50k vocabulary), and the rows of a step are cut into chunks of (nearly) equal size."""
    assert losses._chunk_rows(262144, 512) == 512 and losses._chunk_rows(262144, 100) == 100
    assert losses._chunk_rows(262144, 1024) == 512 and losses._chunk_rows(262144, 1100) == 367  # 3 of 367
    assert losses._chunk_rows(50257, 4000) == 667  # 128 MB of a 50k vocabulary: 6 chunks, the last of 665
    assert losses._chunk_rows(50257, 600) == 600
