"""BERT masked-LM + next-sentence prediction (or RoBERTa-style MLM only, mlm.nsp: false).

Input [CLS] A [SEP] B [SEP] with segment ids 0 for A and 1 for B (tfcli.data.segments builds the
pairs). Of the non-special tokens 15% are chosen; of those 80% become [MASK], 10% a random token,
10% stay. The MLM logits are computed at the chosen positions only (gather, then a fused output
projection + cross-entropy), not at all T positions as in transformers' BertForPreTraining.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import segments
from ..data.sampler import Draw, Source
from ..errors import UserError
from ..models import kinds
from ..models.bert import Bert, MLMHead, build_heads, special_ids  # noqa: F401 (electra and tests read them here)
from ..plugin import Job
from ..recipe import require
from .losses import IGNORE, linear_cross_entropy
from .objective import TextObjective

SPECIAL_TOKENS = list(Bert.special_tokens)  # [PAD] [UNK] [CLS] [SEP] [MASK]


@dataclass(frozen=True)
class MLMConfig:
    """BERT's masked-LM objective (`mlm:` in a recipe): masking and how segments are built."""

    nsp: bool = field(
        default=True, metadata={"help": "false: RoBERTa-style full segments, no next-sentence prediction"}
    )
    mask_prob: float = field(
        default=0.15, metadata={"help": "share of non-special tokens chosen; of those 80% [MASK], 10% random, 10% kept"}
    )
    short_seq_prob: float = field(
        default=0.1, metadata={"help": "pairs made shorter than data.seq_len on purpose, as in BERT"}
    )
    documents: Literal["rows", "paragraphs"] = field(
        default="rows", metadata={"help": "a document is a data row, or each blank-line paragraph"}
    )

    def __post_init__(self):
        require(0 < self.mask_prob < 1, "mlm.mask_prob", "in (0, 1)", self.mask_prob)
        require(0 <= self.short_seq_prob <= 1, "mlm.short_seq_prob", "in [0, 1]", self.short_seq_prob)


def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """MLM cross-entropy at the chosen positions (+ NSP cross-entropy on the pooled [CLS])."""
    hidden = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])  # (B, T, D)
    chosen = batch["mlm_labels"] != IGNORE  # (B, T)
    mlm = heads["mlm"]
    h = mlm.transform(hidden[chosen])  # (N, D): only the predicted positions
    # the bias rides along as one more input column: [h, 1] @ [W, b]^T = h W^T + b
    weight = torch.cat([model.lm_head_weight, mlm.bias[:, None]], dim=1)  # (V, D + 1)
    mlm_loss, correct = linear_cross_entropy(
        F.pad(h, (0, 1), value=1.0), weight, batch["mlm_labels"][chosen], with_accuracy=True
    )
    metrics = {"mlm_loss": mlm_loss.detach(), "mlm_acc": correct.float() / chosen.sum().clamp(min=1)}
    total = mlm_loss
    if "nsp" in heads:
        logits = heads["nsp"](model.pool(hidden))  # (B, 2)
        nsp_loss = F.cross_entropy(logits.float(), batch["nsp_labels"])
        metrics["nsp_loss"] = nsp_loss.detach()
        metrics["nsp_acc"] = (logits.argmax(-1) == batch["nsp_labels"]).float().mean()
        total = total + nsp_loss
    metrics["loss"] = total.detach()
    return total, metrics


@dataclass
class Masker:
    """BERT's masking of one example: choose round(prob * n) of its n maskable tokens; of those,
    `replace` shares become [MASK] and a random token (BERT 0.8 / 0.1; ELECTRA 0.85 / 0), the rest stay."""

    mask_id: int
    special_ids: list[int]
    vocab_size: int
    prob: float = 0.15
    replace: tuple[float, float] = (0.8, 0.1)

    def __post_init__(self):
        self._special = np.array(sorted(set(self.special_ids)))
        self._allowed = np.setdiff1d(np.arange(self.vocab_size), self._special)  # the random-token pool

    def __call__(self, row: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(T,) ids -> (input ids, labels with IGNORE where not chosen)."""
        candidates = np.flatnonzero(~np.isin(row, self._special))
        k = max(1, int(np.round(self.prob * len(candidates)))) if len(candidates) else 0
        chosen = rng.choice(candidates, size=k, replace=False)
        labels = np.full_like(row, IGNORE)
        labels[chosen] = row[chosen]
        r = rng.random(k)
        out = row.copy()
        out[chosen[r < self.replace[0]]] = self.mask_id
        swap = chosen[(r >= self.replace[0]) & (r < self.replace[0] + self.replace[1])]
        out[swap] = rng.choice(self._allowed, size=len(swap))
        return out, labels


def collate(items: list, ids: dict[str, int], masker: Masker, rngs: list[np.random.Generator]) -> dict[str, Tensor]:
    """(A, B, label) pairs or single segments -> padded tensors, each row masked with its own rng."""
    rows, labels = [], []
    for item in items:
        a, b, label = item if isinstance(item, tuple) else (item, None, -1)
        row = np.concatenate([[ids["cls"]], a, [ids["sep"]]] + ([b, [ids["sep"]]] if b is not None else []))
        rows.append((row.astype(np.int64), len(a) + 2))
        labels.append(label)
    T = max(len(r) for r, _ in rows)
    input_ids = torch.full((len(rows), T), ids["pad"], dtype=torch.long)
    mlm_labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    token_type = torch.zeros((len(rows), T), dtype=torch.long)
    attention = torch.zeros((len(rows), T), dtype=torch.long)
    for i, ((row, n_a), rng) in enumerate(zip(rows, rngs)):
        masked, lab = masker(row, rng)
        input_ids[i, : len(row)], mlm_labels[i, : len(row)] = torch.from_numpy(masked), torch.from_numpy(lab)
        token_type[i, n_a : len(row)] = 1
        attention[i, : len(row)] = 1
    batch = {
        "input_ids": input_ids,
        "token_type_ids": token_type,
        "attention_mask": attention,
        "mlm_labels": mlm_labels,
    }
    if labels[0] >= 0:
        batch["nsp_labels"] = torch.tensor(labels)
    return batch


class PairSource(Source):
    """MLM(+NSP) examples built per batch from a sentence store: example i of an epoch is the pair
    (or full segment) at token offset(epoch) + i x max_tokens, so each epoch draws new pairs from
    (seed, epoch) as BERT's dupe_factor does; pairing and masking draw from the example's own
    random stream."""

    def __init__(
        self,
        corpus: segments.Corpus,
        max_tokens: int,
        nsp: bool,
        short_seq_prob: float,
        ids: dict[str, int],
        masker: Masker,
        seed: int,
        shift: bool = True,
    ):
        self.corpus, self.max_tokens, self.nsp, self.short_seq_prob = corpus, max_tokens, nsp, short_seq_prob
        self.ids, self.masker, self.seed, self.shift = ids, masker, seed, shift

    def offset(self, epoch: int) -> int:
        return int(np.random.default_rng([self.seed, epoch, 11]).integers(0, self.max_tokens)) if self.shift else 0

    def epoch_size(self, epoch: int) -> int:
        return max(1, (self.corpus.n_tokens - self.offset(epoch)) // self.max_tokens)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        rngs = [draw.rng(i) for i in range(len(draw))]
        items = []
        for e, i, rng in zip(draw.epochs, draw.indices, rngs):
            at = self.offset(int(e)) + int(i) * self.max_tokens
            items.append(
                segments.pair_at(self.corpus, at, self.max_tokens, rng, self.short_seq_prob)
                if self.nsp
                else segments.segment_at(self.corpus, at, self.max_tokens, self.ids["sep"])
            )
        return collate(items, self.ids, self.masker, rngs)


class MaskedLM(TextObjective):
    key = "mlm"
    model_kinds = (kinds.TEXT_ENCODER,)
    recipe_pattern = "{family}-mini"
    Config = MLMConfig
    describe = "BERT MLM + NSP"
    replace = (0.8, 0.1)  # [MASK] and random-token shares of the chosen tokens

    def example_sources(self, recipe, backbone, nsp: bool) -> tuple[PairSource, PairSource | None]:
        """A sentence store of the data (cached), held-out documents, and the training and held-out
        sources of pairs (NSP) or full segments, masked with this objective's shares."""
        s, d, seed = recipe.settings, recipe.data, recipe.train.seed
        self.check_length(recipe, backbone)
        ids = special_ids(backbone.tokenizer)
        masker = Masker(ids["mask"], sorted(set(ids.values())), backbone.cfg.vocab_size, s.mask_prob, self.replace)
        mode = "paragraphs" if s.documents == "paragraphs" else "sentences"
        train_store, val_store = self.stores(recipe, backbone.tokenizer, mode=mode, eos=False)
        if val_store is not None:
            train_c, val_c = (
                segments.Corpus(train_store, 0, train_store.n_docs),
                segments.Corpus(val_store, 0, val_store.n_docs),
            )
        else:
            train_c, val_c = segments.split_corpus(train_store, d.val_fraction)
        if train_c.n_docs < (2 if nsp else 1):
            raise UserError(f"MLM needs at least 2 training documents, the data has {train_c.n_docs}")
        max_tokens = d.seq_len - (3 if nsp else 2)
        short = getattr(s, "short_seq_prob", 0.0)  # ELECTRA packs full segments: no short pairs
        make = lambda c, seed, shift: PairSource(c, max_tokens, nsp, short, ids, masker, seed, shift)  # noqa: E731
        val = make(val_c, seed + 10**6, False) if val_c.n_docs > (1 if nsp else 0) else None
        return make(train_c, seed, True), val

    def setup(self, recipe, backbone) -> Job:
        train, val = self.example_sources(recipe, backbone, recipe.settings.nsp)
        return Job(
            heads=build_heads(backbone.cfg, nsp=recipe.settings.nsp),
            loss=loss,
            train=train,
            val=val,
            flops_per_item=backbone.model.flops_per_token(recipe.data.seq_len),
            count_items=lambda b: int(b["attention_mask"].sum()),
            unread=() if recipe.settings.nsp else tuple(backbone.model.pool_parameters()),
        )

    def hints(self, run_dir) -> list[str]:
        return [
            f"evaluate it:  tfcli eval --checkpoint {run_dir}",
            f"finetune it:  tfcli finetune mnli --from {run_dir} --data <MNLI directory>",
        ]
