"""`tfcli export --hf` of BERT runs: transformers loads the directory and gives the same logits."""

import json

import pytest
import torch

from tfcli.engine.backbone import from_run
from tfcli.objectives.mlm_nsp import build_heads
from tfcli.tasks.heads import features

from .conftest import invoke, tiny_bert_recipe, transformers_runs_the_export

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, small_text):
    import yaml

    d = tmp_path_factory.mktemp("mlm")
    (d / "r.yaml").write_text(yaml.safe_dump(tiny_bert_recipe(small_text, train={"steps": 4})))
    result = invoke("pretrain", "--recipe", d / "r.yaml", "--out", d / "run", "--quiet")
    assert result.exit_code == 0, result.output
    return d / "run"


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (2, 20), generator=g)
    types = torch.zeros_like(ids)
    types[:, 10:] = 1
    return ids, types, torch.ones_like(ids)


def test_exported_pretraining_run_loads_in_bert_for_pretraining(mlm_run, tmp_path):
    result = invoke("export", "--hf", tmp_path / "hf", "--checkpoint", mlm_run)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    loaded = from_run(mlm_run)
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
    assert all(oct(p.stat().st_mode)[-3:] == "644" for p in (tmp_path / "hf").iterdir())


def test_exported_finetuned_run_loads_in_bert_for_sequence_classification(mlm_run, mnli_dir, tmp_path):
    run = tmp_path / "ft"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        mlm_run,
        "--data",
        mnli_dir,
        "--steps",
        2,
        "--batch-size",
        16,
        "--out",
        run,
        "--quiet",
        "--set",
        "finetune.eval_limit=8",
    )
    assert result.exit_code == 0, result.output
    assert invoke("export", "--hf", tmp_path / "hf", "--checkpoint", run).exit_code == 0
    transformers_runs_the_export(tmp_path / "hf")
    hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.id2label == {0: "entailment", 1: "neutral", 2: "contradiction"}
    loaded = from_run(run, which="best")
    ids, types, mask = _batch(loaded.model.cfg.vocab_size)
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    with torch.no_grad():
        ours = (
            features(loaded.model, batch, "cls") @ loaded.heads["classifier.weight"].t()
            + loaded.heads["classifier.bias"]
        )
        ref = hf(**batch).logits
    assert (ours - ref).abs().max() < 1e-4


def test_export_refuses_a_non_empty_directory(mlm_run, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("")
    result = invoke("export", "--hf", tmp_path / "x", "--checkpoint", mlm_run)
    assert result.exit_code == 2 and "not an empty directory" in result.output
