"""Supervised finetuning on tiny random models: the trained tokens are exactly each reply and
its end token on every shipped template (against transformers' own renderings), packing gives every
example its own loss, grad_accum=4 gives the gradient of one batch four times the size, the whole path
finetune sft -> eval sft -> export --hf -> chat runs, resume is bit for bit, T5 and GPT work, and bad
input is one line with nothing created."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tfcli import recipe as recipes
from tfcli.data.chat import ChatTemplate, shipped_templates
from tfcli.data.conversations import DecoderExamples, Fields
from tfcli.driver import RunRequest, train
from tfcli.engine import model_source
from tfcli.errors import UserError
from tfcli.tasks import answers
from tfcli.tasks.reply_batches import PackedReplies, decoder_loss, decoder_rows, decoder_targets, pack

from .conftest import invoke, read_metrics, train_losses, write_jsonl
from .test_chat import CONVERSATIONS, END_OF_TURN, hf_fast, hf_ids, keeps_prefixes, tokenizer  # noqa: F401  (the fixture)
from .test_gguf import chat_gguf_file, tiny_backbone

transformers = pytest.importorskip("transformers")


def rows(n: int = 20, seed: int = 0) -> list[dict]:
    """Sums as prompt/reply rows, replies of different lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(1, 50, 2))
        out.append({"prompt": f"What is {a} plus {b}?", "completion": f"{a} plus {b} is {a + b}." + " Yes." * (i % 4)})
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory, max_seq_len=512)


# --- which tokens are trained ---------------------------------------------------------------------


def expected_trained(tok, template: ChatTemplate, conversation: list[dict], train_on: str, end: str) -> list[int]:
    """From transformers' rendering and its tokenizer's offsets: a token is trained when it overlaps an
    assistant reply's text or the end-of-turn token written right after it (found by searching the
    rendered text, not by differencing renderings as tfcli does)."""
    hf_tok = hf_fast(tok, template.source)
    text = hf_tok.apply_chat_template(conversation, tokenize=False)
    encoded = hf_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, at = [], 0
    for m in conversation:
        if m["role"] == "assistant":
            start = text.index(m["content"], at)
            stop = text.index(end, start + len(m["content"])) + len(end)
            assert text[start + len(m["content"]) : stop - len(end)].strip() == ""  # only whitespace in between
            spans.append((start, stop))
            at = stop
    spans = spans[-1:] if train_on == "last" else spans
    flags = [int(train_on == "all" or any(s < b and e > a for a, b in spans)) for s, e in encoded["offset_mapping"]]
    flags[0] = 0
    return flags


FAST_TEMPLATES = ("chatml",)  # the fast tier: every template with assistant, these with each mode


@pytest.mark.parametrize(
    "name, train_on",
    [
        pytest.param(
            name, train_on, marks=() if train_on == "assistant" or name in FAST_TEMPLATES else pytest.mark.slow
        )
        for train_on in ("assistant", "last", "all")
        for name in shipped_templates()
    ],
)
def test_trained_tokens_are_each_reply_and_its_end_token(name, train_on, tokenizer):  # noqa: F811
    template = ChatTemplate.load(name)
    tokenizer.specials = tokenizer.specials.__class__(bos="<s>", eos="</s>")
    build = DecoderExamples(tokenizer, template, train_on, 10_000)
    checked = 0
    for conversation in CONVERSATIONS:
        try:
            theirs = hf_ids(tokenizer, template.source, conversation)
        except Exception:  # the template refuses this conversation (a system message): so do we
            assert build.example({"messages": conversation}).startswith("skip:")
            continue
        if not keeps_prefixes(template, conversation):  # its replies cannot be told apart: refused
            with pytest.raises(UserError, match="changes what came before"):
                build.example({"messages": conversation})
            continue
        example = build.example({"messages": conversation})
        assert example.ids.tolist() == theirs
        end = tokenizer.token_id(END_OF_TURN.get(name, "</s>"))
        assert example.trained.tolist() == expected_trained(
            tokenizer, template, conversation, train_on, END_OF_TURN.get(name, "</s>")
        )
        replies = sum(m["role"] == "assistant" for m in conversation)
        if train_on != "all":  # each trained reply's end token, once
            assert example.ids[example.trained > 0].tolist().count(end) == (1 if train_on == "last" else replies)
        checked += 1
    assert checked


def test_a_base_models_example_is_prompt_newline_reply_end_of_text(tokenizer):  # noqa: F811
    tokenizer.specials = tokenizer.specials.__class__(bos="<s>", eos="</s>")  # not left to an earlier test
    example = DecoderExamples(tokenizer, None, "assistant", 100).example({"prompt": "2+2?", "completion": "4"})
    assert tokenizer.decode(example.ids.tolist(), skip_special_tokens=False) == "2+2?\n4</s>"
    trained = example.ids[example.trained > 0].tolist()
    assert tokenizer.decode(trained, skip_special_tokens=False) == "4</s>"  # the end of text is learned
    assert example.prompt == tokenizer.encode("2+2?\n")


def test_rows_that_cannot_be_examples_are_counted_by_reason(tokenizer):  # noqa: F811
    build = DecoderExamples(tokenizer, ChatTemplate.load("chatml"), "assistant", 40, Fields(system=""))
    out = build.build_all(
        [
            {"prompt": "hi", "completion": "hello"},
            {"prompt": "hi"},
            {"prompt": "hi", "completion": "  "},
            {"messages": [{"role": "assistant", "content": "first"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            {"messages": [{"role": "user", "content": "q"}]},
            {"prompt": "word " * 100, "completion": "x"},
            {"prompt": "hi", "completion": "word " * 100},
            "not a row",
        ]
    )
    assert len(out.examples) == 1
    assert out.skipped == {
        "empty 'completion'": 2,
        "roles out of order": 1,
        "empty reply": 1,
        "no assistant reply at the end": 1,
        "prompt alone longer than data.seq_len": 1,
        "longer than data.seq_len": 1,
        "not a row of fields": 1,
    }


# --- packing and gradient accumulation --------------------------------------------------------------


def tiny_examples(n: int = 12, template: bool = False):
    backbone = tiny_backbone()
    chat = ChatTemplate(backbone.tokenizer.chat_template) if template else None
    return backbone, DecoderExamples(backbone.tokenizer, chat, "assistant", 64).build_all(rows(n)).examples


def per_token_loss(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model.logits(model(batch["input_ids"], doc_ids=batch.get("doc_ids")))  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")  # (B, T)


def test_packing_gives_each_example_the_loss_it_has_alone():
    backbone, examples = tiny_examples()
    model, pad = backbone.model, type(backbone.model).pad_id(backbone.tokenizer)
    alone = []
    for e in examples:
        batch = decoder_rows([[e]], pad)
        alone.append(float(per_token_loss(model, batch)[batch["targets"] != -100].mean()))
    source = PackedReplies(examples, 64, pad, seed=3)
    assert len(source.rows) < len(examples) and sorted(i for r in source.rows for i in r) == list(range(len(examples)))
    batch = decoder_rows([[examples[i] for i in row] for row in source.rows], pad)
    assert "doc_ids" in batch and (batch["input_ids"] != pad).sum() > 0
    losses = per_token_loss(model, batch)
    for r, row in enumerate(source.rows):
        for d, i in enumerate(row):
            here = (batch["doc_ids"][r] == d) & (batch["targets"][r] != -100)
            assert float(losses[r][here].mean()) == pytest.approx(alone[i], abs=1e-5)


def test_packing_is_best_fit_and_keeps_examples_whole():
    rows_ = pack(np.array([60, 10, 50, 40, 5, 30, 64]), 64, seed=0)
    assert sorted(i for r in rows_ for i in r) == list(range(7))
    assert all(sum([60, 10, 50, 40, 5, 30, 64][i] for i in r) <= 64 for r in rows_)
    # longest first, each into the fullest row it fits: 64 | 60 | 50+10 | 40+5 | 30 (259 tokens need 5 rows)
    assert rows_ == [[6], [0], [2, 1], [3, 4], [5]]


def sft_trainer(tmp_path, model, **train):
    from tfcli.engine.runtime import setup_runtime
    from tfcli.engine.trainer import ObjectiveModule, Trainer
    from tfcli.plugin import Job

    recipe = recipes.load(
        "sft-llama-mini",
        {"train.steps": 1, "train.device": "cpu", "train.prefetch": 0, **{f"train.{k}": v for k, v in train.items()}},
    )
    job = Job(
        heads=torch.nn.ModuleDict(),
        loss=decoder_loss,
        train=None,
        val=None,
        flops_per_item=1.0,
        count_items=lambda b: 1,
        loss_weight=decoder_targets,
    )
    rt = setup_runtime("cpu", 1)
    trainer = Trainer.__new__(Trainer)  # just what _backward reads: no sampler, no run directory
    trainer.module, trainer.job, trainer.rt, trainer.tc = (
        ObjectiveModule(model, job.heads, job.loss),
        job,
        rt,
        recipe.train,
    )
    trainer.wrapped = trainer.forward = trainer.module
    return trainer


def gradients(trainer, batches) -> dict[str, torch.Tensor]:
    trainer.module.zero_grad(set_to_none=True)
    trainer._backward(batches)
    return {n: p.grad.clone() for n, p in trainer.module.named_parameters()}


def test_four_accumulated_micro_batches_give_the_gradient_of_one_batch_four_times_the_size(tmp_path):
    backbone, examples = tiny_examples(16)
    pad = type(backbone.model).pad_id(backbone.tokenizer)
    examples = sorted(examples, key=lambda e: e.targets)  # micro-batches with very different numbers of targets
    micro = [decoder_rows([[e] for e in examples[i : i + 4]], pad) for i in range(0, 16, 4)]
    big = decoder_rows([[e] for e in examples], pad)
    trainer = sft_trainer(tmp_path, backbone.model.train())
    accumulated, whole = gradients(trainer, micro), gradients(trainer, [big])
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], atol=1e-5, rtol=1e-4)
    trainer.job.loss_weight = None  # a mean of the micro-batches' means is another gradient: the test can fail
    naive = gradients(trainer, micro)
    assert max(float((naive[n] - whole[n]).abs().max()) for n in whole) > 1e-3


# --- the tool ---------------------------------------------------------------------------------------


@pytest.mark.slow  # end to end; the fast tier keeps this module's other tests
def test_finetune_sft_then_eval_export_and_chat(tmp_path, chat_model):
    data = write_jsonl(tmp_path / "rows.jsonl", rows(20) + [{"prompt": "no reply"}])
    result = invoke(
        "finetune",
        "sft",
        "--from",
        chat_model,
        "--data",
        data,
        "--steps",
        12,
        "--batch-size",
        4,
        "--lr",
        3e-3,
        "--out",
        tmp_path / "run",
        "--set",
        "data.val_fraction=0.2",
        "--set",
        "train.log_interval=1",
        "--set",
        "train.eval_interval=6",
        "--set",
        "sft.max_new_tokens=6",
    )
    assert result.exit_code == 0, result.output
    assert "1 empty 'completion'" in result.output and "tokens trained" in result.output
    losses = train_losses(tmp_path / "run")
    assert np.mean([losses[s] for s in (10, 11, 12)]) < np.mean([losses[s] for s in (1, 2, 3)]) - 1.0
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["dev"]["n"] == 4 and report["dev"]["generated"] == 4 and report["dev"]["loss"] > 0
    assert len((tmp_path / "run" / "predictions.jsonl").read_text().splitlines()) == 4
    hint = next(line for line in result.output.splitlines() if line.startswith("evaluate it:")).split(":", 1)[1].split()
    evaluated = invoke(*hint[1:], "--set", "sft.max_new_tokens=4", "--limit", 2)
    assert evaluated.exit_code == 0, evaluated.output
    assert len((tmp_path / "run" / "predictions-sft-limit2.jsonl").read_text().splitlines()) == 2
    exported = invoke("export", "--checkpoint", tmp_path / "run", "--hf", tmp_path / "hf")
    assert exported.exit_code == 0, exported.output
    assert "<|im_start|>" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")
    chat = invoke(
        "chat", "--checkpoint", tmp_path / "hf", "--greedy", "--max-new-tokens", 4, input="What is 2 plus 3?\n/exit\n"
    )
    assert chat.exit_code == 0, chat.output


@pytest.mark.slow  # whole suite only: other fast tests exercise its modules
def test_an_sft_run_resumes_bit_for_bit_packed(tmp_path, chat_model):
    data = write_jsonl(tmp_path / "rows.jsonl", rows(40))
    raw = recipes.load_raw("sft-llama-mini")
    raw.update(data={**raw["data"], "source": data, "seq_len": 64})
    raw["sft"].update(pack=True, generate_limit=0)
    raw["train"].update(
        steps=6, batch_size=2, ckpt_interval=3, eval_interval=3, log_interval=1, device="cpu", eval_batches=1
    )
    raw["finetune"].update(epochs=0.0)
    first = train(
        RunRequest(recipes.from_dict(raw), source=model_source.resolve(chat_model), out=tmp_path / "a", quiet=True)
    )[0]
    shutil.copytree(first, tmp_path / "b")
    crashed = tmp_path / "b"
    shutil.rmtree(crashed / "checkpoints" / "step-0000006")
    (crashed / "checkpoints" / "latest").write_text("step-0000003")
    train(RunRequest(recipes.load_resolved(crashed / "config.yaml"), resume=crashed, quiet=True))
    assert train_losses(crashed) == train_losses(first)
    assert [m for m in read_metrics(first) if m["split"] == "val"][-1]["loss"] == [
        m for m in read_metrics(crashed) if m["split"] == "val"
    ][-1]["loss"]


def test_gsm8k_preset_scores_the_final_number(tmp_path, chat_model, shared_data):
    for split, n in (("train", 16), ("test", 3)):
        lines = (shared_data / "sft" / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:n]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    result = invoke(
        "finetune",
        "gsm8k",
        "--from",
        chat_model,
        "--data",
        tmp_path,
        "--steps",
        1,
        "--batch-size",
        2,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "sft.max_new_tokens=4",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["test"]["metric"] == "final-number" and report["test"]["generated"] == 3


@pytest.mark.parametrize(
    "text,number",
    [
        ("so 3 + 4 = 7.\n#### 7", "7"),
        ("It costs $1,200.50 in all", "1200.5"),
        ("#### -3", "-3"),
        ("no number", None),
        ("12 then 18", "18"),
    ],
)
def test_final_number(text, number):
    assert answers.final_number(text) == number


def test_scores_of_generated_replies():
    assert answers.scores(["The answer is 18.", "#### 5", "7"], ["x\n#### 18", "#### 5", "#### 8"], "final-number") == {
        "exact_match": 2 / 3,
        "strict_exact_match": 1 / 3,
    }
    assert answers.scores(["Paris.", "paris"], ["paris", "Paris"], "exact") == {"exact_match": 0.5}
    assert answers.scores(["It is Paris, of course"], ["paris"], "contains") == {"contains_match": 1.0}


def test_gpt_and_t5_finetune_on_prompt_reply_rows(tmp_path, small_text):
    from .conftest import pretrained_run

    data = write_jsonl(tmp_path / "rows.jsonl", rows(16))
    for objective, model in (
        ("clm", {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 64}),
        ("span", {"family": "t5", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64}),
    ):
        (tmp_path / objective).mkdir()
        base = pretrained_run(tmp_path / objective, small_text, objective, model)
        result = invoke(
            "finetune",
            "sft",
            "--from",
            base,
            "--data",
            data,
            "--steps",
            3,
            "--batch-size",
            4,
            "--out",
            tmp_path / objective / "sft",
            "--set",
            "sft.max_new_tokens=3",
            "--set",
            "data.seq_len=64",
        )
        assert result.exit_code == 0, result.output
        assert json.loads((tmp_path / objective / "sft" / "eval.json").read_text())["dev"]["generated"] >= 1
    refused = invoke(
        "finetune",
        "sft",
        "--from",
        tmp_path / "span" / "run",
        "--data",
        data,
        "--pack",
        "--steps",
        1,
        "--out",
        tmp_path / "t5-packed",
    )
    assert refused.exit_code == 2 and "are for decoders" in refused.output and not (tmp_path / "t5-packed").exists()


def test_bad_input_is_one_line_and_creates_nothing(tmp_path, chat_model):
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "q", "completion": ""}] * 5)
    good = write_jsonl(tmp_path / "good.jsonl", rows(8))
    cases = [
        (["sft", "--from", chat_model, "--data", empty], "sft train: no usable example (4 empty 'completion')"),
        (["sft", "--from", chat_model, "--data", good, "--train", "head"], "no classifier head"),
        (
            ["sft", "--from", chat_model, "--data", good, "--chat-template", "nonesuch"],
            "no such file or shipped template",
        ),
        (["sft", "--from", chat_model, "--data", good, "--train-on", "replies"], "sft.train_on"),
        (["sft", "--from", chat_model, "--data", good, "--set", "sft.preset=squad"], "sft.preset"),
        (["mnli", "--from", chat_model, "--data", good, "--prompt-field", "q"], "is an option of finetune sft"),
    ]
    for args, message in cases:
        result = invoke("finetune", *args, "--steps", 1, "--out", tmp_path / "run", "--quiet")
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and result.output.count("\n") == 1, result.output
        assert not (tmp_path / "run").exists()


def test_every_method_trains_and_saves_only_what_it_trained(tmp_path, chat_model):
    data = write_jsonl(tmp_path / "rows.jsonl", rows(12))
    for method in ("lora", "ia3", "bitfit"):
        out = tmp_path / method
        result = invoke(
            "finetune",
            "sft",
            "--from",
            chat_model,
            "--data",
            data,
            "--train",
            method,
            "--steps",
            2,
            "--batch-size",
            4,
            "--out",
            out,
            "--quiet",
            "--set",
            "sft.generate_limit=0",
        )
        assert result.exit_code == 0, (method, result.output)
        record = json.loads((out / "run.json").read_text())["parameters"]
        assert 0 < record["trained"] < record["total"] / 10, (method, record)
        weights = next((out / "checkpoints").glob("step-*/model.safetensors"))
        assert weights.stat().st_size < 200_000, (method, weights.stat().st_size)  # the subset, not the model


@pytest.mark.slow
def test_compare_puts_the_untrained_model_beside_the_methods(tmp_path, chat_model):
    data = write_jsonl(tmp_path / "rows.jsonl", rows(20))
    result = invoke(
        "compare",
        "--task",
        "sft",
        "--from",
        chat_model,
        "--train",
        "0shot,lora",
        "--budget",
        "2steps",
        "--data",
        data,
        "--set",
        "sft.max_new_tokens=3",
        "--set",
        "data.val_fraction=0.2",
        "--out",
        tmp_path / "study",
    )
    assert result.exit_code == 0, result.output
    table = (tmp_path / "study" / "results.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| sft-")]
    assert len(lines) == 2 and "dev_loss" in table and "none (prompting)" in lines[0] and "-0shot" in lines[0], table
    # every cell is scored on the same held-out rows, with the same settings
    cells = sorted((tmp_path / "study" / "cells").iterdir())
    reports = [json.loads((c / "eval.json").read_text()) for c in cells]
    assert [r["dev"]["n"] for r in reports] == [4, 4] and [r["dev"]["generated"] for r in reports] == [4, 4], reports
    predictions = [
        sorted(json.loads(x)["reference"] for x in next(c.glob("*predictions.jsonl")).read_text().splitlines())
        for c in cells
    ]
    assert predictions[0] == predictions[1]
    assert "sft.max_new_tokens=3" in (tmp_path / "study" / "logs" / f"{cells[0].name}.log").read_text()
    assert all(len(line) <= 80 for line in result.output.splitlines() if "│" in line or "┃" in line), result.output


def test_plain_text_rows_are_evaluated_by_loss_alone_and_the_banner_says_train_on_all(tmp_path, chat_model):
    """Text rows have no prompt to answer: no replies are generated or scored (exact match of a
    continuation of "The" against the whole text means nothing), and every token is trained."""
    rows = [{"text": f"The number {i} comes after {i - 1} and before {i + 1}."} for i in range(1, 41)]
    data = write_jsonl(tmp_path / "text.jsonl", rows)
    result = invoke(
        "finetune",
        "sft",
        "--from",
        chat_model,
        "--data",
        data,
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--set",
        "data.val_fraction=0.1",
    )
    assert result.exit_code == 0, result.output
    assert "train_on all" in result.output and "train_on assistant" not in result.output, result.output
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["dev"]["loss"] > 0 and report["dev"]["ppl"] > 1 and report["dev"]["generated"] == 0
    assert "exact_match" not in report["dev"] and "metric" not in report["dev"]
    assert (tmp_path / "run" / "predictions.jsonl").read_text() == ""


def test_the_final_report_is_proportionate_to_the_run_and_its_phases_have_totals(tmp_path, chat_model, monkeypatch):
    """A 2-step run of 4 examples a step scores 32 held-out examples (the floor), not all 120; the
    reply-loss pass and the generation report their size (batches, rows) so the display shows an ETA."""
    import contextlib

    from tfcli import display
    from tfcli.tasks import sft

    phases = []

    @contextlib.contextmanager
    def recorded(label, total=None, unit=""):
        phases.append((label, total, unit))
        yield lambda n=1: None

    monkeypatch.setattr(display, "phase", recorded)
    monkeypatch.setattr(sft, "phase", recorded)
    data = write_jsonl(tmp_path / "rows.jsonl", rows(240))
    result = invoke(
        "finetune",
        "sft",
        "--from",
        chat_model,
        "--data",
        data,
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "data.val_fraction=0.5",
        "--set",
        "sft.max_new_tokens=2",
        "--set",
        "sft.generate_limit=10",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["dev"]["n"] == 32 and report["dev"]["generated"] == 10, report
    assert ("reply loss on dev", 8, "batches") in phases and ("generating dev replies", 10, "rows") in phases, phases
