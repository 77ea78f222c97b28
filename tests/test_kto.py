"""KTO (issue 73, part 2) on tiny random models: on a fixed batch of labelled rows, tfcli's loss, TRL's
metrics (kl, rewards, log-probabilities) and every gradient equal TRL's KTOTrainer's, with its KL
estimate from the rotated completions, in both layouts and for both losses; pairs split into rows;
the CLI trains, evaluates and resumes; rows without a label or of one kind only are one line."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from tfcli.data.chat import ChatTemplate
from tfcli.data.conversations import DecoderExamples
from tfcli.hf import convert
from tfcli.hf import interop as hf
from tfcli.hf import llama as llama_table
from tfcli.plugin import Backbone
from tfcli.tasks.kto import KTOConfig, KTOLoss, LabelledBatches, LabelledBuilder

from .conftest import invoke, read_metrics, write_jsonl
from .test_dpo import PAIRS, every_pair
from .test_gguf import chat_gguf_file, tiny_backbone
from .test_grpo import logged_training
from .test_resume_matrix import EVERY_STEP, cut_and_resume

UNPAIRED = [
    {"prompt": p["prompt"], "completion": p["chosen"] if i % 3 else p["rejected"], "label": bool(i % 3)}
    for i, p in enumerate(PAIRS * 2)
]


def labelled_rows(backbone, rows=UNPAIRED):
    build = DecoderExamples(backbone.tokenizer, ChatTemplate(backbone.tokenizer.chat_template), "last", 64)
    return LabelledBuilder(build, KTOConfig()).build_all(rows).rows


def trl_kto_step(tmp_path, backbone, reference, rows, cfg: KTOConfig):
    """TRL's KTOTrainer on the same weights, the same ids, its KL completions rotated by one as its
    dataset map rotates them: (loss, metrics, grads by transformers' names)."""
    import datasets

    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    backbone.tokenizer.specials = dataclasses.replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    hf.export(backbone, None, tmp_path / "policy")
    hf.export(Backbone(reference, backbone.tokenizer), None, tmp_path / "reference")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    args = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"), beta=cfg.beta, loss_type=cfg.loss, desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight, report_to=[], use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=len(rows), max_length=None,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{"prompt": "a", "completion": "b", "label": True}] * 2)
    trainer = trl.KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)
    completions = [r.example.ids[r.start :][r.example.trained[r.start :] > 0].tolist() for r in rows]
    examples = [
        {
            "prompt_ids": r.example.ids[: r.start].tolist(),
            "completion_ids": completions[i],
            "KL_completion_ids": completions[i - 1],  # TRL's rotation: [last] + completions[:-1]
            "label": r.desirable,
        }
        for i, r in enumerate(rows)
    ]
    batch = trainer.data_collator(examples)
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("share_prompt", [True, False])
def test_loss_metrics_and_gradients_equal_trls_kto_trainer(tmp_path, loss, share_prompt):
    backbone = tiny_backbone()
    rows = labelled_rows(backbone)[:8]
    assert 0 < sum(r.desirable for r in rows) < len(rows)
    reference = copy.deepcopy(backbone.model).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # a policy that has moved away from the reference
        for p in backbone.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cfg = KTOConfig(loss=loss, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    theirs, their_metrics, their_grads = trl_kto_step(tmp_path, backbone, reference, rows, cfg)
    model = backbone.model.train()
    pad = backbone.tokenizer.token_id("<|endoftext|>")
    batch = LabelledBatches(rows, pad, share_prompt).batch(every_pair(len(rows)))
    ours, metrics = KTOLoss(cfg, "copy", {"reference": reference})(model, None, batch)
    ours.backward()
    assert float(ours) == pytest.approx(theirs, abs=1e-5)
    names = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
    for name in names:
        assert float(metrics[name]) == pytest.approx(their_metrics[name], abs=1e-5), name
    if loss == "kto":
        assert float(metrics["kl"]) > 0  # the estimate is in play
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_in_a_row_per_sequence_the_mismatched_pairs_are_read_without_gradients(family):
    """The KL estimate's sequences take no gradient: in a row per sequence (a model that cannot read two
    replies in a row) they are read without one, as TRL reads them, with the log-probabilities of a
    pass over every row, and the rows' own gradients unchanged."""
    from tfcli.models.gpt import GPT, GPTConfig
    from tfcli.tasks.dpo import logps
    from tfcli.tasks.kto import policy_logps

    backbone = tiny_backbone()
    model = backbone.model
    if family == "gpt":
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(n_layer=2, n_head=2, d_model=32, vocab_size=backbone.tokenizer.vocab_size, max_seq_len=64)
        )
    rows = labelled_rows(backbone)[:6]
    batch = LabelledBatches(rows, type(model).pad_id(backbone.tokenizer), False).batch(every_pair(len(rows)))
    with_grad = []
    hook = model.register_forward_pre_hook(lambda m, args: with_grad.append(torch.is_grad_enabled()))
    try:
        model.zero_grad()
        ours = policy_logps(model, batch)
        ours.sum().backward()
    finally:
        hook.remove()
    assert set(with_grad) == {False, True}  # the rows with gradients, the mismatched pairs without
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    whole = logps(model, batch)
    torch.testing.assert_close(ours, whole, atol=2e-5, rtol=1e-5)
    whole[: len(rows)].sum().backward()
    for name, g in grads.items():
        torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, atol=1e-5, rtol=1e-4)


def test_pairs_become_a_desirable_and_an_undesirable_row():
    backbone = tiny_backbone()
    rows = labelled_rows(backbone, PAIRS[:3])
    assert [r.desirable for r in rows] == [True, False] * 3
    assert rows[0].example.ids[: rows[0].start].tolist() == rows[1].example.ids[: rows[1].start].tolist()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory)


def kto_args(tmp_path, model, steps: int, *more, rows=UNPAIRED * 2) -> list:
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    return ["finetune", "kto", "--from", model, "--data", data, "--steps", steps, "--batch-size", 4, "--lr", 1e-2,
            "--set", "data.val_fraction=0.25", "--train", "lora", *more]  # fmt: skip


def test_finetune_kto_raises_the_margin_and_eval_kto_measures_it(tmp_path, chat_model):
    run = tmp_path / "run"
    result = invoke(*kto_args(tmp_path, chat_model, 10, "--out", run, "--set", "train.log_interval=1"))
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(run) if m["split"] == "train"]
    assert train[0]["loss"] == pytest.approx(0.5, abs=1e-5)  # LoRA starts as the reference: 1 - sigmoid(0)
    assert train[-1]["loss"] < train[0]["loss"] and train[-1]["rewards/margins"] > 0.1
    assert {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"} <= set(train[-1])
    report = json.loads((run / "eval.json").read_text())["dev"]
    assert report["rewards/margins"] > 0 and report["n"] > 0
    evaluated = invoke("eval", "--checkpoint", run, "--limit", 4)
    assert evaluated.exit_code == 0 and "kto dev (4 rows): margin" in evaluated.output, evaluated.output


def test_a_resumed_kto_run_trains_as_the_uninterrupted_one(tmp_path, chat_model):
    whole = invoke(*kto_args(tmp_path, chat_model, 3, "--out", tmp_path / "whole", "--quiet", *EVERY_STEP))
    assert whole.exit_code == 0, whole.output
    cut_and_resume("finetune", tmp_path / "whole", tmp_path)
    assert logged_training(tmp_path / "cut") == logged_training(tmp_path / "whole")


@pytest.mark.parametrize(
    "rows,more,message",
    [
        ([{"prompt": "q", "completion": "a"}], [], "needs 'label' true or false"),
        ([{"prompt": "q", "completion": "a", "label": "yes"}], [], "needs 'label' true or false"),
        ([{**r, "label": True} for r in UNPAIRED], [], "every row is desirable"),
        (UNPAIRED, ["--batch-size", 1], "--batch-size 2 or more"),
        (UNPAIRED, ["--set", "kto.beta=0"], "kto.beta"),
    ],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, chat_model, rows, more, message):
    args = kto_args(tmp_path, chat_model, 1, "--out", tmp_path / "run", *more, rows=rows)
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
