"""Distillation from a teacher (issue 73, part 5) on tiny random models: for the same completions, the
student's generalized JSD to the teacher (forward KL, reverse KL and between, at a temperature) and
every gradient equal TRL's DistillationTrainer's; off-policy steps train on the data's replies (the
same divergence as TRL's given those replies); the CLI trains on-policy and off-policy, resumes bit for
bit, evaluates; a teacher with another vocabulary is one line."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch

from tfcli.data.chat import ChatTemplate
from tfcli.data.conversations import DecoderExamples
from tfcli.engine.runtime import Runtime
from tfcli.engine.trainer import ObjectiveModule
from tfcli.hf import convert
from tfcli.hf import interop as hf
from tfcli.hf import llama as llama_table
from tfcli.plugin import Backbone
from tfcli.tasks.distill import Completions, DistillConfig, Divergence, Item, ItemBuilder, generalized_jsd

from .conftest import invoke, read_metrics, write_jsonl
from .test_dpo import PAIRS
from .test_gguf import chat_gguf_file, tiny_backbone
from .test_grpo import logged_training
from .test_resume_matrix import EVERY_STEP, cut_and_resume

LIMIT = 6
ROWS = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in PAIRS]


def fixed(backbone):
    """Four prompts of five tokens and their completions (one cut at the limit, the others ending in
    the end-of-turn token)."""
    eos = backbone.tokenizer.token_id("<|im_end|>")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 1000, (5,), generator=g).tolist() for _ in range(4)]
    completions = []
    for i, n in enumerate([3, LIMIT, 2, 4]):
        body = torch.randint(100, 1000, (n,), generator=g).tolist()
        completions.append(body if i == 1 else body[:-1] + [eos])
    return prompts, completions


def teacher_of(backbone):
    """Another model with the same vocabulary: deeper, wider, other weights."""
    from tfcli.models.llama import Llama, LlamaConfig

    from .test_llama import spread_

    tok = backbone.tokenizer
    torch.manual_seed(5)
    cfg = LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, d_model=96, d_ff=128, max_seq_len=64, vocab_size=tok.vocab_size)
    model = Llama(cfg).eval()
    spread_(model)
    return Backbone(model, tok, "teacher")


def trl_step(tmp_path, student, teacher, prompts, completions, cfg: DistillConfig):
    """TRL's DistillationTrainer on the same weights, prompts and completions (its tokenization and
    generation replaced): (loss, grads by transformers' names)."""
    import datasets

    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    for b in (student, teacher):
        b.tokenizer.specials = dataclasses.replace(b.tokenizer.specials, pad="<|endoftext|>")
    hf.export(Backbone(student.model, student.tokenizer), None, tmp_path / "student")
    hf.export(Backbone(teacher.model, teacher.tokenizer), None, tmp_path / "teacher")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "student", dtype=torch.float32)
    their_teacher = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "teacher", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=student.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.padding_side = "left"
    args = trl.DistillationConfig(
        output_dir=str(tmp_path / "trl"), beta=cfg.beta, temperature=cfg.temperature, max_completion_length=LIMIT,
        per_device_train_batch_size=len(prompts), report_to=[], use_cpu=True, bf16=False, fp16=False,
    )  # fmt: skip
    inputs = [{"prompt": "q"} for _ in prompts]
    trainer = trl.DistillationTrainer(
        model=model, teacher_model=their_teacher, args=args,
        train_dataset=datasets.Dataset.from_list(inputs), processing_class=tokenizer,
    )  # fmt: skip
    trainer._tokenize_prompts = lambda p: (prompts, None, {})
    trainer._generate_single_turn = lambda *a, **k: [list(c) for c in completions]
    model.train()
    out = trainer._generate_and_score_completions(inputs)
    loss = trainer.compute_loss(model, out)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def ours(student, teacher, prompts, completions, cfg: DistillConfig):
    """tfcli's on-policy step with the sampling replaced by the fixed completions."""
    items = [Item(p, None) for p in prompts]
    plugin = SimpleNamespace(rt=Runtime(torch.device("cpu")), agreed=bool)
    rollout = Completions(plugin, cfg, items, {student.tokenizer.token_id("<|im_end|>")}, 0)
    rollout.sample = lambda model, asked, seed: [list(c) for c in completions]
    batch = {"index": torch.arange(len(items)), "seed": torch.tensor([0])}
    model = student.model.train()
    (rows,), metrics = rollout(ObjectiveModule(model, torch.nn.ModuleDict(), None), [batch])
    assert float(metrics["on_policy"]) == 1.0
    loss, logged = Divergence(cfg, {"teacher": teacher.model.eval()})(model, None, rows)
    loss.backward()
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    return float(loss.detach()), grads, logged


@pytest.mark.parametrize(
    "beta,temperature,chunk",
    [(1.0, 1.0, 0), (0.0, 0.9, 0), (0.5, 1.0, 0), (0.5, 1.0, 3), (1.0, 0.8, 3)],
    ids=["reverse", "forward", "jsd", "jsd-in-chunks", "reverse-in-chunks"],
)
def test_the_divergence_and_gradients_equal_trls_distillation_trainer(tmp_path, monkeypatch, beta, temperature, chunk):
    """With `chunk`, the completion tokens' logits are formed 3 rows at a time, as a large vocabulary's
    are: the same loss and gradients."""
    if chunk:
        import tfcli.tasks.distill as distill

        monkeypatch.setattr(distill, "distill_rows", lambda vocab: chunk)
        taken = []
        formed = distill.chunk_logits
        monkeypatch.setattr(distill, "chunk_logits", lambda h, *a: taken.append(len(h)) or formed(h, *a))
    student = tiny_backbone()
    teacher = teacher_of(student)
    prompts, completions = fixed(student)
    cfg = DistillConfig(beta=beta, temperature=temperature, lmbda=1.0)
    theirs, their_grads = trl_step(tmp_path, copy.deepcopy(student), copy.deepcopy(teacher), prompts, completions, cfg)
    mine, grads, logged = ours(student, teacher, prompts, completions, cfg)
    assert mine == pytest.approx(theirs, abs=1e-5) and mine > 1e-3
    assert float(logged["entropy"]) > 0
    assert not chunk or (max(taken) == chunk and len(taken) > 2), taken  # each model's logits, 3 rows a chunk
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("beta", [1.0, 0.0])
@pytest.mark.parametrize("softcap,temperature,rows", [(0.0, 1.0, 64), (4.0, 0.7, 5)])
def test_the_kls_closed_form_gradient_is_autograds(beta, softcap, temperature, rows):
    """Reverse and forward KL take their gradient in closed form, the logits in reused buffers
    (kl_with_gradient): the summed divergence, the student's entropy and the gradients of the hidden
    states and the head equal autograd's through the plain formula (a soft cap, a temperature, in
    chunks of 5 rows or one), the teacher's cap its own; without a gradient asked for, the same sums."""
    from tfcli.tasks.distill import _ChunkedDivergence, generalized_jsd, tempered

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(13, 8, generator=g), torch.randn(50, 8, generator=g)
    their_hidden, their_weight = torch.randn(13, 8, generator=g), torch.randn(50, 8, generator=g)
    cfg = DistillConfig(beta=beta, temperature=temperature)
    caps = (softcap, softcap / 2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mine = tempered(h @ w.t(), caps[0], temperature)
    theirs = tempered(their_hidden @ their_weight.t(), caps[1], temperature)
    expected = generalized_jsd(mine, theirs, beta).sum()
    expected.backward()
    entropy = -(mine.exp() * mine).sum()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total, got_entropy = _ChunkedDivergence.apply(h2, w2, their_hidden, their_weight, caps, cfg, rows)
    (2.0 * total).backward()
    scale = max(float(expected), 1.0)
    assert float(total) == pytest.approx(float(expected), abs=1e-5 * scale) and float(expected) > 0.1
    assert float(got_entropy) == pytest.approx(float(entropy), abs=1e-5 * max(float(entropy), 1.0))
    torch.testing.assert_close(h2.grad, 2.0 * h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w2.grad, 2.0 * w.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        again, _ = _ChunkedDivergence.apply(hidden, weight, their_hidden, their_weight, caps, cfg, rows)
    assert float(again) == pytest.approx(float(total), abs=1e-6 * scale)


def test_student_and_teacher_read_each_row_only_as_far_as_its_completion_ends():
    """Completions of 3, 6, 2 and 4 tokens after prompts of 5 pad the step's rows to 11 positions:
    each model reads groups of rows of like width (reply_batches.hidden_states), never a row's padding
    beyond its group's widest row; the loss is the one TRL's trainer gives (the test above)."""
    student = tiny_backbone()
    teacher = teacher_of(student)
    prompts, completions = fixed(student)
    read = {"student": [], "teacher": []}
    hooks = [
        b.model.register_forward_pre_hook(lambda m, args, who=who: read[who].append(tuple(args[0].shape)))
        for who, b in (("student", student), ("teacher", teacher))
    ]
    widths = torch.tensor([len(p) + len(c) - 1 for p, c in zip(prompts, completions)])
    try:
        ours(student, teacher, prompts, completions, DistillConfig(lmbda=1.0))
    finally:
        for hook in hooks:
            hook.remove()
    padded = len(prompts) * int(widths.max() + 1)
    for who, shapes in read.items():
        assert sum(r for r, _ in shapes) == len(prompts) and len(shapes) > 1, (who, shapes)
        assert sum(r * t for r, t in shapes) <= 1.125 * int(widths.sum()) < padded, (who, shapes)


def test_the_generalized_jsd_is_the_two_kls_at_its_ends_and_symmetric_between():
    g = torch.Generator().manual_seed(0)
    s = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    t = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    kl = lambda a, b: (a.exp() * (a - b)).sum(-1)  # noqa: E731
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), kl(t, s))
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), kl(s, t))
    torch.testing.assert_close(generalized_jsd(s, t, 0.5), generalized_jsd(t, s, 0.5))
    assert (generalized_jsd(s, t, 0.5) <= 0.6932).all() and (generalized_jsd(s, s, 0.3).abs() < 1e-6).all()


def test_an_off_policy_step_trains_on_the_datas_replies_as_trl_would_score_them(tmp_path):
    """lmbda 0: the rows are the data's replies; their divergence is TRL's given those replies as the
    completions."""
    student = tiny_backbone()
    teacher = teacher_of(student)
    build = DecoderExamples(student.tokenizer, ChatTemplate(student.tokenizer.chat_template), "assistant", 64)
    items = ItemBuilder(build, DistillConfig()).build_all(ROWS[:4]).items
    prompts = [i.prompt for i in items]
    replies = [i.example.ids[len(i.prompt) :][i.example.trained[len(i.prompt) :] > 0].tolist() for i in items]
    cfg = DistillConfig(beta=0.0, lmbda=0.0)
    plugin = SimpleNamespace(rt=Runtime(torch.device("cpu")), agreed=bool)
    rollout = Completions(plugin, cfg, items, set(), 0)
    rollout.sample = None  # an off-policy step never samples
    model = student.model.train()
    batch = {"index": torch.arange(4), "seed": torch.tensor([0])}
    (rows,), metrics = rollout(ObjectiveModule(model, torch.nn.ModuleDict(), None), [batch])
    assert float(metrics["on_policy"]) == 0.0
    mine, _ = Divergence(cfg, {"teacher": teacher.model.eval()})(model, None, rows)
    theirs, _ = trl_step(tmp_path, copy.deepcopy(student), copy.deepcopy(teacher), prompts, replies, cfg)
    assert float(mine) == pytest.approx(theirs, abs=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and a teacher (another tiny llama with the same vocabulary) as GGUF files."""
    root = tmp_path_factory.mktemp("distill")
    student = chat_gguf_file(tmp_path_factory)
    hf.export_gguf(teacher_of(tiny_backbone()), None, root / "teacher.gguf", "f32")
    return student, root / "teacher.gguf"


def distill_args(tmp_path, models, steps: int, *more) -> list:
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS * 2)
    student, teacher = models
    return ["finetune", "distill", "--from", student, "--teacher", teacher, "--data", data, "--steps", steps,
            "--batch-size", 4, "--lr", 1e-2, "--set", "data.val_fraction=0.25", "--set",
            "distill.max_completion_length=8", *more]  # fmt: skip


@pytest.mark.parametrize("lmbda", [1.0, 0.0])
def test_finetune_distill_brings_the_student_closer_and_eval_distill_measures_it(tmp_path, models, lmbda):
    run = tmp_path / "run"
    args = distill_args(tmp_path, models, 12, "--out", run, "--set", f"distill.lmbda={lmbda}")
    result = invoke(*args, "--set", "train.log_interval=1", "--set", "distill.beta=0")
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(run) if m["split"] == "train"]
    assert {m["on_policy"] for m in train} == {lmbda}
    report = json.loads((run / "eval.json").read_text())["dev"]
    evaluated = invoke("eval", "--checkpoint", run)
    assert evaluated.exit_code == 0 and "divergence from the teacher" in evaluated.output, evaluated.output
    before = invoke("eval", "distill", "--checkpoint", models[0], "--data", tmp_path / "rows.jsonl", "--set",
                    f"distill.teacher={models[1]}", "--out", tmp_path / "before.json")  # fmt: skip
    assert before.exit_code == 0, before.output
    start = next(v for v in json.loads((tmp_path / "before.json").read_text()).values() if isinstance(v, dict))
    assert report["loss"] < start["loss"], (report, start)  # closer to the teacher on held-out replies


def test_a_resumed_distillation_trains_as_the_uninterrupted_one(tmp_path, models):
    mixed = ["--set", "distill.lmbda=0.5", "--quiet", *EVERY_STEP]
    whole = invoke(*distill_args(tmp_path, models, 3, "--out", tmp_path / "whole", *mixed))
    assert whole.exit_code == 0, whole.output
    cut_and_resume("finetune", tmp_path / "whole", tmp_path)
    assert logged_training(tmp_path / "cut") == logged_training(tmp_path / "whole")


def test_a_teacher_with_another_vocabulary_or_none_is_one_line(tmp_path, models, tmp_path_factory):
    from tfcli.data.tokenizers import load_tokenizer_files
    from tfcli.models.llama import Llama, LlamaConfig

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    other = Backbone(Llama(LlamaConfig(n_layer=1, n_head=2, d_model=32, d_ff=64, vocab_size=tok.vocab_size)), tok)
    hf.export_gguf(other, None, tmp_path / "other.gguf", "f32")
    for teacher, why in ((tmp_path / "other.gguf", "its vocabulary is not the student's"), (None, "needs a teacher")):
        args = distill_args(tmp_path, (models[0], teacher or ""), 1, "--out", tmp_path / "run")
        if teacher is None:
            args = [a for a in args if a not in ("--teacher", "")]
        result = invoke(*args)
        assert result.exit_code == 2 and why in result.output and "Traceback" not in result.output, result.output
        assert not (tmp_path / "run").exists()


def test_a_teacher_held_in_nf4_is_its_nf4_weights_distribution_in_a_fraction_of_the_memory(tmp_path, models):
    """distill.teacher_quantize nf4 freezes the teacher's block linears in NF4 (QLoRA's base): the
    divergence is exactly the one from the teacher with those weights dequantized, not the full
    teacher's, its weights take a fraction of the bytes, and the memory plan counts it so."""
    from tfcli.adapters import frozen_in_nf4
    from tfcli.engine.memory import tensor_bytes
    from tfcli.models.nf4 import NF4Linear

    student = tiny_backbone()
    full = teacher_of(student).model
    held = frozen_in_nf4(copy.deepcopy(full))
    quantized = [n for n, m in held.named_modules() if isinstance(m, NF4Linear)]
    assert len(quantized) >= 3 * len(held.blocks)  # each block's attention and MLP linears
    plain = copy.deepcopy(full)  # (an NF4 weight does not deep-copy)
    for name in quantized:
        parent, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(parent), leaf, held.get_submodule(name).dequantized())
    prompts, completions = fixed(student)
    cfg = DistillConfig(beta=0.5, lmbda=1.0)
    losses = {}
    for name, teacher in (("nf4", held), ("dequantized", plain), ("full", full)):
        losses[name], _, _ = ours(
            copy.deepcopy(student), Backbone(teacher, student.tokenizer), prompts, completions, cfg
        )
    assert losses["nf4"] == pytest.approx(losses["dequantized"], abs=1e-6)
    assert abs(losses["nf4"] - losses["full"]) > 1e-6  # the NF4 weights are not the full ones
    blocks = lambda m: tensor_bytes(*m.blocks)  # noqa: E731
    assert blocks(held) < 0.35 * blocks(full)

    frozen = {}
    for setting in ("none", "nf4"):
        run = tmp_path / setting
        result = invoke(
            *distill_args(tmp_path, models, 2, "--out", run, "--set", f"distill.teacher_quantize={setting}")
        )
        assert result.exit_code == 0, result.output
        plan = next(line for line in result.output.splitlines() if line.startswith("memory plan:"))
        found = re.search(r"frozen ([\d.]+) (kB|MB)", plan)
        assert found, plan
        frozen[setting] = float(found.group(1)) * {"kB": 1, "MB": 1024}[found.group(2)]
    assert frozen["nf4"] < frozen["none"], frozen  # (the embeddings and norms stay in fp32)
    evaluated = invoke("eval", "--checkpoint", run)
    assert evaluated.exit_code == 0 and "divergence from the teacher" in evaluated.output, evaluated.output
