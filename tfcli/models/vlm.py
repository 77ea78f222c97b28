"""A vision-language model: tfcli's ViT reads the images, a small projector maps its features to the
decoder's width, and a llama-family decoder reads them in place of the image tokens of its prompt.

Two projectors, as the architectures tfcli reads and writes (hf/llava.py, hf/idefics3.py) have them:
  mlp      LLaVA: linear, activation, linear over each patch's features (the [CLS] dropped where
           the tower has one), from the hidden state of layer `feature_layer` (-2: the one before last)
  shuffle  Idefics3 / SmolVLM: the tower's normalised last layer, every scale x scale group of patches
           concatenated into one (pixel shuffle: scale^2 fewer, wider tokens), then one linear
The prompt holds `image_seq_len` image tokens for each frame (data/image_sft.py expands the marker);
forward() scatters the frames' features over them in order, as transformers' masked_scatter does.
The model is a decoder to every task: it generates, trains replies and scores like one, and its
`reads_images` tells the tasks that bring pixels that it takes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor, nn

from .blocks import ACTIVATIONS, KVCache
from .llama import Llama, LlamaConfig
from .pooling import DecoderTraits
from .vit import ViT, ViTConfig


@dataclass(frozen=True)
class ImageProcessing:
    """How images become a model's pixels (the `model.processing:` section of a vision-language recipe;
    data/image_processor.py does it, as transformers' image processors do)."""

    resize: Literal["shortest_edge", "square", "longest_edge"] = "square"
    size: int = 224
    crop: int = 0  # shortest_edge's centre crop
    resample: int = 3  # PIL's filter: 0 nearest, 1 Lanczos, 2 bilinear, 3 bicubic
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    split: bool = False  # longest_edge: cut the image into tiles, then the whole image
    tile: int = 0  # longest_edge: the tiles' side (and the whole image's); the vision tower's image size

    def __post_init__(self):
        if self.size < 1 or self.crop < 0 or self.tile < 0 or self.resample not in range(6):
            raise ValueError("model.processing: size >= 1, crop and tile >= 0, resample a PIL filter (0-5)")
        if self.resize == "longest_edge" and not self.tile:
            raise ValueError("model.processing.tile must be set for longest_edge resizing")
        if self.resize == "shortest_edge" and not self.crop:
            raise ValueError("model.processing.crop must be set for shortest_edge resizing (a square for the tower)")

    @property
    def side(self) -> int:
        """The side of every frame it makes."""
        return {"shortest_edge": self.crop, "square": self.size, "longest_edge": self.tile}[self.resize]


@dataclass(frozen=True)
class VLMConfig:
    """A vision tower, a projector and a decoder, and how images reach them."""

    family: str = "vlm"
    vision: ViTConfig = field(default_factory=lambda: ViTConfig(pos_embed="learned"))
    text: LlamaConfig = field(default_factory=LlamaConfig)
    processing: ImageProcessing = field(default_factory=lambda: ImageProcessing(size=32))
    projector: Literal["mlp", "shuffle"] = "mlp"
    projector_act: Literal["gelu", "gelu_tanh", "silu", "relu"] = "gelu"  # mlp's activation
    projector_bias: bool = True  # mlp's biases
    scale_factor: int = 2  # shuffle's: each side of a patch group
    feature_layer: int = -2  # the tower's hidden state the projector reads (0: the embeddings; -1: the last block's)
    drop_cls: bool = True  # the projector reads the patches only (LLaVA's "default" strategy)
    vision_norm: bool = False  # the tower's final norm on its features (Idefics3)
    image_token: str = "<image>"  # the token each frame's features replace
    image_token_id: int = -1  # its id in the tokenizer (-1: filled in from the tokenizer)
    hf_model_type: Literal["llava", "idefics3", "smolvlm"] = (
        "llava"  # the transformers architecture it came from / exports as
    )

    def __post_init__(self):
        layers = self.vision.n_layer
        if not -layers - 1 <= self.feature_layer <= layers:
            raise ValueError(f"model.feature_layer must name one of the tower's {layers + 1} hidden states")
        if self.processing.side != self.vision.image_size:
            raise ValueError(
                f"model.processing makes {self.processing.side}-pixel frames; model.vision.image_size is "
                f"{self.vision.image_size}"
            )
        if self.projector == "shuffle" and (self.scale_factor < 1 or self.vision.grid % self.scale_factor):
            raise ValueError(
                f"model.scale_factor must divide the tower's {self.vision.grid}-patch side, got {self.scale_factor}"
            )

    # what the rest of tfcli reads of a decoder's config
    @property
    def max_seq_len(self) -> int:
        return self.text.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def d_model(self) -> int:
        return self.text.d_model

    @property
    def n_layer(self) -> int:
        return self.text.n_layer

    def with_layers(self, n: int) -> VLMConfig:
        """The decoder's first n layers and the whole tower (the memory plan probes one and two blocks)."""
        return replace(self, text=self.text.with_layers(n))

    @property
    def image_seq_len(self) -> int:
        """Image tokens per frame."""
        patches = self.vision.n_patches + (0 if self.drop_cls or not self.vision.cls_token else 1)
        return patches // self.scale_factor**2 if self.projector == "shuffle" else patches

    @property
    def tiled_prompt(self) -> bool:
        """An image's tokens as Idefics3 writes them (each tile's after its <row_r_col_c>, then the whole
        image's after <global-img>, between <fake_token_around_image>s): the prompt of the models that read
        images through the pixel-shuffle projector; else LLaVA's, the image tokens alone."""
        return self.projector == "shuffle"

    @property
    def tower_layers(self) -> int:
        """The tower's blocks the features pass through (the later ones are kept, never run)."""
        return self.feature_layer if self.feature_layer >= 0 else self.vision.n_layer + 1 + self.feature_layer


class MLPProjector(nn.Module):
    """LLaVA's: (N, S, D_vision) -> (N, S, D_text) through linear, activation, linear."""

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.up = nn.Linear(cfg.vision.d_model, cfg.text.d_model, bias=cfg.projector_bias)
        self.act = ACTIVATIONS[cfg.projector_act]
        self.down = nn.Linear(cfg.text.d_model, cfg.text.d_model, bias=cfg.projector_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class ShuffleProjector(nn.Module):
    """Idefics3's: pixel shuffle, then one linear without bias."""

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.scale = cfg.scale_factor
        self.proj = nn.Linear(cfg.vision.d_model * cfg.scale_factor**2, cfg.text.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(pixel_shuffle(x, self.scale))


def pixel_shuffle(x: Tensor, scale: int) -> Tensor:
    """(N, S, D) patches of a square grid -> (N, S / scale^2, D * scale^2): each scale x scale group of
    neighbours one token, in Idefics3's order."""
    n, seq, d = x.shape
    side = int(seq**0.5)
    x = x.reshape(n, side, side // scale, d * scale)  # (N, rows, cols / s, D s): s neighbours in a row joined
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, d * scale * scale)  # and s rows
    return x.permute(0, 2, 1, 3).reshape(n, seq // scale**2, d * scale**2)


class VisionLanguage(DecoderTraits, nn.Module):
    """forward(input_ids, ..., pixel_values) -> the decoder's hidden states (B, T, D)."""

    reads_images = True

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = ViT(cfg.vision)
        self.projector = MLPProjector(cfg) if cfg.projector == "mlp" else ShuffleProjector(cfg)
        self.decoder = Llama(cfg.text)

    # the decoder's face, as the tasks, the losses and generation read it
    @property
    def logit_scale(self) -> float:
        return self.decoder.logit_scale

    @property
    def logit_softcap(self) -> float:
        return self.decoder.logit_softcap

    @property
    def lm_head_weight(self) -> Tensor:
        return self.decoder.lm_head_weight

    def logits(self, hidden: Tensor) -> Tensor:
        return self.decoder.logits(hidden)

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        return self.decoder.new_caches(max_len)

    def cache_stale(self, cached: int, total: int) -> bool:
        return self.decoder.cache_stale(cached, total)

    def describe(self) -> str:
        cfg = self.cfg
        tower = sum(p.numel() for p in self.vision.parameters())
        projector = sum(p.numel() for p in self.projector.parameters())
        return (
            f"a vision-language model ({cfg.hf_model_type}): a {tower:,}-parameter ViT "
            f"({cfg.vision.image_size}px, {cfg.tower_layers} of {cfg.vision.n_layer} blocks read), a "
            f"{projector:,}-parameter {cfg.projector} projector, {cfg.image_seq_len} tokens per frame"
        )

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """The decoder's FLOPs per token (the tower's, per image, are not counted: an MFU that reads low)."""
        return self.decoder.flops_per_token(seq_len, target_len)

    def image_features(self, pixel_values: Tensor) -> Tensor:
        """(F, C, H, W) frames -> (F, image_seq_len, D_text): the tower's chosen hidden state, projected."""
        tower = self.vision
        x = tower.embed(pixel_values.to(tower.patch_embed.weight.dtype))  # (F, [1 +] N, D_vision)
        for block in tower.blocks[: self.cfg.tower_layers]:
            x = block(x)
        if self.cfg.vision_norm:
            x = tower.norm(x)
        if self.cfg.drop_cls and tower.cls_token is not None:
            x = x[:, 1:]
        return self.projector(x)

    def forward(
        self,
        input_ids: Tensor,
        caches: list | None = None,
        all_layers: bool = False,
        doc_ids: Tensor | None = None,
        key_mask: Tensor | None = None,
        shared_prompt: Tensor | None = None,
        pixel_values: Tensor | None = None,
    ):
        """input_ids (B, T) holding image_seq_len image tokens per frame of pixel_values (F, C, H, W),
        in order -> hidden states (B, T, D)."""
        embeds = self.decoder.embed(input_ids)  # (B, T, D)
        if pixel_values is not None and len(pixel_values):
            features = self.image_features(pixel_values)  # (F, S, D)
            where = input_ids == self.cfg.image_token_id  # (B, T)
            if int(where.sum()) != features.shape[0] * features.shape[1]:
                raise ValueError(
                    f"{int(where.sum())} image tokens in the input for {features.shape[0]} frames of "
                    f"{features.shape[1]} tokens each"
                )
            embeds = embeds.masked_scatter(where[..., None], features.to(embeds.dtype))
        return self.decoder(input_ids, caches, all_layers, doc_ids, key_mask, shared_prompt, embeds=embeds)


def image_inputs(batch: dict) -> dict:
    """The model inputs a batch carries besides its tokens: its frames, where it has images."""
    return {"pixel_values": batch["pixel_values"]} if "pixel_values" in batch else {}


def frames_of(images: list) -> Tensor | None:
    """Every image's frames (F_i, C, S, S) of a batch, in order, as one (F, C, S, S); None without."""
    return torch.cat(images) if images else None
