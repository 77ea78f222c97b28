"""`tfcli pretrain`: wire a recipe's data, tokenizer, model and objective into the trainer."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import checkpoint, objectives
from . import recipe as recipes
from .data.sources import load_documents
from .data.tokenizers import TextTokenizer, build_tokenizer
from .display import console
from .errors import UserError
from .models import build_model
from .recipe import Recipe
from .train import Runtime, fit, setup_runtime, teardown


def check_family(recipe: Recipe, objective) -> None:
    if recipe.model.family != objective.FAMILY:
        raise UserError(f"objective {recipe.objective!r} trains a {objective.FAMILY!r} model, but recipe "
                        f"{recipe.name!r} describes a {recipe.model.family!r} model")


def pretrain(recipe: Recipe, out: Optional[Path] = None, resume: Optional[Path] = None,
             quiet: bool = False) -> Path:
    """Train from scratch (or continue `resume`) and return the run directory."""
    objective = objectives.get(recipe.objective)
    check_family(recipe, objective)
    rt = setup_runtime(recipe.train.device, recipe.train.threads)
    try:
        ckpt = checkpoint.find(resume) if resume else None
        docs, tokenizer = None, None
        if getattr(objective, "TEXT", True):  # image objectives (MAE) load their own data in prepare()
            docs = load_docs(recipe)
            tokenizer = TextTokenizer.from_run(resume) if resume else shared_tokenizer(recipe, objective, docs, rt)
            fill_vocab(recipe, tokenizer)
            if recipe.data.seq_len > recipe.model.max_seq_len:
                raise UserError(f"data.seq_len ({recipe.data.seq_len}) exceeds model.max_seq_len "
                                f"({recipe.model.max_seq_len})")
        torch.manual_seed(recipe.train.seed)
        model = build_model(recipe.model)
        with main_first(rt):
            prepared = objective.prepare(recipe, tokenizer, docs, model, rt.rank, rt.world_size)
        run_dir = Path(resume) if resume else None
        run_dir = open_run_dir(recipe, out, rt, tokenizer, existing=run_dir)
        if rt.is_main:
            if not quiet:
                n = sum(p.numel() for p in model.parameters())
                console.print(f"[bold]{recipe.name}[/]: {recipe.objective} on a {n / 1e6:.2f}M-parameter "
                              f"{recipe.model.family}, run directory [green]{run_dir}[/]"
                              + (f" (resuming from {ckpt.name})" if ckpt else ""))
        evaluation = prepared.evaluation(run_dir) if prepared.evaluation else None
        fit(model, prepared, recipe, run_dir, rt, resume_from=ckpt, evaluation=evaluation, quiet=quiet)
        return run_dir
    finally:
        teardown(rt)


def load_docs(recipe: Recipe) -> dict:
    d = recipe.data
    return {"train": load_documents(d.source, d.text_field),
            "val": load_documents(d.val_source, d.text_field) if d.val_source else None}


def train_text_sample(docs, max_chars: int):
    """The first `max_chars` characters of the training documents, for learning a vocabulary."""
    total = 0
    for row in docs["train"]:
        if total >= max_chars:
            return
        text = row["text"][: max_chars - total]
        total += len(text)
        yield text


def shared_tokenizer(recipe: Recipe, objective, docs, rt: Runtime) -> TextTokenizer:
    """Rank 0 trains (or loads) the tokenizer; under DDP the others receive the same one."""
    tok = None
    if rt.is_main:
        t = recipe.tokenizer
        tok = build_tokenizer(t.kind, vocab_size=t.vocab_size, path=t.path, lowercase=t.lowercase,
                              texts=train_text_sample(docs, t.train_chars), specials=objective.SPECIAL_TOKENS)
    if rt.distributed:
        from tokenizers import Tokenizer

        text = _broadcast(rt, tok.tok.to_str() if tok else None)
        tok = TextTokenizer(Tokenizer.from_str(text))
    return tok


def fill_vocab(recipe: Recipe, tokenizer: TextTokenizer) -> None:
    if recipe.model.vocab_size <= 0:
        recipe.model.vocab_size = tokenizer.vocab_size
    elif recipe.model.vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size ({recipe.model.vocab_size}) is smaller than the tokenizer's "
                        f"({tokenizer.vocab_size})")


def open_run_dir(recipe: Recipe, out: Optional[Path], rt: Runtime, tokenizer: Optional[TextTokenizer] = None,
                 existing: Optional[Path] = None) -> Path:
    """Create the run directory (or reuse `existing`, when resuming) and write the resolved recipe and
    the tokenizer into it. Rank 0 writes; every rank gets the same path. Called only once the data,
    tokenizer and model are known to be good, so bad input never leaves a run directory behind."""
    run_dir = existing or _broadcast(rt, new_run_dir(recipe, out))
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        recipes.save(recipe, run_dir / "config.yaml")
        if tokenizer is not None:
            tokenizer.save(run_dir)
    return run_dir


def new_run_dir(recipe: Recipe, out: Optional[Path]) -> Path:
    if out is not None:
        out = Path(out)
        if (out / checkpoint.CHECKPOINTS).exists():
            raise UserError(f"{out} already holds a run; use --resume {out} or another --out")
        return out
    return Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"


@contextlib.contextmanager
def main_first(rt: Runtime):
    """Rank 0 runs the block first (e.g. fills the tokenization cache), then the others."""
    if rt.distributed and not rt.is_main:
        dist.barrier()
    yield
    if rt.distributed and rt.is_main:
        dist.barrier()


def _broadcast(rt: Runtime, value):
    if not rt.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]

