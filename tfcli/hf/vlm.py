"""What LLaVA's and Idefics3's tables share (hf/llava.py, hf/idefics3.py): the decoder read and written
by its own architecture's table under the vision-language model's prefix, the image processing read
from preprocessor_config.json, and the export's config, tokenizer and processor files.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import UserError
from ..models.vlm import ImageProcessing, VLMConfig
from . import llama, towers
from .convert import Export, Rule, json_text, read_config, refuse_classifier  # noqa: F401  (json_text: tables write with it)

PREPROCESSOR = "__preprocessor__"  # where interop puts a directory's image processor settings in the raw config
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
SOURCE = "__file__"  # the file the settings came from, for the one line that refuses them
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def text_table(model_type: str | None):
    """The table module of the decoder's architecture (llama, qwen2, gemma, ...): a llama-family one."""
    from . import registry

    return registry.decoder_record(model_type).table


def text_config(raw_text: dict, state: dict, theirs: str):
    """The decoder's LlamaConfig, read by its architecture's table from `text_config` (the weights
    under `theirs` given to it under a causal LM's names)."""
    module = text_table(raw_text.get("model_type"))
    own = {k.replace(theirs, "model.", 1): v for k, v in state.items() if k.startswith(theirs)}
    return module.config_from_hf(raw_text, own)


def text_rules(cfg: VLMConfig, theirs: str, head: str) -> list[Rule]:
    """The decoder's table, its names moved: tfcli's model.* under model.decoder.*, transformers'
    model.* under `theirs` and lm_head under `head`."""
    module = text_table(cfg.text.hf_model_type)
    moved = []
    for r in module.rules(cfg.text):
        names = tuple(
            head + n[len("lm_head.") :] if n.startswith("lm_head.") else theirs + n[len("model.") :] for n in r.theirs
        )
        moved.append(replace(r, ours="model.decoder." + r.ours[len("model.") :], theirs=names))
    return moved


def read_processor(path: Path) -> dict:
    """A directory's image processor settings, where transformers writes them: preprocessor_config.json
    (transformers 4, or an image processor saved alone) or the `image_processor` entry of
    processor_config.json (transformers 5 saves a whole processor's there). Neither: one line, since
    defaults would cut and scale images otherwise than the model was trained on."""
    path = Path(path)
    if (path / PROCESSOR_FILES[0]).is_file():
        return {**read_config(path, PROCESSOR_FILES[0]), SOURCE: str(path / PROCESSOR_FILES[0])}
    if (path / PROCESSOR_FILES[1]).is_file():
        settings = read_config(path, PROCESSOR_FILES[1]).get("image_processor")
        if isinstance(settings, dict):
            return {**settings, SOURCE: str(path / PROCESSOR_FILES[1])}
    raise UserError(
        f"{path}: no image processor settings (neither preprocessor_config.json nor an image_processor "
        "entry in processor_config.json); save the model's processor beside it (processor.save_pretrained)"
    )


def processing(raw: dict, tower: str, split_default: bool = False) -> ImageProcessing:
    """The image processing a preprocessor_config.json describes (transformers' defaults for the tower
    where the directory has none); a setting it cannot use is one line naming its file."""
    p = raw.get(PREPROCESSOR) or {}
    try:
        return _processing(p, raw, tower, split_default)
    except (ValueError, TypeError, AttributeError) as e:
        where = p.get(SOURCE, "the image processor settings")
        raise UserError(f"{where}: {e if isinstance(e, ValueError) else 'a setting of the wrong type'}") from None


def _processing(p: dict, raw: dict, tower: str, split_default: bool) -> ImageProcessing:
    vision, t = raw.get("vision_config") or {}, towers.tower(tower)
    side = vision.get("image_size", 224)
    resample = p.get("resample", t.resample)
    common = dict(
        resample=RESAMPLE.get(resample, 3) if isinstance(resample, str) else int(resample),
        rescale=float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else 1.0,
        mean=tuple(p.get("image_mean") or t.mean),
        std=tuple(p.get("image_std") or t.std),
    )
    if p.get("do_normalize") is False:
        common.update(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    size, crop = p.get("size") or {}, p.get("crop_size") or {}
    if t.resize == "tiles":
        tile = (p.get("max_image_size") or {}).get("longest_edge", side)
        longest = size.get("longest_edge", 4 * tile)
        split = p.get("do_image_splitting", split_default)
        return ImageProcessing("longest_edge", longest, split=bool(split), tile=tile, **common)
    if "shortest_edge" in size:
        crop_side = crop.get("height", size["shortest_edge"]) if p.get("do_center_crop", True) else 0
        return ImageProcessing("shortest_edge", size["shortest_edge"], crop=crop_side, **common)
    if size or t.resize == "square":
        return ImageProcessing("square", size.get("height", side), **common)
    return ImageProcessing("shortest_edge", side, crop=side, **common)


def processor_json(cfg: VLMConfig, processor_type: str, extra: dict) -> str:
    """preprocessor_config.json for the run's image processing."""
    p = cfg.processing
    out = {
        "image_processor_type": processor_type,
        "do_resize": True,
        "resample": p.resample,
        "do_rescale": True,
        "rescale_factor": p.rescale,
        "do_normalize": True,
        "image_mean": list(p.mean),
        "image_std": list(p.std),
        "do_convert_rgb": True,
    }
    if p.resize == "shortest_edge":
        out.update(size={"shortest_edge": p.size}, do_center_crop=True, crop_size={"height": p.crop, "width": p.crop})
    elif p.resize == "square":
        out.update(size={"height": p.size, "width": p.size}, do_center_crop=False)
    else:
        out.update(
            size={"longest_edge": p.size},
            max_image_size={"longest_edge": p.tile},
            do_image_splitting=p.split,
            do_pad=True,
        )
    return json_text({**out, **extra})


def export_parts(backbone, recipe) -> tuple[dict, Export]:
    """(the decoder's config.json entries, its architecture's Export: tokenizer files, token ids)."""
    cfg = backbone.cfg
    if "classifier.weight" in backbone.heads:
        refuse_classifier("vision-language", "any", "no transformers vision-language class classifies")
    module = text_table(cfg.text.hf_model_type)
    spec = llama.export(backbone, recipe, to_hf=lambda _: module.config_to_hf(cfg.text))
    text = {k: v for k, v in spec.config.items() if k != "architectures"}
    return text, spec
