"""ELECTRA replaced-token detection (Clark et al. 2020): a small generator trained by MLM fills the
masked positions with sampled tokens, and the discriminator, the BERT encoder being pretrained,
tells for every token whether it was replaced. Loss = generator MLM + 50 x discriminator loss.

Data and masking are BERT's (full segments, no NSP), except that ELECTRA's masking keeps no random
tokens (85% [MASK], 15% unchanged). Generator and discriminator share the embeddings (token,
position, segment, LayerNorm); the generator reads them through a projection to its own width,
as transformers' ElectraForMaskedLM does with `embeddings_project`. After pretraining the
discriminator is the model (`--from` a run finetunes it as any BERT); the generator is a head.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.bert import encoder_blocks, run_blocks
from ..models.blocks import ACTIVATIONS, init_normal_
from ..plugin import Job
from ..recipe import require
from .losses import IGNORE
from .mlm_nsp import MaskedLM, MLMHead


@dataclass(frozen=True)
class ElectraConfig:
    """The `electra:` recipe section."""

    generator_size: float = field(
        default=0.25, metadata={"help": "generator width (d_model, d_ff, heads) as a share of the discriminator's"}
    )
    generator_layers: int = field(default=0, metadata={"help": "0: as many layers as the discriminator"})
    disc_weight: float = field(default=50.0, metadata={"help": "the discriminator loss's weight (the paper's lambda)"})
    temperature: float = field(default=1.0, metadata={"help": "of the generator's sampling"})
    mask_prob: float = field(default=0.15, metadata={"help": "the share of tokens the generator replaces"})
    documents: Literal["rows", "paragraphs"] = field(
        default="rows", metadata={"help": "a document is a data row, or each blank-line paragraph"}
    )

    def __post_init__(self):
        require(0 < self.generator_size <= 1, "electra.generator_size", "in (0, 1]", self.generator_size)
        require(self.generator_layers >= 0, "electra.generator_layers", ">= 0", self.generator_layers)
        require(self.disc_weight > 0, "electra.disc_weight", "> 0", self.disc_weight)
        require(self.temperature > 0, "electra.temperature", "> 0", self.temperature)
        require(0 < self.mask_prob < 1, "electra.mask_prob", "in (0, 1)", self.mask_prob)


class Generator(nn.Module):
    """A narrow BERT encoder over the discriminator's embeddings, with an MLM head tied to them."""

    def __init__(self, disc, size: float, layers: int):
        super().__init__()
        head_dim = disc.d_model // disc.n_head
        n_head = max(1, round(disc.n_head * size))
        self.cfg = replace(
            disc,
            n_head=n_head,
            d_model=n_head * head_dim,
            d_ff=max(1, round(disc.d_ff * size)),
            n_layer=layers or disc.n_layer,
        )
        self.project = nn.Linear(disc.d_model, self.cfg.d_model)
        self.blocks = encoder_blocks(self.cfg)
        self.mlm = MLMHead(self.cfg.d_model, disc.d_model, disc.vocab_size, disc.layer_norm_eps, disc.activation)
        init_normal_(self)

    def forward(self, embedded: Tensor, attention_mask: Tensor) -> Tensor:
        """The shared embeddings (B, T, D) -> generator hidden states (B, T, D_gen)."""
        return run_blocks(self.blocks, self.project(embedded), attention_mask)


class DiscriminatorHead(nn.Module):
    """transformers' ElectraDiscriminatorPredictions: dense, activation, one logit per token."""

    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.act = ACTIVATIONS[cfg.activation]
        self.prediction = nn.Linear(cfg.d_model, 1)
        init_normal_(self)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.prediction(self.act(self.dense(hidden))).squeeze(-1)  # (B, T)


def ranking_auc(scores: Tensor, positive: Tensor) -> Tensor:
    """Area under the ROC curve of `scores` (N,) for the boolean labels `positive` (N,): the chance that a
    replaced token scores above an original one (Mann-Whitney U over ranks; 0.5 is a constant score).
    Unlike disc_acc it says whether the discriminator ranks at all while it still predicts the base rate."""
    n_pos = positive.sum(dtype=torch.float64)
    n_neg = positive.numel() - n_pos
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, scores.numel() + 1, dtype=torch.float64, device=scores.device)
    u = (ranks * positive).sum() - n_pos * (n_pos + 1) / 2
    pairs = n_pos * n_neg
    # one class only: no ranking to measure, 0.5; chosen on the device, as a metric must not sync each step
    return torch.where(pairs > 0, u / pairs.clamp(min=1), 0.5).float()


def make_loss(disc_weight: float, temperature: float):
    def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Generator MLM at the masked positions, then the discriminator on the sampled replacements."""
        ids, types, attn, labels = (
            batch["input_ids"],
            batch["token_type_ids"],
            batch["attention_mask"],
            batch["mlm_labels"],
        )
        chosen = labels != IGNORE  # (B, T)
        gen = heads["generator"]
        logits = gen.mlm.logits(gen(model.embed(ids, types), attn)[chosen], model.lm_head_weight).float()  # (N, V)
        gen_loss = F.cross_entropy(logits, labels[chosen])
        with torch.no_grad():
            sampled = torch.multinomial(torch.softmax(logits / temperature, -1), 1).squeeze(-1)  # (N,)
            original = torch.where(chosen, labels, ids)  # the uncorrupted text
            corrupted = original.masked_scatter(chosen, sampled)
            replaced = (corrupted != original).float()  # (B, T): a sample equal to the original is not "replaced"
        disc_logits = heads["discriminator"](model(corrupted, types, attn))  # (B, T)
        valid = attn.bool()
        scores, targets = disc_logits[valid].float(), replaced[valid]  # (N_tokens,) each
        disc_loss = F.binary_cross_entropy_with_logits(scores, targets)
        total = gen_loss + disc_weight * disc_loss
        metrics = {
            "loss": total.detach(),
            "gen_loss": gen_loss.detach(),
            "gen_acc": (logits.argmax(-1) == labels[chosen]).float().mean(),
            "disc_loss": disc_loss.detach(),
            "disc_acc": ((scores > 0).float() == targets).float().mean(),
            "disc_auc": ranking_auc(scores.detach(), targets.bool()),
            "replaced": targets.mean(),
        }
        return total, metrics

    return loss


class Electra(MaskedLM):
    key = "electra"
    Config = ElectraConfig
    recipe_pattern = "electra-mini"
    describe = "ELECTRA replaced-token detection"
    replace = (0.85, 0.0)

    def setup(self, recipe, backbone) -> Job:
        s, cfg, T = recipe.settings, backbone.cfg, recipe.data.seq_len
        train, val = self.example_sources(recipe, backbone, nsp=False)
        heads = nn.ModuleDict(
            {"generator": Generator(cfg, s.generator_size, s.generator_layers), "discriminator": DiscriminatorHead(cfg)}
        )
        gen = heads["generator"].cfg
        n_gen = sum(p.numel() for p in heads.parameters())  # the generator (and the discriminator's head)
        generator = 6.0 * n_gen + 12.0 * T * gen.n_layer * gen.d_model
        return Job(
            heads=heads,
            loss=make_loss(s.disc_weight, s.temperature),
            train=train,
            val=val,
            flops_per_item=backbone.model.flops_per_token(T) + generator,
            count_items=lambda b: int(b["attention_mask"].sum()),
            unread=tuple(backbone.model.pool_parameters()),
        )  # no NSP: nothing pools
