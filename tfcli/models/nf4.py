"""A frozen linear whose weight is kept in 4-bit NormalFloat (NF4, Dettmers et al. 2023, QLoRA), built
with torchao's NF4 tensor as torchtune's FrozenNF4Linear is: blocks of 64 weights share a scale, the
scales themselves quantized to 8 bits in blocks of 256 (or 128, 64 where 256 does not divide them),
about 4.1 bits a weight. The weight is
dequantized block by block inside the matmul; the gradient flows to the input only (the base is
frozen; QLoRA trains adapters beside it).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BLOCK, SCALER_BLOCKS = 64, (256, 128, 64, 32, 16, 8)  # torchao's (and the QLoRA paper's) 64 and 256;
# smaller scaler blocks where 256 does not divide a matrix's blocks (SmolLM2's 576-wide attention)
SHARDABLE = 8  # the scales come in a number of groups 8 divides, so FSDP can split them over 2, 4 or 8 processes


def quiet_torchao(module: str):
    """A torchao module, imported without its notes about CUDA kernel libraries a CPU cannot load."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return __import__(module, fromlist=["_"])
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _nf4():
    return quiet_torchao("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


def scaler_block(linear: nn.Linear) -> int:
    """The largest scaler block (of 256 down to 8) that divides the weight's blocks of 64 into a number
    of groups SHARDABLE divides (FSDP splits every part of an NF4 weight in equal shares), else the
    largest that divides them; 0: the weight cannot be held in NF4 (torchao needs whole blocks of both)."""
    n = linear.weight.numel()
    if n % BLOCK:
        return 0
    blocks = n // BLOCK
    dividing = [s for s in SCALER_BLOCKS if blocks % s == 0]
    return next((s for s in dividing if (blocks // s) % SHARDABLE == 0), dividing[0] if dividing else 0)


def unshardable(module: nn.Module, shares: int) -> str:
    """The first NF4 weight FSDP cannot split into `shares` equal parts (its rows and every part of
    its codes and scales), as 'name (rows x columns)'; '' when each can be."""
    for name, w in module.named_parameters():
        w = w.to_local() if hasattr(w, "to_local") else w
        if hasattr(w, "scaler_block_size"):  # an NF4 weight: a linear's, or one expert's of a mixture
            rows, columns = w.shape
            if rows % shares or (w.n_blocks // w.scaler_block_size) % shares:
                return f"{name.removesuffix('.weight')} ({rows} x {columns})"
    return ""


def to_nf4(weight: Tensor):
    """A frozen (out, in) weight in NF4 (what NF4Linear holds), for weights that are not a linear's own
    (a mixture's stacked experts)."""
    probe = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    return _nf4().to_nf4(weight, BLOCK, scaler_block(probe))


def linear_nf4(x: Tensor, weight) -> Tensor:
    """x (..., in) @ an NF4 weight (out, in)^T, dequantized block by block."""
    return _nf4().linear_nf4(x, weight)


def quantizable(linear: nn.Linear) -> bool:
    return scaler_block(linear) > 0


class NF4Linear(nn.Module):
    """y = x W^T + b with W (out, in) in NF4, frozen, and b (if any) frozen in its own precision."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        weight = _nf4().to_nf4(base.weight.detach(), BLOCK, scaler_block(base))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
        self.dense: Tensor | None = None  # the dequantized weight, kept while a generation runs

    def forward(self, x: Tensor) -> Tensor:
        if self.dense is not None and not torch.is_grad_enabled():  # adapters.held_for_generation
            out = F.linear(x, self.dense.to(x.dtype))  # what linear_nf4 computes, dequantized once
        else:
            out = _nf4().linear_nf4(x, self.weight)  # (..., out)
        return out if self.bias is None else out + self.bias

    def dense_weight(self) -> Tensor:
        """The dequantized weight, in the precision it was quantized from (what export writes)."""
        return self.weight.get_original_weight()

    def dense_bytes(self) -> int:
        return self.weight.numel() * self.weight.dtype.itemsize

    def dequantized(self) -> nn.Linear:
        """A plain linear of the dequantized weight (what export writes)."""
        weight = self.dense_weight()
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=weight.device)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if self.bias is not None:
                plain.bias.copy_(self.bias)
        return plain.to(weight.dtype)

    def sharded(self) -> bool:
        return hasattr(self.weight, "to_local")  # FSDP made it a DTensor of this process's rows

    def held_weight(self) -> Tensor:
        """The NF4 weight this process holds: the whole one, or under FSDP its share."""
        return self.weight.to_local() if self.sharded() else self.weight

    def weight_bytes(self) -> int:
        """The memory the weight (its 4-bit codes, quantized scales and their factors) and bias take."""
        weight = self.held_weight()
        parts = [getattr(weight, name) for name in weight.__tensor_flatten__()[0]]
        if self.bias is not None:
            parts.append(self.bias)
        return sum(t.numel() * t.element_size() for t in parts)
