"""A vision-language model composed from parts tfcli already has (`finetune --from DECODER
--vision-from VISION`): the tower a ViT run (an MAE or image-classification run) or a ViT directory,
the decoder a llama-family run, directory or GGUF, and a fresh projector between them, LLaVA's shape.

The decoder's tokenizer gains the image token where it lacks it (its embedding and LM head one row
longer, the new row the mean of the others: the row an image token reads is replaced by the image's
features, so only its output row ever matters). The tower's features are its last block's output
without its final norm, the [CLS] dropped, as LLaVA reads a CLIP tower; so the composed model is one
`export --hf` can write as LLaVA. The images are resized square to the tower's size and normalised as
the vision run normalised its own.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tokenizers import AddedToken

from ..display import note
from ..errors import UserError
from ..models.llama import Llama
from ..models.vit import ViT
from ..models.vlm import ImageProcessing, VisionLanguage, VLMConfig
from ..plugin import Backbone
from .model_source import ModelSource


def compose(decoder: Backbone, vision_source: ModelSource, template, seed: int) -> Backbone:
    """`decoder` (read from --from) and the tower --vision-from names -> the composed backbone, its
    projector initialised from `seed`; `template`: the recipe's vlm model section (its projector,
    feature and image-token settings)."""
    from .backbone import from_hf, from_run

    if not isinstance(template, VLMConfig):
        raise UserError("--vision-from composes a vision-language model: use a recipe of the vlm family (sft-vlm-mini)")
    if not isinstance(decoder.model, Llama):
        raise UserError(f"--vision-from joins a tower to a llama-family decoder; --from holds a {decoder.family!r}")
    vision = from_run(vision_source.path) if vision_source.is_run else from_hf(vision_source, [])
    if not isinstance(vision.model, ViT) or vision.cfg.stem != "patch":
        raise UserError(
            f"--vision-from {vision_source}: a ViT with a patch stem (an MAE or image-classify run, or a ViT "
            f"directory) is what a vision-language model reads; this is a {vision.family!r}"
        )
    tok = decoder.tokenizer
    if tok.token_id(template.image_token) is None:
        tok.tok.add_special_tokens([AddedToken(template.image_token, special=True, normalized=False)])
    grown = grow_vocabulary(decoder.model, tok.vocab_size)
    cfg = replace(
        template,
        vision=vision.cfg,
        text=grown.cfg,
        processing=processing_of(vision),
        image_token_id=tok.token_id(template.image_token),
        feature_layer=-1,
        vision_norm=False,
        drop_cls=True,
        hf_model_type="llava",
    )
    torch.manual_seed(seed)
    model = VisionLanguage(cfg)
    model.vision.load_state_dict(vision.model.state_dict())
    model.decoder.load_state_dict(grown.state_dict())
    note(
        f"the projector between {vision_source} and the decoder is new (initialised from train.seed); "
        "--train projector trains it alone first, as LLaVA's first stage does"
    )
    return Backbone(model, tok, decoder.source)


def grow_vocabulary(model: Llama, size: int) -> Llama:
    """The decoder with `size` rows of embedding (and LM head), the new ones the mean of the old."""
    if size <= model.cfg.vocab_size:
        return model
    grown = Llama(replace(model.cfg, vocab_size=size))
    state = model.state_dict()
    for name in ("wte.weight", "lm_head.weight"):
        if name in state:
            old = state[name]
            state[name] = torch.cat([old, old.mean(0, keepdim=True).expand(size - len(old), -1)])
    grown.load_state_dict(state)
    return grown


def processing_of(vision: Backbone) -> ImageProcessing:
    """Square frames of the tower's size, normalised with the vision run's mean and std (0.5 where it
    names none)."""
    settings = vision.recipe.settings if vision.recipe is not None else None
    mean = tuple(getattr(settings, "mean", (0.5, 0.5, 0.5)))
    std = tuple(getattr(settings, "std", (0.5, 0.5, 0.5)))
    return ImageProcessing("square", vision.cfg.image_size, resample=3, mean=mean, std=std)
