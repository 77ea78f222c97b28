"""Pretraining objectives: plug-ins (tfcli.plugin) registered in tfcli.registry.OBJECTIVES.

`Objective` gives every objective the held-out evaluation of `tfcli eval`; `TextObjective` adds
what the text objectives share: their documents, read once, and a sample of them for training a
tokenizer. An objective module then defines only its data source, heads and loss.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator

from ..data.sources import load_documents
from ..display import console, phase
from ..errors import UserError
from ..evaluate import held_out_metrics, metrics_table
from ..plugin import EvalOptions, Plugin
from ..sampler import sequential_batches
from ..train import ObjectiveModule


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
        with phase("evaluating"):
            metrics = held_out_metrics(module, batches, self.rt.device, t.precision)
        if not metrics:
            raise UserError("no held-out batches to evaluate on (data shorter than one block?)")
        metrics = job.held_out_metrics(metrics)
        console.print(metrics_table(f"{backbone.checkpoint}", metrics))
        return metrics


class TextObjective(Objective):
    """An objective over documents of text (data.source, data.val_source)."""

    def documents(self, recipe) -> dict:
        """{'train': Dataset of `text`, 'val': Dataset or None}, read once per plug-in."""
        d = recipe.data
        key = (d.source, d.val_source, d.text_field)
        if getattr(self, "_docs_key", None) != key:
            with phase(f"reading {d.source}"):
                self._docs = {"train": load_documents(d.source, d.text_field),
                              "val": load_documents(d.val_source, d.text_field) if d.val_source else None}
            self._docs_key = key
        return self._docs

    def tokenizer_key(self, recipe) -> str:
        return f"{self.documents(recipe)['train']._fingerprint}|{recipe.tokenizer.train_chars}"

    @staticmethod
    def check_length(recipe, backbone) -> None:
        """Blocks must fit the model's learned positions."""
        if recipe.data.seq_len > backbone.cfg.max_seq_len:
            raise UserError(f"data.seq_len ({recipe.data.seq_len}) exceeds model.max_seq_len ({backbone.cfg.max_seq_len})")

    def tokenizer_texts(self, recipe) -> Iterator[str]:
        """The first tokenizer.train_chars characters of the training documents."""
        total, limit = 0, recipe.tokenizer.train_chars
        for row in self.documents(recipe)["train"]:
            if total >= limit:
                return
            text = row["text"][: limit - total]
            total += len(text)
            yield text
