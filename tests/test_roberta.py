"""RoBERTa and XLM-RoBERTa against transformers on the same weights (tiny random configs transformers
writes, fp32): the encoder's hidden states on right-padded rows, the MLM head's logits, a
classification step's loss and every gradient (RobertaForSequenceClassification's head is BERT's
pooler and classifier), and the export reloaded by transformers with the same outputs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli.hf import convert  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.models import build_model  # noqa: E402
from tfcli.models.bert import MLMHead  # noqa: E402
from tfcli.plugin import Backbone  # noqa: E402

from .test_llama import spread_  # noqa: E402

SHAPE = dict(
    vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
    max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
)  # fmt: skip
CLASSES = {
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", "RobertaForMaskedLM"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification", "XLMRobertaForMaskedLM"),
}
IDS = torch.randint(3, 80, (3, 12), generator=torch.Generator().manual_seed(2))
MASK = torch.ones_like(IDS)
MASK[1, 8:], MASK[2, 5:] = 0, 0  # right padding, as tfcli pads an encoder's rows
IDS = IDS.masked_fill(MASK == 0, 1)


def saved(kind: str, arch: int, path, **extra):
    config = getattr(transformers, CLASSES[kind][0])(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[kind][arch])(config).eval()
    spread_(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" not in name and "layer_norm" not in name:
                p.mul_(0.4)
    model.save_pretrained(path)
    return model


def read(path):
    cfg, state = hf.read_pretrained(path)
    model = build_model(cfg).eval()
    model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")}, strict=False)
    return cfg, model, {k[6:]: v for k, v in state.items() if k.startswith("heads.")}


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_the_encoder_and_the_mlm_head_match_transformers(kind, tmp_path):
    theirs = saved(kind, 2, tmp_path / "mlm")
    cfg, ours, heads = read(tmp_path / "mlm")
    assert cfg.position_offset == 2 and cfg.hf_model_type == kind and cfg.context == 38
    mlm = MLMHead(32, 32, 80, cfg.layer_norm_eps)
    mlm.load_state_dict({k[4:]: v for k, v in heads.items() if k.startswith("mlm.")})
    with torch.no_grad():
        out = theirs(IDS, attention_mask=MASK, output_hidden_states=True)
        hidden = ours(IDS, None, MASK)
        real = MASK.bool()
        assert (hidden[real] - out.hidden_states[-1][real]).abs().max() < 1e-4
        assert (mlm.logits(hidden, ours.wte.weight)[real] - out.logits[real]).abs().max() < 1e-4
        assert out.logits.std() > 0.3


def test_a_classification_step_gives_transformers_loss_and_gradients(tmp_path):
    theirs = saved("roberta", 1, tmp_path / "cls", num_labels=3).train()
    cfg, ours, heads = read(tmp_path / "cls")
    assert_a_classification_step_matches(theirs, ours, heads, hf.roberta.rules(cfg, classifier=True), IDS, MASK)


def assert_a_classification_step_matches(theirs, ours, heads: dict, rules, ids, mask) -> None:
    """One step of an encoder (in train mode, dropout off) and tfcli's classifier on its pooled
    features: the loss and every gradient, under transformers' names, equal the *ForSequenceClassification's
    (1e-5). `heads` holds the classifier read from the same directory."""
    ours.train()
    classifier = torch.nn.Linear(ours.cfg.d_model, 3)
    classifier.load_state_dict({k[len("classifier.") :]: v for k, v in heads.items()})
    labels = torch.tensor([0, 2, 1])
    want = theirs(ids, attention_mask=mask, labels=labels).loss
    want.backward()
    got = torch.nn.functional.cross_entropy(classifier(ours.pool(ours(ids, None, mask))), labels)
    got.backward()
    assert abs(got.item() - want.item()) < 1e-5
    grads = {f"model.{n}": p.grad for n, p in ours.named_parameters() if p.grad is not None}
    grads |= {f"heads.classifier.{n}": p.grad for n, p in classifier.named_parameters()}
    named = convert.to_hf(grads, rules)
    reference = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    assert named.keys() == reference.keys()
    assert max((named[n] - reference[n]).abs().max().item() for n in named) < 1e-5


def test_a_classifier_exports_as_roberta_for_sequence_classification(tmp_path):
    theirs = saved("roberta", 1, tmp_path / "cls", num_labels=3)
    cfg, ours, heads = read(tmp_path / "cls")
    backbone = Backbone(model=ours, tokenizer=None, source="test", heads=heads, labels=("a", "b", "c"))
    arch, _ = hf.export(backbone, None, tmp_path / "out")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert arch == "RobertaForSequenceClassification" and reloaded.config.id2label[2] == "c"
    with torch.no_grad():
        assert (reloaded(IDS, attention_mask=MASK).logits - theirs(IDS, attention_mask=MASK).logits).abs().max() < 1e-5
