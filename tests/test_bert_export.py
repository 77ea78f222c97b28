"""`tfcli export --hf`: transformers loads the directory and gives the same logits as tfcli."""
import json

import pytest
import torch
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.inference import load_run
from tfcli.objectives.mlm_nsp import build_heads
from tfcli.tasks import sequence_classification as seqcls

from .test_mlm_nsp import _tiny_bert_recipe

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, small_text):
    import yaml

    d = tmp_path_factory.mktemp("mlm")
    raw = _tiny_bert_recipe(small_text)
    raw["train"]["steps"] = 4
    (d / "r.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["pretrain", "--objective", "mlm", "--recipe", str(d / "r.yaml"),
                                      "--out", str(d / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    return d / "run"


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (2, 20), generator=g)
    types = torch.zeros_like(ids)
    types[:, 10:] = 1
    return ids, types, torch.ones_like(ids)


def test_exported_pretraining_run_loads_in_bert_for_pretraining(mlm_run, tmp_path):
    result = CliRunner().invoke(app, ["export", "--hf", str(tmp_path / "hf"), "--checkpoint", str(mlm_run)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    loaded = load_run(mlm_run)
    heads = build_heads(loaded.model.cfg)
    heads.load_state_dict(loaded.heads)
    ids, types, mask = _batch(loaded.model.cfg.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        hidden = loaded.model(ids, types, mask)
        mlm = heads["mlm"].logits(hidden, loaded.model.lm_head_weight)
        nsp = heads["nsp"](loaded.model.pool(hidden))
    assert (mlm - ref.prediction_logits).abs().max() < 1e-4
    assert (nsp - ref.seq_relationship_logits).abs().max() < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("To be, or not")["input_ids"][1:-1] == loaded.tokenizer.encode("To be, or not")


def test_exported_finetuned_run_loads_in_bert_for_sequence_classification(mlm_run, small_text, tmp_path,
                                                                           shared_data):
    data = tmp_path / "mnli"
    data.mkdir()
    for split, n in (("train", 48), ("dev_matched", 16), ("dev_mismatched", 16)):
        lines = (shared_data / "mnli" / f"{split}.jsonl").read_text().splitlines()[:n]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    run = tmp_path / "ft"
    result = CliRunner().invoke(app, ["finetune", "mnli", "--from", str(mlm_run), "--data", str(data), "--steps",
                                      "2", "--batch-size", "16", "--out", str(run), "--quiet",
                                      "--set", "task.epochs=0"])
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(app, ["export", "--hf", str(tmp_path / "hf"), "--checkpoint", str(run)]).exit_code == 0
    hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.id2label == {0: "entailment", 1: "neutral", 2: "contradiction"}
    model, heads, _, _, _ = seqcls._load_classifier(run)
    ids, types, mask = _batch(model.cfg.vocab_size)
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    with torch.no_grad():
        ours = heads["classifier"](seqcls.features(model, batch, "cls"))
        ref = hf(**batch).logits
    assert (ours - ref).abs().max() < 1e-4


def test_export_refuses_a_non_empty_directory(mlm_run, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("")
    result = CliRunner().invoke(app, ["export", "--hf", str(tmp_path / "x"), "--checkpoint", str(mlm_run)])
    assert result.exit_code == 2 and "not empty" in result.output
