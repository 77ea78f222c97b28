"""Failure behaviour. Bad input of every kind (CLI, recipes, data, images, task files, checkpoints,
Hugging Face directories) is one line on stderr naming the problem, exit code 2, and no file
created or changed. Faults: a pickle in a checkpoint is never run; kill -9 at random moments and
resume gives the uninterrupted losses; a NaN stops the run with `latest` at the last good
checkpoint; SIGINT saves and resumes exactly; a full disk keeps `latest` valid; a second writer
is refused."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tfcli import cli
from tfcli.engine import checkpoint

from .conftest import TINY_VIT, read_metrics, tiny_gpt_recipe, tiny_npz, train_losses

MARKER = "pickle-ran.txt"


class Payload:
    """A pickle that writes a file when unpickled: what a booby-trapped checkpoint would carry."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("this must never run",))


def run_cli(*args, capfd) -> tuple[int, str, str]:
    """`tfcli ARGS` in-process through main(), as a user runs it: (exit code, stdout, stderr)."""
    argv = sys.argv
    sys.argv = ["tfcli", *map(str, args)]
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capfd.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with a hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory, small_text, shared_data):
    """A workspace of data files, a finished tiny GPT run, a tiny ViT run and a tiny HF BERT dir."""
    root = tmp_path_factory.mktemp("bad")
    (root / "text.txt").write_text(small_text.read_text()[:20_000])
    (root / "empty.txt").write_text("   \n\n")
    (root / "tiny.yaml").write_text(
        yaml.safe_dump(tiny_gpt_recipe(root / "text.txt", train={"steps": 4, "ckpt_interval": 2}))
    )
    (root / "broken.yaml").write_text("model: [unclosed\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "notes.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (root / "corrupt.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    (root / "data.xyz").write_text("what")
    np.savez(root / "strings.npz", x_train=np.array([["a"] * 4] * 4))
    np.savez(root / "nox.npz", y_train=np.zeros(4))
    np.savez(root / "tiny-images.npz", x_train=np.zeros((8, 1, 1, 3), np.uint8), y_train=np.arange(8) % 2)
    tiny_npz(root / "images.npz")
    (root / "noimg").mkdir()
    (root / "a-file").write_text("x")
    (root / "busy").mkdir()
    (root / "busy" / "notes.txt").write_text("someone's files")
    (root / "reviews.csv").write_text("title,label\ngood,pos\nbad,neg\nfine,pos\nawful,neg\nok,meh\n")
    (root / "header.csv").write_text("title,label\n")
    mnli = root / "mnli"
    mnli.mkdir()
    (mnli / "train.jsonl").write_text(json.dumps({"premise": "p", "hypothesis": "h", "label": 0}) + "\n")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert (
            subprocess.run(
                [sys.executable, "-m", "tfcli", "pretrain", "--recipe", "tiny.yaml", "--out", "run", "--quiet"],
                capture_output=True,
            ).returncode
            == 0
        )
        vit = [x for k, v in TINY_VIT.items() for x in ("--set", f"model.{k}={v}")]
        assert (
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tfcli",
                    "pretrain",
                    "--objective",
                    "mae",
                    "--data",
                    "images.npz",
                    "--steps",
                    "1",
                    "--out",
                    "vitrun",
                    "--quiet",
                    *vit,
                ],
                capture_output=True,
            ).returncode
            == 0
        )
    finally:
        os.chdir(cwd)
    return root


def hf_dir(root: Path, name: str, config: dict, weights: bytes = None) -> Path:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return d


def broken_run(root: Path, name: str, damage) -> Path:
    """A copy of the finished run, damaged by `damage(run, latest checkpoint)`."""
    run = root / name
    if not run.exists():
        shutil.copytree(root / "run", run)
        damage(run, checkpoint.find(run))
    return run


def _legacy(run: Path, ckpt: Path):
    for f in (checkpoint.STATE, checkpoint.STATE_TENSORS):
        (ckpt / f).unlink()
    with open(ckpt / checkpoint.LEGACY_STATE, "wb") as f:
        pickle.dump({"optimizer": Payload(str(run.parent / MARKER))}, f)


GPT = ["pretrain", "--recipe", "tiny.yaml"]
BAD = [  # (arguments, what the one line must say); {root} is the workspace
    (GPT + ["--batch-size", 0], "train.batch_size must be >= 1, got 0"),
    (GPT + ["--lr", "-1e-3"], "optim.lr must be a positive number"),
    (GPT + ["--set", "train.log_interval=0"], "train.log_interval must be >= 1"),
    (GPT + ["--set", "train.ckpt_interval=0"], "train.ckpt_interval must be >= 1"),
    (GPT + ["--set", "train.eval_batches=0"], "train.eval_batches must be >= 1"),
    (GPT + ["--set", "train.eval_interval=-3"], "train.eval_interval must be >= 1"),
    (GPT + ["--set", "train.keep_checkpoints=0"], "train.keep_checkpoints must be >= 1"),
    (GPT + ["--set", "data.seq_len=0"], "data.seq_len must be >= 2"),
    (GPT + ["--set", "model.dropout=2"], "model.dropout must be in [0, 1)"),
    (GPT + ["--set", "optim.betas=[2,3]"], "optim.betas must be two numbers in [0, 1)"),
    (GPT + ["--set", "optim.eps=0"], "optim.eps must be > 0"),
    (GPT + ["--set", "optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0"),
    (GPT + ["--set", "train.clip_grad=-1"], "train.clip_grad must be >= 0"),
    (GPT + ["--set", "schedule.warmup_steps=-1"], "schedule.warmup_steps must be >= 0"),
    (GPT + ["--steps", 0], "train.steps is 0"),
    (GPT + ["--steps", -5], "train.steps must be >= 1"),
    (GPT + ["--set", "train.grad_accum=0"], "train.grad_accum must be >= 1"),
    (GPT + ["--set", "data.val_fraction=1.5"], "data.val_fraction must be in [0, 1)"),
    (GPT + ["--set", "train.device=tpu"], "train.device must be auto, cpu, cuda"),
    (GPT + ["--set", "train.precision=fp8"], "train.precision: 'fp8' is not one of"),
    (GPT + ["--set", "model.d_model=31"], "model.d_model (31) must be divisible by model.n_head (2)"),
    (GPT + ["--set", "model.n_layer=0"], "model.n_layer must be >= 1"),
    (GPT + ["--set", "model.family=rnn"], "model.family: unknown family 'rnn'"),
    (GPT + ["--set", "tokenizer.vocab_size=-1"], "tokenizer.vocab_size must be >= 0"),
    (GPT + ["--set", "optim.lrr=1"], "optim.lrr: unknown key"),
    (GPT + ["--set", "train.steps=ten"], "train.steps: expected an integer"),
    (GPT + ["--set", "nonsense"], "must look like key.path=value"),
    (GPT + ["--set", "mlm.nsp=false"], "mlm: unknown key"),
    (GPT + ["--no-nsp"], "--no-nsp applies to --objective mlm only"),
    (["pretrain", "--objective", "xyz"], "unknown objective 'xyz'"),
    (["pretrain", "--recipe", "nope"], "unknown recipe 'nope'"),
    (["pretrain", "--recipe", "missing.yaml"], "recipe file not found: missing.yaml"),
    (["pretrain", "--recipe", "broken.yaml"], "not valid YAML"),
    (["pretrain", "--recipe", "list.yaml"], "a recipe must be a mapping"),
    (["pretrain", "--objective", "mlm", "--set", "mlm.mask_prob=1.5"], "mlm.mask_prob must be in (0, 1)"),
    (["pretrain", "--objective", "mae", "--set", "mae.crop_scale=[0.5,2]"], "mae.crop_scale must be two numbers"),
    (
        ["pretrain", "--objective", "electra", "--set", "electra.generator_size=0"],
        "electra.generator_size must be in (0, 1]",
    ),
    (
        ["pretrain", "--objective", "mae", "--recipe", "gpt-mini"],
        "describes a 'gpt' model; objective 'mae' trains 'vit'",
    ),
    (["finetune", "no-such-task"], "unknown task 'no-such-task'"),
    (["finetune", "mnli", "--epochs", -1], "finetune.epochs must be >= 0"),
    (["finetune", "mnli", "--set", "finetune.warmup_fraction=1"], "finetune.warmup_fraction must be in [0, 1)"),
    (["finetune", "classify", "--set", "classify.preset=xnli"], "classify.preset: unknown preset 'xnli'"),
    # paths
    (GPT + ["--out", "a-file"], "--out a-file is a file"),
    (GPT + ["--out", "busy"], "--out busy is a directory with other files in it"),
    (GPT + ["--out", "run"], "run already holds a run; use --resume run"),
    (GPT + ["--data", "/no/such.txt"], "data not found: /no/such.txt"),
    (GPT + ["--data", "empty.txt"], "no text (every document is empty)"),
    (GPT + ["--data", "nomatch/*.txt"], "no files match 'nomatch/*.txt'"),
    (GPT + ["--data", "data.xyz"], "unsupported data file {root}/data.xyz"),  # a run records absolute paths
    (GPT + ["--data", "notes.jsonl"], "no 'text' field (columns: body)"),
    (GPT + ["--data", "broken.jsonl"], "could not read"),
    (GPT + ["--data", "corrupt.parquet"], "could not read"),
    # images
    (["pretrain", "--objective", "mae", "--data", "strings.npz"], "images must be numbers"),
    (["pretrain", "--objective", "mae", "--data", "nox.npz"], "no x_train array"),
    (["pretrain", "--objective", "mae", "--data", "tiny-images.npz"], "smaller than one 4x4 patch"),
    (["pretrain", "--objective", "mae", "--data", "noimg"], "no readable images in {root}/noimg"),
    (["finetune", "image-classify", "--data", "text.txt"], "unsupported image data {root}/text.txt"),
    # task files
    (
        [
            "finetune",
            "classify",
            "--from",
            "{hfbert}",
            "--data",
            "reviews.csv",
            "--text-fields",
            "title",
            "--set",
            "classify.labels=[pos,neg]",
        ],
        "row 5: unknown label 'meh' (labels: pos, neg)",
    ),
    (
        ["finetune", "classify", "--from", "{hfbert}", "--data", "reviews.csv", "--text-fields", "body"],
        "no column 'body'",
    ),
    (["finetune", "classify", "--from", "{hfbert}", "--data", "reviews.csv"], "classify.text_fields: name the column"),
    (["finetune", "classify", "--from", "{hfbert}", "--data", "header.csv", "--text-fields", "title"], "no rows"),
    (["finetune", "mnli", "--from", "{hfbert}", "--data", "mnli"], "no evaluation split file"),
    # checkpoints and runs
    (["eval", "--checkpoint", "/no/such/run"], "--checkpoint /no/such/run: not found"),
    (["generate", "--checkpoint", "/no/such/run"], "--checkpoint /no/such/run: not found"),
    (["generate", "--checkpoint", "vitrun", "--prompt", "hi"], "holds a 'vit' model; generate needs"),
    (["generate", "--checkpoint", "run", "--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["generate", "--checkpoint", "run", "--top-p", 0], "--top-p in (0, 1]"),
    (["eval", "mae", "--checkpoint", "run"], "`eval mae` needs 'vit'"),
    (["pretrain", "--resume", "busy"], "--resume busy: no config.yaml there"),
    (["pretrain", "--resume", "{notrecipe}"], "config.yaml is not a tfcli recipe"),
    (["pretrain", "--resume", "{corruptconfig}"], "not valid YAML"),
    (["pretrain", "--resume", "{nostate}"], "state.json is missing; the checkpoint is incomplete"),
    (["pretrain", "--resume", "{legacy}"], "is a pickle, which tfcli does not load"),
    (
        ["pretrain", "--resume", "run", "--set", "model.d_model=64"],
        "model.d_model was 32 and cannot change when resuming",
    ),
    # --from gives the whole model: a model setting would be dropped (the run kept the source's)
    (["pretrain", "--from", "run", "--set", "model.n_layer=1"], "--set model.n_layer=1: the model comes from --from"),
    (["finetune", "mnli", "--from", "run", "--set", "model.dropout=0.1"], "--set model.dropout=0.1: the model comes"),
    (["eval", "--checkpoint", "{truncated}"], "model.safetensors: unreadable"),
    (["eval", "--checkpoint", "{badtokenizer}"], "tokenizer.json: not a readable tokenizer"),
    (["eval", "--checkpoint", "{badmeta}"], "has no config.yaml"),
    (["export", "--checkpoint", "run", "--hf", "busy"], "busy exists and is not an empty directory"),
    (["export", "--checkpoint", "run", "--hf", "a-file"], "a-file exists and is not an empty directory"),
    (["upgrade", "{legacy}"], "refused by the weights_only loader"),
    # Hugging Face directories
    (["finetune", "mnli", "--from", "{unknown}"], "model_type 'hyena9' is not supported"),
    (["finetune", "mnli", "--from", "{noweights}"], "no model.safetensors, sharded safetensors or pytorch_model.bin"),
    (["finetune", "mnli", "--from", "{badweights}"], "not a readable safetensors file"),
    (["finetune", "mnli", "--from", "{picklebin}"], "refused or unreadable with weights_only=True"),
    (["finetune", "mnli", "--from", "noimg"], "neither a tfcli run nor a Hugging Face model directory"),
    (["finetune", "mnli", "--from", "/no/such/model"], "--from /no/such/model: not found"),
    (["finetune", "image-classify", "--from", "run"], "image-classify reads a decoder only from an igpt run"),
]


@pytest.fixture(scope="module")
def places(work, shared_data):
    """The damaged runs and directories the cases name, made once."""
    bert = {
        "model_type": "bert",
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "hidden_size": 8,
        "intermediate_size": 16,
        "vocab_size": 30522,
    }
    import transformers

    hfbert = work / "hfbert"
    if not hfbert.exists():
        transformers.BertModel(
            transformers.BertConfig(**{k: v for k, v in bert.items() if k != "model_type"})
        ).save_pretrained(hfbert)
        shutil.copy(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt", hfbert / "vocab.txt")
    picklebin = hf_dir(work, "picklebin", bert)
    with open(picklebin / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": Payload(str(work / MARKER))}, f)
    return {
        "root": work,
        "hfbert": hfbert,
        "unknown": hf_dir(work, "unknown", {"model_type": "hyena9"}),  # no family, nor a transformers one
        "noweights": hf_dir(work, "noweights", bert),
        "picklebin": picklebin,
        "badweights": hf_dir(work, "badweights", bert, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"),
        "notrecipe": broken_run(work, "notrecipe", lambda r, c: (r / "config.yaml").write_text("my: notes\n")),
        "corruptconfig": broken_run(work, "corruptconfig", lambda r, c: (r / "config.yaml").write_text("a: [\n")),
        "nostate": broken_run(work, "nostate", lambda r, c: (c / checkpoint.STATE).unlink()),
        "legacy": broken_run(work, "legacy", _legacy),
        "truncated": broken_run(
            work,
            "truncated",
            lambda r, c: (c / checkpoint.WEIGHTS).write_bytes((c / checkpoint.WEIGHTS).read_bytes()[:100]),
        ),
        "badtokenizer": broken_run(work, "badtokenizer", lambda r, c: (r / "tokenizer.json").write_text("{garbage")),
        "badmeta": broken_run(work, "badmeta", lambda r, c: (r / "config.yaml").unlink()),
    }


def test_there_are_at_least_sixty_cases():
    assert len(BAD) >= 60


@pytest.mark.parametrize(
    "args,message",  # the fast tier takes every other case, the whole suite all of them
    [pytest.param(*case, marks=() if i % 2 == 0 else pytest.mark.slow) for i, case in enumerate(BAD)],
    ids=[f"{i:02d}" for i in range(len(BAD))],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(args, message, work, places, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(work)
    monkeypatch.setenv("TFCLI_CACHE", str(tmp_path / "cache"))  # caches may be written; the workspace may not
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    args = [str(a).format(**places) for a in args]
    before = snapshot(work)
    code, out, err = run_cli(*args, capfd=capfd)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.format(**places) in lines[0], err
    assert "Traceback" not in out + err
    assert snapshot(work) == before, "a bad input created or changed a file"
    assert not (work / MARKER).exists()


# --- faults -----------------------------------------------------------------------------------------


def tiny(tmp: Path, text: Path, **train) -> Path:
    raw = tiny_gpt_recipe(
        text,
        train={"steps": 24, "ckpt_interval": 4, "eval_interval": 8, "log_interval": 1, "keep_checkpoints": 3, **train},
    )
    raw["model"]["dropout"] = 0.1  # so that the RNG state matters for exact resume
    (tmp / "r.yaml").write_text(yaml.safe_dump(raw))
    return tmp / "r.yaml"


def tfcli_process(*args, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tfcli", *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, small_text) -> tuple[Path, Path]:
    """The uninterrupted run the fault tests compare against, and its recipe."""
    tmp = tmp_path_factory.mktemp("whole")
    recipe = tiny(tmp, small_text)
    p = tfcli_process("pretrain", "--recipe", recipe, "--out", tmp / "run", "--quiet", cwd=tmp)
    assert p.wait(300) == 0, p.stderr.read()
    return tmp / "run", recipe


def test_a_pickle_in_a_checkpoint_is_never_run(whole_run, tmp_path, capfd):
    run = tmp_path / "run"
    shutil.copytree(whole_run[0], run)
    _legacy(run, checkpoint.find(run))
    code, _, err = run_cli("pretrain", "--resume", run, "--steps", 30, capfd=capfd)
    assert code == 2 and "is a pickle" in err and f"tfcli upgrade {run}" in err
    code, _, err = run_cli("upgrade", run, capfd=capfd)
    assert code == 2 and "refused by the weights_only loader" in err
    assert not (tmp_path / MARKER).exists()


def test_an_old_plain_state_pt_is_upgraded_and_resumes(whole_run, tmp_path, capfd):
    """What tfcli < 0.2 wrote (optimizer, schedule, data, numpy and python RNG state) converts."""
    run = tmp_path / "run"
    shutil.copytree(whole_run[0], run)
    ckpt = checkpoint.find(run)
    torch.save(checkpoint.load_state(ckpt), ckpt / checkpoint.LEGACY_STATE)
    state = checkpoint.load_state(ckpt)
    for f in (checkpoint.STATE, checkpoint.STATE_TENSORS):
        (ckpt / f).unlink()
    assert run_cli("upgrade", run, capfd=capfd)[0] == 0
    again = checkpoint.load_state(ckpt)
    assert again["data"] == state["data"] and torch.equal(again["rng"]["torch"], state["rng"]["torch"])
    assert (
        np.array_equal(again["rng"]["numpy"][1], state["rng"]["numpy"][1])
        and again["rng"]["python"] == state["rng"]["python"]
    )


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_losses(whole_run, tmp_path):
    expected = train_losses(whole_run[0])
    run, rng = tmp_path / "run", random.Random(0)
    first = True
    for _ in range(5):
        args = ["pretrain", "--recipe", whole_run[1], "--out", run] if first else ["pretrain", "--resume", run]
        p = tfcli_process(*args, "--quiet", cwd=tmp_path)
        time.sleep(rng.uniform(2.5, 5.0))  # past start-up, somewhere in the steps and checkpoint writes
        p.send_signal(signal.SIGKILL)
        p.wait()
        first = first and not (run / "config.yaml").exists()
        if (run / checkpoint.CHECKPOINTS / "latest").is_file():
            checkpoint.verify(checkpoint.find(run))  # latest always names a whole checkpoint
    p = tfcli_process(
        *(["pretrain", "--recipe", whole_run[1], "--out", run] if first else ["pretrain", "--resume", run]),
        "--quiet",
        cwd=tmp_path,
    )
    assert p.wait(300) == 0, p.stderr.read()
    assert train_losses(run) == expected  # bit for bit, every step logged once
    assert not (run / checkpoint.LOCK).exists()


@pytest.mark.slow
def test_sigint_saves_at_the_step_boundary_and_the_resumed_run_equals_an_uninterrupted_one(small_text, tmp_path):
    recipe = tiny(tmp_path, small_text, steps=150, ckpt_interval=1000, eval_interval=1000)
    straight = tmp_path / "straight"
    assert tfcli_process("pretrain", "--recipe", recipe, "--out", straight, "--quiet", cwd=tmp_path).wait(300) == 0
    run = tmp_path / "run"
    p = tfcli_process("pretrain", "--recipe", recipe, "--out", run, "--quiet", cwd=tmp_path)
    deadline = time.time() + 120
    while not ((run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 5) and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    assert p.wait(60) == 130
    step = checkpoint.read_meta(checkpoint.find(run))["step"]
    assert 5 <= step < 150  # no checkpoint was due: the one there is the interruption's
    assert (
        f"interrupted at step {step}: a checkpoint was saved; resume with tfcli pretrain --resume {run}"
        in p.stderr.read()
    )
    assert tfcli_process("pretrain", "--resume", run, "--quiet", cwd=tmp_path).wait(300) == 0
    assert train_losses(run) == train_losses(straight)


def test_a_nan_stops_the_run_with_latest_at_the_last_good_checkpoint(whole_run, tmp_path, capfd, monkeypatch):
    from tfcli.engine.trainer import Trainer
    from tfcli.objectives import next_token

    real, real_step, calls = next_token.loss, Trainer._train_step, {"n": 0}

    def counted_step(self):  # training steps only (the memory plan's probes call the loss too)
        calls["n"] += 1
        return real_step(self)

    def poisoned(model, heads, batch):
        value, metrics = real(model, heads, batch)
        if torch.is_grad_enabled() and calls["n"] == 10:  # the 10th training step
            value = value * float("nan")
        return value, metrics

    monkeypatch.setattr(next_token, "loss", poisoned)
    monkeypatch.setattr(Trainer, "_train_step", counted_step)
    run = tmp_path / "run"
    code, _, err = run_cli("pretrain", "--recipe", whole_run[1], "--out", run, "--quiet", capfd=capfd)
    assert code == 2 and err.count("\n") == 1
    assert "step 10: grad_norm nan" in err and "stopped before updating the weights (latest is step-0000008" in err
    ckpt = checkpoint.find(run)
    assert ckpt.name == "step-0000008"
    assert all(torch.isfinite(v).all() for v in checkpoint.load_weights(ckpt).values())
    calls["n"] = 0
    code, _, err = run_cli(
        "pretrain",
        "--recipe",
        whole_run[1],
        "--out",
        tmp_path / "skip",
        "--quiet",
        "--set",
        "train.skip_nonfinite=1",
        capfd=capfd,
    )
    assert code == 0, err
    assert [r for r in read_metrics(tmp_path / "skip") if r.get("split") == "skipped"][0]["step"] == 10


def test_a_full_disk_keeps_latest_valid(whole_run, tmp_path, capfd, monkeypatch):
    """A real small tmpfs where this machine lets the test mount one, else a simulated ENOSPC."""
    import errno

    run = tmp_path / "disk" / "run"
    run.parent.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(run.parent)], capture_output=True
        ).returncode
        == 0
    )
    try:
        if not mounted:
            original, calls = checkpoint.save_file, {"n": 0}

            def failing(tensors, path, *a, **k):
                if path.endswith(checkpoint.WEIGHTS):
                    calls["n"] += 1
                    if calls["n"] == 3:
                        Path(path).write_bytes(b"half a file")
                        raise OSError(errno.ENOSPC, "No space left on device")
                return original(tensors, path, *a, **k)

            monkeypatch.setattr(checkpoint, "save_file", failing)
        code, _, err = run_cli(
            "pretrain",
            "--recipe",
            whole_run[1],
            "--out",
            run,
            "--quiet",
            "--set",
            "train.keep_checkpoints=100",
            capfd=capfd,
        )
        assert (
            code == 2 and err.count("\n") == 1 and "No space left on device" in err and "latest is still step-" in err
        )
        latest = checkpoint.find(run)
        checkpoint.verify(latest)
        assert not list((run / checkpoint.CHECKPOINTS).glob(".*.tmp"))
    finally:
        if mounted:
            subprocess.run(["umount", str(run.parent)])


def test_a_second_writer_is_refused_and_a_dead_writers_lock_is_taken_over(whole_run, tmp_path, capfd):
    import socket

    run = tmp_path / "run"
    shutil.copytree(whole_run[0], run)
    (run / checkpoint.LOCK).write_text(f"{os.getpid()}@{socket.gethostname()}")  # a live process: this one
    before = snapshot(run)
    code, _, err = run_cli("pretrain", "--resume", run, "--steps", 30, "--quiet", capfd=capfd)
    assert code == 2 and f"is being written by process {os.getpid()}" in err
    assert snapshot(run) == before
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / checkpoint.LOCK).write_text(f"{dead.stdout.strip()}@{socket.gethostname()}")
    code, _, err = run_cli("pretrain", "--resume", run, "--steps", 26, "--quiet", capfd=capfd)
    assert code == 0, err
    assert not (run / checkpoint.LOCK).exists()


def test_an_internal_error_is_one_line_naming_the_traceback_file(capfd, monkeypatch, tmp_path):
    from tfcli import recipe as recipes

    monkeypatch.setenv("TFCLI_CACHE", str(tmp_path))
    monkeypatch.setattr(recipes, "load", lambda *a, **k: 1 / 0)
    code, _, err = run_cli("recipes", "show", "gpt-mini", capfd=capfd)
    assert code == 1 and err.count("\n") == 1
    assert "internal error (ZeroDivisionError: division by zero)" in err and str(tmp_path / "last-error.txt") in err
    assert "ZeroDivisionError" in (tmp_path / "last-error.txt").read_text()


def test_run_files_are_replaced_whole_so_another_rank_never_reads_half_of_one(tmp_path):
    """Resuming on two processes, rank 1 read run.json while rank 0 wrote it again, and stopped with
    "run.json: unreadable" (seen once in the suite): run.json and config.yaml are written to a
    temporary file and moved over the old one, so a reader holds the old text or the new."""
    import json

    from tfcli import recipe as recipes
    from tfcli.engine.checkpoint import write_atomic

    path = tmp_path / "run.json"
    path.write_text('{"from": "a"}')
    with open(path) as reader:  # opened before the write, read after it
        write_atomic(path, '{"from": "b"}')
        assert json.load(reader) == {"from": "a"}
    assert json.loads(path.read_text()) == {"from": "b"}
    config = tmp_path / "config.yaml"
    recipes.save(recipes.load("gpt-mini"), config)
    with open(config) as reader:
        recipes.save(recipes.load("llama-mini"), config)
        assert "family: gpt" in reader.read()
    assert recipes.load_resolved(config).model.family == "llama"
    assert not list(tmp_path.glob(".*.tmp"))
