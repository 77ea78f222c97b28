"""T5 span corruption: T5's noise statistics and lengths, reconstructibility, sentinel order,
shift-right alignment, learning, and `tfcli pretrain --objective span` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.data.sampler import Sampler
from tfcli.models.t5 import T5, T5Config
from tfcli.objectives import span_corruption as sc

SENTINELS = np.arange(1000, 1100)  # ids outside the raw tokens' range, so they are recognisable
EOS, PAD = 1, 0


def corrupted(n_rows: int, raw_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(5, 900, size=(n_rows, raw_len))
    batch = sc.SpanCorruptor(SENTINELS, eos_id=EOS, start_id=PAD)(raw, [rng] * n_rows)
    return raw, batch


def test_noise_fraction_and_mean_span_length_on_a_large_sample():
    rng = np.random.default_rng(0)
    noise = spans = total = 0
    for length in rng.integers(50, 1000, size=2000):
        mask = sc.random_spans_noise_mask(int(length), rng)
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        assert (mask.sum(), starts.sum()) == sc.noise_counts(int(length), 0.15, 3.0)  # T5's counts exactly
        assert not mask[0] and mask[-1]  # T5: a kept span first, a noise span last
        noise, spans, total = noise + mask.sum(), spans + starts.sum(), total + len(mask)
    assert abs(noise / total - 0.15) < 0.01
    assert abs(noise / spans - 3.0) < 0.3


def test_span_positions_are_random():
    rng = np.random.default_rng(1)
    masks = np.stack([sc.random_spans_noise_mask(100, rng) for _ in range(3000)])
    # away from the ends (T5 always starts with kept tokens and ends with noise) every position
    # is noise about 15% of the time, and draws differ
    per_position = masks[:, 20:80].mean(0)
    assert per_position.min() > 0.1 and per_position.max() < 0.2
    assert len({m.tobytes() for m in masks}) > 2900


def test_lengths_fill_the_encoder_exactly():
    assert sc.compute_input_and_target_lengths(512) == (568, 114)  # T5's and HF's published numbers
    for inputs_len in (16, 64, 114, 128, 256):
        raw_len, targets_len = sc.compute_input_and_target_lengths(inputs_len)
        _, batch = corrupted(4, raw_len, seed=inputs_len)
        assert batch["input_ids"].shape == (4, inputs_len)
        assert batch["labels"].shape == batch["decoder_input_ids"].shape == (4, targets_len)


def merge(inputs: list[int], targets: list[int]) -> list[int]:
    """Put every target span back where its sentinel stands in the input."""
    spans, current = {}, None
    for t in targets[:-1]:
        if t in SENTINELS:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    out = []
    for t in inputs[:-1]:
        out += spans.pop(t) if t in SENTINELS else [t]
    assert not spans  # every target span was used once
    return out


def test_every_source_token_appears_once_and_merging_gives_back_the_original():
    raw, batch = corrupted(64, 141)
    for row, inputs, targets in zip(raw, batch["input_ids"].tolist(), batch["labels"].tolist()):
        assert inputs[-1] == EOS and targets[-1] == EOS
        kept = [t for t in inputs if t not in SENTINELS and t != EOS]
        dropped = [t for t in targets if t not in SENTINELS and t != EOS]
        assert len(kept) + len(dropped) == len(row)
        assert merge(inputs, targets) == row.tolist()


def test_sentinels_appear_in_order():
    _, batch = corrupted(32, 568)
    for inputs, targets in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        for seq in (inputs, targets):
            used = [t for t in seq if t in SENTINELS]
            assert used == SENTINELS[: len(used)].tolist()
        assert targets[0] == SENTINELS[0]  # the target starts with the first sentinel


def tiny_t5() -> T5:
    torch.manual_seed(0)
    return T5(T5Config(n_layer=2, n_head=4, d_model=32, d_ff=64, vocab_size=1100, max_seq_len=64))


def test_decoder_input_is_the_target_shifted_right_and_never_shows_step_t():
    _, batch = corrupted(2, 70)
    labels, dec = batch["labels"], batch["decoder_input_ids"]
    assert (dec[:, 0] == PAD).all() and torch.equal(dec[:, 1:], labels[:, :-1])
    model = tiny_t5().eval()
    t = 6
    changed = labels.clone()
    changed[:, t] = SENTINELS[50]
    with torch.no_grad():
        a = model(batch["input_ids"], None, dec)
        b = model(batch["input_ids"], None, sc.shift_right(changed, PAD))
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])  # positions <= t cannot see target t
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_a_few_steps_lower_the_loss():
    _, batch = corrupted(8, 70)
    model = tiny_t5()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, metrics = sc.loss(model, None, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert 0.0 <= float(metrics["token_acc"]) <= 1.0


def test_padded_targets_change_neither_the_loss_nor_the_gradients():
    import torch.nn.functional as F

    _, batch = corrupted(4, 70)
    labels = torch.cat([batch["labels"], torch.full((4, 5), -100)], dim=1)
    labels[0, 10:] = -100  # one row's target is shorter still
    padded = {"input_ids": batch["input_ids"], "labels": labels, "decoder_input_ids": sc.shift_right(labels, PAD)}
    model = tiny_t5()
    loss, _ = sc.loss(model, None, padded)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = model.logits(model(padded["input_ids"], None, padded["decoder_input_ids"]))  # every position
    reference = F.cross_entropy(full.flatten(0, 1), labels.flatten(), ignore_index=-100)
    reference.backward()
    assert torch.allclose(loss, reference, atol=1e-5)
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters()))


def test_corruption_follows_each_block_s_own_random_stream():
    """The same block at the same position is corrupted the same way, resumed or not, whatever the
    process count (the resume itself: test_sampler)."""
    tokens = np.random.default_rng(0).integers(5, 900, size=5000)
    source = sc.CorruptedBlocks(tokens, 70, sc.SpanCorruptor(SENTINELS, EOS, PAD), seed=3)
    whole = Sampler(source, 4, seed=3).next_batch()
    halves = [Sampler(source, 2, seed=3, rank=r, world_size=2).next_batch() for r in range(2)]
    assert all(torch.equal(torch.cat([h[k] for h in halves]), whole[k]) for k in whole)
    assert whole["input_ids"].shape[0] == 4 and bool((whole["input_ids"][:, -1] == EOS).all())


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """The first 40k characters of Tiny Shakespeare (../shared/data)."""
    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "tinyshakespeare.txt"
    path = tmp_path_factory.mktemp("text") / "shakespeare_head.txt"
    path.write_text(src.read_text()[:40_000])
    return path


def recipe_file(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def tiny_t5_recipe(data) -> dict:
    return {
        "name": "tiny-t5",
        "objective": "span",
        "model": {"family": "t5", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
        "tokenizer": {"kind": "char"},
        "data": {"source": str(data), "val_fraction": 0.1, "seq_len": 48},
        "optim": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "train": {
            "steps": 8,
            "batch_size": 4,
            "log_interval": 2,
            "eval_interval": 8,
            "eval_batches": 2,
            "ckpt_interval": 8,
            "seed": 5,
            "device": "cpu",
        },
    }


@pytest.fixture(scope="module")
def span_run(tmp_path_factory, text_file) -> Path:
    tmp = tmp_path_factory.mktemp("span")
    out = tmp / "run"
    result = CliRunner().invoke(
        app,
        [
            "pretrain",
            "--objective",
            "span",
            "--recipe",
            recipe_file(tmp, tiny_t5_recipe(text_file)),
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    return out


def test_pretrain_span_through_the_cli(span_run):
    out = span_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert train[-1]["step"] == 8 and train[-1]["loss"] < train[0]["loss"]
    assert any(r.get("split") == "val" and "token_acc" in r for r in records)
    assert (out / "checkpoints" / "latest").is_file()


def test_span_needs_a_t5_recipe(tmp_path, text_file):
    raw = tiny_t5_recipe(text_file)
    raw["model"] = {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 64}
    result = CliRunner().invoke(app, ["pretrain", "--objective", "span", "--recipe", recipe_file(tmp_path, raw)])
    assert result.exit_code == 2 and "describes a 'gpt' model; objective 'span' trains 't5'" in result.output


def test_generate_from_a_t5_run_with_and_without_the_cache(span_run):
    def run(*extra):
        result = CliRunner().invoke(
            app,
            [
                "generate",
                "--checkpoint",
                str(span_run),
                "--prompt",
                "Thank you <extra_id_0> me to your party <extra_id_1> week.",
                "--greedy",
                "--max-new-tokens",
                "12",
                *extra,
            ],
        )
        assert result.exit_code == 0, result.output
        return result.output

    cached = run()
    assert cached.strip() and cached == run("--no-cache")
    result = CliRunner().invoke(app, ["generate", "--checkpoint", str(span_run)])
    assert result.exit_code == 2 and "--prompt" in result.output


def test_export_a_t5_run_that_transformers_loads(span_run, tmp_path):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from tfcli.engine.backbone import from_run as load_run

    result = CliRunner().invoke(app, ["export", "--checkpoint", str(span_run), "--hf", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Thank you <extra_id_0> me to your party <extra_id_1> week."
    loaded = load_run(span_run)
    ids = loaded.tokenizer.encode(text) + [loaded.tokenizer.eos_id]
    assert tok(text).input_ids == ids  # the exported tokenizer appends </s>, as T5's do
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")
    x, dec = torch.tensor([ids]), torch.tensor([[tok.pad_token_id, 5, 9]])
    with torch.no_grad():
        ours = loaded.model.logits(loaded.model(x, None, dec))
        theirs = hf(input_ids=x, decoder_input_ids=dec).logits
    assert (ours - theirs).abs().max() < 1e-4
