"""Text classification: a user's own CSV / JSONL (bad rows skipped and counted, unknown labels and
missing columns one line each), MNLI as a preset (GLUE TSV, JSON Lines, the hub), finetuning and
evaluation through the CLI, every pooling."""

import json
import shutil

import pytest
import torch

from tfcli.data.labelled import load_splits
from tfcli.errors import UserError
from tfcli.models.bert import Bert, BertConfig
from tfcli.tasks.classify import ClassifyConfig, text_spec
from tfcli.tasks.heads import check_pooling, features

from .conftest import invoke, read_metrics

MNLI = text_spec(ClassifyConfig(preset="mnli"))
LABELS = ("entailment", "neutral", "contradiction")
HEADER = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "gold_label",
]


def _tsv(path, rows):
    lines = ["\t".join(HEADER)]
    for i, (a, b, label) in enumerate(rows):
        lines.append("\t".join([str(i), "1", "1n", "fiction", "(x)", "(y)", "(x)", "(y)", a, b, label, label]))
    path.write_text("\n".join(lines) + "\n")


def test_glue_tsv_maps_labels_and_counts_skipped_rows(tmp_path):
    for split in ("train", "dev_matched", "dev_mismatched"):
        _tsv(
            tmp_path / f"{split}.tsv",
            [
                ("A man eats.", "Someone eats.", "entailment"),
                ('It rains "hard".', "It is dry.", "contradiction"),
                ("No gold.", "None.", "-"),  # annotators disagreed: GLUE's '-'
                ("A cat.", "An animal maybe.", "neutral"),
            ],
        )
    (tmp_path / "dev_matched.tsv").open("a").write("5\t1\t1n\tfiction\tshort row\n")  # missing fields
    splits, labels = load_splits(MNLI, str(tmp_path))
    assert labels == LABELS
    assert splits["dev_matched"].rows == [
        (("A man eats.", "Someone eats."), 0),
        (('It rains "hard".', "It is dry."), 2),
        (("A cat.", "An animal maybe."), 1),
    ]
    assert splits["dev_matched"].skipped == 2 and splits["train"].skipped == 1


def test_jsonl_takes_words_or_glue_ids_and_skips_bad_rows(tmp_path):
    lines = [
        {"premise": "p1", "hypothesis": "h1", "label": "Neutral"},
        {"premise": "p2", "hypothesis": "h2", "label": 2},
        {"premise": "p3", "hypothesis": "h3", "label": "0"},
        {"premise": "p4", "hypothesis": "h4", "label": -1},
        {"premise": "p5", "label": "entailment"},
        {"premise": "p6", "hypothesis": "", "label": "entailment"},
    ]
    for split in ("train", "dev_matched", "dev_mismatched"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    splits, _ = load_splits(MNLI, str(tmp_path))
    assert splits["train"].rows == [(("p1", "h1"), 1), (("p2", "h2"), 2), (("p3", "h3"), 0)]
    assert splits["train"].skipped == 4  # label -1, missing hypothesis, empty hypothesis, a broken JSON line


def test_unknown_label_missing_column_and_missing_split_are_one_line_errors(tmp_path):
    def write(row):
        for split in ("train", "dev_matched", "dev_mismatched"):
            (tmp_path / f"{split}.jsonl").write_text(json.dumps(row) + "\n")

    write({"premise": "p", "hypothesis": "h", "label": "maybe"})
    with pytest.raises(UserError, match=r"train.jsonl: row 1: unknown label 'maybe' \(labels: entailment, neutral"):
        load_splits(MNLI, str(tmp_path))
    write({"premise": "p", "label": "neutral"})
    with pytest.raises(UserError, match=r"no column 'hypothesis' \(columns: premise, label\)"):
        load_splits(MNLI, str(tmp_path))
    (tmp_path / "dev_matched.jsonl").unlink()
    (tmp_path / "dev_mismatched.jsonl").unlink()
    with pytest.raises(UserError, match=r"no evaluation split file \(dev_matched.tsv or dev_mismatched.tsv"):
        load_splits(MNLI, str(tmp_path))
    with pytest.raises(UserError, match="data not found"):
        load_splits(MNLI, str(tmp_path / "nope"))


def test_unreachable_hub_is_a_clear_error(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # skip the reachability probe: load_dataset itself fails

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        UserError, match=r"could not load Hugging Face dataset 'nyu-mll/glue:mnli' \(Couldn't reach.*--data"
    ):
        load_splits(MNLI, "")


def test_real_shared_data_loads(shared_data):
    splits, _ = load_splits(MNLI, str(shared_data / "mnli"))
    assert len(splits["dev_matched"].rows) == 1815 and splits["dev_matched"].skipped == 0
    assert sorted({y for _, y in splits["dev_matched"].rows}) == [0, 1, 2]


@pytest.fixture(scope="module")
def tiny_hf_bert(tmp_path_factory, shared_data):
    """A tiny random transformers BERT saved as a Hugging Face directory with the real vocabulary."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf-bert")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    transformers.BertModel(cfg).save_pretrained(d)
    shutil.copy(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt", d / "vocab.txt")
    return d


def reviews(path, fmt: str):
    """A sentiment file with two text fields: good and bad rows, and labels as words."""
    rows = [{"title": f"great {i}", "body": "loved it, would buy again", "label": "pos"} for i in range(24)]
    rows += [{"title": f"awful {i}", "body": "broke on the first day", "label": "neg"} for i in range(24)]
    rows += [{"title": "", "body": "no title", "label": "pos"}, {"title": "no label", "body": "x", "label": ""}]
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        path.write_text("title,body,label\n" + "".join(f'"{r["title"]}","{r["body"]}",{r["label"]}\n' for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_classify_a_users_own_file(tiny_hf_bert, tmp_path, fmt):
    data = reviews(tmp_path / f"reviews.{fmt}", fmt)
    out = tmp_path / "run"
    result = invoke(
        "finetune",
        "classify",
        "--from",
        tiny_hf_bert,
        "--data",
        data,
        "--text-fields",
        "title,body",
        "--label-field",
        "label",
        "--steps",
        4,
        "--batch-size",
        8,
        "--out",
        out,
        "--set",
        "train.eval_interval=2",
        "--set",
        "data.val_fraction=0.25",
    )
    assert result.exit_code == 0, result.output
    assert "classify train: 36 rows, 2 skipped" in result.output and "classify dev: 12 rows, 0 skipped" in result.output
    assert json.loads((out / "labels.json").read_text()) == ["neg", "pos"]  # learned from the data, sorted
    report = json.loads((out / "eval.json").read_text())
    assert report["dev"]["n"] == 12 and report["dev"]["labels"] == ["neg", "pos"]
    assert "dev_acc" in [r for r in read_metrics(out) if r.get("split") == "val"][-1]
    one = invoke("eval", "--checkpoint", out, "--input", "great stuff", "--input", "loved it")
    probs = {line.split()[0]: float(line.split()[1]) for line in one.stdout.strip().splitlines()}
    assert one.exit_code == 0 and set(probs) == {"neg", "pos"} and abs(sum(probs.values()) - 1) < 1e-3


def test_classify_errors_name_the_problem_in_one_line(tiny_hf_bert, tmp_path):
    data = reviews(tmp_path / "reviews.csv", "csv")
    base = ["finetune", "classify", "--from", tiny_hf_bert, "--data", data, "--steps", 1, "--out", tmp_path / "run"]
    for extra, message in (
        (["--text-fields", "title,summary"], "no column 'summary' (columns: title, body, label)"),
        (["--text-fields", "title", "--label-field", "stars"], "no column 'stars'"),
        ([], "classify.text_fields: name the column(s) holding the text"),
        (
            ["--text-fields", "title", "--set", "classify.labels=[pos,neutral]"],
            "row 25: unknown label 'neg' (labels: pos, neutral)",
        ),
    ):
        result = invoke(*base, *extra)
        assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, result.output
        assert not (tmp_path / "run").exists()  # nothing written for bad input


def test_finetune_mnli_from_a_hugging_face_dir_then_eval(tiny_hf_bert, mnli_dir, tmp_path):
    out = tmp_path / "run"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        tiny_hf_bert,
        "--data",
        mnli_dir,
        "--steps",
        6,
        "--batch-size",
        16,
        "--lr",
        "1e-3",
        "--pooling",
        "last4-concat",
        "--out",
        out,
        "--quiet",
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.log_interval=1",
    )
    assert result.exit_code == 0, result.output
    val = [r for r in read_metrics(out) if r.get("split") == "val"]
    assert len(val) == 2 and {"dev_matched_acc", "dev_mismatched_acc"} <= set(val[0])
    assert (out / "checkpoints" / "best").is_file()
    report = json.loads((out / "eval.json").read_text())
    assert report["dev_matched"]["n"] == 30 and sum(map(sum, report["dev_mismatched"]["confusion"])) == 30
    pair = invoke("eval", "mnli", "--checkpoint", out, "--premise", "A man eats.", "--hypothesis", "Nobody eats.")
    assert pair.exit_code == 0, pair.output
    probs = {line.split()[0]: float(line.split()[1]) for line in pair.stdout.strip().splitlines()}
    assert set(probs) == set(LABELS) and abs(sum(probs.values()) - 1) < 1e-3
    before = (out / "eval.json").read_text()
    full = invoke("eval", "mnli", "--checkpoint", out, "--limit", 12)
    assert full.exit_code == 0 and "confusion matrix" in full.output and "dev_mismatched" in full.output
    assert "majority class" in full.output
    assert (out / "eval.json").read_text() == before  # the training's report is never overwritten
    limited = json.loads((out / "eval-mnli-limit12.json").read_text())
    per_class = [sum(row) for row in limited["dev_matched"]["confusion"]]  # this slice has no neutral rows
    assert limited["dev_matched"]["n"] == 12 and sorted(per_class) == [0, 6, 6]  # balanced over the labels present


def test_head_only_training_leaves_the_backbone_untouched(tiny_hf_bert, mnli_dir, tmp_path):
    from tfcli.engine.checkpoint import find, load_weights
    from tfcli.hf import interop as hf

    out = tmp_path / "run"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        tiny_hf_bert,
        "--data",
        mnli_dir,
        "--steps",
        3,
        "--train",
        "head",
        "--head-lr",
        "1e-2",
        "--out",
        out,
        "--quiet",
        "--set",
        "finetune.eval_limit=8",
    )
    assert result.exit_code == 0, result.output
    weights = load_weights(find(out))
    assert set(weights) == {"heads.classifier.weight", "heads.classifier.bias"}  # the frozen backbone is not copied
    assert weights["heads.classifier.weight"].shape == (3, 32)
    from tfcli.engine.backbone import from_run

    _, original = hf.read_pretrained(tiny_hf_bert)
    model = from_run(out).model.state_dict()
    assert torch.equal(model["blocks.0.attn.qkv.weight"], original["model.blocks.0.attn.qkv.weight"])


def test_epochs_set_the_steps_and_warmup_and_steps_win(tiny_hf_bert, mnli_dir, tmp_path):
    from tfcli import recipe as recipes

    result = invoke(
        "finetune",
        "mnli",
        "--from",
        tiny_hf_bert,
        "--data",
        mnli_dir,
        "--epochs",
        0.5,
        "--batch-size",
        16,
        "--out",
        tmp_path / "a",
        "--quiet",
        "--set",
        "finetune.eval_limit=8",
        "--set",
        "finetune.warmup_fraction=0.2",
        "--set",
        "finetune.limit=160",
    )
    assert result.exit_code == 0, result.output
    rec = recipes.load_resolved(tmp_path / "a" / "config.yaml")
    assert rec.train.steps == 5 and rec.schedule.warmup_steps == 1  # 0.5 * 160 / 16; 20% of 5
    assert rec.model.n_layer == 4 and rec.model.d_model == 32  # the backbone's own shape
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        tiny_hf_bert,
        "--data",
        mnli_dir,
        "--steps",
        3,
        "--out",
        tmp_path / "b",
        "--quiet",
        "--set",
        "finetune.eval_limit=8",
    )
    assert result.exit_code == 0 and recipes.load_resolved(tmp_path / "b" / "config.yaml").train.steps == 3


def test_finetune_from_a_missing_path_is_a_one_line_error(mnli_dir, tmp_path):
    result = invoke("finetune", "mnli", "--from", tmp_path / "missing", "--data", mnli_dir)
    assert result.exit_code == 2 and "not found" in result.output


def test_every_pooling_has_the_right_width_and_ignores_padding():
    model = Bert(BertConfig(n_layer=4, n_head=2, d_model=16, vocab_size=40, dropout=0.0)).eval()
    ids = torch.randint(5, 40, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}
    other = dict(batch, input_ids=ids.masked_fill(mask == 0, 7))  # different pad contents
    widths = {"cls": 16, "mean": 16, "last4-sum": 16, "last4-concat": 64}
    with torch.no_grad():
        for pooling, width in widths.items():
            feats = features(model, batch, pooling)
            assert feats.shape == (2, width)
            assert torch.allclose(feats, features(model, other, pooling), atol=1e-5), pooling
        layers = model(ids, attention_mask=mask, all_layers=True)
        assert torch.allclose(features(model, batch, "last4-sum"), sum(h[:, 0] for h in layers[-4:]))
        mean = features(model, batch, "mean")
        assert torch.allclose(mean[1], layers[-1][1, :5].mean(0), atol=1e-6)  # pads left out of the mean
    with pytest.raises(UserError, match="at least 4 layers"):
        check_pooling(BertConfig(n_layer=2, n_head=2, d_model=16, vocab_size=40), "last4-sum")


def test_finetune_resume_is_bit_exact(tiny_hf_bert, mnli_dir, tmp_path):
    """A finetuning run cut after its step-3 checkpoint and resumed logs the same losses as the whole run."""
    from .conftest import train_losses

    whole = tmp_path / "whole"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        tiny_hf_bert,
        "--data",
        mnli_dir,
        "--steps",
        6,
        "--batch-size",
        8,
        "--out",
        whole,
        "--quiet",
        "--set",
        "train.ckpt_interval=3",
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.log_interval=1",
        "--set",
        "train.keep_checkpoints=5",
        "--set",
        "finetune.eval_limit=6",
    )
    assert result.exit_code == 0, result.output
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-0000006")
    (cut / "checkpoints" / "latest").write_text("step-0000003")
    (cut / "checkpoints" / "best").write_text("step-0000003")
    keep = [line for line in (cut / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 3]
    (cut / "metrics.jsonl").write_text("\n".join(keep) + "\n")
    result = invoke("finetune", "mnli", "--resume", cut, "--quiet")
    assert result.exit_code == 0, result.output
    a, b = train_losses(whole), train_losses(cut)
    assert sorted(b) == list(range(1, 7)) and [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]
