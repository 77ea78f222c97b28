"""DPO on tiny random models: on a fixed batch tfcli's loss, every metric and the gradients
equal TRL's DPOTrainer's (same weights, same pairs; sigmoid and IPO); the three reference modes give
the same loss on LoRA; HH dialogues and TRL's formats become pairs; the CLI trains, evaluates and
resumes (precomputed reference read back); bad input is one line with nothing created."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch

from tfcli import adapters
from tfcli import recipe as recipes
from tfcli.data.chat import ChatTemplate
from tfcli.data.conversations import DecoderExamples
from tfcli.data.preferences import PairBuilder, dialogue
from tfcli.data.sampler import Draw
from tfcli.driver import RunRequest, train
from tfcli.engine import model_source
from tfcli.engine.runtime import to_device
from tfcli.hf import convert
from tfcli.hf import interop as hf
from tfcli.hf import llama as llama_table
from tfcli.objectives.losses import lm_head, sequence_logprobs
from tfcli.recipe import AdapterConfig
from tfcli.tasks.dpo import DPOConfig, Preference, dpo_loss, precompute
from tfcli.tasks.reply_batches import PairBatches

from .conftest import DEVICE, close, invoke, read_metrics, train_losses, write_jsonl
from .test_gguf import chat_gguf_file, tiny_backbone

PAIRS = [
    {"prompt": f"What is {a} plus {b}?", "chosen": f"It is {a + b}.", "rejected": f"I think it is {a + b + 3}, or so."}
    for a, b in [(1, 2), (7, 5), (3, 9), (4, 4), (10, 1), (6, 2), (8, 8), (2, 11)]
]


def every_pair(n: int) -> Draw:
    """The draw of pairs 0..n-1, in order."""
    return Draw(
        torch.zeros(n, dtype=torch.long).numpy(), torch.arange(n).numpy(), torch.zeros(n, 3, dtype=torch.long).numpy()
    )


@pytest.fixture
def exact_fp32():
    """fp32 matmuls in fp32 (a CUDA run turns TF32 on for the whole process)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def tiny_pairs(backbone, rows=PAIRS):
    build = DecoderExamples(backbone.tokenizer, ChatTemplate(backbone.tokenizer.chat_template), "last", 64)
    return PairBuilder(build).build_all(rows).pairs


def test_hh_dialogues_and_trl_formats_become_pairs():
    assert dialogue("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant: see you") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    backbone = tiny_backbone()
    rows = [
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go"},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go"}],
        },
        {"prompt": "hi", "chosen": "hello", "rejected": "go"},
        {"prompt": "hi", "chosen": "same", "rejected": "same"},
        {"prompt": "hi", "rejected": "x"},
        {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c\n\nAssistant: d"},
    ]
    build = DecoderExamples(backbone.tokenizer, ChatTemplate(backbone.tokenizer.chat_template), "last", 64)
    out = PairBuilder(build).build_all(rows)
    assert len(out.pairs) == 3 and all(p.chosen.ids.tolist() == out.pairs[0].chosen.ids.tolist() for p in out.pairs)
    assert out.skipped == {
        "identical replies": 1,
        "no 'chosen'": 1,
        "dialogues that do not share every turn but the last reply": 1,
    }
    tok, pair = backbone.tokenizer, out.pairs[0]
    assert tok.decode(pair.chosen.ids[pair.chosen.trained > 0].tolist(), skip_special_tokens=False) == "hello<|im_end|>"
    assert (
        tok.decode(pair.rejected.ids[pair.rejected.trained > 0].tolist(), skip_special_tokens=False) == "go<|im_end|>"
    )


TRAINERS: list = []  # the last TRL trainer trl_batch_loss built


def trl_batch_loss(tmp_path, backbone, reference, pairs, loss_type: str, beta: float):
    """TRL's DPOTrainer on the same weights (exported), the same token ids: (loss, metrics, grads by
    transformers' names)."""
    from tfcli.plugin import Backbone

    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    # transformers builds the embedding with padding_idx = pad_token_id, whose row then gets no gradient; with
    # ChatML's <|im_end|> as the pad that is a real token's row: pad with one the text never holds instead
    from dataclasses import replace

    import datasets

    backbone.tokenizer.specials = replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    hf.export(backbone, None, tmp_path / "policy")
    hf.export(Backbone(reference, backbone.tokenizer), None, tmp_path / "reference")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        loss_type=[loss_type],
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=len(pairs),
        max_length=None,
        bf16=False,
        fp16=False,
    )
    dataset = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)
    rows = []
    for p in pairs:
        start = int(p.chosen.trained.nonzero()[0][0])
        assert p.chosen.ids[:start].tolist() == p.rejected.ids[:start].tolist()
        rows.append(
            {
                "prompt_ids": p.chosen.ids[:start].tolist(),
                "chosen_ids": p.chosen.ids[p.chosen.trained > 0].tolist(),
                "rejected_ids": p.rejected.ids[p.rejected.trained > 0].tolist(),
            }
        )
    batch = trainer.data_collator(rows)
    trainer.last_batch = dict(batch)  # kept for the loss-family test, which reuses this trainer
    TRAINERS.append(trainer)
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), pytest.param("ipo", 0.5, marks=pytest.mark.slow)])
def test_loss_metrics_and_gradients_equal_trls_on_a_fixed_batch(tmp_path, loss_type, beta):
    backbone = tiny_backbone()
    pairs = tiny_pairs(backbone)
    reference = copy.deepcopy(backbone.model).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # a policy that has moved away from the reference
        for p in backbone.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    theirs, their_metrics, their_grads = trl_batch_loss(tmp_path, backbone, reference, pairs, loss_type, beta)
    model = backbone.model.train()
    batch = PairBatches(pairs, type(model).pad_id(backbone.tokenizer)).batch(every_pair(len(pairs)))
    ours, metrics = Preference(DPOConfig(beta=beta, loss=loss_type), "copy", {"reference": reference})(
        model, None, batch
    )
    ours.backward()
    assert float(ours) == pytest.approx(theirs, abs=1e-5) and abs(float(ours) - 0.6931) > 1e-3
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "entropy",  # of the policy's next-token distribution, over every trained token
        "logits/chosen",  # the logits' mean over the vocabulary, over the chosen replies' tokens
        "logits/rejected",
        "mean_token_accuracy",  # the chosen replies' tokens that are the policy's argmax
    ):
        assert float(metrics[name]) == pytest.approx(their_metrics[name], abs=1e-5), name
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_a_pair_reads_its_prompt_once_and_its_replies_score_as_two_rows_would(family, exact_fp32):
    """One row per pair (the prompt, the chosen reply, then the rejected one continuing the prompt's
    positions without seeing the chosen): the same log-probabilities and gradients as a row for each.
    On TFCLI_TEST_DEVICE (CUDA's attention takes the mask in its own kernels), in exact fp32 (no TF32)."""
    from tfcli.models.gpt import GPT, GPTConfig
    from tfcli.tasks.dpo import logps

    backbone = tiny_backbone()
    torch.manual_seed(0)
    model = (
        backbone.model
        if family == "llama"
        else GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, vocab_size=backbone.tokenizer.vocab_size, max_seq_len=64))
    )
    pairs = tiny_pairs(backbone)
    pad, draw = type(model).pad_id(backbone.tokenizer), every_pair(len(pairs))
    shared, apart = PairBatches(pairs, pad).batch(draw), PairBatches(pairs, pad, share_prompt=False).batch(draw)
    assert shared["input_ids"].size(0) == len(pairs) and apart["input_ids"].size(0) == 2 * len(pairs)
    assert (shared["input_ids"] != pad).sum() < 0.8 * (apart["input_ids"] != pad).sum()  # each prompt read once
    model, device = model.to(DEVICE), torch.device(DEVICE)
    shared, apart = to_device(shared, device), to_device(apart, device)
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    grads = []
    for batch in (shared, apart):
        torch.testing.assert_close(logps(model, batch), logps(model, apart), atol=2e-5, rtol=0)
        model.zero_grad()
        loss, _ = Preference(DPOConfig(beta=0.1, loss="ipo"), "copy", {"reference": reference})(model, None, batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_rows_are_read_at_their_own_width_with_the_states_of_the_padded_batch(share_prompt, exact_fp32):
    """A batch whose one long reply pads every other row: the model reads each group of rows of like
    width only as far as they are read (the padding never computed) and every log-probability, reward
    state and gradient equals the padded batch's."""
    from tfcli.tasks.dpo import logps
    from tfcli.tasks.reply_batches import hidden_states, row_widths

    backbone = tiny_backbone()
    rows = [dict(r) for r in PAIRS]
    rows[3]["rejected"] = " ".join(["and then it is more"] * 4)  # one long rejected reply
    pairs = tiny_pairs(backbone, rows)
    model = backbone.model
    pad = type(model).pad_id(backbone.tokenizer)
    batch = PairBatches(pairs, pad, share_prompt=share_prompt).batch(every_pair(len(pairs)))
    widths = row_widths(batch)
    read = []
    hook = model.register_forward_pre_hook(lambda m, args: read.append(args[0].numel()))
    try:
        model.zero_grad()
        ours = logps(model, batch)
        ours.sum().backward()
    finally:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ids = batch["input_ids"]
    assert len(pairs) == len(rows) and len(read) > 1  # the long row is read apart from the rest
    assert sum(read) <= 1.125 * int(widths.sum()) < ids.numel()
    model.zero_grad()
    padded = model(ids, shared_prompt=batch.get("shared_prompt"))
    with torch.no_grad():
        alone = hidden_states(model, batch)
    for r, w in enumerate(widths.tolist()):
        torch.testing.assert_close(alone[r, :w], padded[r, :w], atol=2e-5, rtol=1e-5)
    head = lm_head(model, padded)
    targets = [batch["targets"]] + ([batch["rejected_targets"]] if share_prompt else [])
    theirs = torch.cat([sequence_logprobs(head.hidden, head.weight, t, head.softcap) for t in targets])
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    theirs.sum().backward()
    for name, g in grads.items():
        torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, atol=1e-5, rtol=1e-4)


def test_a_window_shorter_than_a_row_of_two_replies_reads_a_row_per_reply(exact_fp32, capsys):
    """A sliding window counts keys by their distance in the row: a second reply placed after the first
    is farther from its prompt there than its positions say, so in a row of two its log-probabilities
    are not its own (shown). A model with such a window trains with a row per reply, said once; one
    whose window is longer than any row shares its prompt."""
    from tfcli.engine.runtime import Runtime
    from tfcli.tasks.dpo import DPO, logps

    backbone = tiny_backbone(sliding_window=8)
    model, pairs = backbone.model, tiny_pairs(backbone)
    pad, draw = type(model).pad_id(backbone.tokenizer), every_pair(len(pairs))
    shared, apart = PairBatches(pairs, pad).batch(draw), PairBatches(pairs, pad, share_prompt=False).batch(draw)
    with torch.no_grad():
        assert (logps(model, shared) - logps(model, apart)).abs().max() > 1e-3
    recipe = recipes.load("dpo-llama-mini", {"data.seq_len": 64})
    task = DPO(Runtime(torch.device("cpu")), quiet=False)
    assert task.resolve(recipe, backbone).settings.share_prompt is False
    assert "a sliding window of 8 tokens" in capsys.readouterr().err
    assert task.resolve(recipe, tiny_backbone(sliding_window=128)).settings.share_prompt is True


def test_the_three_references_give_the_same_loss_on_lora():
    backbone = tiny_backbone()
    pairs = tiny_pairs(backbone)
    base = copy.deepcopy(backbone.model).eval()
    pad = type(backbone.model).pad_id(backbone.tokenizer)
    table = precompute(backbone.model, pairs, pad, 3, torch.device("cpu"))  # before the adapters, as setup does
    adapters.apply(
        backbone.model, "lora", AdapterConfig(rank=4, alpha=8, targets=("q", "k", "v", "o", "up", "gate", "down"))
    )
    torch.manual_seed(2)
    with torch.no_grad():
        for p in backbone.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)  # trained adapters: the policy is no longer the base
    model, cfg = backbone.model.eval(), DPOConfig(beta=0.2)
    draw = every_pair(len(pairs))
    with torch.no_grad():
        copied = Preference(cfg, "copy", {"reference": base})(model, None, PairBatches(pairs, pad).batch(draw))
        switched = Preference(cfg, "base", {})(model, None, PairBatches(pairs, pad).batch(draw))
        stored = Preference(cfg, "precompute", {})(model, None, PairBatches(pairs, pad, table).batch(draw))
    assert abs(float(copied[0]) - 0.6931) > 1e-3
    for other in (switched, stored):
        assert float(other[0]) == pytest.approx(float(copied[0]), abs=1e-5)
        for k in copied[1]:
            assert float(other[1][k]) == pytest.approx(float(copied[1][k]), abs=1e-5), k


def test_label_smoothing_is_conservative_dpo():
    policy, reference = torch.tensor([-3.0, -9.0, -6.0, -9.0]), torch.tensor([-5.0, -8.0, -6.0, -6.0])
    loss, metrics = dpo_loss(policy, reference, torch.tensor([3, 5, 4, 6]), DPOConfig(beta=0.5, label_smoothing=0.2))
    h = 0.5 * ((policy[:2] - reference[:2]) - (policy[2:] - reference[2:]))
    expected = (-0.8 * torch.nn.functional.logsigmoid(h) - 0.2 * torch.nn.functional.logsigmoid(-h)).mean()
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    assert float(metrics["rewards/accuracies"]) == 1.0 and float(metrics["rewards/margins"]) == pytest.approx(
        float(h.mean())
    )


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory)


@pytest.mark.slow  # end to end; the fast tier keeps this module's other tests
def test_finetune_dpo_learns_the_preference_and_eval_dpo_measures_it(tmp_path, chat_model):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 4)
    result = invoke(
        "finetune",
        "dpo",
        "--from",
        chat_model,
        "--data",
        data,
        "--train",
        "lora",
        "--steps",
        10,
        "--batch-size",
        4,
        "--lr",
        1e-2,
        "--out",
        tmp_path / "run",
        "--set",
        "data.val_fraction=0.25",
        "--set",
        "train.log_interval=1",
        "--set",
        "train.eval_interval=5",
    )
    assert result.exit_code == 0, result.output
    metrics = [m for m in read_metrics(tmp_path / "run") if m["split"] == "train"]
    assert metrics[0]["loss"] == pytest.approx(0.693147, abs=1e-5) and metrics[-1]["loss"] < 0.5
    assert metrics[-1]["rewards/margins"] > 0.3 and metrics[-1]["rewards/accuracies"] == 1.0
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["dev"]["rewards/accuracies"] > 0.5 and report["dev"]["n"] == 8
    evaluated = invoke("eval", "dpo", "--checkpoint", tmp_path / "run", "--reference", chat_model, "--limit", 4)
    assert evaluated.exit_code == 0 and "reward accuracy" in evaluated.output, evaluated.output


def test_reading_each_prompt_once_or_twice_draws_the_same_batches():
    """The sampler groups pairs by their longer reply either way: dpo.share_prompt changes how a batch
    is laid out, never which pairs it holds (nor the batches another tool is handed to compare with)."""
    from tfcli.data.sampler import make_sampler

    backbone = tiny_backbone()
    rows = [{**p, "chosen": p["chosen"] + " ok" * i} for i, p in enumerate(PAIRS * 4)]  # 32 reply lengths
    replies = []  # each batch's chosen replies, by their trained tokens (the same in either layout)
    for share in (True, False):
        sampler = make_sampler(PairBatches(tiny_pairs(backbone, rows), 0, share_prompt=share), 4, 7)
        replies.append([(sampler.next_batch()["targets"][:4] != -100).sum(1).tolist() for _ in range(8)])
    assert replies[0] == replies[1] and len({tuple(r) for r in replies[0]}) == 8


def test_a_run_reading_each_prompt_once_trains_as_one_reading_it_twice(tmp_path, chat_model):
    """On the CPU, where fp32 is exact enough to compare after updates (the function itself is compared
    on TFCLI_TEST_DEVICE above: in bf16 the two layouts round differently, and updates amplify it)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 2)
    losses = []
    for share in ("true", "false"):
        out = tmp_path / f"share-{share}"
        result = invoke(
            "finetune", "dpo", "--from", chat_model, "--data", data, "--steps", 3, "--batch-size", 4, "--lr", 1e-2,
            "--out", out, "--set", "data.val_fraction=0.25", "--set", "train.log_interval=1",
            "--set", f"dpo.share_prompt={share}", "--set", "train.device=cpu", "--quiet",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        losses.append(train_losses(out))
    assert "share_prompt: false" in (tmp_path / "share-false" / "config.yaml").read_text()
    assert list(losses[0].values()) == pytest.approx(list(losses[1].values()), abs=1e-5) and losses[0][3] < losses[0][1]


@pytest.mark.slow  # whole suite only: other fast tests exercise its modules
def test_a_precomputed_reference_is_written_once_and_read_back_on_resume(tmp_path, chat_model):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 3)
    raw = recipes.load_raw("dpo-llama-mini")
    raw["data"].update(source=data, seq_len=64)
    raw["dpo"].update(reference="precompute")
    raw["finetune"].update(train="lora", epochs=0.0)
    raw["train"].update(steps=6, batch_size=4, ckpt_interval=3, eval_interval=3, log_interval=1, device="cpu")
    raw["optim"].update(lr=1e-2)
    first = train(
        RunRequest(recipes.from_dict(raw), source=model_source.resolve(chat_model), out=tmp_path / "a", quiet=True)
    )[0]
    saved = json.loads((first / "reference_logps.json").read_text())
    assert len(saved["train"]) + len(saved["held_out"]) == 24
    crashed = tmp_path / "b"
    shutil.copytree(first, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-0000006")
    (crashed / "checkpoints" / "latest").write_text("step-0000003")
    stored = crashed / "reference_logps.json"
    stored.write_text(
        json.dumps({k: [[x + 1.0 for x in row] for row in v] for k, v in saved.items()})
    )  # read, not redone
    train(RunRequest(recipes.load_resolved(crashed / "config.yaml"), resume=crashed, quiet=True))
    ours, again = train_losses(first), train_losses(crashed)
    assert [again[s] for s in (1, 2, 3)] == [ours[s] for s in (1, 2, 3)]
    assert json.loads(stored.read_text())["train"][0][0] == saved["train"][0][0] + 1.0
    stored.write_text(json.dumps(saved))
    shutil.rmtree(crashed / "checkpoints" / "step-0000006")
    (crashed / "checkpoints" / "latest").write_text("step-0000003")
    train(RunRequest(recipes.load_resolved(crashed / "config.yaml"), resume=crashed, quiet=True))
    assert train_losses(crashed) == ours  # with the file as written, bit for bit


def test_bad_input_is_one_line_and_creates_nothing(tmp_path, chat_model):
    good = write_jsonl(tmp_path / "good.jsonl", PAIRS)
    cases = [
        (
            ["--data", write_jsonl(tmp_path / "a.jsonl", [{"prompt": "q", "good": "x", "rejected": "y"}] * 4)],
            "no usable pairs (3 no 'chosen')",
        ),
        (
            ["--data", write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "chosen": "x", "rejected": "x"}] * 4)],
            "no usable pairs (3 identical replies)",
        ),
        (["--data", good, "--set", "dpo.beta=0"], "dpo.beta must be > 0"),
        (["--data", good, "--train", "all", "--set", "dpo.reference=base"], "dpo.reference base"),
        (
            ["--data", good, "--set", "dpo.loss=sigmoid,sft", "--set", "dpo.loss_weights=[1.0]"],
            "dpo.loss_weights must be one weight per loss of dpo.loss (2)",
        ),
    ]
    for args, message in cases:
        result = invoke(
            "finetune", "dpo", "--from", chat_model, *args, "--steps", 1, "--out", tmp_path / "run", "--quiet"
        )
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and result.output.count("\n") == 1, result.output
        assert not (tmp_path / "run").exists()


def test_no_held_out_pairs_trains_without_evaluation_and_says_so(tmp_path, chat_model):
    """A held-out file whose pairs are all unusable holds out none: the run says so in one line, logs no
    empty held-out records, and writes no eval.json."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"prompt": "q", "chosen": "same", "rejected": "same"}])
    result = invoke(
        "finetune",
        "dpo",
        "--from",
        chat_model,
        "--data",
        data,
        "--train",
        "lora",
        "--steps",
        3,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--set",
        "train.eval_interval=1",
        "--set",
        f"data.val_source={dev}",
    )
    assert result.exit_code == 0, result.output
    assert "no held-out examples" in result.output and "without held-out evaluation" in result.output, result.output
    assert not [m for m in read_metrics(tmp_path / "run") if m["split"] == "val"]
    assert not (tmp_path / "run" / "eval.json").exists()


LOSS_FAMILY = {  # TRL 1.16's DPO loss types beyond sigmoid and ipo: label smoothing where they read it
    "hinge": 0.0, "robust": 0.1, "exo_pair": 0.1, "nca_pair": 0.0, "bco_pair": 0.0, "sppo_hard": 0.0,
    "apo_zero": 0.0, "apo_down": 0.0, "discopop": 0.0, "sigmoid_norm": 0.0, "aot": 0.1, "aot_unpaired": 0.0,
    "sft": 0.0, "sigmoid,sft": 0.0, "hinge,bco_pair,sft": 0.0,
}  # fmt: skip
LOSS_WEIGHTS = {"hinge,bco_pair,sft": [0.5, 2.0, 0.25]}  # TRL's loss_weights (else 1 each)


def test_every_loss_of_trls_dpo_family_gives_its_loss_and_gradients(tmp_path):
    """Each loss type, on the same weights and pairs as TRL's DPOTrainer (its loss_type, label_smoothing
    and discopop_tau set on one trainer): the same loss and gradients."""
    trl = pytest.importorskip("trl")
    backbone = tiny_backbone()
    pairs = tiny_pairs(backbone)
    reference = copy.deepcopy(backbone.model).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in backbone.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    beta = 0.2
    trl_batch_loss(tmp_path, backbone, reference, pairs, "sigmoid", beta)  # builds TRL's side once
    trainer = TRAINERS[-1]
    model = backbone.model.train()
    batch = PairBatches(pairs, type(model).pad_id(backbone.tokenizer)).batch(every_pair(len(pairs)))
    assert isinstance(trainer, trl.DPOTrainer)
    for loss_type, smoothing in LOSS_FAMILY.items():
        names = loss_type.split(",")
        weights = LOSS_WEIGHTS.get(loss_type, [1.0] * len(names))
        trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = names, weights, smoothing
        trainer.model.zero_grad()
        theirs = trainer.compute_loss(trainer.model, dict(trainer.last_batch))
        theirs.backward()
        their_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        model.zero_grad()
        cfg = DPOConfig(beta=beta, loss=loss_type, label_smoothing=smoothing, loss_weights=tuple(weights))
        ours, _ = Preference(cfg, "copy", {"reference": reference})(model, None, batch)
        ours.backward()
        assert float(ours) == pytest.approx(float(theirs), abs=1e-5), loss_type
        grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
        for name, g in grads.items():  # within 1e-5 of the gradient's own size (sppo_hard's are large)
            assert close(g, their_grads[name], 1e-5), (loss_type, name, (g - their_grads[name]).abs().max())


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"dpo.loss": "sigmoid,nope"}, "dpo.loss must be one or more of"),
        ({"dpo.loss": "sigmoid,orpo"}, "not cpo, simpo, orpo"),
        ({"dpo.loss": "sigmoid,sft", "dpo.loss_weights": [1.0]}, "one weight per loss of dpo.loss (2)"),
        ({"dpo.loss": "sigmoid", "dpo.alpha": 0.25}, "dpo.alpha must be 0 unless dpo.loss is cpo or simpo"),
    ],
)
def test_losses_and_weights_that_do_not_fit_are_one_line(settings, message):
    with pytest.raises(recipes.RecipeError, match=re.escape(message)):
        recipes.load("dpo-llama-mini", settings)


def test_exo_pair_without_label_smoothing_is_one_line():
    """EXO's loss reads log(eps): with dpo.label_smoothing 0 it is infinite, so the recipe says so."""
    with pytest.raises(recipes.RecipeError, match=r"^dpo.label_smoothing must be > 0 for exo_pair"):
        recipes.load("dpo-llama-mini", {"dpo.loss": "exo_pair"})
    assert (
        recipes.load("dpo-llama-mini", {"dpo.loss": "exo_pair", "dpo.label_smoothing": 0.1}).settings.loss == "exo_pair"
    )


def labelled(pairs: list, side: str, pad: int) -> dict:
    """TRL's legacy preference batch for one side: input ids, attention mask and labels (IGNORE where
    tfcli trains nothing), right-padded."""
    examples = [getattr(p, side) for p in pairs]
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.ids)
        ids[r, :n], mask[r, :n] = torch.from_numpy(e.ids), 1
        labels[r, :n] = torch.from_numpy(e.ids).masked_fill(torch.from_numpy(e.trained) == 0, -100)
    return {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}


@pytest.mark.parametrize(
    "loss,trainer,settings",
    [
        ("cpo", "CPO", {"loss_type": "sigmoid", "cpo_alpha": 1.0, "label_smoothing": 0.1}),
        ("simpo", "CPO", {"loss_type": "simpo", "cpo_alpha": 0.5, "simpo_gamma": 0.5}),
        ("simpo", "CPO", {"loss_type": "alphapo", "cpo_alpha": 0.0, "alpha": 0.25}),  # AlphaPO
        ("cpo", "CPO", {"loss_type": "sigmoid", "cpo_alpha": 1.0, "alpha": -0.1}),  # its reward, on CPO
        ("orpo", "ORPO", {}),
    ],
)
@pytest.mark.parametrize("share_prompt", [True, False])
def test_reference_free_losses_equal_trls_cpo_and_orpo_trainers(tmp_path, loss, trainer, settings, share_prompt):
    """CPO, SimPO, AlphaPO (TRL's experimental CPOTrainer) and ORPO (its ORPOTrainer) need no reference:
    on the same weights and token ids, tfcli's loss, TRL's metrics and every gradient equal theirs."""
    from dataclasses import replace

    import datasets

    from tfcli.plugin import Backbone

    transformers = pytest.importorskip("transformers")
    experimental = pytest.importorskip(f"trl.experimental.{trainer.lower()}")
    backbone = tiny_backbone()
    backbone.tokenizer.specials = replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    pairs = tiny_pairs(backbone)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in backbone.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    beta = 0.2
    hf.export(Backbone(backbone.model, backbone.tokenizer), None, tmp_path / "policy")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    config = getattr(experimental, f"{trainer}Config")(
        output_dir=str(tmp_path / "trl"), beta=beta, report_to=[], use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=len(pairs), **settings,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    theirs_trainer = getattr(experimental, f"{trainer}Trainer")(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    pad = backbone.tokenizer.token_id("<|endoftext|>")
    batch = {**labelled(pairs, "chosen", pad), **labelled(pairs, "rejected", pad)}
    model.train()
    theirs, their_metrics = theirs_trainer.get_batch_loss_metrics(model, batch)
    theirs.backward()

    ours_cfg = DPOConfig(
        beta=beta, loss=loss, label_smoothing=settings.get("label_smoothing", 0.0),
        cpo_alpha=settings.get("cpo_alpha", 1.0), simpo_gamma=settings.get("simpo_gamma", 0.5),
        alpha=settings.get("alpha", 0.0),
    )  # fmt: skip
    ours_model = backbone.model.train()
    ours_batch = PairBatches(pairs, pad, share_prompt=share_prompt, other_targets=loss == "orpo").batch(
        every_pair(len(pairs))
    )
    ours, metrics = Preference(ours_cfg, "none", {})(ours_model, None, ours_batch)
    ours.backward()
    assert float(ours) == pytest.approx(float(theirs), abs=1e-5)
    names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]
    names += ["logps/rejected", "nll_loss"] + (["log_odds_ratio", "log_odds_chosen"] if loss == "orpo" else [])
    for name in names:
        assert float(metrics[name]) == pytest.approx(float(their_metrics[name]), abs=1e-5), name
    grads = convert.to_hf(
        {f"model.{n}": p.grad for n, p in ours_model.named_parameters()}, llama_table.rules(ours_model.cfg)
    )
    their_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


def test_a_reference_free_run_holds_no_reference_and_evaluates_without_one(tmp_path, chat_model):
    """dpo.loss=simpo trains the policy alone (no frozen copy, no reference pass) and learns the
    preference; eval dpo needs no --reference for it."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 2)
    result = invoke(
        "finetune", "dpo", "--from", chat_model, "--data", data, "--steps", 8, "--batch-size", 4, "--lr", 1e-2,
        "--out", tmp_path / "run", "--set", "data.val_fraction=0.25", "--set", "train.log_interval=1",
        "--set", "dpo.loss=simpo", "--set", "dpo.cpo_alpha=0", "--set", "dpo.beta=2.0",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    train = [m for m in read_metrics(tmp_path / "run") if m["split"] == "train"]
    assert train[-1]["rewards/margins"] > train[0]["rewards/margins"] and train[-1]["loss"] < train[0]["loss"]
    plan = next(line for line in result.output.splitlines() if line.startswith("memory plan"))
    assert train[-1]["nll_loss"] == 0.0 and "frozen" not in plan, plan  # a copy-reference run plans "frozen 1 MB"
    evaluated = invoke("eval", "dpo", "--checkpoint", tmp_path / "run", "--limit", 4)
    assert evaluated.exit_code == 0 and "reward accuracy" in evaluated.output, evaluated.output
