"""Reward models (issue 73, part 1) on tiny random models: on a fixed batch tfcli's Bradley-Terry loss,
TRL's metrics and every gradient (the score head's included) equal TRL's RewardTrainer's, with margins
and centring, in both layouts (a row per pair, a row per reply); the CLI trains a reward model that
learns the preference, evaluates it, resumes bit for bit and exports an
AutoModelForSequenceClassification that scores as tfcli does; bad input is one line with nothing
created."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tfcli.hf import convert
from tfcli.hf import interop as hf
from tfcli.hf import llama as llama_table
from tfcli.plugin import Backbone
from tfcli.tasks.reply_batches import RewardBatches
from tfcli.tasks.reward_model import BradleyTerry, RewardConfig, rewards, score_head

from .conftest import invoke, read_metrics, write_jsonl
from .test_dpo import PAIRS, every_pair, tiny_pairs
from .test_gguf import chat_gguf_file, tiny_backbone
from .test_grpo import logged_training
from .test_resume_matrix import EVERY_STEP, cut_and_resume

MARGINS = [0.0, 0.5, 1.0, 0.0, 2.0, 0.25, 0.0, 1.5]


def trl_reward_step(tmp_path, backbone, head, pairs, center: float | None):
    """TRL's RewardTrainer on the same weights (exported as a reward model), the same token ids:
    (loss, metrics, grads by transformers' names)."""
    import datasets

    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    scored = Backbone(backbone.model, backbone.tokenizer, heads={"score.weight": head.weight.detach().clone()})
    hf.export(scored, None, tmp_path / "rm")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, per_device_train_batch_size=len(pairs),
        max_length=None, bf16=False, fp16=False, center_rewards_coefficient=center,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{"chosen": "b", "rejected": "c"}])
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    rows = [
        {"chosen_ids": p.chosen.ids.tolist(), "rejected_ids": p.rejected.ids.tolist(), "margin": p.margin}
        for p in pairs
    ]
    batch = trainer.data_collator(rows)
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_metrics_and_gradients_equal_trls_reward_trainer(tmp_path, share_prompt, center):
    backbone = tiny_backbone()
    backbone.tokenizer.specials = dataclasses.replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    pairs = [dataclasses.replace(p, margin=m) for p, m in zip(tiny_pairs(backbone), MARGINS)]
    torch.manual_seed(3)
    head = score_head(backbone.cfg.d_model)
    with torch.no_grad():
        head.weight.mul_(20)  # rewards well away from 0: the sigmoid, margins and centring all matter
    theirs, their_metrics, their_grads = trl_reward_step(tmp_path, backbone, head, pairs, center)

    model, heads = backbone.model.train(), torch.nn.ModuleDict({"score": head})
    pad = backbone.tokenizer.token_id("<|endoftext|>")
    batch = RewardBatches(pairs, pad, share_prompt).batch(every_pair(len(pairs)))
    ours, metrics = BradleyTerry(RewardConfig(center_rewards_coefficient=center or 0.0))(model, heads, batch)
    ours.backward()
    assert float(ours) == pytest.approx(theirs, abs=1e-5) and abs(theirs - 0.6931) > 0.05
    for name in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        assert float(metrics[name]) == pytest.approx(their_metrics[name], abs=1e-5), name
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    grads["score.weight"] = head.weight.grad
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


def test_a_row_per_pair_scores_as_a_row_per_reply():
    backbone = tiny_backbone()
    pairs = tiny_pairs(backbone)
    head = score_head(backbone.cfg.d_model)
    pad = backbone.tokenizer.token_id("<|endoftext|>")
    shared, apart = (RewardBatches(pairs, pad, share).batch(every_pair(len(pairs))) for share in (True, False))
    assert (shared["input_ids"] != pad).sum() < 0.8 * (apart["input_ids"] != pad).sum()  # each prompt read once
    with torch.no_grad():
        torch.testing.assert_close(rewards(backbone.model, head, shared), rewards(backbone.model, head, apart))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory)


def rm_args(tmp_path, model, steps: int, *more) -> list:
    data = write_jsonl(tmp_path / "pairs.jsonl", [{**p, "margin": 0.5} for p in PAIRS * 3])
    return ["finetune", "rm", "--from", model, "--data", data, "--steps", steps, "--batch-size", 4, "--lr", 1e-2,
            "--set", "data.val_fraction=0.25", *more]  # fmt: skip


def test_finetune_rm_learns_the_preference_evaluates_and_exports_a_sequence_classifier(tmp_path, chat_model):
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    result = invoke(
        *rm_args(tmp_path, chat_model, 12, "--out", run, "--train", "lora", "--set", "train.log_interval=1")
    )
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(run) if m["split"] == "train"]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"] and train[-1]["accuracy"] == 1.0
    assert {"margin", "min_reward", "mean_reward", "max_reward"} <= set(train[-1])
    report = json.loads((run / "eval.json").read_text())["dev"]
    assert report["accuracy"] == 1.0 and report["n"] == 6 and report["margin"] > 0
    evaluated = invoke("eval", "--checkpoint", run, "--limit", 4)
    assert evaluated.exit_code == 0 and "rm dev (4 pairs): accuracy" in evaluated.output, evaluated.output
    assert "rm dev: 6 pairs" in evaluated.output, evaluated.output
    assert "tfcli export --checkpoint" in result.output and "tfcli chat" not in result.output

    exported = invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf")
    assert exported.exit_code == 0 and "AutoModelForSequenceClassification" in exported.output, exported.output
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    conversation = [{"role": "user", "content": PAIRS[0]["prompt"]}, {"role": "assistant", "content": "It is 3."}]
    ids = tokenizer.apply_chat_template(conversation, return_tensors="pt", return_dict=True)["input_ids"]
    assert model.config.pad_token_id not in ids[0, -1:].tolist()
    from tfcli.engine.backbone import from_run

    ours = from_run(run)
    head = score_head(ours.cfg.d_model, ours.heads)
    batch = {"input_ids": ids, "score_row": torch.tensor([0]), "score_at": torch.tensor([ids.size(1) - 1])}
    with torch.no_grad():
        want = rewards(ours.model.eval(), head, batch)
        got = model(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # a batch as the exported tokenizer pads it scores each conversation as it scores alone
    assert tokenizer.pad_token_id == model.config.pad_token_id
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in (conversation, conversation[:1])]
    padded = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        both = model(**padded).logits[:, 0]
        alone = torch.cat(
            [model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[:, 0] for t in texts]
        )
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-5)
    gguf = invoke("export", "--checkpoint", run, "--gguf", tmp_path / "rm.gguf")
    assert gguf.exit_code == 2 and "--hf" in gguf.output and not (tmp_path / "rm.gguf").exists(), gguf.output


def test_the_score_head_trains_alone_on_the_frozen_model(tmp_path, chat_model):
    result = invoke(*rm_args(tmp_path, chat_model, 4, "--train", "head", "--out", tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "training 64 of" in result.output, result.output  # the score head's d_model weights, no bias


def test_a_resumed_reward_model_trains_as_the_uninterrupted_one(tmp_path, chat_model):
    whole = invoke(*rm_args(tmp_path, chat_model, 3, "--out", tmp_path / "whole", "--quiet", *EVERY_STEP))
    assert whole.exit_code == 0, whole.output
    cut_and_resume("finetune", tmp_path / "whole", tmp_path)
    assert logged_training(tmp_path / "cut") == logged_training(tmp_path / "whole")


@pytest.mark.parametrize(
    "rows,more,message",
    [
        ([{"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}], [], "no usable pairs"),
        (PAIRS, ["--set", "rm.center_rewards_coefficient=-1"], "rm.center_rewards_coefficient"),
        (PAIRS, ["--set", "rm.margin_field=chosen"], "no usable pairs"),
    ],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, chat_model, rows, more, message):
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    result = invoke(
        "finetune", "rm", "--from", chat_model, "--data", data, "--steps", 1, "--out", tmp_path / "run", *more
    )
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory, chat_model):
    root = tmp_path_factory.mktemp("rm")
    result = invoke(*rm_args(root, chat_model, 2, "--out", root / "run", "--quiet"))
    assert result.exit_code == 0, result.output
    return root / "run"


def test_grpo_with_a_reward_model_run_scores_each_completion_as_the_model_does(tmp_path, chat_model, reward_run):
    """--reward rm:RUN: each sampled completion's reward is the reward model's score of the prompt
    and that completion, rendered as it was trained (here ChatML); a relative path is recorded whole."""
    from tfcli.tasks.reward_model import RunReward
    from tfcli.tasks.rewards import parse

    from .test_grpo import PROMPTS

    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    args = ["finetune", "grpo", "--from", chat_model, "--data", data, "--steps", 1, "--batch-size", 2]
    args += ["--set", "grpo.max_completion_length=8", "--set", "grpo.num_generations=2", "--set", "grpo.eval_prompts=2"]
    args += ["--set", "data.val_fraction=0.125", "--out", tmp_path / "run", "--quiet"]
    result = invoke(*args, "--reward", f"rm:{reward_run}:0.5")
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(tmp_path / "run") if m["split"] == "train"]
    assert "rewards/rm/mean" in train[-1], train[-1]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    scorer = RunReward(str(reward_run))
    want = scorer([s["prompt"] for s in samples], [s["completion"] for s in samples])
    assert [s["rewards/rm"] for s in samples] == pytest.approx(want, abs=1e-5)
    assert len({round(w, 6) for w in want}) > 1  # different completions, different scores
    assert [r.weight for r in parse(f"rm:{reward_run}:0.5", "answer")] == [0.5]
    plain = invoke(*args[:-3], "--out", tmp_path / "plain", "--reward", "contains", "--dry-run")
    planned = invoke(*args[:-3], "--out", tmp_path / "planned", "--reward", f"rm:{reward_run}", "--dry-run")
    lines = [next(x for x in r.output.splitlines() if x.startswith("memory plan: ")) for r in (plain, planned)]
    assert "frozen" not in lines[0] and "frozen 1 MB" in lines[1], lines  # the reward model is in the plan


@pytest.mark.parametrize("which", ["gguf", "dpo run", "nowhere"])
def test_a_reward_that_is_not_a_reward_model_run_is_one_line(tmp_path, chat_model, which):
    from .test_grpo import PROMPTS

    if which == "dpo run":
        pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
        made = invoke("finetune", "dpo", "--from", chat_model, "--data", pairs, "--steps", 1, "--out", tmp_path / "dpo")
        assert made.exit_code == 0, made.output
    target = {"gguf": chat_model, "dpo run": tmp_path / "dpo", "nowhere": tmp_path / "nowhere"}[which]
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    result = invoke(
        "finetune", "grpo", "--from", chat_model, "--data", data, "--steps", 1, "--reward", f"rm:{target}",
        "--set", "grpo.max_completion_length=8", "--out", tmp_path / "run", "--quiet",
    )  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    why = "not a reward model" if which == "dpo run" else "checkpoint not found"
    assert f"--reward rm:{target}: " in result.output and why in result.output, result.output
    assert result.output.strip().count("\n") == 0 and not (tmp_path / "run").exists(), result.output


@pytest.mark.slow
def test_a_generic_decoders_reward_model_trains_and_exports_its_sequence_classifier(tmp_path):
    """The generic path (transformers' own modules, here StableLM): a row per reply, and the export is
    StableLmForSequenceClassification scoring as tfcli does."""
    transformers = pytest.importorskip("transformers")
    from tfcli.data.tokenizers import load_tokenizer_files
    from tfcli.engine.backbone import from_run

    from .test_generic import hf_decoder

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    model = tmp_path / "model"
    hf_decoder("stablelm", vocab_size=tok.vocab_size).save_pretrained(model)
    tok.tok.save(str(model / "tokenizer.json"))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 2)
    run = tmp_path / "run"
    result = invoke("finetune", "rm", "--from", model, "--data", pairs, "--steps", 2, "--out", run, "--quiet")
    assert result.exit_code == 0, result.output
    assert "share_prompt: false" in (run / "config.yaml").read_text()
    exported = invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf")
    assert exported.exit_code == 0 and "StableLmForSequenceClassification" in exported.output, exported.output
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours = from_run(run)
    ids = torch.tensor([tok.encode("What is 1 plus 2?\n") + tok.encode("It is 3.") + [tok.eos_id]])
    batch = {"input_ids": ids, "score_row": torch.tensor([0]), "score_at": torch.tensor([ids.size(1) - 1])}
    assert theirs.config.pad_token_id is None  # GPT-2's one special token ends every sequence: none can pad
    with torch.no_grad():
        want = rewards(ours.model.eval(), score_head(ours.cfg.d_model, ours.heads), batch)
        torch.testing.assert_close(theirs(input_ids=ids).logits[:, 0], want, atol=1e-4, rtol=1e-4)
