"""Sentence-pair classification on a BERT encoder: [CLS] a [SEP] b [SEP] -> one of N labels.

Generic over the task (MNLI is a `PairTask`: a loader and a label set). The backbone comes from a
tfcli BERT run, a Hugging Face BERT directory, or a fresh initialisation (the from-scratch
baseline). Batches are length-grouped and padded only to their own longest row. Features: the
pooled [CLS] (`cls`, transformers' BertForSequenceClassification exactly), the mean of the token
outputs, or the [CLS] vectors of the last four layers summed or concatenated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from ..objectives.mlm_nsp import SPECIAL_TOKENS, special_ids


@dataclass
class Rows:
    """A split's usable (a, b, label id) rows, and how many rows were skipped as unusable."""

    rows: list
    skipped: int = 0


@dataclass
class PairTask:
    name: str
    labels: tuple[str, ...]
    train_split: str
    eval_splits: tuple[str, ...]
    load_split: Callable[[str, str], Rows]  # (data, split) -> Rows
    best_key: str  # the metric that picks the best checkpoint


# --- encoding and batching --------------------------------------------------------------------

def encode(tokenizer, rows: list, max_length: int) -> list[tuple[np.ndarray, int, int]]:
    """(a, b, label) rows -> (ids of [CLS] a [SEP] b [SEP], length of "[CLS] a [SEP]", label),
    the longer of a and b trimmed first until the pair fits max_length."""
    ids = special_ids(tokenizer)
    a_ids = tokenizer.encode_batch([r[0] for r in rows])
    b_ids = tokenizer.encode_batch([r[1] for r in rows])
    out = []
    for a, b, row in zip(a_ids, b_ids, rows):
        la, lb = len(a), len(b)
        while la + lb > max_length - 3:
            la, lb = (la - 1, lb) if la > lb else (la, lb - 1)
        seq = np.array([ids["cls"], *a[:la], ids["sep"], *b[:lb], ids["sep"]], dtype=np.int64)
        out.append((seq, la + 2, row[2]))
    return out


def collate(examples: list, pad_id: int) -> dict[str, Tensor]:
    """Pad to the longest row of this batch only (dynamic padding)."""
    T = max(len(e[0]) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    types = torch.zeros((len(examples), T), dtype=torch.long)
    mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (seq, n_a, _) in enumerate(examples):
        ids[i, : len(seq)] = torch.from_numpy(seq)
        types[i, n_a: len(seq)] = 1
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
            "labels": torch.tensor([e[2] for e in examples])}


class LengthGroupedBatches:
    """Resumable training batches: each epoch a random order (from seed, epoch), cut into
    mega-batches of 50 batches sorted by length, so a batch holds rows of similar length
    (transformers' LengthGroupedSampler); the batches themselves come in random order."""

    def __init__(self, examples: list, pad_id: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.examples, self.pad_id = examples, pad_id
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.lengths = np.array([len(e[0]) for e in examples])
        self.epoch, self.index = 0, 0
        self._cached: Optional[tuple[int, list]] = None

    def _batches(self) -> list:
        if self._cached is None or self._cached[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            order, size = rng.permutation(len(self.examples)), self.batch_size * self.world_size
            mega = size * 50
            order = np.concatenate([m[np.argsort(-self.lengths[m], kind="stable")]
                                    for m in np.array_split(order, max(1, math.ceil(len(order) / mega)))])
            batches = [order[i: i + size] for i in range(0, len(order) - size + 1, size)] or [order]
            self._cached = (self.epoch, [batches[i] for i in rng.permutation(len(batches))])
        return self._cached[1]

    def next_batch(self) -> dict[str, Tensor]:
        batches = self._batches()
        if self.index >= len(batches):
            self.epoch, self.index = self.epoch + 1, 0
            batches = self._batches()
        picked = batches[self.index][self.rank * self.batch_size: (self.rank + 1) * self.batch_size]
        self.index += 1
        return collate([self.examples[i] for i in picked], self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def sequential_batches(examples: list, pad_id: int, batch_size: int):
    """Evaluation batches in length order (least padding), each row once."""
    order = np.argsort([len(e[0]) for e in examples], kind="stable")
    for i in range(0, len(order), batch_size):
        yield collate([examples[j] for j in order[i: i + batch_size]], pad_id)


# --- features, head, loss ---------------------------------------------------------------------

def feature_dim(d_model: int, pooling: str) -> int:
    return 4 * d_model if pooling == "last4-concat" else d_model


def check_pooling(model, pooling: str) -> None:
    if pooling.startswith("last4") and model.cfg.n_layer < 4:
        raise UserError(f"--pooling {pooling} needs at least 4 layers; this model has {model.cfg.n_layer}")


def features(model, batch: dict[str, Tensor], pooling: str) -> Tensor:
    """(B, T) inputs -> (B, F) features for the classifier."""
    args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    if pooling == "cls":
        return model.pool(model(*args))  # BERT's pooler: tanh(dense([CLS]))
    if pooling == "mean":
        hidden, m = model(*args), batch["attention_mask"][..., None].to(torch.float32)  # (B, T, D), (B, T, 1)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)
    cls = [h[:, 0] for h in model(*args, all_layers=True)[-4:]]  # 4 x (B, D)
    return torch.stack(cls).sum(0) if pooling == "last4-sum" else torch.cat(cls, dim=-1)


def make_loss(pooling: str, dropout: float):
    """Cross-entropy of the classifier on dropout(features); metrics loss and acc."""
    def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        feats = F.dropout(features(model, batch, pooling), dropout, training=model.training)
        logits = heads["classifier"](feats)  # (B, n_labels)
        value = F.cross_entropy(logits.float(), batch["labels"])
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return value, {"loss": value.detach(), "acc": acc}
    return loss


def build_head(d_model: int, pooling: str, n_labels: int) -> nn.ModuleDict:
    head = nn.Linear(feature_dim(d_model, pooling), n_labels)
    nn.init.normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    return nn.ModuleDict({"classifier": head})


@torch.no_grad()
def predict(model, heads, examples: list, pad_id: int, pooling: str, batch_size: int = 64,
            device: torch.device = torch.device("cpu")) -> tuple[np.ndarray, np.ndarray]:
    """Class probabilities (N, n_labels) in the order of `examples`, and the gold labels."""
    was = model.training
    model.eval()
    order = np.argsort([len(e[0]) for e in examples], kind="stable")
    probs = np.zeros((len(examples), heads["classifier"].out_features), dtype=np.float32)
    for i in range(0, len(order), batch_size):
        idx = order[i: i + batch_size]
        batch = {k: v.to(device) for k, v in collate([examples[j] for j in idx], pad_id).items()}
        probs[idx] = torch.softmax(heads["classifier"](features(model, batch, pooling)).float(), -1).cpu().numpy()
    model.train(was)
    return probs, np.array([e[2] for e in examples])


# --- backbone ---------------------------------------------------------------------------------

def load_backbone(recipe, from_: Optional[Path]):
    """(model, tokenizer) from a tfcli BERT run, a Hugging Face BERT directory, or fresh from the
    recipe; recipe.model is replaced by the backbone's config so that the run describes itself."""
    from ..data.tokenizers import build_tokenizer, load_tokenizer_files
    from ..hf import bert as hf_bert
    from ..models import build_model

    if from_ is not None and not Path(from_).exists():
        raise UserError(f"--from {from_}: not found")
    if from_ is not None and hf_bert.is_hf_dir(from_):
        cfg, model_sd, _, _ = hf_bert.read_hf_dir(Path(from_))
        model = build_model(cfg)
        model.load_state_dict(model_sd)
        tokenizer = load_tokenizer_files(str(from_), SPECIAL_TOKENS)
        tokenizer.tok.no_padding()
        tokenizer.tok.no_truncation()
    elif from_ is not None:
        from ..inference import load_run

        loaded = load_run(Path(from_))
        if loaded.recipe.model.family != "bert":
            raise UserError(f"--from {from_}: holds a {loaded.recipe.model.family!r} model; this task needs a BERT")
        model, tokenizer, cfg = loaded.model.train(), loaded.tokenizer, loaded.recipe.model
    else:
        t = recipe.tokenizer
        if t.kind != "file":
            raise UserError("without --from, set tokenizer.kind: file and tokenizer.path to a BERT vocabulary")
        tokenizer = build_tokenizer("file", vocab_size=t.vocab_size, path=t.path, lowercase=t.lowercase,
                                    texts=[], specials=SPECIAL_TOKENS)
        cfg = recipe.model
        cfg.vocab_size = cfg.vocab_size or tokenizer.vocab_size
        torch.manual_seed(recipe.train.seed)
        model = build_model(cfg)
    recipe.model = cfg
    return model, tokenizer


# --- finetune and evaluate --------------------------------------------------------------------

def _load_rows(task: PairTask, data: str, split: str, limit: int, quiet: bool) -> list:
    loaded = task.load_split(data, split)
    rows = loaded.rows[:limit] if limit > 0 else loaded.rows
    if not quiet:
        from ..display import console

        console.print(f"{task.name} {split}: {len(rows):,} rows" + (f" (first {limit:,})" if limit > 0 else "")
                      + f", {loaded.skipped:,} skipped (label -1 or missing fields)")
    if not rows:
        raise UserError(f"{task.name} {split}: no usable rows")
    return rows


def _optimizer(model, heads, recipe, device):
    """AdamW with the head at task.head_lr (0: optim.lr); --train head leaves the backbone frozen."""
    from ..train import build_optimizer

    wd = recipe.optim.weight_decay
    head_lr = recipe.task.head_lr or recipe.optim.lr
    groups = [{"params": [p for p in heads.parameters() if p.dim() >= 2], "weight_decay": wd, "lr": head_lr},
              {"params": [p for p in heads.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": head_lr}]
    if recipe.task.train == "all":
        params = list(model.parameters())
        groups += [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        model.requires_grad_(False)
    return build_optimizer(nn.ModuleDict({"heads": heads}), recipe, device, groups)


def finetune(task: PairTask, recipe, from_: Optional[Path] = None, out: Optional[Path] = None,
             quiet: bool = False) -> Path:
    """Train backbone (or only the head) + classifier; evaluate on task.eval_splits as it goes
    (the best checkpoint is kept), then report the best checkpoint on the full eval splits."""
    from ..objectives import Prepared
    from ..pretrain import open_run_dir
    from ..train import Evaluation, fit, setup_runtime, teardown

    tc, t = recipe.train, recipe.task
    rt = setup_runtime(tc.device, tc.threads)
    try:
        model, tokenizer = load_backbone(recipe, from_)
        check_pooling(model, t.pooling)
        t.max_length = min(t.max_length, model.cfg.max_seq_len)  # no longer than the model's positions
        pad = special_ids(tokenizer)["pad"]
        train_ex = encode(tokenizer, _load_rows(task, t.data, task.train_split, t.limit, quiet), t.max_length)
        evals = {s: encode(tokenizer, _load_rows(task, t.data, s, t.eval_limit, quiet), t.max_length)
                 for s in task.eval_splits}
        if t.epochs > 0:
            tc.steps = max(1, math.ceil(t.epochs * len(train_ex) / (tc.batch_size * tc.grad_accum * rt.world_size)))
        if t.warmup_fraction > 0:
            recipe.schedule.warmup_steps = max(1, round(t.warmup_fraction * tc.steps))
        heads = build_head(model.cfg.d_model, t.pooling, len(task.labels))
        first = task.eval_splits[0]

        def run_eval(module) -> dict[str, float]:
            out = {}
            for split, ex in evals.items():
                probs, gold = predict(module.model, module.heads, ex, pad, t.pooling, tc.batch_size, rt.device)
                out[f"{split}_acc"] = float((probs.argmax(1) == gold).mean())
            return out

        mean_len = float(np.mean([len(e[0]) for e in train_ex]))
        n_params = sum(p.numel() for p in model.parameters())
        # embedding tables are lookups, not matrix products: they do not count towards MFU
        n_matmul = n_params - sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                                  for p in m.parameters())
        prepared = Prepared(
            train=LengthGroupedBatches(train_ex, pad, tc.batch_size, tc.seed, rt.rank, rt.world_size),
            val=lambda: (b for b, _ in zip(sequential_batches(evals[first], pad, tc.batch_size), range(tc.eval_batches))),
            loss=make_loss(t.pooling, model.cfg.dropout), items_per_batch=lambda b: int(b["labels"].numel()),
            flops_per_item=6.0 * n_matmul * mean_len, heads=heads, item_name="ex")
        run_dir = open_run_dir(recipe, out, rt, tokenizer)
        if not quiet:
            from ..display import console

            console.print(f"[bold]{recipe.name}[/]: {task.name} on a {n_params / 1e6:.2f}M-parameter bert from "
                          f"{from_ or 'scratch'}, {tc.steps} steps, run directory [green]{run_dir}[/]")
        fit(model, prepared, recipe, run_dir, rt, evaluation=Evaluation(run_eval, task.best_key),
            optimizer=_optimizer(model, heads, recipe, rt.device), quiet=quiet)
    finally:
        teardown(rt)
    if rt.is_main:
        _report(task, run_dir, "best", t.data, 0, quiet)  # the full splits, whatever eval_limit was
    return run_dir


def _report(task: PairTask, path: Path, which: str, data: Optional[str], limit: int, quiet: bool = False) -> dict:
    """Full evaluation of a checkpoint on the task's eval splits (data None: the run's own task.data);
    printed and saved as eval.json beside the checkpoints."""
    import json

    from ..checkpoint import run_dir_of
    from ..display import console
    from .classification_report import metrics, tables

    model, heads, recipe, tokenizer, ckpt = _load_classifier(path, which)
    data = recipe.task.data if data is None else data
    results = {}
    for split in task.eval_splits:
        ex = encode(tokenizer, _load_rows(task, data, split, limit, True), recipe.task.max_length)
        probs, gold = predict(model, heads, ex, special_ids(tokenizer)["pad"], recipe.task.pooling)
        results[split] = metrics(probs.argmax(1), gold, task.labels)
        if not quiet:
            for table in tables(split, results[split], task.labels):
                console.print(table)
    (run_dir_of(ckpt) / "eval.json").write_text(json.dumps({"checkpoint": str(ckpt), **results}, indent=1))
    return results


def _load_classifier(path: Path, which: str = "best"):
    from ..inference import load_run

    loaded = load_run(Path(path), which)
    if "classifier.weight" not in loaded.heads:
        raise UserError(f"{loaded.checkpoint} has no classifier head; is it a finetuned run?")
    heads = build_head(loaded.model.cfg.d_model, loaded.recipe.task.pooling, loaded.heads["classifier.weight"].shape[0])
    heads.load_state_dict({k: v for k, v in loaded.heads.items() if k.startswith("classifier.")})
    return loaded.model, heads.eval(), loaded.recipe, loaded.tokenizer, loaded.checkpoint


def evaluate(task: PairTask, checkpoint: Path, options) -> None:
    """`tfcli eval TASK`: one pair's label probabilities, or the full report on the eval splits."""
    from ..display import console

    if (options.premise is None) != (options.hypothesis is None):
        raise UserError("give both --premise and --hypothesis, or neither")
    if options.premise is not None:
        model, heads, recipe, tokenizer, _ = _load_classifier(checkpoint)
        ex = encode(tokenizer, [(options.premise, options.hypothesis, 0)], recipe.task.max_length)
        probs, _ = predict(model, heads, ex, special_ids(tokenizer)["pad"], recipe.task.pooling)
        for name, p in zip(task.labels, probs[0]):
            console.print(f"{name:>14}  {p:.4f}")
        return
    _report(task, checkpoint, "best", options.data, options.limit or 0)
