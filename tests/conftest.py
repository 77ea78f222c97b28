"""Shared fixtures: tiny recipes and real data from ../shared/data, sized for 2 CPU cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner


def one_core_per_worker() -> None:
    """Under pytest-xdist (`make test` runs a worker per core), each worker keeps to cores of its own,
    so that two workers never wait on each other's threads: a run inside a test sees its share of the
    usable cores and takes that many threads, and the processes a test starts inherit the share."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if count == 1 or not cores:
        torch.set_num_threads(2)
    elif count <= len(cores):
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) :: count])
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    else:  # more workers than cores
        torch.set_num_threads(1)


one_core_per_worker()

# The files that take longest (measured on 2 cores, 2026-12-02) run first: with a worker per core
# and a file at a time (--dist loadfile), the longest start at once and the short ones fill in
# after, so that the workers finish together instead of one waiting on a long file started last.
LONGEST_FIRST = [
    "test_readme",
    "test_ddp",
    "test_compile",
    "test_moe",
    "test_smollm2",
    "test_generic",
    "test_bench_harness",
    "test_failures",
    "test_vlm",  # the fast tier's longest file
]


def pytest_configure(config):
    """tfcli's bytecode compiled once, before the workers start: the suite starts some 170 Python
    processes (torchrun's, compare's cells, documented commands), and where PYTHONDONTWRITEBYTECODE
    is set (this project's machines) each compiled the package from its source again, 0.5 s a
    process. Reading bytecode is still allowed there; only writing it is off."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        import compileall

        compileall.compile_dir(REPO / "tfcli", quiet=2)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file keeps its order


REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TFCLI_SHARED_DATA", REPO.parent / "shared" / "data"))
# where the tests' runs train: cpu, or TFCLI_TEST_DEVICE=cuda on a GPU machine (the same tests, the CUDA path)
DEVICE = os.environ.get("TFCLI_TEST_DEVICE", "cpu")


from tfcli.engine.runtime import busy_cores as measured_busy_cores  # noqa: E402, F401  (the real one, for its own test)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Runs in the tests choose their CPU threads as on a quiet machine (the suite's own process is
    the busy one), so that thread counts, and with them floating-point sums, are the same every time."""
    from tfcli.engine import runtime

    monkeypatch.setattr(runtime, "busy_cores", lambda seconds=0.2: 0.0)


@pytest.fixture(autouse=True)
def notes_shown():
    """Each test starts with notes shown, as each command does: a run called in the test process with
    quiet on (the driver's display.configure) would otherwise silence the notes of the tests after it
    in the same worker, which some tests read."""
    from tfcli import display

    display.configure(True)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"{SHARED} is missing: tests need ../shared/data beside the checkout")
    return SHARED


@pytest.fixture(scope="session")
def small_text(tmp_path_factory, shared_data) -> Path:
    """The first 60k characters of Tiny Shakespeare."""
    path = tmp_path_factory.mktemp("text") / "shakespeare_head.txt"
    path.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:60_000])
    return path


@pytest.fixture(scope="session")
def mnli_dir(tmp_path_factory, shared_data) -> Path:
    """A small slice of ../shared/data/mnli: 300 train rows, 30 of each dev split."""
    out = tmp_path_factory.mktemp("mnli")
    for split, n in (("train", 300), ("dev_matched", 30), ("dev_mismatched", 30)):
        lines = (shared_data / "mnli" / f"{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def tiny_gpt_recipe(data: Path, **sections) -> dict:
    """A GPT recipe small enough to train for a few steps in a second or two."""
    raw = {
        "name": "tiny-gpt",
        "objective": "clm",
        "model": {"family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
        "tokenizer": {"kind": "char"},
        "data": {"source": str(data), "val_fraction": 0.1, "seq_len": 32},
        "optim": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
        "schedule": {"warmup_steps": 5, "decay": "cosine", "min_lr": 3e-4},
        "train": {
            "steps": 20,
            "batch_size": 8,
            "log_interval": 1,
            "eval_interval": 10,
            "eval_batches": 4,
            "ckpt_interval": 10,
            "keep_checkpoints": 5,
            "seed": 7,
            "device": DEVICE,
        },
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values) if isinstance(values, dict) else raw.__setitem__(section, values)
    return raw


def tiny_bert_recipe(data, objective: str = "mlm", **sections) -> dict:
    """A two-layer BERT on `data` with a small trained WordPiece vocabulary."""
    raw = {
        "name": f"tiny-{objective}",
        "objective": objective,
        "model": {
            "family": "bert",
            "n_layer": 2,
            "n_head": 2,
            "d_model": 48,
            "d_ff": 96,
            "max_seq_len": 64,
            "dropout": 0.0,
        },
        "tokenizer": {"kind": "wordpiece", "vocab_size": 400, "lowercase": True},
        "data": {"source": str(data), "val_fraction": 0.1, "seq_len": 64},
        objective: {"documents": "paragraphs"},
        "optim": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.01},
        "schedule": {"warmup_steps": 3, "decay": "linear", "min_lr": 0.0},
        "train": {
            "steps": 30,
            "batch_size": 16,
            "log_interval": 5,
            "eval_interval": 30,
            "eval_batches": 2,
            "ckpt_interval": 30,
            "seed": 3,
            "device": DEVICE,
        },
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe dict to a YAML file and return its path."""

    def write(raw: dict, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return path

    return write


def write_jsonl(path: Path, rows) -> str:
    """Rows as JSON Lines at `path`; the path as the CLI takes it."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if m.get("split") == "train"}


def invoke(*args, input: str = None):
    """Run the CLI in-process (with `input` on its standard input); the Result has exit_code and output."""
    from tfcli.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def set_args(overrides: dict) -> list[str]:
    """{'a.b': v} -> ['--set', 'a.b=v', ...] (lists as JSON)."""
    out = []
    for k, v in overrides.items():
        out += ["--set", f"{k}={json.dumps(v) if isinstance(v, (list, tuple)) else v}"]
    return out


def pretrained_run(
    tmp: Path, text: Path, objective: str, model: dict, tokenizer: dict = None, steps: int = 2, **sections
) -> Path:
    """A few steps of pretraining of a tiny text model (byte-level BPE of 400 tokens by default)."""
    (tmp / "text.txt").write_text(text.read_text()[:30_000])
    raw = {
        "name": f"tiny-{objective}",
        "objective": objective,
        "model": model,
        "tokenizer": tokenizer or {"kind": "bpe", "vocab_size": 400, "train_chars": 30_000},
        "data": {"source": str(tmp / "text.txt"), "val_fraction": 0.1, "seq_len": 48},
        "train": {
            "steps": steps,
            "batch_size": 4,
            "log_interval": 1,
            "eval_interval": steps,
            "eval_batches": 1,
            "ckpt_interval": steps,
            "device": DEVICE,
        },
        **sections,
    }
    (tmp / "r.yaml").write_text(yaml.safe_dump(raw))
    result = invoke("pretrain", "--recipe", tmp / "r.yaml", "--out", tmp / "run", "--quiet")
    assert result.exit_code == 0, result.output
    return tmp / "run"


TINY_VIT = {
    "image_size": 16,
    "patch_size": 4,
    "n_layer": 2,
    "n_head": 2,
    "d_model": 32,
    "d_ff": 64,
    "decoder_d_model": 32,
    "decoder_n_layer": 1,
    "decoder_n_head": 2,
    "decoder_d_ff": 64,
}


def tiny_npz(path: Path, n: int = 96, size: int = 16) -> Path:
    """Smooth random gradients, tinted by class (0 red, 1 blue), as x_train/y_train/x_test/y_test."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size

    def make(k):
        imgs, labels = [], []
        for i in range(k):
            c = rng.uniform(0, 1, (3, 3))
            img = c[:, 0, None, None] + c[:, 1, None, None] * xx + c[:, 2, None, None] * yy
            img[2 * (i % 2)] += 1.0  # class 0 reddish, class 1 bluish
            imgs.append((np.clip(img / 3.5, 0, 1).transpose(1, 2, 0) * 255).astype(np.uint8))
            labels.append(i % 2)
        return np.stack(imgs), np.array(labels)

    xtr, ytr = make(n)
    xte, yte = make(16)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte, class_names=np.array(["a", "b"]))
    return path


def mae_overrides(npz: Path, **extra) -> dict:
    o = {f"model.{k}": v for k, v in TINY_VIT.items()}
    o.update(
        {
            "data.source": str(npz),
            "train.batch_size": 16,
            "train.steps": 4,
            "train.log_interval": 2,
            "train.eval_interval": 2,
            "train.eval_batches": 1,
            "train.ckpt_interval": 2,
            "schedule.warmup_steps": 1,
            "train.threads": 1,  # a worker has one core: 2 threads on it took these runs' files 72 s, not 13 s
            "mae.crop_scale": [0.5, 1.0],
        }
    )
    o.update(extra)
    return o


def save_hf_bert(path: Path, shared: Path, arch: str = "BertModel") -> Path:
    """A tiny random transformers BERT (`arch`: BertModel, BertForMaskedLM, ...) with BERT's real
    uncased vocabulary, saved as a Hugging Face directory."""
    import shutil

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    getattr(transformers, arch)(config).save_pretrained(path)
    shutil.copy(shared / "tokenizers" / "bert-base-uncased" / "vocab.txt", path / "vocab.txt")
    return path


@pytest.fixture(scope="session")
def hf_bert(tmp_path_factory, shared_data) -> Path:
    """A tiny BertModel (no pretraining heads), as sentence-transformers models are saved."""
    return save_hf_bert(tmp_path_factory.mktemp("hf-bert"), shared_data)


@pytest.fixture(scope="session")
def hf_bert_mlm(tmp_path_factory, shared_data) -> Path:
    """A tiny BertForMaskedLM: a BERT with its masked-LM head."""
    return save_hf_bert(tmp_path_factory.mktemp("hf-bert-mlm"), shared_data, "BertForMaskedLM")


def hf_llama_dir(path: Path, max_positions: int = 128, hidden: int = 32, inner: int = 64) -> Path:
    """A tiny random transformers Llama (GPT-2's tokenizer, spread weights) saved as a Hugging Face
    directory: what adapter export and benchmark parity compare tfcli against."""
    import transformers

    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_llama import spread_

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    spread_(model)
    model.save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    return path


TEXTS = ("a short one", "and then a rather longer sentence than the first")


def transformers_runs_the_export(out: Path) -> None:
    """An export as a user takes it: the model by its config's architecture, no weight left out, its
    tokenizer (or processor) from the same folder, and a padded batch of two through both: the short
    row's outputs equal its outputs alone (the padding is masked)."""
    import transformers
    from PIL import Image

    from tfcli.hf.convert import auto_class

    arch = json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, auto_class(arch)).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    model.eval()
    images = [Image.fromarray(np.full((40, 56, 3), 60 * i, np.uint8)) for i in (1, 3)]
    if auto_class(arch) == "AutoModelForImageTextToText":
        processor = transformers.AutoProcessor.from_pretrained(out)
        texts = [processor.image_token + t for t in TEXTS]
        batch = processor(images=images, text=texts, padding=True, return_tensors="pt")
        alone = processor(images=images[:1], text=texts[:1], return_tensors="pt")
    elif "Image" in auto_class(arch) or "ViT" in arch:
        processor = transformers.AutoImageProcessor.from_pretrained(out)
        batch, alone = processor(images, return_tensors="pt"), processor(images[:1], return_tensors="pt")
    else:
        tok = transformers.AutoTokenizer.from_pretrained(out)
        cut = dict(truncation=True, max_length=16, return_tensors="pt")  # within the tiniest context
        batch, alone = tok(list(TEXTS), padding=True, **cut), tok(TEXTS[:1], **cut)
        assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # the first row is padded
        if auto_class(arch) == "AutoModelForSeq2SeqLM":
            for inputs in (batch, alone):
                inputs["decoder_input_ids"] = torch.zeros(len(inputs["input_ids"]), 1, dtype=torch.long)
    with torch.no_grad():
        together, single = model(**batch), model(**alone)
    name = next(k for k in ("logits", "last_hidden_state", "pooler_output") if getattr(single, k, None) is not None)
    got, want = getattr(together, name)[0], getattr(single, name)[0]
    if got.dim() > 1 and got.shape != want.shape:  # per-token outputs: the short row's own positions
        got = got[: want.shape[0]]
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), (arch, (got - want).abs().max())


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> bool:
    """fp32 results whose summation order may differ (another CPU's kernels, another thread count):
    within `tol` of the larger of 1 and the compared values' own size, so the test passes on any CPU
    of this kind (an absolute 1e-5 on logits of size 3 failed at 1.04e-5 on another EPYC)."""
    return (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def near(got: float, want: float, tol: float = 1e-5) -> bool:
    """close() for two numbers (losses of runs whose sums are split another way)."""
    return abs(got - want) <= tol * max(1.0, abs(want))
