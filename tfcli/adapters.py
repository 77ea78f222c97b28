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
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import UserError
from .models import kinds, nf4
from .models.blocks import MLP, Attention, linear
from .models.latent_attention import LatentAttention
from .models.moe import StackedExperts, moe_layers

if TYPE_CHECKING:  # the recipe reads this table (methods' defaults): adapters does not import it back
    from .recipe import AdapterConfig


def linear_parts(model: nn.Module, name: str, module: nn.Linear) -> tuple[tuple[str, int], ...] | None:
    """The parts a block's linear holds and their widths, in output order (None for a linear outside
    the blocks): an attention's layout (grouped-query attention's k and v narrower than q), or the
    MLP's one part."""
    ask = getattr(model, "linear_parts", None)  # a model that names its linears itself (models/generic.py)
    if ask is not None:
        return ask(name, module)
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, LatentAttention) and leaf in ("q", "q_a", "q_b", "kv_a", "kv_b", "out"):
        return parent.layout(leaf)
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
        # kept while a generation runs (held_for_generation): the merged weight, or else scaled_b()
        self.held_weight: Tensor | None = None
        self.held_b: Tensor | None = None
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

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:  # adapters.disabled: the base model alone
            return self.base(x)
        if self.held_weight is not None and not torch.is_grad_enabled():  # never in a step that trains
            return linear(x, self.held_weight, self.base.bias)
        flat = x.reshape(-1, x.size(-1))  # (N, in)
        dropped = self.drop(flat) if self.training and self.drop.p else flat
        h = F.linear(dropped, self.lora_a.flatten(0, 1))  # (N, parts * r)
        out = self.base(flat)  # (N, out); a frozen linear keeps nothing of it for backward
        # the update added in place into the product itself, not into a view of it (the base's output
        # for (..., in) inputs): in place into a view, autograd's backward copies the output-sized
        # gradient twice (CopySlices); out of place, the forward copies the output into fresh memory
        held = self.held_b is not None and not torch.is_grad_enabled()  # never in a step that trains B
        b = self.held_b if held else self.scaled_b()
        out.addmm_(h.to(out.dtype), b.t().to(out.dtype))
        return out.view(*x.shape[:-1], out.size(-1))

    def merged(self) -> nn.Linear:
        """A plain linear: the base (dequantized if NF4) plus the update, in full precision."""
        base = self.base.dequantized() if isinstance(self.base, nf4.NF4Linear) else self.base
        with torch.no_grad():
            base.weight.copy_(self.merged_weight(base.weight))
        return base

    def merged_weight(self, weight: Tensor | None = None) -> Tensor:
        """A new tensor of the base's weight (dequantized if NF4) plus the update (in one fused product,
        in fp32, rounded once to the weight's dtype): what `merged` writes and a CPU generation reads."""
        if weight is None:
            weight = self.base.dense_weight() if isinstance(self.base, nf4.NF4Linear) else self.base.weight
        with torch.no_grad():
            return torch.addmm(weight.float(), self.scaled_b(), self.lora_a.flatten(0, 1)).to(weight.dtype)


class ExpertLoRA(nn.Module):
    """LoRA on a mixture's experts (adapter.experts): one rank-r update per expert for each targeted part
    (gate, up, down), stacked like the experts: A (E, r, in), B (E, out, r), B zero at init. Each expert
    trains only on the tokens routed to it."""

    def __init__(self, experts: StackedExperts, parts: tuple[str, ...], cfg: AdapterConfig):
        super().__init__()
        self.active = True  # False inside adapters.disabled(model)
        self.scale, self.drop = cfg.alpha / cfg.rank, nn.Dropout(cfg.dropout)
        self.lora_a, self.lora_b = nn.ParameterDict(), nn.ParameterDict()
        for part in parts:
            n, out, inner = experts.shape_of(part)
            a = torch.empty(n, cfg.rank, inner)
            for e in range(n):  # each expert's A as LoRALinear initialises one
                nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
            self.lora_a[part], self.lora_b[part] = nn.Parameter(a), nn.Parameter(torch.zeros(n, out, cfg.rank))

    def product(self, x: Tensor, counts: list[int], part: str) -> Tensor | None:
        """x (N, in), rows grouped by expert (counts[e] each) -> each row's expert's update of `part`
        (N, out), or None where the part has no adapters."""
        if not self.active or part not in self.lora_a:
            return None
        a, b = self.lora_a[part], self.lora_b[part] * self.scale
        pieces = [(rows @ a[e].t()) @ b[e].t() for e, rows in enumerate(self.drop(x).split(counts)) if counts[e]]
        return torch.cat(pieces) if pieces else x.new_zeros(0, b.shape[1])

    def delta(self, part: str) -> Tensor:
        """(E, out, in): every expert's update of `part`."""
        return (self.lora_b[part] * self.scale) @ self.lora_a[part]


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


@dataclass(frozen=True)
class Method:
    """One finetuning method (finetune.train, --train): how it is applied to a model and what the rest
    of tfcli asks of it, so that no module outside this table compares a method's name (torchtune's
    peft utilities: an adapter module, the parameters it trains, switching it off). A new method, or a
    new kind of adapter, is one record here."""

    name: str
    apply: Callable[..., int]  # (model, cfg, skip: module-name prefixes left alone) -> linears adapted
    backbone_trains: bool = True  # False: the model is frozen and only the task's head trains (a linear probe)
    whole: bool = False  # every weight trains: a run saves its whole model (else only what it trains)
    switchable: bool = False  # its adapters switch off to give the base back (a DPO/GRPO `base` reference)
    quantized: bool = False  # the block linears are held frozen in 4-bit NF4: needs a pretrained base
    peft: bool = False  # export --peft writes its adapters as a PEFT LoRA
    flops: float = 4.0  # a step's FLOPs per token in forward passes: 6 with every weight's gradient, 2 for a head
    defaults_from: str = ""  # the recipe's `methods` entry it takes when it has none of its own
    memory_hint: str = "--train qlora"  # what a run that does not fit train.memory_limit may try


def _full(model: nn.Module, cfg: AdapterConfig, skip: tuple[str, ...] = ()) -> int:
    return 0


def _frozen(model: nn.Module, cfg: AdapterConfig, skip: tuple[str, ...] = ()) -> int:
    model.requires_grad_(False)
    return 0


def _projector(model: nn.Module, cfg: AdapterConfig, skip: tuple[str, ...] = ()) -> int:
    """LLaVA's first stage: the projector between a vision-language model's tower and decoder alone."""
    bridge = getattr(model, "projector", None)
    if bridge is None:
        raise UserError("this model has no projector (a vision-language model's) to train alone")
    model.requires_grad_(False)
    bridge.requires_grad_(True)
    return 0


def _norms_and_biases(model: nn.Module, cfg: AdapterConfig, skip: tuple[str, ...] = ()) -> int:
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            m.requires_grad_(True)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.requires_grad_(True)
    return 0


def _adapted(wrap: Callable[[nn.Module, list, frozenset, AdapterConfig], nn.Module | None], quantize: bool = False):
    """A method that swaps `wrap(linear, parts, part names, cfg)` (None: leave it) into the block linears,
    each first frozen in NF4 when `quantize`; the rest of the model frozen."""

    def apply(model: nn.Module, cfg: AdapterConfig, skip: tuple[str, ...] = ()) -> int:
        model.requires_grad_(False)
        count = 0
        for name, module in list(model.named_modules()):
            if name.startswith(skip):  # a part left frozen as it is (a vision tower)
                continue
            parts = linear_parts(model, name, module) if isinstance(module, nn.Linear) else None
            if parts is None:
                continue
            if quantize and nf4.quantizable(module):
                module = nf4.NF4Linear(module)  # every block linear frozen in NF4, adapted or not
                _replace(model, name, module)
            adapter = wrap(module, parts, frozenset(p for p, _ in parts), cfg)
            if adapter is not None:
                _replace(model, name, adapter)
                count += 1
        count += _adapt_experts(model, cfg, wrap is _lora, quantize)
        if not count:
            found = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise UserError(
                f"adapter.targets {', '.join(cfg.targets)} match no linear of this model (its linears: "
                f"{', '.join(found[:8])}{', ...' if len(found) > 8 else ''}); name other parts, or all-linear"
            )
        return count

    return apply


def frozen_in_nf4(model: nn.Module) -> nn.Module:
    """`model` frozen with every block linear and expert in NF4, as QLoRA holds its base, and nothing
    adapted: a model the loss only reads (a distillation teacher) in about a quarter of its memory.
    The embeddings, norms and output layer keep their precision."""
    model.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and linear_parts(model, name, module) is not None and nf4.quantizable(module):
            _replace(model, name, nf4.NF4Linear(module))
    for stack in model.modules():
        if isinstance(stack, StackedExperts) and not stack.quantized:
            stack.quantize()
    return model


def holds_nf4(model: nn.Module) -> bool:
    return any(isinstance(m, nf4.NF4Linear) for m in model.modules())


def _adapt_experts(model: nn.Module, cfg: AdapterConfig, lora: bool, quantize: bool) -> int:
    """A mixture's experts: frozen in NF4 with the rest of the block (qlora), and with adapter.experts
    given per-expert LoRA on the targeted gate / up / down; -> how many expert stacks were adapted."""
    stacks = [m for m in model.modules() if isinstance(m, StackedExperts)]
    experts = bool(cfg is not None and cfg.experts)  # IA3 runs without adapter settings
    if experts and not stacks:
        raise UserError("adapter.experts: this model has no mixture of experts")
    parts = tuple(p for p in ("gate", "up", "down") if p in cfg.parts) if experts else ()
    if experts and not (lora and parts):
        raise UserError(
            "adapter.experts puts LoRA on the experts' gate, up and down: use --train lora or qlora with "
            "adapter.targets naming some of them"
        )
    for stack in stacks:
        if quantize:
            stack.quantize()
        if experts:
            stack.adapters = ExpertLoRA(stack, parts, cfg)
    return len(stacks) if experts else 0


def _lora(linear: nn.Module, parts: list, names: frozenset, cfg: AdapterConfig) -> nn.Module | None:
    return LoRALinear(linear, parts, cfg.parts, cfg) if names & set(cfg.parts) else None


def _ia3(linear: nn.Module, parts: list, names: frozenset, cfg: AdapterConfig) -> nn.Module | None:
    if names & {"k", "v"} or names == {"down"}:
        return IA3Linear(linear, parts, on_input=names == {"down"})
    return None


METHODS = {
    m.name: m
    for m in (
        Method("all", _full, whole=True, flops=6.0, memory_hint="--train lora or qlora, or optim.name adamw8bit"),
        Method("head", _frozen, backbone_trains=False, flops=2.0),
        Method("lora", _adapted(_lora), switchable=True, peft=True),
        Method(
            "qlora",
            _adapted(_lora, quantize=True),
            switchable=True,
            quantized=True,
            peft=True,
            defaults_from="lora",
            memory_hint="a larger train.memory_limit",
        ),
        Method("ia3", _adapted(_ia3), switchable=True),
        Method("bitfit", _norms_and_biases),
        Method("projector", _projector, memory_hint="a larger train.memory_limit"),
    )
}


def method(name: str) -> Method:
    """The record of finetune.train `name` (the recipe has already checked it is one)."""
    return METHODS[name]


def check_base(name: str, pretrained: bool) -> None:
    """QLoRA freezes a pretrained base in 4-bit NF4 and trains adapters on it: on a fresh model the base
    is random weights that never train (and a fresh run saves its whole model, which NF4 cannot be)."""
    if method(name).quantized and not pretrained:
        raise UserError(
            f"--train {name} freezes a pretrained model in 4-bit NF4 and trains LoRA adapters on it: give "
            f"--from MODEL (on a fresh model the frozen base would be random weights), or --train lora or all"
        )


def apply(
    model: nn.Module, name: str, cfg: AdapterConfig, freeze_router: bool = False, train_vision: bool = False
) -> int:
    """Apply finetune.train `name` to the model with the recipe's adapter settings: adapters swapped into
    its block linears (lora, qlora, ia3) and what the method does not train frozen; return how many
    linears were adapted. The caller keeps the task's heads trainable. freeze_router: a mixture of
    experts' routers keep their pretrained weights whatever the method (the adapter methods freeze
    them anyway). A vision-language model's tower stays frozen, without adapters, unless
    train_vision; its projector trains with every method that trains the model (as LLaVA's does)."""
    tower = getattr(model, "vision", None) if kinds.reads_images(model) else None
    if train_vision and tower is None:
        raise UserError("finetune.train_vision: this model has no vision tower")
    try:
        count = method(name).apply(model, cfg, () if train_vision or tower is None else ("vision.",))
    except UserError as e:
        raise UserError(f"--train {name}: {e}") from None
    for layer in moe_layers(model) if freeze_router else ():
        layer.router.requires_grad_(False)
    if tower is not None:
        if not train_vision:
            tower.requires_grad_(False)
        if method(name).backbone_trains:
            model.projector.requires_grad_(True)
    return count


def adapted_modules(model: nn.Module) -> str:
    """Which modules carry adapters, for the run's first lines: their names with the layer number
    left out, and how many there are ("" when none): `12 modules: attn.qkv, mlp.up (in each of 6 layers)`."""
    names = [n for n, m in model.named_modules() if isinstance(m, (LoRALinear, IA3Linear, ExpertLoRA))]
    if not names:
        return ""
    shapes = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names)  # each layer's names, once
    stems = [s.split(".*.", 1)[-1] for s in shapes]
    layers = len(names) // max(len(shapes), 1)
    each = f" (in each of {layers} layers)" if len(shapes) * layers == len(names) and layers > 1 else ""
    return f"{len(names)} modules: {', '.join(dict.fromkeys(stems))}{each}"


@contextlib.contextmanager
def disabled(model: nn.Module):
    """The base model inside the block: every LoRA and IA3 adapter passes its input to the frozen
    linear alone (torchtune's disable_adapter; a preference-tuning reference without a second copy).
    BitFit trains the base's own biases and norms, so it has no adapter-free base: refused."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRALinear, IA3Linear, ExpertLoRA))]
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


MERGED_GENERATION_BYTES = 2 << 30  # the most a generation's full-precision copies of linears may take


@contextlib.contextmanager
def held_for_generation(model: nn.Module):
    """Inside it (a generation: no weight changes, no gradient), the LoRA linears do not form their
    update at every token, nor the NF4 linears dequantize their weight. On the CPU, each LoRA linear
    holds its weight merged with its update (the weight export writes, bit for bit; an NF4 base's
    dequantized first, as export does), and each other NF4 linear its dequantized weight (what its
    forward computes, bit for bit), so a decoding step reads one matrix a linear: the two small products
    a LoRA linear adds cost a sixth of a LoRA-adapted SmolLM2's decoding, 8 rows a token, and
    dequantizing a QLoRA base at every token most of it (docs/results/measured.md); TRL's vLLM path
    samples from merged weights too. The copies last the generation, up to MERGED_GENERATION_BYTES in
    all (the gain is a fixed cost a linear, the copy grows with the model). Elsewhere (a GPU, a sharded
    base, a larger model) each LoRA linear keeps its scaled B instead: the scaling and block-diagonal
    layout were a quarter of a LoRA linear's time."""
    held = [m for m in model.modules() if isinstance(m, LoRALinear) and m.active]
    merged_bases = {id(m.base) for m in held}
    quantized = [m for m in model.modules() if isinstance(m, nf4.NF4Linear) and id(m) not in merged_bases]
    copies = all(_copyable(m.base) for m in held) and all(_copyable(q) for q in quantized)
    size = sum(_dense_bytes(m.base) for m in held) + sum(_dense_bytes(q) for q in quantized)
    copies = copies and size <= MERGED_GENERATION_BYTES
    with torch.no_grad():
        for m in held:
            if copies:
                m.held_weight = m.merged_weight()
            else:
                m.held_b = m.scaled_b()
        for q in quantized if copies else ():
            q.dense = q.dense_weight()
    try:
        yield
    finally:
        for m in held:
            m.held_weight = m.held_b = None
        for q in quantized:
            q.dense = None


def _copyable(linear: nn.Module) -> bool:
    """Whether a generation may hold a full-precision copy of the linear's weight: a plain weight or
    a whole NF4 one (not a process's share), on the CPU."""
    if isinstance(linear, nf4.NF4Linear):
        return not linear.sharded() and linear.weight.device.type == "cpu"
    weight = getattr(linear, "weight", None)
    dense = isinstance(weight, Tensor) and type(weight.data) is Tensor and weight.is_floating_point()
    return dense and weight.device.type == "cpu"


def _dense_bytes(linear: nn.Module) -> int:
    return linear.dense_bytes() if isinstance(linear, nf4.NF4Linear) else linear.weight.nbytes


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its linear and dequantize every NF4 base, leaving a plain model (for
    export)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (LoRALinear, IA3Linear)):
            _replace(model, name, module.merged())
        elif isinstance(module, nf4.NF4Linear) and not _inside_adapter(model, name):
            _replace(model, name, module.dequantized())
        elif isinstance(module, StackedExperts):
            module.merge_adapters()
    return model


def _inside_adapter(model: nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0]
    return bool(parent) and isinstance(model.get_submodule(parent), (LoRALinear, IA3Linear))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    new.train(model.training)  # an adapter swapped into a model in eval mode is in eval mode (no dropout)
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
