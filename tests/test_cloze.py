"""Zero-shot cloze for BERT: the template is checked and filled token for token as the filled-in
string would tokenize; the label-word scores equal transformers' masked-LM logits at the [MASK];
`tfcli eval mnli --cloze` reads a Hugging Face directory and reports against the majority class."""

from __future__ import annotations

import json

import pytest
import torch

from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.engine.backbone import from_hf
from tfcli.errors import UserError
from tfcli.objectives.mlm_nsp import SPECIAL_TOKENS, build_heads, special_ids
from tfcli.tasks import cloze

from .conftest import invoke

FIELDS = ("premise", "hypothesis")


@pytest.fixture(scope="module")
def tok(shared_data):
    return load_tokenizer_files(str(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt"), SPECIAL_TOKENS)


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{premise} , {hypothesis}", "exactly one [MASK], has 0"),
        ("{premise} [MASK] [MASK] {hypothesis}", "exactly one [MASK], has 2"),
        ("{premise} ? [MASK] , {claim}", "unknown field {claim}"),
        ("{premise} ? [MASK]", "must name {hypothesis} exactly once"),
        ("{premise} {premise} [MASK] {hypothesis}", "must name {premise} exactly once"),
    ],
)
def test_a_bad_template_is_refused_naming_the_problem(template, problem):
    with pytest.raises(UserError, match=problem.replace("[", r"\[").replace("{", r"\{").replace("}", r"\}")):
        cloze.parse_template(template, FIELDS)


def test_the_template_is_filled_as_the_whole_string_would_tokenize(tok):
    rows = [
        (("The cat sat on the mat.", "A cat is sitting."), 0),
        (("It rained [MASK] all day!", "The ground is dry."), 2),
    ]
    pieces = cloze.parse_template(cloze.default_template(FIELDS), FIELDS)
    ids = special_ids(tok)
    encoded = cloze.encode(tok, ids, pieces, FIELDS, rows, max_length=64)
    first, n, label = encoded[0]
    expected = [ids["cls"]] + tok.encode("The cat sat on the mat. ? [MASK] , A cat is sitting.") + [ids["sep"]]
    assert first.tolist() == expected and n == len(expected) and label == 0
    # a [MASK] typed in the data is [UNK]: every row has exactly one mask, the template's
    second = encoded[1][0]
    assert (second == ids["mask"]).sum() == 1 and ids["unk"] in second.tolist()


def test_long_texts_are_cut_never_the_template(tok):
    rows = [((" ".join(["word"] * 200), "short one"), 1)]
    pieces = cloze.parse_template("{hypothesis} ? [MASK] , {premise}", FIELDS)
    ids = special_ids(tok)
    seq, n, _ = cloze.encode(tok, ids, pieces, FIELDS, rows, max_length=32)[0]
    text = tok.decode(seq.tolist(), skip_special_tokens=False)
    assert n == len(seq) == 32 and text.startswith("[CLS] short one? [MASK], word word") and text.endswith("[SEP]")


def test_label_words_must_be_single_tokens(tok):
    assert len(cloze.word_ids(tok, ("yes", "maybe", "no"))) == 3
    with pytest.raises(UserError, match="'photosynthesizing' is .* tokens"):
        cloze.word_ids(tok, ("yes", "photosynthesizing"))


def test_cloze_scores_equal_transformers_masked_lm_logits(hf_bert_mlm, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForMaskedLM.from_pretrained(hf_bert_mlm).eval()
    backbone = from_hf(hf_bert_mlm, SPECIAL_TOKENS)
    heads = build_heads(backbone.cfg, nsp=False)
    heads.load_state_dict({k: v for k, v in backbone.heads.items() if k.startswith("mlm.")})
    ids, words = special_ids(tok), cloze.word_ids(tok, ("yes", "maybe", "no"))
    pieces = cloze.parse_template(cloze.default_template(FIELDS), FIELDS)
    rows = [(("A man plays a guitar.", "A person makes music."), 0), (("Two dogs run.", "Cats sleep."), 2)]
    examples = cloze.encode(tok, ids, pieces, FIELDS, rows, 64)
    from tfcli.tasks.classify import collate

    batch = collate(examples, ids["pad"])
    head = cloze.ClozeHead(lambda rows, train: None, ids["mask"], words, heads, 1.0)
    with torch.no_grad():
        ours = head.scores(backbone.model.eval(), heads, batch)  # (2, 3)
        logits = hf(
            input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"], attention_mask=batch["attention_mask"]
        ).logits  # (2, T, V)
    theirs = logits[batch["input_ids"] == ids["mask"]][:, words]
    assert ours.shape == (2, 3) and (ours - theirs).abs().max() < 1e-4


def test_eval_cloze_reads_a_hugging_face_bert_and_reports_the_majority_class(
    hf_bert_mlm, mnli_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    result = invoke("eval", "mnli", "--checkpoint", hf_bert_mlm, "--cloze", "--data", mnli_dir, "--limit", 12)
    assert result.exit_code == 0, result.output
    assert "dev_matched: accuracy" in result.output and "majority class" in result.output
    report = json.loads(next(tmp_path.glob("eval-*cloze.json")).read_text())
    assert report["dev_matched"]["n"] == 12 and report["dev_matched"]["mlm_head"] == 1.0


def test_cloze_without_a_masked_lm_head_says_so(hf_bert, mnli_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("eval", "mnli", "--checkpoint", hf_bert, "--cloze", "--data", mnli_dir, "--limit", 6)
    assert result.exit_code == 0, result.output
    assert "has no masked-LM head" in " ".join(result.output.split())


def test_cloze_excludes_few_shot_and_a_hugging_face_model_needs_its_task(hf_bert_mlm, mnli_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("eval", "mnli", "--checkpoint", hf_bert_mlm, "--cloze", "--data", mnli_dir, "--few-shot", 2)
    assert result.exit_code == 2 and "give one" in result.output
    result = invoke("eval", "--checkpoint", hf_bert_mlm, "--cloze")
    assert result.exit_code == 2 and "name the task" in result.output
