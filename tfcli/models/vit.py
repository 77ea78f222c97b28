"""Vision Transformer encoder and the MAE decoder, built from the shared blocks.

The encoder (`ViT`) returns hidden states; the MAE decoder (`MAEDecoder`) turns the encoded
visible patches back into pixels of every patch. The decoder is an objective head: it lives in
the MAE objective's heads and is dropped after pretraining. Patchify, unpatchify and random
masking are pure functions so that the objective, the pictures and the tests share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .blocks import MLP, Attention, Block, check_config, dense_flops_per_token, make_norm, through_blocks
from .kinds import VISION_ENCODER
from .pooling import vision_features, vision_layer_features


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a ViT encoder plus its MAE decoder (decoder_* fields, mask_ratio, norm_pix_loss)."""

    family: str = "vit"
    image_size: int = 32
    patch_size: int = 4
    channels: int = 3
    n_layer: int = 6
    n_head: int = 3
    d_model: int = 192
    d_ff: int = 768
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    pos_embed: Literal["learned", "sincos"] = "sincos"  # learned 1-D, or MAE's fixed 2-D sin-cos
    stem: Literal["patch", "conv"] = "patch"  # patchify (P x P, stride P), or Xiao et al.'s 3x3 stride-2 convolutions
    cls_token: bool = True  # a [CLS] token before the patches (SigLIP: none)
    patch_bias: bool = True  # the patch projection's bias (CLIP: none)
    pre_norm: bool = False  # a LayerNorm of the embeddings before the blocks (CLIP's pre_layrnorm)
    activation: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"  # the MLP's (CLIP: quick_gelu; SigLIP: gelu_tanh)
    decoder_d_model: int = 128
    decoder_n_layer: int = 2
    decoder_n_head: int = 4
    decoder_d_ff: int = 512
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False

    def __post_init__(self):
        check_config(self)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"model.image_size ({self.image_size}) must be a multiple of model.patch_size ({self.patch_size})"
            )
        for d, h, name in ((self.d_model, self.n_head, ""), (self.decoder_d_model, self.decoder_n_head, "decoder_")):
            if d % h:
                raise ValueError(f"model.{name}d_model ({d}) must be divisible by model.{name}n_head ({h})")
            if self.pos_embed == "sincos" and d % 4:
                raise ValueError(f"model.{name}d_model ({d}) must be divisible by 4 for sin-cos positions")
        if not 0.0 <= self.mask_ratio < 1.0:
            raise ValueError(f"model.mask_ratio must be in [0, 1), got {self.mask_ratio}")
        if not self.cls_token and self.pos_embed == "sincos":
            raise ValueError("model.pos_embed sincos keeps a row for [CLS]: a ViT without one has learned positions")
        if self.stem == "conv" and (self.patch_size < 2 or self.patch_size & (self.patch_size - 1)):
            raise ValueError(
                f"model.stem conv halves the image log2(patch_size) times: model.patch_size must be a "
                f"power of 2 (>= 2), got {self.patch_size}"
            )

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid**2


# --- pure functions -----------------------------------------------------------------------------


def patchify(pixels: Tensor, patch: int) -> Tensor:
    """(B, C, H, W) -> (B, N, P*P*C), patches in raster order, each flattened as (row, col, channel)."""
    B, C, H, W = pixels.shape
    h, w = H // patch, W // patch
    x = pixels.reshape(B, C, h, patch, w, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, h * w, patch * patch * C)


def unpatchify(patches: Tensor, patch: int, channels: int = 3) -> Tensor:
    """(B, N, P*P*C) -> (B, C, H, W): the exact inverse of patchify for a square grid."""
    B, N, _ = patches.shape
    g = int(round(N**0.5))
    x = patches.reshape(B, g, g, patch, patch, channels)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(B, channels, g * patch, g * patch)


def n_visible(n_patches: int, mask_ratio: float) -> int:
    """Patches the encoder sees: round(N * (1 - mask_ratio)), at least one."""
    return max(1, int(round(n_patches * (1.0 - mask_ratio))))


def random_masking(noise: Tensor, mask_ratio: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample shuffle by sorting noise (B, N); keep the lowest-noise patches (official MAE).

    Returns ids_keep (B, K) of visible patches, ids_restore (B, N) that undoes the shuffle,
    and mask (B, N) with 1 on masked patches and 0 on visible ones.
    """
    B, N = noise.shape
    keep = n_visible(N, mask_ratio)
    ids_shuffle = torch.argsort(noise, dim=1)  # (B, N) ascending noise: small is kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)  # (B, N)
    mask = torch.ones(B, N, device=noise.device)
    mask[:, :keep] = 0
    mask = torch.gather(mask, 1, ids_restore)  # (B, N) back in raster order
    return ids_shuffle[:, :keep], ids_restore, mask


def sincos_2d(grid: int, dim: int) -> Tensor:
    """Fixed 2-D sin-cos positions (1, 1 + grid*grid, dim), a zero row for [CLS] first.

    Layout as in the official MAE code (and so in its released weights): the first half encodes
    the column, the second half the row, each as [sin | cos] over dim/4 frequencies.
    """
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))  # (dim/4,)
    rows, cols = torch.meshgrid(
        torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64), indexing="ij"
    )
    c = cols.flatten().outer(omega)  # (N, dim/4)
    r = rows.flatten().outer(omega)
    emb = torch.cat([c.sin(), c.cos(), r.sin(), r.cos()], dim=1)  # (N, dim)
    return torch.cat([torch.zeros(1, dim, dtype=torch.float64), emb]).float()[None]


# --- modules ------------------------------------------------------------------------------------


def _blocks(
    n: int, d: int, heads: int, d_ff: int, eps: float, dropout: float, activation: str = "gelu"
) -> nn.ModuleList:
    """Pre-norm shared blocks (exact GELU in ViT and MAE; CLIP's quick GELU, SigLIP's tanh GELU)."""
    return nn.ModuleList(
        Block(
            Attention(d, heads, bias=True, dropout=dropout),
            MLP(d, d_ff, activation=activation, bias=True, dropout=dropout),
            make_norm("layernorm", d, eps),
            make_norm("layernorm", d, eps),
            prenorm=True,
            dropout=dropout,
        )
        for _ in range(n)
    )


def _positions(module: nn.Module, cfg: ViTConfig, dim: int) -> None:
    """Learned 1-D positions (a parameter) or fixed 2-D sin-cos (a buffer, recomputed, not saved)."""
    if cfg.pos_embed == "learned":
        module.pos_embed = nn.Parameter(torch.zeros(1, cfg.n_patches + int(cfg.cls_token), dim))
        nn.init.trunc_normal_(module.pos_embed, std=0.02)
    else:
        module.register_buffer("pos_embed", sincos_2d(cfg.grid, dim), persistent=False)


def _init_linear_(module: nn.Module) -> None:
    """MAE initialisation: xavier-uniform linear layers, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class ChannelNorm(nn.Module):
    """LayerNorm over the channels of every position of a (B, C, H, W) map: independent of the batch,
    the same in training and evaluation."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvStem(nn.Module):
    """Xiao et al. 2021 ("Early convolutions help transformers see better"): log2(P) convolutions of
    3x3, stride 2, each followed by a norm and ReLU (channels doubling up to D), then a 1x1 projection
    to D: the same (H/P) x (W/P) token grid as P x P patches.

    `keep` (B, 1, H, W), 1 on the pixels of visible patches: MAE's encoder may not see a masked patch,
    and a 3x3 convolution reaches across patch borders, so masked pixels are zeroed before every
    convolution (ConvMAE's masked convolution)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        steps = cfg.patch_size.bit_length() - 1  # log2(P)
        widths = [max(8, cfg.d_model >> (steps - i)) for i in range(1, steps + 1)]  # ..., D/2, D
        layers, c = [], cfg.channels
        for w in widths:
            layers.append(
                nn.ModuleDict(
                    {
                        "conv": nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False),
                        "norm": ChannelNorm(w, cfg.layer_norm_eps),
                    }
                )
            )
            c = w
        self.layers = nn.ModuleList(layers)
        self.proj = nn.Conv2d(c, cfg.d_model, 1)

    def forward(self, pixels: Tensor, keep: Tensor | None = None) -> Tensor:
        """(B, C, H, W) -> (B, D, H/P, W/P)."""
        x = pixels
        for layer in self.layers:
            if keep is not None:
                x = x * nn.functional.interpolate(keep, size=x.shape[-2:], mode="nearest")
            x = torch.relu(layer["norm"](layer["conv"](x)))
        return self.proj(x)


class ViT(nn.Module):
    """ViT encoder: Conv2d patchify (kernel = stride = P) or a convolutional stem, [CLS], positions,
    pre-norm blocks. The switches of CLIP's and SigLIP's vision towers (a vision-language model's
    encoder, models/vlm.py): no [CLS] (SigLIP), no patch bias and a norm before the blocks (CLIP), their
    activations."""

    kind = VISION_ENCODER
    features, layer_features = vision_features, vision_layer_features  # what a classifier / probe reads
    special_tokens = ()  # reads pixels
    poolings = ("cls", "mean")

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = (
            nn.Conv2d(cfg.channels, cfg.d_model, cfg.patch_size, stride=cfg.patch_size, bias=cfg.patch_bias)
            if cfg.stem == "patch"
            else ConvStem(cfg)
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if cfg.cls_token else None
        _positions(self, cfg, cfg.d_model)
        self.pre_norm = make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps) if cfg.pre_norm else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = _blocks(
            cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_ff, cfg.layer_norm_eps, cfg.dropout, cfg.activation
        )
        self.norm = make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps)
        _init_linear_(self)
        if cfg.stem == "patch":
            w = self.patch_embed.weight
            nn.init.xavier_uniform_(w.view(w.size(0), -1))  # like a linear layer on flattened patches
            if cfg.patch_bias:
                nn.init.zeros_(self.patch_embed.bias)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)

    def embed(self, pixels: Tensor, ids_keep: Tensor | None = None) -> Tensor:
        """(B, C, H, W) -> (B, 1 + K, D): [CLS] then the kept patches (all N if ids_keep is None); a
        tower without [CLS], (B, K, D). CLIP's norm of the embeddings applied."""
        B, _, H, W = pixels.shape
        if H != self.cfg.image_size or W != self.cfg.image_size:
            raise ValueError(f"images are {H}x{W}, the model takes {self.cfg.image_size}x{self.cfg.image_size}")
        x = self.tokens(pixels, ids_keep).flatten(2).transpose(1, 2)  # (B, N, D)
        cls_rows = int(self.cls_token is not None)
        x = x + self.pos_embed[:, cls_rows:]
        if ids_keep is not None:
            x = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, x.size(-1)))  # (B, K, D)
        if self.cls_token is not None:
            cls = (self.cls_token + self.pos_embed[:, :1]).expand(B, -1, -1)  # (B, 1, D)
            x = torch.cat([cls.to(x.dtype), x], dim=1)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        return self.drop(x)

    def describe(self) -> str:
        """A line for the run's banner: the stem, its tokens and its parameters."""
        params = sum(p.numel() for p in self.patch_embed.parameters())
        patchify = self.cfg.patch_size**2 * self.cfg.channels * self.cfg.d_model + self.cfg.d_model
        what = (
            "patchify"
            if self.cfg.stem == "patch"
            else f"convolutional stem ({len(self.patch_embed.layers)} 3x3 "
            f"stride-2 convolutions + 1x1; patchify would have {patchify:,})"
        )
        return f"{what}: {self.cfg.n_patches} tokens ({self.cfg.grid}x{self.cfg.grid}) + [CLS], {params:,} parameters"

    def tokens(self, pixels: Tensor, ids_keep: Tensor | None = None) -> Tensor:
        """The stem: (B, C, H, W) -> (B, D, H/P, W/P). A convolutional stem given the kept patches sees
        only their pixels."""
        if self.cfg.stem == "patch" or ids_keep is None:
            return self.patch_embed(pixels)
        g, p = self.cfg.grid, self.cfg.patch_size
        keep = torch.zeros(pixels.size(0), g * g, device=pixels.device).scatter_(1, ids_keep, 1.0)  # (B, N)
        keep = keep.view(-1, 1, g, g).repeat_interleave(p, 2).repeat_interleave(p, 3)  # (B, 1, H, W)
        return self.patch_embed(pixels, keep)

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """Training FLOPs per token of seq_len tokens ([CLS] and seq_len - 1 patches): the blocks, and
        the patch projection on the patches."""
        cfg = self.cfg
        embed = cfg.d_model * cfg.channels * cfg.patch_size**2 * (seq_len - 1) / seq_len
        return dense_flops_per_token(self.blocks, cfg.n_layer, seq_len, cfg.d_model) + 6.0 * embed

    def forward_features(self, pixels: Tensor, ids_keep: Tensor | None = None, all_layers: bool = False):
        """Normalised hidden states (B, 1 + K, D); only the kept patches enter the blocks. all_layers: the
        embeddings and every block's output (n_layer + 1), each normalised (a probe of every depth)."""
        x = self.embed(pixels, ids_keep)
        return through_blocks(x, self.blocks, lambda i, block, h: block(h), all_layers, self.norm)

    def forward(self, pixels: Tensor, ids_keep: Tensor | None = None) -> Tensor:
        return self.forward_features(pixels, ids_keep)

    @staticmethod
    def pool(hidden: Tensor, how: str = "cls") -> Tensor:
        """(B, 1 + N, D) -> (B, D): the [CLS] vector or the mean of the patch vectors."""
        return hidden[:, 0] if how == "cls" else hidden[:, 1:].mean(dim=1)


class MAEDecoder(nn.Module):
    """Narrow decoder: visible tokens + a shared mask token at each masked position -> pixels."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        d = cfg.decoder_d_model
        self.cfg = cfg
        self.embed = nn.Linear(cfg.d_model, d)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, d))
        _positions(self, cfg, d)
        self.blocks = _blocks(
            cfg.decoder_n_layer, d, cfg.decoder_n_head, cfg.decoder_d_ff, cfg.layer_norm_eps, cfg.dropout
        )
        self.norm = make_norm("layernorm", d, cfg.layer_norm_eps)
        self.pred = nn.Linear(d, cfg.patch_size**2 * cfg.channels)
        _init_linear_(self)
        nn.init.normal_(self.mask_token, std=0.02)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the decoder's seq_len tokens (every position: visible and masked)."""
        return dense_flops_per_token(self, self.cfg.decoder_n_layer, seq_len, self.cfg.decoder_d_model)

    def forward(self, latent: Tensor, ids_restore: Tensor) -> Tensor:
        """latent (B, 1 + K, D), ids_restore (B, N) -> predicted patches (B, N, P*P*C) in raster order."""
        x = self.embed(latent)  # (B, 1 + K, d)
        B, N = ids_restore.shape
        d = x.size(-1)
        masks = self.mask_token.expand(B, N - (x.size(1) - 1), d)  # (B, N - K, d)
        x_ = torch.cat([x[:, 1:], masks], dim=1)  # (B, N, d) in shuffled order
        x_ = torch.gather(x_, 1, ids_restore[..., None].expand(-1, -1, d))  # (B, N, d) raster order
        x = torch.cat([x[:, :1], x_], dim=1) + self.pos_embed  # (B, 1 + N, d)
        for block in self.blocks:
            x = block(x)
        return self.pred(self.norm(x))[:, 1:]  # (B, N, P*P*C)
