"""MNLI: loaders (GLUE TSV, JSON Lines, the hub), label mapping, skipped rows, finetune and eval via the CLI."""
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.errors import UserError
from tfcli.tasks import mnli

from .conftest import read_metrics

HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
          "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]


def _tsv(path, rows):
    lines = ["\t".join(HEADER)]
    for i, (a, b, label) in enumerate(rows):
        lines.append("\t".join([str(i), "1", "1n", "fiction", "(x)", "(y)", "(x)", "(y)", a, b, label, label]))
    path.write_text("\n".join(lines) + "\n")


def test_glue_tsv_loader_maps_labels_and_counts_skipped_rows(tmp_path):
    _tsv(tmp_path / "dev_matched.tsv", [("A man eats.", "Someone eats.", "entailment"),
                                        ("It rains \"hard\".", "It is dry.", "contradiction"),
                                        ("No gold.", "None.", "-"),  # annotators disagreed: GLUE's '-'
                                        ("A cat.", "An animal maybe.", "neutral")])
    (tmp_path / "dev_matched.tsv").open("a").write("5\t1\t1n\tfiction\tshort row\n")  # missing fields
    rows = mnli.load_split(str(tmp_path), "dev_matched")
    assert rows.rows == [("A man eats.", "Someone eats.", 0), ('It rains "hard".', "It is dry.", 2),
                         ("A cat.", "An animal maybe.", 1)]
    assert rows.skipped == 2


def test_jsonl_loader_takes_words_or_glue_ids_and_skips_bad_rows(tmp_path):
    lines = [{"premise": "p1", "hypothesis": "h1", "label": "Neutral"},
             {"premise": "p2", "hypothesis": "h2", "label": 2},
             {"premise": "p3", "hypothesis": "h3", "label": "0"},
             {"premise": "p4", "hypothesis": "h4", "label": -1},
             {"premise": "p5", "label": "entailment"},
             {"premise": "p6", "hypothesis": "", "label": "entailment"},
             {"premise": "p7", "hypothesis": "h7", "label": "maybe"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = mnli.load_split(str(tmp_path), "train")
    assert rows.rows == [("p1", "h1", 1), ("p2", "h2", 2), ("p3", "h3", 0)]
    assert rows.skipped == 4


def test_label_mapping_is_glue_order():
    assert [mnli.label_id(x) for x in ("entailment", "neutral", "contradiction", 0, 1, 2, "-", -1, 3, None, True)] \
        == [0, 1, 2, 0, 1, 2, -1, -1, -1, -1, -1]


def test_missing_split_and_missing_directory_are_one_line_errors(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(UserError, match=r"no dev_mismatched\.tsv or dev_mismatched\.jsonl"):
        mnli.load_split(str(tmp_path), "dev_mismatched")
    with pytest.raises(UserError, match="not found"):
        mnli.load_split(str(tmp_path / "nope"), "train")


def test_unreachable_hub_is_a_clear_error(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # skip the reachability probe: load_dataset itself fails

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'glue' on the Hub\nmore lines")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match=r"could not load Hugging Face dataset 'glue:mnli' \(Couldn't reach.*--data DIR"):
        mnli.load_split("", "train")


def test_real_shared_data_loads(shared_data):
    rows = mnli.load_split(str(shared_data / "mnli"), "dev_matched")
    assert len(rows.rows) == 1815 and rows.skipped == 0
    assert sorted({r[2] for r in rows.rows}) == [0, 1, 2]


@pytest.fixture(scope="module")
def small_mnli(tmp_path_factory, shared_data):
    d = tmp_path_factory.mktemp("mnli")
    for split, n in (("train", 160), ("dev_matched", 40), ("dev_mismatched", 40)):
        lines = (shared_data / "mnli" / f"{split}.jsonl").read_text().splitlines()[:n]
        (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def tiny_hf_bert(tmp_path_factory, shared_data):
    """A tiny random transformers BERT saved as a Hugging Face directory with the real vocabulary."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf-bert")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(cfg).save_pretrained(d)
    shutil.copy(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt", d / "vocab.txt")
    return d


def test_finetune_from_a_hugging_face_dir_then_eval(tiny_hf_bert, small_mnli, tmp_path):
    out = tmp_path / "run"
    args = ["finetune", "mnli", "--from", str(tiny_hf_bert), "--data", str(small_mnli), "--steps", "6",
            "--batch-size", "16", "--lr", "1e-3", "--pooling", "last4-concat", "--out", str(out), "--quiet",
            "--set", "train.eval_interval=3", "--set", "train.log_interval=1", "--set", "task.epochs=0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = read_metrics(out)
    val = [r for r in rows if r.get("split") == "val"]
    assert len(val) == 2 and {"dev_matched_acc", "dev_mismatched_acc"} <= set(val[0])
    assert (out / "checkpoints" / "best").is_file()
    report = json.loads((out / "eval.json").read_text())
    assert report["dev_matched"]["n"] == 40 and sum(map(sum, report["dev_mismatched"]["confusion"])) == 40
    pair = CliRunner().invoke(app, ["eval", "mnli", "--checkpoint", str(out), "--premise", "A man eats.",
                                    "--hypothesis", "Nobody eats."])
    assert pair.exit_code == 0, pair.output
    probs = {line.split()[0]: float(line.split()[1]) for line in pair.output.strip().splitlines()}
    assert set(probs) == set(mnli.LABELS) and abs(sum(probs.values()) - 1) < 1e-3
    full = CliRunner().invoke(app, ["eval", "mnli", "--checkpoint", str(out), "--limit", "10"])
    assert full.exit_code == 0 and "confusion matrix" in full.output and "dev_mismatched" in full.output


def test_head_only_training_leaves_the_backbone_untouched(tiny_hf_bert, small_mnli, tmp_path):
    from tfcli.checkpoint import find, load_weights
    from tfcli.hf.bert import read_hf_dir

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", "mnli", "--from", str(tiny_hf_bert), "--data", str(small_mnli),
                                      "--steps", "3", "--train", "head", "--head-lr", "1e-2", "--out", str(out),
                                      "--quiet", "--set", "task.epochs=0", "--set", "task.eval_limit=8"])
    assert result.exit_code == 0, result.output
    weights = load_weights(find(out))
    _, original, _, _ = read_hf_dir(tiny_hf_bert)
    assert torch.equal(weights["model.blocks.0.attn.qkv.weight"], original["blocks.0.attn.qkv.weight"])
    assert weights["heads.classifier.weight"].shape == (3, 32)


def test_epochs_set_the_steps_and_warmup(tiny_hf_bert, small_mnli, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", "mnli", "--from", str(tiny_hf_bert), "--data", str(small_mnli),
                                      "--epochs", "0.5", "--batch-size", "16", "--out", str(out), "--quiet",
                                      "--set", "task.eval_limit=8", "--set", "task.warmup_fraction=0.2"])
    assert result.exit_code == 0, result.output
    from tfcli import recipe as recipes

    rec = recipes.load_resolved(out / "config.yaml")
    assert rec.train.steps == 5 and rec.schedule.warmup_steps == 1  # 0.5 * 160 / 16; 20% of 5
    assert rec.model.n_layer == 4 and rec.model.d_model == 32  # the backbone's own shape


def test_finetune_from_a_missing_path_is_a_one_line_error(small_mnli, tmp_path):
    result = CliRunner().invoke(app, ["finetune", "mnli", "--from", str(tmp_path / "missing"), "--data",
                                      str(small_mnli)])
    assert result.exit_code == 2 and "not found" in result.output


def test_every_pooling_has_the_right_width_and_ignores_padding():
    from tfcli.models.bert import Bert, BertConfig
    from tfcli.tasks import sequence_classification as seqcls

    model = Bert(BertConfig(n_layer=4, n_head=2, d_model=16, vocab_size=40, dropout=0.0)).eval()
    ids = torch.randint(5, 40, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}
    other = dict(batch, input_ids=ids.masked_fill(mask == 0, 7))  # different pad contents
    widths = {"cls": 16, "mean": 16, "last4-sum": 16, "last4-concat": 64}
    with torch.no_grad():
        for pooling, width in widths.items():
            feats = seqcls.features(model, batch, pooling)
            assert feats.shape == (2, width)
            assert torch.allclose(feats, seqcls.features(model, other, pooling), atol=1e-5), pooling
        layers = model(ids, attention_mask=mask, all_layers=True)
        assert torch.allclose(seqcls.features(model, batch, "last4-sum"), sum(h[:, 0] for h in layers[-4:]))
        mean = seqcls.features(model, batch, "mean")
        assert torch.allclose(mean[1], layers[-1][1, :5].mean(0), atol=1e-6)  # pads left out of the mean
    with pytest.raises(UserError, match="at least 4 layers"):
        seqcls.check_pooling(Bert(BertConfig(n_layer=2, n_head=2, d_model=16, vocab_size=40)), "last4-sum")
