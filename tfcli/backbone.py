"""Backbones: the model a run trains or evaluates, with its tokenizer, from one of three places:
a fresh initialisation of the recipe's model (tokenizer trained or loaded as the recipe says), a
tfcli run (its config.yaml, checkpoint and tokenizer.json), or a Hugging Face directory (through
tfcli.hf). Everything that reads weights for training, eval, generate or export comes here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from tokenizers import Tokenizer

from . import checkpoint, hf
from . import recipe as recipes
from .data.tokenizers import TOKENIZER_FILE, TextTokenizer, build_tokenizer, load_tokenizer_files
from .errors import UserError
from .models import TEXT_FAMILIES, build_model
from .plugin import Backbone
from .runtime import Runtime

LABELS_FILE = "labels.json"  # a classifier run's class names, in id order


def is_run(path: Path) -> bool:
    """Whether `path` is a tfcli run directory or one of its checkpoints."""
    path = Path(path)
    return (checkpoint.run_dir_of(path) / "config.yaml").is_file() and \
        ((path / checkpoint.CHECKPOINTS).is_dir() or (path / checkpoint.WEIGHTS).is_file())


def family_of(path: Optional[str]) -> Optional[str]:
    """The model family a --from path holds (a tfcli run or a Hugging Face directory), if it is one."""
    if not path or not Path(path).exists():
        return None
    path = Path(path)
    if is_run(path):
        return recipes.load_resolved(checkpoint.run_dir_of(path) / "config.yaml").model.family
    if (path / hf.convert.CONFIG).is_file():
        return hf.family_of_config(hf.read_config(path), path)
    return None


def from_run(path: Path, which: str = "latest", device: str = "cpu") -> Backbone:
    """A trained run (or one of its checkpoints) -> its model in eval mode, head weights, recipe,
    tokenizer and class names."""
    ckpt = checkpoint.find(Path(path), which)
    run = checkpoint.run_dir_of(ckpt)
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run} has no config.yaml; is it a tfcli run?")
    recipe = recipes.load_resolved(run / "config.yaml")
    model = build_model(recipe.model)
    weights = checkpoint.load_weights(ckpt)
    own = {k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}
    missing, _ = model.load_state_dict(own, strict=False)
    if missing:
        raise UserError(f"{ckpt}: checkpoint lacks weights {missing[:3]}... for a {recipe.model.family} model")
    heads = {k[len("heads."):]: v for k, v in weights.items() if k.startswith("heads.")}
    tok = TextTokenizer.from_run(run) if (run / TOKENIZER_FILE).is_file() else None
    labels = tuple(json.loads((run / LABELS_FILE).read_text())) if (run / LABELS_FILE).is_file() else ()
    return Backbone(model.to(device).eval(), tok, str(path), heads, recipe, ckpt, labels)


def from_hf(path: Path, specials: list[str]) -> Backbone:
    """A local Hugging Face directory -> model (all its weights), head weights and tokenizer."""
    cfg, state = hf.read_pretrained(Path(path))
    model = build_model(cfg)
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    heads = {k[len("heads."):]: v for k, v in state.items() if k.startswith("heads.")}
    tok = load_tokenizer_files(str(path), specials) if cfg.family in TEXT_FAMILIES else None
    return Backbone(model, tok, str(path), heads)


def fresh(recipe, texts: Iterable[str], specials: list[str], rt: Runtime) -> Backbone:
    """The recipe's model, randomly initialised (seeded), with the tokenizer the recipe describes."""
    tok = shared_tokenizer(recipe.tokenizer, texts, specials, rt) if recipe.model.family in TEXT_FAMILIES else None
    cfg = with_vocab(recipe.model, tok)
    torch.manual_seed(recipe.train.seed)
    return Backbone(build_model(cfg), tok, "scratch")


def for_resume(run_dir: Path, recipe) -> Backbone:
    """A run being resumed: its model shape and tokenizer; the weights come from its checkpoint."""
    tok = TextTokenizer.from_run(run_dir) if (Path(run_dir) / TOKENIZER_FILE).is_file() else None
    return Backbone(build_model(recipe.model), tok, str(run_dir))


def load(source: Optional[str], recipe, plugin, rt: Runtime) -> Backbone:
    """The backbone a training run starts from: `source` (--from) or a fresh model. The family is
    checked against the plug-in before anything is built or trained."""
    if source is not None and not Path(source).exists():
        raise UserError(f"--from {source}: not found")
    family = recipe.model.family if source is None else family_of(source)
    if family is None:
        raise UserError(f"--from {source}: neither a tfcli run nor a Hugging Face model directory (config.json)")
    if family not in plugin.families:
        where = f"--from {source}" if source else f"recipe {recipe.name!r}"
        raise UserError(f"{where} describes a {family!r} model; {plugin.kind} {plugin.key!r} trains "
                        f"{' or '.join(repr(f) for f in plugin.families)}")
    if source is None:
        return fresh(recipe, plugin.tokenizer_texts(recipe), plugin.special_tokens(family), rt)
    if is_run(Path(source)):
        backbone = from_run(Path(source), which="best")
        backbone.model.train()
        return backbone
    return from_hf(Path(source), plugin.special_tokens(family))


def with_vocab(cfg, tokenizer: Optional[TextTokenizer]):
    """model.vocab_size 0 takes the tokenizer's; a smaller one than the tokenizer's is an error."""
    if tokenizer is None:
        return cfg
    if cfg.vocab_size <= 0:
        return recipes.replace(cfg, vocab_size=tokenizer.vocab_size)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size})")
    return cfg


def shared_tokenizer(cfg, texts: Iterable[str], specials: list[str], rt: Runtime) -> TextTokenizer:
    """Rank 0 trains (or loads) the tokenizer; under DDP the others receive the same one."""
    tok = None
    if rt.is_main:
        tok = build_tokenizer(cfg.kind, vocab_size=cfg.vocab_size, path=cfg.path, lowercase=cfg.lowercase,
                              texts=texts, specials=specials)
    if rt.distributed:
        tok = TextTokenizer(Tokenizer.from_str(rt.broadcast(tok.tok.to_str() if tok else None)))
    return tok
