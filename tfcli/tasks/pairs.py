"""What the tasks that learn from preference pairs share (DPO, reward models): the recipe fields that
name a pair's columns, reading every split's pairs through the SFT example builder, and a row per pair
(its prompt read once) unless the model cannot read two replies in one row."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from .. import display
from ..data.conversations import DecoderExamples
from ..data.preferences import PairBuilder, PairFields, Pairs
from ..models import kinds
from .replies import ReplyConfig, ReplyTask


@dataclass(frozen=True)
class PairConfig(ReplyConfig):
    """A pair task's recipe section: a reply task's fields, and the pair's columns."""

    presets: ClassVar[bool] = False  # no preset of pairs yet

    share_prompt: bool = field(
        default=True,
        metadata={"help": "a row per pair, its prompt read once for both replies (False: a row per reply)"},
    )
    chosen_field: str = field(default="chosen", metadata={"help": "the column holding the preferred reply"})
    rejected_field: str = field(default="rejected", metadata={"help": "the column holding the other reply"})

    def pair_fields(self) -> PairFields:
        return PairFields(self.prompt_column, self.chosen_field, self.rejected_field, self.system)


class PairTask(ReplyTask):
    """A task whose rows are preference pairs: each split read as pairs of decoder examples."""

    noun = eval_noun = "pairs"
    model_kinds = (kinds.DECODER,)

    def resolve(self, recipe, backbone):
        """A model that cannot read a prompt once for two replies (blocks.replies_to_one_prompt; the generic path's
        transformers modules), or whose sliding window is shorter than a row of two replies can be
        (a window counts the second reply's keys by their distance in the row, not by its positions),
        trains with a row per reply (share_prompt false), said once."""
        recipe = super().resolve(recipe, backbone)
        window = getattr(backbone.model, "shortest_window", 0)
        longest_row = 2 * min(recipe.data.seq_len, backbone.cfg.max_seq_len)
        if not recipe.settings.share_prompt:
            return recipe
        if not getattr(backbone.model, "reads_shared_prompt", True) or 0 < window < longest_row:
            why = (
                "this model reads"
                if not window
                else f"a sliding window of {window} tokens, shorter than two replies, needs"
            )
            display.note(
                f"{self.key}: {why} a row per reply ({self.key}.share_prompt false): its prompts are read twice"
            )
            recipe = dataclasses.replace(recipe, settings=dataclasses.replace(recipe.settings, share_prompt=False))
        return recipe

    def pairs(
        self, recipe, backbone, data: str | None = None, need_train: bool = True, say: bool = True
    ) -> dict[str, Pairs]:
        """Every split's pairs (the training split first), each split's skipped rows named (say)."""
        length = min(recipe.data.seq_len, backbone.cfg.max_seq_len)
        examples = DecoderExamples(backbone.tokenizer, self.template(recipe, backbone), "last", length)
        return self.read(recipe, PairBuilder(examples, self.pair_fields(recipe.settings)), data, need_train, say)

    def pair_fields(self, cfg: PairConfig) -> PairFields:
        return cfg.pair_fields()

    @staticmethod
    def items(built: Pairs) -> list:
        return built.pairs

    def text_columns(self, cfg: PairConfig) -> tuple[str, ...]:
        return (cfg.prompt_column, cfg.chosen_field, cfg.rejected_field)
