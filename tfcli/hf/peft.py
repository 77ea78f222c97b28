"""A LoRA run as a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`), unmerged, that
`peft.PeftModel.from_pretrained(base, OUT)` applies to the transformers model the run started from.

tfcli keeps one A (r x in) and one block of B per adapted part of a fused projection; PEFT keeps one
LoRA per transformers module. The family's weight table says which transformers module each part
is (`model.blocks.0.attn.qkv` -> q_proj, k_proj, v_proj), so each part's A and B become that
module's lora_A and lora_B, with the same alpha / r.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from .. import adapters
from ..errors import UserError
from .convert import check_writable, write_dir

TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder-decoder": "SEQ_2_SEQ_LM", "text-encoder": "FEATURE_EXTRACTION"}


def adapter_tensors(model, rules) -> tuple[dict[str, Tensor], set[str]]:
    """PEFT's lora_A / lora_B tensors of every LoRA linear, and the transformers modules they adapt."""
    by_ours = {r.ours: r for r in rules}
    tensors, modules = {}, set()
    for name, module in model.named_modules():
        if not isinstance(module, adapters.LoRALinear):
            continue
        rule = by_ours.get(f"model.{name}.weight")
        if rule is None or len(rule.theirs) != len(module.parts) or rule.part[1] > 1:
            raise UserError(
                f"export --peft: tfcli's {name} holds {', '.join(module.parts)} in one transformers module "
                f"here, which a PEFT LoRA of rank r cannot hold; export --hf writes the merged model"
            )
        b_rows = iter(module.lora_b.split(module.adapted))
        a_rows = iter(module.lora_a)
        for theirs, on in zip(rule.theirs, module.enabled):
            if not on:
                continue
            target = theirs[: -len(".weight")]
            tensors[f"base_model.model.{target}.lora_A.weight"] = next(a_rows).detach().clone()  # (r, in)
            tensors[f"base_model.model.{target}.lora_B.weight"] = next(b_rows).detach().clone()  # (out, r)
            modules.add(target.rsplit(".", 1)[-1])
    return tensors, modules


def check(backbone, recipe, rules, out: Path) -> None:
    """Everything export refuses, checked before a base is written beside the adapters."""
    _adapters(backbone, recipe, rules, out)


def export(backbone, recipe, rules, base: str, out: Path) -> None:
    """Write the run's LoRA adapters as a PEFT directory over `base` (the run's --from model)."""
    tensors, modules = _adapters(backbone, recipe, rules, out)
    write_peft(recipe, backbone, tensors, modules, base, out)


def _adapters(backbone, recipe, rules, out: Path):
    """The run's PEFT tensors and target modules; a one-line refusal for a run that has none."""
    ft = recipe.finetune if recipe is not None else None
    if ft is None or not adapters.method(ft.train).peft:
        raise UserError(
            f"export --peft writes LoRA adapters; this run trained {ft.train if ft else 'from scratch'} "
            f"(export --hf writes the whole model)"
        )
    if backbone.heads:
        raise UserError(
            "export --peft: this LoRA run also trained a classifier head, which a PEFT adapter of the "
            "base model does not hold; export --hf writes the merged model with it"
        )
    check_writable(out)
    tensors, modules = adapter_tensors(backbone.model, rules)
    if not tensors:
        raise UserError("export --peft: this run has no LoRA adapters")
    return tensors, modules


def write_peft(recipe, backbone, tensors: dict, modules: set, base: str, out: Path) -> None:
    a = recipe.adapter
    config = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES.get(backbone.model.kind),
        "base_model_name_or_path": base,
        "r": a.rank,
        "lora_alpha": a.alpha,
        "lora_dropout": a.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    write_dir(
        out,
        {},
        tensors,
        {"adapter_config.json": json.dumps(config, indent=2)},
        weights="adapter_model.safetensors",
        config_name=None,
    )
