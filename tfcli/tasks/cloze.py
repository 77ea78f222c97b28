"""Zero-shot classification with a BERT's masked-LM head (a cloze, as PET does: Schick & Schütze 2021):
the texts go into a template with one [MASK], and each label is scored by its word's logit at the
mask. Nothing is trained.

    tfcli eval mnli --checkpoint RUN_OR_HF_DIR --cloze
    template "{premise} ? [MASK] , {hypothesis}", words yes / maybe / no (entailment / neutral / contradiction)

The template is split into its pieces (text, {field}, [MASK]) and each piece tokenized on its own,
so a long text is cut by tokens, never the template. A space between pieces goes to the piece after
it, as byte-level BPE (RoBERTa, ModernBERT) and SentencePiece (XLM-R) attach a space to the word it
precedes: " ? [MASK] , {b}" is "Ġ?", the mask, "Ġ,", "Ġ" + b's first word, and the label words are
" yes" / " no" (RoBERTa's "Ġyes"). WordPiece drops the spaces, so for BERT nothing moves. Either way
the pieces tokenize as the filled-in string would.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.sampler import Source
from ..errors import UserError
from ..plugin import Batch
from .classification import Head

MASK = "[MASK]"
_PIECES = re.compile(r"(\{[^{}]*\}|\[MASK\])")


def default_template(fields: tuple[str, ...]) -> str:
    """'{a} ? [MASK] , {b}' for a pair (PET's MNLI pattern), '{a} it was [MASK] .' for one text."""
    if len(fields) == 2:
        return f"{{{fields[0]}}} ? {MASK} , {{{fields[1]}}}"
    return f"{{{fields[0]}}} it was {MASK} ."


def parse_template(template: str, fields: tuple[str, ...]) -> list[str]:
    """The template's pieces in order: literal text, '{field}' or '[MASK]' (checked: one mask, every
    field once, no unknown names)."""
    pieces = [p for p in _PIECES.split(template) if p]  # spaces kept: they say where the spaces go
    named = [p[1:-1] for p in pieces if p.startswith("{")]
    where = f"classify.cloze_template {template!r}"
    if pieces.count(MASK) != 1:
        raise UserError(f"{where}: needs exactly one {MASK}, has {pieces.count(MASK)}")
    unknown = [n for n in named if n not in fields]
    if unknown:
        raise UserError(
            f"{where}: unknown field {{{unknown[0]}}} (the texts are {', '.join('{' + f + '}' for f in fields)})"
        )
    missing = [f for f in fields if named.count(f) != 1]
    if missing:
        raise UserError(f"{where}: must name {{{missing[0]}}} exactly once")
    return pieces


def placed(pieces: list[str]) -> list[tuple[str, bool]]:
    """The template's pieces as the filled-in string holds them: each literal text trimmed, and whether a
    space comes before the piece (the space after a literal, or a space-only piece, moves onto the next)."""
    out, space = [], False
    for p in pieces:
        if p == MASK or p.startswith("{"):
            out.append((p, space))
            space = False
        elif p.strip():
            out.append((p.strip(), space or p[0].isspace()))
            space = p[-1].isspace()
        else:
            space = True
    return out


def mask_follows_space(pieces: list[str]) -> bool:
    """Whether the label word reads after a space at the mask (then " yes", not "yes")."""
    return dict(placed(pieces))[MASK]


def word_ids(tokenizer, words: tuple[str, ...], spaced: bool = True) -> list[int]:
    """Each label word's one token id, as the word reads at the mask: after a space (`spaced`) " yes", which
    byte-level BPE and SentencePiece give its own token (a word the vocabulary splits cannot be scored at
    one mask)."""
    out = []
    for word in words:
        ids = tokenizer.encode(" " * spaced + word)
        if len(ids) != 1:
            raise UserError(
                f"classify.cloze_words: {word!r} is {len(ids)} tokens in this vocabulary; "
                f"each label word must be a single token"
            )
        out.append(ids[0])
    return out


def encode(
    tokenizer, ids: dict[str, int], pieces: list[str], text_fields: tuple[str, ...], rows: list, max_length: int
) -> list:
    """(texts, label) rows, texts in `text_fields` order -> ([CLS] filled template [SEP] ids, its length,
    label): the longest text is cut token by token until the row fits; a [MASK] inside a text
    becomes [UNK], so each row has exactly one."""
    laid = placed(pieces)
    space = {p: s for p, s in laid if p.startswith("{")}
    literal = {(p, s): tokenizer.encode(" " * s + p) for p, s in laid if p != MASK and not p.startswith("{")}
    fixed = 3 + sum(len(literal[p]) for p in laid if p in literal)  # + [CLS] [MASK] [SEP]
    if fixed >= max_length:
        raise UserError(f"classify.cloze_template: {fixed} tokens without the texts; data.seq_len is {max_length}")
    encoded = {
        f: tokenizer.encode_batch([" " * space["{" + f + "}"] + r[0][i] for r in rows])
        for i, f in enumerate(text_fields)
    }
    out = []
    for k, (_, label) in enumerate(rows):
        texts = {f: [ids["unk"] if t == ids["mask"] else t for t in encoded[f][k]] for f in text_fields}
        while fixed + sum(map(len, texts.values())) > max_length:
            max(texts.values(), key=len).pop()
        seq = [ids["cls"]]
        for p in laid:
            seq += [ids["mask"]] if p[0] == MASK else texts[p[0][1:-1]] if p[0].startswith("{") else literal[p]
        seq.append(ids["sep"])
        out.append((np.array(seq, dtype=np.int64), len(seq), label))
    return out


class ClozeHead(Head):
    """Label words scored at the [MASK] through the model's MLM head (its family's mlm_heads: BERT's
    transform and bias, ModernBERT's prediction head and output bias; then the tied embedding). A
    BERT saved without its MLM head (e.g. a sentence-transformers model) scores by the dot product of
    the mask's hidden state with the words' embeddings, and says so in its report."""

    def __init__(
        self,
        make_source: Callable[[list, bool], Source],
        mask_id: int,
        words: list[int],
        mlm_heads: nn.ModuleDict | None,
        tokens_per_item: float,
    ):
        self.make_source, self.mask_id, self.words, self.tokens_per_item = make_source, mask_id, words, tokens_per_item
        self.heads = mlm_heads if mlm_heads is not None else nn.ModuleDict()

    def source(self, rows: list, train: bool) -> Source:
        return self.make_source(rows, train)

    def scores(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch) -> Tensor:
        ids = batch["input_ids"]
        hidden = model(ids, batch["token_type_ids"], batch["attention_mask"])  # (B, T, D)
        at_mask = hidden[ids == self.mask_id]  # (B, D): one [MASK] per row
        words = torch.tensor(self.words, device=ids.device)
        weight = model.lm_head_weight[words]  # (L, D)
        if "mlm" not in heads:
            return at_mask @ weight.t()  # (B, L)
        mlm = heads["mlm"]
        return mlm.transform(at_mask) @ weight.t() + mlm.bias[words]  # (B, L)

    def loss(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch):
        logits = self.scores(model, heads, batch).float()
        loss = F.cross_entropy(logits, batch["labels"])
        return loss, {"loss": loss.detach(), "acc": (logits.argmax(-1) == batch["labels"]).float().mean()}

    def flops_per_item(self, model: nn.Module, data, train: str) -> float:
        from .heads import matmul_params

        return 2.0 * matmul_params(model) * self.tokens_per_item

    def notes(self) -> dict[str, float]:
        return {"mlm_head": float("mlm" in self.heads)}
