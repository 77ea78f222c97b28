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
from tfcli.hf import roberta as roberta_table  # noqa: E402
from tfcli.models import build_model  # noqa: E402
from tfcli.models.bert import MLMHead  # noqa: E402
from tfcli.plugin import Backbone  # noqa: E402

from .conftest import close  # noqa: E402
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
    assert_a_classification_step_matches(theirs, ours, heads, roberta_table.rules(cfg, classifier=True), IDS, MASK)


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
    assert all(close(named[n], reference[n]) for n in named)


def test_a_classifier_exports_as_roberta_for_sequence_classification(tmp_path):
    theirs = saved("roberta", 1, tmp_path / "cls", num_labels=3)
    cfg, ours, heads = read(tmp_path / "cls")
    backbone = Backbone(model=ours, tokenizer=None, source="test", heads=heads, labels=("a", "b", "c"))
    arch, _ = hf.export(backbone, None, tmp_path / "out")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert arch == "RobertaForSequenceClassification" and reloaded.config.id2label[2] == "c"
    with torch.no_grad():
        assert close(reloaded(IDS, attention_mask=MASK).logits, theirs(IDS, attention_mask=MASK).logits, 1e-5)


@pytest.fixture(scope="module")
def roberta_with_tokenizer(tmp_path_factory, shared_data):
    """A RoBERTa directory as transformers writes one, with a tokenizer of its own: a byte-level BPE with
    RoBERTa's specials (<s>=0, <pad>=1, </s>=2, <unk>=3, <mask> last) and its pair template, saved by
    RobertaTokenizerFast beside a tiny RobertaForMaskedLM (its head spread, so that scores differ)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rows = [json.loads(line) for line in (shared_data / "mnli" / "train.jsonl").read_text().splitlines()[:400]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([r["premise"] for r in rows], trainer=trainer)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # "? <mask>": the mask takes the space
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    fast = transformers.RobertaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
    )  # fmt: skip
    path = tmp_path_factory.mktemp("roberta") / "model"
    config = transformers.RobertaConfig(
        **{**SHAPE, "vocab_size": len(fast), "max_position_embeddings": 130}, type_vocab_size=1
    )  # one token type, as roberta-base has
    torch.manual_seed(0)
    model = transformers.RobertaForMaskedLM(config)
    spread_(model)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path, rows


def test_its_own_tokenizer_encodes_pairs_as_transformers_does(roberta_with_tokenizer):
    """<s> a </s></s> b </s>, the longer text cut first: the ids RobertaTokenizerFast gives a pair with
    truncation, at lengths that cut and one that does not."""
    from tfcli.data.tokenizers import load_tokenizer_files
    from tfcli.tasks.classify import encode

    path, rows = roberta_with_tokenizer
    ours, theirs = load_tokenizer_files(str(path), []), transformers.AutoTokenizer.from_pretrained(path)
    pairs = [(r["premise"], r["hypothesis"]) for r in rows[:100]]
    for length in (16, 40, 512):
        want = [theirs(a, b, truncation=True, max_length=length)["input_ids"] for a, b in pairs]
        assert [list(ids) for ids, _, _ in encode(ours, [(p, 0) for p in pairs], length)] == want
    assert any(len(w) == 40 for w in [theirs(a, b, truncation=True, max_length=40)["input_ids"] for a, b in pairs])


@pytest.mark.slow
def test_a_roberta_checkpoint_with_its_own_tokenizer_trains_mnli_and_exports(
    roberta_with_tokenizer, mnli_dir, tmp_path
):
    """From the directory alone: MNLI trains with a head, `eval --premise` gives the probabilities that
    transformers gives the export, read with the export's own tokenizer."""
    from .conftest import invoke, transformers_runs_the_export

    path, _ = roberta_with_tokenizer
    trained = invoke(
        "finetune", "mnli", "--from", path, "--data", mnli_dir, "--train", "all", "--steps", 3, "--batch-size", 8,
        "--lr", 1e-3, "--out", tmp_path / "run", "--quiet", "--set", "data.seq_len=48", "--set", "finetune.eval_limit=8",
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    exported = invoke("export", "--checkpoint", tmp_path / "run", "--hf", tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    transformers_runs_the_export(tmp_path / "out")  # its tokenizer pads (there was no tokenizer_config.json)
    premise, hypothesis = "The cat sat on the mat, looking at the birds outside.", "A cat is indoors."
    said = invoke("eval", "--checkpoint", tmp_path / "run", "--premise", premise, "--hypothesis", hypothesis)
    assert said.exit_code == 0, said.output
    ours = {line.split()[0]: float(line.split()[1]) for line in said.output.splitlines() if len(line.split()) == 2}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        theirs = model(**tok(premise, hypothesis, return_tensors="pt")).logits.softmax(-1)[0]
    printed = [ours[model.config.id2label[i]] for i in range(3)]  # to 4 decimals
    assert max(abs(p - q) for p, q in zip(theirs.tolist(), printed)) <= 0.5e-4 + 1e-6


def test_cloze_places_spaces_as_byte_level_bpe_does_and_scores_as_roberta_for_masked_lm(roberta_with_tokenizer):
    """The filled-in template is the ids RobertaTokenizerFast gives "a ? <mask> , b" (a space belongs
    to the word after it: "Ġ,", "ĠA"), the label words are read as they follow a space ("Ġthe"), and
    their scores at the mask are RobertaForMaskedLM's logits."""
    from tfcli.engine.backbone import from_hf
    from tfcli.objectives.mlm_nsp import SPECIAL_TOKENS, special_ids
    from tfcli.tasks import cloze
    from tfcli.tasks.classify import collate

    path, rows = roberta_with_tokenizer
    backbone, theirs_tok = from_hf(path, SPECIAL_TOKENS), transformers.AutoTokenizer.from_pretrained(path)
    tok, fields = backbone.tokenizer, ("premise", "hypothesis")
    filled = {(r["premise"], r["hypothesis"]): f"{r['premise']} ? <mask> , {r['hypothesis']}" for r in rows[:12]}
    pairs = [p for p, text in filled.items() if len(theirs_tok(text)["input_ids"]) <= 128][:6]  # none cut
    pieces = cloze.parse_template(cloze.default_template(fields), fields)
    ids = special_ids(tok)
    batch = collate(cloze.encode(tok, ids, pieces, fields, [(p, 0) for p in pairs], 128), ids["pad"])
    want = [theirs_tok(filled[p])["input_ids"] for p in pairs]
    assert len(pairs) == 6 and [row[: len(w)].tolist() for row, w in zip(batch["input_ids"], want)] == want
    words = cloze.word_ids(tok, ("the", "a", "and"), cloze.mask_follows_space(pieces))
    assert words == theirs_tok.convert_tokens_to_ids(["Ġthe", "Ġa", "Ġand"])
    heads = backbone.model.mlm_heads()
    heads.load_state_dict({k: v for k, v in backbone.heads.items() if k.startswith("mlm.")})
    head = cloze.ClozeHead(lambda rows, train: None, ids["mask"], words, heads, 1.0)
    reference = transformers.AutoModelForMaskedLM.from_pretrained(path).eval()
    with torch.no_grad():
        ours = head.scores(backbone.model.eval(), heads, batch)  # (6, 3)
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert (ours - logits[batch["input_ids"] == ids["mask"]][:, words]).abs().max() < 1e-4 and ours.std() > 0.1
