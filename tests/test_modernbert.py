"""ModernBERT against transformers on the same weights (a tiny random config transformers writes, fp32):
the encoder's hidden states on right-padded rows, with local attention narrower than the rows, a
[CLS] classification step's loss and every gradient, and the export reloaded by transformers with the
same logits; what tfcli does not implement refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli.errors import UserError  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.hf import modernbert as modernbert_table  # noqa: E402
from tfcli.models import build_model  # noqa: E402
from tfcli.plugin import Backbone  # noqa: E402

from .test_llama import spread_  # noqa: E402
from .test_roberta import assert_a_classification_step_matches  # noqa: E402

SHAPE = dict(
    vocab_size=80, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=3, pad_token_id=0,
    bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None, classifier_dropout=0.0,
    norm_bias=True,
)  # fmt: skip
IDS = torch.randint(3, 80, (3, 12), generator=torch.Generator().manual_seed(2))
MASK = torch.ones_like(IDS)
MASK[1, 8:], MASK[2, 5:] = 0, 0  # right padding
IDS = IDS.masked_fill(MASK == 0, 0)


def saved(path, architecture: str = "ModernBertForSequenceClassification", **extra):
    config = transformers.ModernBertConfig(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    spread_(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(0.4)
    model.save_pretrained(path)
    return model


def read(path):
    cfg, state = hf.read_pretrained(path)
    model = build_model(cfg).eval()
    missing, _ = model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")}, strict=False)
    assert not missing
    return cfg, model, {k[6:]: v for k, v in state.items() if k.startswith("heads.")}


def test_the_encoder_and_its_classifier_match_transformers(tmp_path):
    theirs = saved(tmp_path / "m", num_labels=3)
    cfg, ours, heads = read(tmp_path / "m")
    assert cfg.layer_types == ("full", "sliding", "sliding") and cfg.local_window == 4
    classifier = torch.nn.Linear(32, 3)
    classifier.load_state_dict({k[len("classifier.") :]: v for k, v in heads.items()})
    with torch.no_grad():
        out = theirs(IDS, attention_mask=MASK, output_hidden_states=True)
        hidden = ours(IDS, None, MASK)
        real = MASK.bool()
        assert (hidden[real] - theirs.model(IDS, attention_mask=MASK).last_hidden_state[real]).abs().max() < 1e-4
        assert (classifier(ours.pool(hidden)) - out.logits).abs().max() < 1e-4
        narrow = ours(IDS[:, :12], None, MASK)  # the local layers matter: widening them changes the output
        ours.blocks[1].attn.window = ours.blocks[2].attn.window = 64
        assert (ours(IDS[:, :12], None, MASK) - narrow).abs().max() > 1e-3


def test_a_classification_step_gives_transformers_loss_and_gradients(tmp_path):
    theirs = saved(tmp_path / "m", num_labels=3).train()
    cfg, ours, heads = read(tmp_path / "m")
    assert_a_classification_step_matches(theirs, ours, heads, modernbert_table.rules(cfg), IDS, MASK)


def test_a_classifier_exports_as_modernbert_for_sequence_classification(tmp_path):
    theirs = saved(tmp_path / "m", num_labels=3)
    cfg, ours, heads = read(tmp_path / "m")
    backbone = Backbone(model=ours, tokenizer=None, source="test", heads=heads, labels=("a", "b", "c"))
    arch, _ = hf.export(backbone, None, tmp_path / "out")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert arch == "ModernBertForSequenceClassification" and reloaded.config.id2label[2] == "c"
    with torch.no_grad():
        assert (reloaded(IDS, attention_mask=MASK).logits - theirs(IDS, attention_mask=MASK).logits).abs().max() < 1e-4


def test_an_unknown_rope_type_is_refused_in_one_line(tmp_path):
    saved(tmp_path / "m", num_labels=3)
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["rope_parameters"]["full_attention"]["rope_type"] = "ntk-by-parts"
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="rope_type 'ntk-by-parts' is not supported"):
        hf.read_pretrained(tmp_path / "m")


@pytest.mark.slow  # whole suite only: the parity tests above exercise the modules
@pytest.mark.parametrize("method", ["all", "lora"])
def test_mnli_trains_resumes_bit_for_bit_and_exports(method, mnli_dir, tmp_path):
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_resume_matrix import assert_resumes_exactly

    tok = load_tokenizer_files("builtin:bert-base-uncased", [])
    saved(tmp_path / "model", num_labels=3, vocab_size=tok.vocab_size)
    tok.tok.save(str(tmp_path / "model" / "tokenizer.json"))
    args = [
        "mnli",
        "--from",
        tmp_path / "model",
        "--data",
        mnli_dir,
        "--train",
        method,
        "--batch-size",
        4,
        "--pooling",
        "cls",
    ]
    args += ["--set", "finetune.eval_limit=8", "--set", "data.seq_len=32"]
    assert_resumes_exactly("finetune", args, tmp_path)
    out = tmp_path / "out"
    from .conftest import invoke

    exported = invoke("export", "--checkpoint", tmp_path / "whole", "--hf", out)
    assert exported.exit_code == 0, exported.output
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert reloaded.config.model_type == "modernbert" and reloaded.config.num_labels == 3
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(out)  # its tokenizer pads (there was no tokenizer_config.json)


def saved_masked_lm(path, shared):
    """A tiny ModernBertForMaskedLM with BERT's uncased WordPiece vocabulary ([CLS] [SEP] [MASK])."""
    import shutil

    model = saved(path, "ModernBertForMaskedLM", vocab_size=30522, max_position_embeddings=128)
    shutil.copy(shared / "tokenizers" / "bert-base-uncased" / "vocab.txt", path / "vocab.txt")
    return model


def test_cloze_reads_modernberts_masked_lm_head_as_transformers_does(tmp_path, shared_data, mnli_dir, monkeypatch):
    """Its prediction head, the tied embedding and decoder.bias: the label words' scores at [MASK] are
    ModernBertForMaskedLM's logits; `eval --cloze` runs on the directory."""
    from tfcli.engine.backbone import from_hf
    from tfcli.objectives.mlm_nsp import SPECIAL_TOKENS, special_ids
    from tfcli.tasks import cloze
    from tfcli.tasks.classify import collate

    from .conftest import invoke

    theirs = saved_masked_lm(tmp_path / "mlm", shared_data)
    backbone = from_hf(tmp_path / "mlm", SPECIAL_TOKENS)
    assert "mlm.bias" in backbone.heads
    heads = backbone.model.mlm_heads()
    heads.load_state_dict({k: v for k, v in backbone.heads.items() if k.startswith("mlm.")})
    assert set(heads.state_dict()) == {"mlm.bias"}  # the transform is the model's own prediction head
    tok = backbone.tokenizer
    ids, words = special_ids(tok), cloze.word_ids(tok, ("yes", "maybe", "no"))
    fields = ("premise", "hypothesis")
    pieces = cloze.parse_template(cloze.default_template(fields), fields)
    rows = [(("A man plays a guitar.", "A person makes music."), 0), (("Two dogs run.", "Cats sleep."), 2)]
    batch = collate(cloze.encode(tok, ids, pieces, fields, rows, 64), ids["pad"])
    head = cloze.ClozeHead(lambda rows, train: None, ids["mask"], words, heads, 1.0)
    with torch.no_grad():
        ours = head.scores(backbone.model.eval(), heads, batch)  # (2, 3)
        logits = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = logits[batch["input_ids"] == ids["mask"]][:, words]
    assert ours.shape == (2, 3) and (ours - want).abs().max() < 1e-4 and want.std() > 0.1
    name, _ = hf.export(backbone, None, tmp_path / "out")  # and back out as a masked LM
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert name == "ModernBertForMaskedLM" and (again - logits).abs().max() < 1e-4
    monkeypatch.chdir(tmp_path)
    result = invoke("eval", "mnli", "--checkpoint", tmp_path / "mlm", "--cloze", "--data", mnli_dir, "--limit", 12)
    assert result.exit_code == 0, result.output
    report = json.loads(next(tmp_path.glob("eval-*cloze.json")).read_text())
    assert report["dev_matched"]["n"] == 12 and report["dev_matched"]["mlm_head"] == 1.0
