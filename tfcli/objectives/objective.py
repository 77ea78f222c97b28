"""The base classes of the pretraining objectives.

`Objective` gives every objective the held-out evaluation of `tfcli eval`; `TextObjective` adds what
the text objectives share: their documents' sources, the token stores made from them, and a
sample of the text for training a tokenizer. An objective module then defines only its data
source, heads and loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..data.documents import open_source
from ..data.sampler import sequential_batches
from ..data.store import TokenStore, cached_store, is_store
from ..display import console, counted, phase
from ..engine.evaluate import held_out_metrics, metrics_table
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..plugin import EvalOptions, Plugin


class Objective(Plugin):
    kind = "objective"

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """Held-out metrics of a pretraining run: its own validation split, or all of options.data."""
        if options.data:
            recipe = replace(recipe, data=replace(recipe.data, source=options.data, val_source=options.data))
        if options.batches:
            recipe = replace(recipe, train=replace(recipe.train, eval_batches=options.batches))
        job = self.setup(recipe, backbone)
        job.heads.load_state_dict(backbone.heads)
        module = ObjectiveModule(backbone.model, job.heads, job.loss).to(self.rt.device)
        t = recipe.train
        batches = sequential_batches(job.val, t.batch_size, t.seed, t.eval_batches) if job.val is not None else ()
        total = min(t.eval_batches, math.ceil(job.val.epoch_size(0) / t.batch_size)) if job.val is not None else 0
        with phase("evaluating", total, "batches") as advance:
            metrics = held_out_metrics(module, counted(batches, advance), self.rt.device, t.precision)
        if not metrics:
            raise UserError("no held-out batches to evaluate on (data shorter than one block?)")
        metrics = job.held_out_metrics(metrics)
        console.print(metrics_table(f"{backbone.checkpoint}", metrics))
        return metrics


class TextObjective(Objective):
    """An objective over documents of text (data.source, data.val_source), tokenized once into a
    store on disk (tfcli.data.store) that every run over the same data and tokenizer shares."""

    def sources(self, recipe) -> dict:
        """{'train': DocumentSource or a prepared store's path, 'val': the same or None}."""
        d = recipe.data
        return {
            "train": _source(d.source, d.text_field),
            "val": _source(d.val_source, d.text_field) if d.val_source else None,
        }

    def stores(self, recipe, tokenizer, mode: str = "text", eos: bool = True) -> tuple:
        """(training store, held-out store or None) of the recipe's data through `tokenizer`."""
        src = self.sources(recipe)
        quiet = self.quiet or not self.rt.is_main
        return tuple(
            None if s is None else open_store(s, tokenizer, mode, eos, recipe.data.workers, quiet)
            for s in (src["train"], src["val"])
        )

    def streams(self, recipe, backbone, block_len: int, make_batch) -> tuple:
        """(training stream, held-out blocks) of the documents read as a stream (data.streaming)."""
        from ..data.streaming import stream_sources

        train = self.sources(recipe)["train"]
        if isinstance(train, str):
            raise UserError(f"data.streaming: {train} is a prepared store; train on it without streaming")
        return stream_sources(train, backbone.tokenizer, block_len, recipe.data, recipe.train, make_batch)

    def tokenizer_key(self, recipe) -> str:
        train = self.sources(recipe)["train"]
        return f"{train if isinstance(train, str) else train.fingerprint()}|{recipe.tokenizer.train_chars}"

    def resolve(self, recipe, backbone):
        """Continued pretraining of a model with fewer positions than the recipe's blocks: blocks of
        the model's length (said in one line) instead of an error about a recipe the user did not pick."""
        recipe = super().resolve(recipe, backbone)
        limit = getattr(backbone.cfg, "max_seq_len", recipe.data.seq_len)
        if backbone.source != "scratch" and recipe.data.seq_len > limit:
            if self.rt.is_main and not self.quiet:
                console.print(
                    f"[yellow]note:[/] {backbone.source} reads at most {limit} positions: data.seq_len "
                    f"{recipe.data.seq_len} -> {limit}"
                )
            recipe = replace(recipe, data=replace(recipe.data, seq_len=limit))
        return recipe

    @staticmethod
    def check_length(recipe, backbone) -> None:
        """Blocks must fit the model's learned positions."""
        if recipe.data.seq_len > backbone.cfg.max_seq_len:
            raise UserError(
                f"data.seq_len ({recipe.data.seq_len}) exceeds model.max_seq_len ({backbone.cfg.max_seq_len})"
            )

    def tokenizer_texts(self, recipe) -> Iterator[str]:
        """The first tokenizer.train_chars characters of the training documents (streamed)."""
        train = self.sources(recipe)["train"]
        if isinstance(train, str):
            raise UserError(f"{train} is a prepared token store: its tokenizer comes with it (tokenizer.kind file)")
        total, limit = 0, recipe.tokenizer.train_chars
        for text, _ in train.pieces():
            if total >= limit:
                return
            text = text[: limit - total]
            total += len(text)
            yield text
        if total == 0:
            raise UserError(f"{train.spec}: no text (every document is empty)")


def _source(spec: str, text_field: str):
    """A prepared store's directory as it is; anything else as a DocumentSource (files checked now)."""
    return spec if is_store(spec) else open_source(spec, text_field)


def open_store(source, tokenizer, mode: str, eos: bool, workers: int, quiet: bool):
    """A prepared store (checked to be of `tokenizer` and `mode`), or the cached store of a source."""
    if isinstance(source, str):
        store = TokenStore.open(Path(source))
        if store.tokenizer_fingerprint() != tokenizer.fingerprint():
            raise UserError(
                f"{source} was tokenized with another tokenizer than this model's; prepare it with "
                f"the model's (tfcli prepare --tokenizer RUN_OR_TOKENIZER)"
            )
        if (store.index["mode"] == "text") != (mode == "text"):
            raise UserError(
                f"{source} was prepared as {store.index['mode']!r}; this objective needs {mode!r} "
                f"(tfcli prepare --objective ...)"
            )
        return store
    return cached_store(source, tokenizer, mode=mode, eos=eos, workers=workers, quiet=quiet)
