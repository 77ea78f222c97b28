"""What a finetuning run trains: everything, the head only, or a parameter-efficient subset, for every
family and task through one module.

`--train` (finetune.train):
  all     every parameter
  head    the task's head only (the backbone frozen: a linear probe)
  lora    low-rank updates of named linears (Hu et al. 2021): y = W x + (alpha / r) B A dropout(x)
  qlora   LoRA on a base whose block linears are frozen in 4-bit NF4 (Dettmers et al. 2023; torchao's
          NF4, as torchtune builds it): the base's matrices in about an eighth of fp32's memory
  ia3     learned scales of keys, values and the MLP's inner activations (Liu et al. 2022), init 1
  bitfit  biases and norms only (Ben Zaken et al. 2021; T5 has no biases: its norms)

Targets name the parts of the shared transformer block, the same in every family: q, k, v (the
fused self-attention projection `attn.qkv` and cross-attention's `q` / fused `kv` are split into
their parts by the attention's own layout, so grouped-query attention's narrower k and v get
adapters of their own width, as litgpt's LoRAQKVLinear does), o (the attention output), up, gate,
down (the MLP).
At initialisation an adapted model computes exactly what the base model does; `merge` folds the
adapters back into plain linears (export writes a plain transformers model).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import UserError
from .models import nf4
from .models.blocks import MLP, Attention, linear
from .recipe import AdapterConfig


def linear_parts(model: nn.Module, name: str, module: nn.Linear) -> tuple[tuple[str, int], ...] | None:
    """The parts a block's linear holds and their widths, in output order (None for a linear outside
    the blocks): an attention's layout (grouped-query attention's k and v narrower than q), or the
    MLP's one part."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, Attention) and leaf in ("qkv", "kv", "q", "out"):
        return parent.layout(leaf)
    if isinstance(parent, MLP) and leaf in ("up", "gate", "down"):
        return ((leaf, module.out_features),)
    return None


def adapted_widths(widths: tuple[int, ...], enabled: list[bool]) -> tuple[int, ...]:
    """The widths of the parts that carry an adapter, in output order."""
    return tuple(w for w, on in zip(widths, enabled) if on)


def _flatten_stacked(name: str, stacked_dims: int):
    """A load_state_dict pre-hook: adapters saved before parts had their own widths stored `name`
    as (parts, width, ...); the flat layout is the same numbers, concatenated."""

    def hook(state_dict, prefix, *args):
        t = state_dict.get(prefix + name)
        if t is not None and t.dim() == stacked_dims:
            state_dict[prefix + name] = t.flatten(0, 1)

    return hook


class LoRALinear(nn.Module):
    """A frozen linear plus rank-r updates of the chosen parts of its output (zero at init: B = 0)."""

    def __init__(
        self, base: nn.Linear, parts: tuple[tuple[str, int], ...], targets: tuple[str, ...], cfg: AdapterConfig
    ):
        super().__init__()
        self.base, self.parts, self.widths = base, tuple(p for p, _ in parts), tuple(w for _, w in parts)
        self.enabled = [p in targets for p in self.parts]
        self.active = True  # False inside adapters.disabled(model)
        self.scale, self.drop = cfg.alpha / cfg.rank, nn.Dropout(cfg.dropout)
        n = sum(self.enabled)
        self.lora_a = nn.Parameter(torch.empty(n, cfg.rank, base.in_features))  # (parts, r, D_in)
        self.adapted = adapted_widths(self.widths, self.enabled)
        self.lora_b = nn.Parameter(torch.zeros(sum(self.adapted), cfg.rank))  # (adapted parts' widths, r)
        nn.init.kaiming_uniform_(self.lora_a.view(-1, base.in_features), a=math.sqrt(5))
        self._register_load_state_dict_pre_hook(_flatten_stacked("lora_b", 3))

    def scaled_b(self) -> Tensor:
        """(out, parts * r): each adapted part's B, times alpha / r, on a block diagonal; zero rows for
        the parts left alone. One matrix, so the update is two plain linears with no output-sized
        concatenation kept for the backward pass."""
        blocks = iter((self.lora_b * self.scale).split(self.adapted))  # each (W_part, r)
        return torch.block_diag(
            *[next(blocks) if on else self.lora_b.new_zeros(w, 0) for w, on in zip(self.widths, self.enabled)]
        )

    def delta_weight(self) -> Tensor:
        """(out, in): the update of the whole fused weight, zeros where a part is not adapted."""
        return self.scaled_b() @ self.lora_a.flatten(0, 1)

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:  # adapters.disabled: the base model alone
            return self.base(x)
        flat = x.reshape(-1, x.size(-1))  # (N, in)
        h = F.linear(self.drop(flat), self.lora_a.flatten(0, 1))  # (N, parts * r)
        out = self.base(flat)  # (N, out); a frozen linear keeps nothing of it for backward
        # the update added in place into the product itself, not into a view of it (the base's output
        # for (..., in) inputs): in place into a view, autograd's backward copies the output-sized
        # gradient twice (CopySlices); out of place, the forward copies the output into fresh memory
        out.addmm_(h.to(out.dtype), self.scaled_b().t().to(out.dtype))
        return out.view(*x.shape[:-1], out.size(-1))

    def merged(self) -> nn.Linear:
        """A plain linear: the base (dequantized if NF4) plus the update, in full precision."""
        base = self.base.dequantized() if isinstance(self.base, nf4.NF4Linear) else self.base
        with torch.no_grad():
            base.weight += self.delta_weight().to(base.weight.dtype)
        return base


class IA3Linear(nn.Module):
    """A frozen linear whose chosen output parts (keys, values) or inputs (the MLP's `down`) are
    scaled by learned vectors, ones at init."""

    def __init__(self, base: nn.Linear, parts: tuple[tuple[str, int], ...], on_input: bool):
        super().__init__()
        self.base, self.on_input = base, on_input
        self.parts, self.widths = tuple(p for p, _ in parts), tuple(w for _, w in parts)
        self.active = True  # False inside adapters.disabled(model)
        if on_input:
            self.ia3 = nn.Parameter(torch.ones(base.in_features))
        else:
            self.enabled = [p in ("k", "v") for p in self.parts]
            self.adapted = adapted_widths(self.widths, self.enabled)
            self.ia3 = nn.Parameter(torch.ones(sum(self.adapted)))
            self._register_load_state_dict_pre_hook(_flatten_stacked("ia3", 2))

    def scale_vector(self) -> Tensor:
        if self.on_input:
            return self.ia3
        pieces = iter(self.ia3.split(self.adapted))
        return torch.cat(
            [next(pieces) if on else self.ia3.new_ones(w) for w, on in zip(self.widths, self.enabled)]
        )  # (out,)

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:  # adapters.disabled: the base model alone
            return self.base(x)
        if self.on_input:
            return self.base(x * self.ia3)
        s = self.scale_vector()
        bias = self.base.bias
        return linear(x, self.base.weight * s[:, None], bias * s if bias is not None else None)

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            if self.on_input:
                self.base.weight *= self.ia3[None, :]
            else:
                s = self.scale_vector()
                self.base.weight *= s[:, None]
                if self.base.bias is not None:
                    self.base.bias *= s
        return self.base


SWITCHABLE = ("lora", "qlora", "ia3")  # methods whose adapters switch off to leave the base model (disabled)
QUANTIZED_BASE = ("qlora",)  # methods that hold a pretrained base in NF4, frozen


def check_base(method: str, pretrained: bool) -> None:
    """QLoRA freezes a pretrained base in 4-bit NF4 and trains adapters on it: on a fresh model the base
    is random weights that never train (and a fresh run saves its whole model, which NF4 cannot be)."""
    if method in QUANTIZED_BASE and not pretrained:
        raise UserError(
            f"--train {method} freezes a pretrained model in 4-bit NF4 and trains LoRA adapters on it: give "
            f"--from MODEL (on a fresh model the frozen base would be random weights), or --train lora or all"
        )


def apply(model: nn.Module, method: str, cfg: AdapterConfig | None) -> int:
    """Swap adapters into the model's block linears (lora, ia3) and freeze what the method does not
    train; return how many linears were adapted. The caller keeps the task's heads trainable."""
    if method == "all":
        return 0
    model.requires_grad_(False)
    if method == "head":
        return 0
    if method == "bitfit":
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.requires_grad_(True)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.requires_grad_(True)
        return 0
    cfg = cfg or AdapterConfig()
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        parts = linear_parts(model, name, module)
        if parts is None:
            continue
        names = {p for p, _ in parts}
        if method == "qlora" and nf4.quantizable(module):
            module = nf4.NF4Linear(module)  # every block linear frozen in NF4, adapted or not
            _replace(model, name, module)
        if method in ("lora", "qlora") and names & set(cfg.targets):
            _replace(model, name, LoRALinear(module, parts, cfg.targets, cfg))
            count += 1
        elif method == "ia3" and (names & {"k", "v"} or names == {"down"}):
            _replace(model, name, IA3Linear(module, parts, on_input=names == {"down"}))
            count += 1
    if not count:
        raise UserError(f"--train {method}: no {', '.join(cfg.targets)} projections in this model to adapt")
    return count


@contextlib.contextmanager
def disabled(model: nn.Module):
    """The base model inside the block: every LoRA and IA3 adapter passes its input to the frozen
    linear alone (torchtune's disable_adapter; a preference-tuning reference without a second copy).
    BitFit trains the base's own biases and norms, so it has no adapter-free base: refused."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRALinear, IA3Linear))]
    if not adapted:
        raise UserError(
            "this model has no LoRA or IA3 adapters to switch off (BitFit and full finetuning "
            "change the base weights themselves)"
        )
    for m in adapted:
        m.active = False
    try:
        yield model
    finally:
        for m in adapted:
            m.active = True


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its linear and dequantize every NF4 base, leaving a plain model (for
    export)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (LoRALinear, IA3Linear)):
            _replace(model, name, module.merged())
        elif isinstance(module, nf4.NF4Linear) and not _inside_adapter(model, name):
            _replace(model, name, module.dequantized())
    return model


def _inside_adapter(model: nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0]
    return bool(parent) and isinstance(model.get_submodule(parent), (LoRALinear, IA3Linear))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    new.train(model.training)  # an adapter swapped into a model in eval mode is in eval mode (no dropout)
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
