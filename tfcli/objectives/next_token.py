"""GPT next-token prediction: cross-entropy of token t+1 given tokens <= t over packed blocks."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from ..data.packing import BlockSource, WindowSource, documents_from_eos, split_stores, within_documents
from ..errors import UserError
from ..models import kinds
from ..plugin import Job
from .losses import next_token_loss as loss  # noqa: F401  (the objective's loss; text-to-text tasks train it too)
from .losses import with_perplexity
from .objective import TextObjective


def shifted_pairs(blocks, rngs, eos: int | None = None) -> dict[str, Tensor]:
    """(B, T + 1) blocks -> inputs and the targets one to the right; given the end-of-text id (a
    stream with data.document_mask), attention and targets also stay inside each document."""
    t = torch.from_numpy(blocks)
    pair = {"input_ids": t[:, :-1], "targets": t[:, 1:]}
    return pair if eos is None else within_documents(pair, torch.from_numpy(documents_from_eos(blocks, eos)))


class NextToken(TextObjective):
    key = "clm"
    streaming = True  # reads data.streaming sources
    model_kinds = (kinds.DECODER,)
    recipe_pattern = "{family}-mini"
    describe = "GPT next-token"

    def setup(self, recipe, backbone) -> Job:
        """Tokenize into a store (cached), hold out the tail of the stream, sample shuffled blocks or
        random windows, read from the store per batch."""
        d, mask = recipe.data, recipe.data.document_mask
        self.check_length(recipe, backbone)
        if d.streaming:
            eos = backbone.tokenizer.eos_id if mask else None
            if mask and eos is None:
                raise UserError(
                    "data.document_mask: a stream's documents are told apart by the end-of-text "
                    "token, and this tokenizer has none"
                )
            source, held_out = self.streams(recipe, backbone, d.seq_len + 1, partial(shifted_pairs, eos=eos))
        else:
            train, val = split_stores(*self.stores(recipe, backbone.tokenizer), d.val_fraction, d.seq_len)
            source = (
                WindowSource(train, d.seq_len, mask)
                if d.sampling == "windows"
                else BlockSource(train, d.seq_len, recipe.train.seed, document_mask=mask)
            )
            held_out = BlockSource(val, d.seq_len, shift=False, document_mask=mask) if len(val) > d.seq_len else None
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=source,
            val=held_out,
            flops_per_item=backbone.model.flops_per_token(d.seq_len),
            count_items=lambda b: b["input_ids"].numel(),
            held_out_metrics=with_perplexity,
        )

    def hints(self, run_dir) -> list[str]:
        return [
            f'generate from it:  tfcli generate --checkpoint {run_dir} --prompt "..."',
            f"evaluate it:       tfcli eval --checkpoint {run_dir}",
        ]
