"""BERT masked-LM + next-sentence prediction (or RoBERTa-style MLM only, mlm.nsp: false).

Input [CLS] A [SEP] B [SEP] with segment ids 0 for A and 1 for B (tfcli.data.segments builds the
pairs). Of the non-special tokens 15% are chosen; of those 80% become [MASK], 10% a random token,
10% stay. The MLM logits are computed at the chosen positions only (gather, then a fused output
projection + cross-entropy), not at all T positions as in transformers' BertForPreTraining.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import segments
from ..errors import UserError
from ..models.blocks import ACTIVATIONS, init_normal_, make_norm
from . import Prepared
from .losses import IGNORE, linear_cross_entropy

FAMILY = "bert"
DEFAULT_RECIPE = "bert-mini"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class MLMHead(nn.Module):
    """BERT's prediction-head transform (dense, activation, LayerNorm) and the output bias; the
    output weight is the model's token embedding (tied)."""

    def __init__(self, d_model: int, vocab_size: int, eps: float, activation: str = "gelu"):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.act = ACTIVATIONS[activation]
        self.norm = make_norm("layernorm", d_model, eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def transform(self, hidden: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(hidden)))

    def logits(self, hidden: Tensor, weight: Tensor) -> Tensor:
        """(..., D) -> (..., V): all logits, for parity checks and inspection."""
        return self.transform(hidden) @ weight.t() + self.bias


def build_heads(cfg, nsp: bool = True) -> nn.ModuleDict:
    """The pretraining heads for a BertConfig: 'mlm' and (with NSP) 'nsp' on the pooled [CLS]."""
    heads = nn.ModuleDict({"mlm": MLMHead(cfg.d_model, cfg.vocab_size, cfg.layer_norm_eps, cfg.activation)})
    if nsp:
        heads["nsp"] = nn.Linear(cfg.d_model, 2)
    init_normal_(heads)
    return heads


def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """MLM cross-entropy at the chosen positions (+ NSP cross-entropy on the pooled [CLS])."""
    hidden = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])  # (B, T, D)
    chosen = batch["mlm_labels"] != IGNORE  # (B, T)
    mlm = heads["mlm"]
    h = mlm.transform(hidden[chosen])  # (N, D): only the predicted positions
    # the bias rides along as one more input column: [h, 1] @ [W, b]^T = h W^T + b
    weight = torch.cat([model.lm_head_weight, mlm.bias[:, None]], dim=1)  # (V, D + 1)
    mlm_loss, correct = linear_cross_entropy(F.pad(h, (0, 1), value=1.0), weight, batch["mlm_labels"][chosen],
                                             with_accuracy=True)
    n = chosen.sum().clamp(min=1)
    metrics = {"mlm_loss": mlm_loss.detach(), "mlm_acc": correct.float() / n}
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
    """BERT's masking: choose round(p * n) of each row's n maskable tokens; 80/10/10."""

    mask_id: int
    special_ids: list[int]
    vocab_size: int
    prob: float = 0.15

    def __post_init__(self):
        self._special = torch.tensor(self.special_ids)
        self._allowed = torch.tensor(sorted(set(range(self.vocab_size)) - set(self.special_ids)))  # random-token pool

    def __call__(self, ids: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """ids (B, T) with padding -> (masked input ids, labels with IGNORE where not chosen)."""
        special = torch.isin(ids, self._special)  # (B, T)
        n_cand = (~special).sum(1)  # (B,)
        n_pick = torch.where(n_cand > 0, (n_cand.float() * self.prob).round().clamp(min=1), 0).long()
        noise = torch.rand(ids.shape, generator=gen).masked_fill(special, 2.0)  # specials sort last
        rank = noise.argsort(1).argsort(1)  # (B, T): position of each token in the random order
        chosen = rank < n_pick[:, None]
        labels = ids.masked_fill(~chosen, IGNORE)
        r = torch.rand(ids.shape, generator=gen)
        out = ids.masked_fill(chosen & (r < 0.8), self.mask_id)
        swap = chosen & (r >= 0.8) & (r < 0.9)
        random_ids = self._allowed[torch.randint(len(self._allowed), ids.shape, generator=gen)]
        return torch.where(swap, random_ids, out), labels


class PairBatches:
    """Resumable stream of MLM(+NSP) batches. Each epoch re-draws the pairs (and their masks)
    from (seed, epoch), as BERT's dupe_factor does, and visits them in a random order."""

    def __init__(self, build, masker: Masker, ids: dict[str, int], batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        self.build, self.masker, self.ids = build, masker, ids
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.epoch, self.index = 0, 0
        self._epoch_items = None

    def _items(self):
        if self._epoch_items is None or self._epoch_items[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            items = self.build(rng)
            if not items:
                raise UserError("the training data is too short to make a single MLM example")
            self._epoch_items = (self.epoch, items, rng.permutation(len(items)))
        return self._epoch_items[1], self._epoch_items[2]

    def next_batch(self) -> dict[str, Tensor]:
        picked = []
        while len(picked) < self.batch_size * self.world_size:
            items, order = self._items()
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            picked.append(items[order[self.index]])
            self.index += 1
        mine = picked[self.rank * self.batch_size: (self.rank + 1) * self.batch_size]
        seed = np.random.default_rng([self.seed, self.epoch, self.index, self.rank]).integers(2**62)
        gen = torch.Generator().manual_seed(int(seed))  # masks depend only on the data position: exact resume
        return collate(mine, self.ids, self.masker, gen)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def collate(items: list, ids: dict[str, int], masker: Masker, gen: torch.Generator) -> dict[str, Tensor]:
    """(A, B, label) pairs or single segments -> padded, masked tensors."""
    rows, types, labels = [], [], []
    for item in items:
        a, b, label = item if isinstance(item, tuple) else (item, None, -1)
        row = [ids["cls"], *a.tolist(), ids["sep"]]
        seg = [0] * len(row)
        if b is not None:
            row += [*b.tolist(), ids["sep"]]
            seg += [1] * (len(b) + 1)
        rows.append(row), types.append(seg), labels.append(label)
    T = max(map(len, rows))
    input_ids = torch.full((len(rows), T), ids["pad"], dtype=torch.long)
    token_type = torch.zeros((len(rows), T), dtype=torch.long)
    attention = torch.zeros((len(rows), T), dtype=torch.long)
    for i, (row, seg) in enumerate(zip(rows, types)):
        input_ids[i, : len(row)] = torch.tensor(row)
        token_type[i, : len(seg)] = torch.tensor(seg)
        attention[i, : len(row)] = 1
    masked, mlm_labels = masker(input_ids, gen)
    batch = {"input_ids": masked, "token_type_ids": token_type, "attention_mask": attention, "mlm_labels": mlm_labels}
    if labels[0] >= 0:
        batch["nsp_labels"] = torch.tensor(labels)
    return batch


def special_ids(tokenizer) -> dict[str, int]:
    names = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
    out = {k: tokenizer.token_id(v) for k, v in names.items()}
    missing = [names[k] for k, v in out.items() if v is None]
    if missing:
        raise UserError(f"the tokenizer lacks {', '.join(missing)}, which MLM needs (a BERT WordPiece vocabulary)")
    return out


def prepare(recipe, tokenizer, docs, model, rank: int = 0, world_size: int = 1) -> Prepared:
    """Sentences (cached), held-out documents, pairs (or full segments) drawn per epoch, masks."""
    m, data, train = recipe.mlm, recipe.data, recipe.train
    ids = special_ids(tokenizer)
    masker = Masker(ids["mask"], sorted(set(ids.values())), model.cfg.vocab_size, m.mask_prob)
    paragraphs = m.documents == "paragraphs"
    corpus = segments.tokenize_sentences(docs["train"], tokenizer, paragraphs)
    if docs.get("val") is not None:
        train_c, val_c = corpus, segments.tokenize_sentences(docs["val"], tokenizer, paragraphs)
    else:
        n_val = int(corpus.n_docs * data.val_fraction) if data.val_fraction > 0 else 0
        if corpus.n_docs - n_val < (2 if m.nsp else 1):
            raise UserError(f"MLM needs at least 2 training documents, the data has {corpus.n_docs - n_val}")
        train_c, val_c = corpus.subset(range(0, corpus.n_docs - n_val)), corpus.subset(range(corpus.n_docs - n_val, corpus.n_docs))

    def builder(c):
        if m.nsp:
            return lambda rng: segments.sentence_pairs(c, data.seq_len - 3, rng, m.short_seq_prob)
        return lambda rng: segments.full_segments(c, data.seq_len - 2, ids["sep"])

    sampler = PairBatches(builder(train_c), masker, ids, train.batch_size, train.seed, rank, world_size)
    val_items = builder(val_c)(np.random.default_rng([train.seed, 10**6])) if val_c.n_docs > (1 if m.nsp else 0) else []

    def val():
        gen = torch.Generator().manual_seed(train.seed)
        step = train.batch_size * world_size
        for b in range(min(train.eval_batches, len(val_items) // step)):
            first = b * step + rank * train.batch_size
            yield collate(val_items[first: first + train.batch_size], ids, masker, gen)

    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return Prepared(
        train=sampler, val=val, loss=loss,
        items_per_batch=lambda b: int(b["attention_mask"].sum()),
        flops_per_item=6.0 * n_params + 12.0 * model.cfg.n_layer * data.seq_len * model.cfg.d_model,
        heads=build_heads(model.cfg, nsp=m.nsp),
    )
