"""Backbones: the model a run trains or evaluates, with its tokenizer, from one of three places:
a fresh initialisation of the recipe's model (tokenizer trained or loaded as the recipe says), a
tfcli run (its config.yaml, checkpoint and tokenizer.json), or a Hugging Face directory (through
tfcli.hf). Everything that reads weights for training, eval, generate or export comes here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from .. import adapters, display
from .. import recipe as recipes
from ..data.sources import cache_dir, write_into_place
from ..data.store import is_store
from ..data.tokenizers import TOKENIZER_FILE, TextTokenizer, build_tokenizer, load_tokenizer_files
from ..display import console, phase
from ..errors import UserError
from ..hf import gguf, interop
from ..models import TEXT_FAMILIES, build_model, model_class
from ..plugin import Backbone
from . import checkpoint, model_source
from .model_source import ModelSource
from .runtime import Runtime

LABELS_FILE = "labels.json"  # a classifier run's class names, in id order
RUN_FILE = "run.json"  # provenance: the --from model (and checkpoint), commands, versions


def recorded(run_dir: Path | None) -> dict:
    """A run's run.json ({} when it has none, as runs from before 0.2 do)."""
    path = Path(run_dir) / RUN_FILE if run_dir else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None


def base_model(run_dir: Path, recipe):
    """The model a run that saves only what it trained (LoRA, IA3, BitFit, head) started from: its
    --from model, read again from where run.json says, as PEFT adapters load onto their base."""
    record = recorded(run_dir)
    named = record.get("from_checkpoint") or record.get("from")
    source = model_source.recorded(named)
    if source is None:
        raise UserError(
            f"{run_dir} holds only the weights it trained; its base model {named or '(unrecorded)'} is not found"
        )
    if source.is_run:
        model = adapters.merge(from_run(source.path).model)  # a base that was itself adapted
    else:
        cfg, state = interop.read_pretrained(source.path, source.raw_config, source.is_gguf)
        model = read_into(cfg, state, source.path)
    if model.cfg != recipe.model:
        raise UserError(f"{run_dir}: its base model {named} is no longer the model the run trained on")
    return model.train()


def from_run(path: Path, which: str = "best", device: str = "cpu") -> Backbone:
    """A trained run (or one of its checkpoints) -> its model in eval mode, head weights, recipe,
    tokenizer and class names. Of a run, every command reads its best checkpoint (its latest when it
    keeps no best), and says which."""
    ckpt = checkpoint.find(Path(path), which)
    if which == "best" and checkpoint.chosen(path, ckpt):
        display.note(checkpoint.chosen(path, ckpt))
    run = checkpoint.run_dir_of(ckpt)
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run} has no config.yaml; is it a tfcli run?")
    recipe = recipes.load_resolved(run / "config.yaml")
    partial = bool(checkpoint.read_meta(ckpt).get("partial"))
    model = base_model(run, recipe) if partial else build_model(recipe.model, weights_follow=True)
    if recipe.finetune is not None:
        adapters.apply(
            model, recipe.finetune.train, recipe.adapter, recipe.finetune.freeze_router, recipe.finetune.train_vision
        )
    weights = checkpoint.load_weights(ckpt)
    own = {k[len("model.") :]: v for k, v in weights.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(own, strict=False)
    if unexpected or (missing and not partial):
        raise UserError(
            f"{ckpt}: its weights do not fit a {recipe.model.family} model "
            f"({(unexpected or missing)[0]} {'unexpected' if unexpected else 'missing'})"
        )
    heads = {k[len("heads.") :]: v for k, v in weights.items() if k.startswith("heads.")}
    tok = TextTokenizer.from_run(run) if (run / TOKENIZER_FILE).is_file() else None
    labels = tuple(json.loads((run / LABELS_FILE).read_text())) if (run / LABELS_FILE).is_file() else ()
    return Backbone(model.to(device).eval(), tok, str(path), heads, recipe, ckpt, labels, run_dir=run)


def for_inference(named: str | Path | ModelSource, device: str = "cpu") -> Backbone:
    """What `--checkpoint` names, in eval mode on `device`: a tfcli run or checkpoint (its best), a
    Hugging Face directory or GGUF file, or a hub id (generate, eval and export take the same things)."""
    source = named if isinstance(named, ModelSource) else model_source.resolve(named, "--checkpoint")
    if source.is_run:
        return from_run(source.path, device=device)
    backbone = from_hf(source, list(model_class(source.family).special_tokens))
    backbone.model.to(device).eval()
    backbone.checkpoint = source.path
    return backbone


def from_hf(named: Path | ModelSource, specials: list[str], shapes_only: bool = False) -> Backbone:
    """A Hugging Face directory or GGUF file -> model (all its weights), head weights and tokenizer;
    shapes_only: the model on the meta device, no weight read (a memory plan)."""
    source = named if isinstance(named, ModelSource) else model_source.resolve(named, "--from")
    with phase(f"reading {source.path}"):
        cfg, state = interop.read_pretrained(source.path, source.raw_config, source.is_gguf, shapes_only)
    if source.is_gguf:
        tok = gguf.read_tokenizer(source.path)
    else:
        tok = load_tokenizer_files(str(source.path), specials) if cfg.family in TEXT_FAMILIES else None
    if tok is not None and tok.vocab_size > cfg.vocab_size:  # its ids past the embedding would crash a lookup
        raise UserError(
            f"{source.path}: its tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size "
            f"({cfg.vocab_size}); the tokenizer is not this model's"
        )
    model = on_meta(cfg) if shapes_only else read_into(cfg, state, source.path)
    heads = {k[len("heads.") :]: v for k, v in state.items() if k.startswith("heads.")}
    return Backbone(model, tok, str(source.path), heads)


def read_into(cfg, state: dict, path: Path):
    """The model of `cfg` holding a Hugging Face file's weights (none drawn at random first)."""
    return load_hf_weights(build_model(cfg, weights_follow=True), state, path)


def load_hf_weights(model, state: dict, path: Path):
    """A Hugging Face model's weights into ours. A part a base model is saved without (BERT's pooler
    in BertForMaskedLM, ModernBERT's prediction head in a bare ModernBertModel: the model's
    `fresh_if_missing`) keeps its fresh initialisation, as transformers does; anything else missing
    is an error."""
    own = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    wanted = model.state_dict()
    for name, tensor in own.items():
        if name in wanted and wanted[name].shape != tensor.shape:
            raise UserError(
                f"{path}: its weights do not fit the model its config.json describes ({name} is "
                f"{tuple(tensor.shape)} in the weights, {tuple(wanted[name].shape)} by config.json's "
                f"{_sizes_of(name)})"
            )
    missing, unexpected = model.load_state_dict(own, strict=False)
    fresh = getattr(model, "fresh_if_missing", ())
    bad = unexpected or [k for k in missing if not k.startswith(fresh)]
    if bad:
        raise UserError(f"{path}: its weights do not fit the model its config.json describes ({bad[0]})")
    new = sorted({p for p in fresh for k in missing if k.startswith(p)})
    with torch.random.fork_rng():  # the same fresh weights every time the base is read (eval, resume)
        torch.manual_seed(0)
        for prefix in new:
            for m in model.get_submodule(prefix.rstrip(".")).modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    if new:
        display.note(
            f"{path} has no weights for the model's {', '.join(p.rstrip('.') for p in new)}; initialised fresh"
        )
    return model


def _sizes_of(name: str) -> str:
    """The config.json fields that set a tensor's shape, by what the tensor is."""
    if any(p in name for p in ("attn", "attention", "q_norm", "k_norm")):
        return "hidden_size, num_attention_heads, num_key_value_heads and head_dim"
    if any(p in name for p in ("mlp", "ffn", "experts", "router")):
        return "hidden_size, intermediate_size and expert counts"
    return "hidden_size and vocab_size"


def on_meta(cfg):
    """The model of `cfg` with no memory behind its tensors (what a memory plan reads: shapes)."""
    with torch.device("meta"):
        return build_model(cfg)


def fresh(recipe, plugin, rt: Runtime, shapes_only: bool = False) -> Backbone:
    """The recipe's model, randomly initialised (seeded), with the tokenizer the recipe describes."""
    tok = shared_tokenizer(recipe, plugin, rt) if recipe.model.family in TEXT_FAMILIES and plugin.reads_text else None
    cfg = with_vocab(plugin.model_shape(recipe), tok)
    torch.manual_seed(recipe.train.seed)
    return Backbone(on_meta(cfg) if shapes_only else build_model(cfg), tok, "scratch")


def for_resume(run_dir: Path, recipe, ckpt: Path, shapes_only: bool = False) -> Backbone:
    """A run being resumed: its model (the base's weights when it saves only what it trained) and its
    tokenizer; its own weights come from the checkpoint."""
    tok = TextTokenizer.from_run(run_dir) if (Path(run_dir) / TOKENIZER_FILE).is_file() else None
    partial = bool(checkpoint.read_meta(ckpt).get("partial"))
    if shapes_only:
        model = on_meta(recipe.model)
    else:
        model = base_model(run_dir, recipe) if partial else build_model(recipe.model, weights_follow=True)
    return Backbone(model, tok, recorded(run_dir).get("from") or str(run_dir), resumed=True)


def check_family(source: ModelSource | None, recipe, plugin) -> str:
    """The source's family, checked: it holds a model the plug-in trains (nothing read but its config)."""
    family = recipe.model.family if source is None else source.family
    if family not in plugin.families:
        where = f"--from {source}" if source else f"recipe {recipe.name!r}"
        raise UserError(
            f"{where} describes a {family!r} model; {plugin.kind} {plugin.key!r} trains "
            f"{' or '.join(repr(f) for f in plugin.families)}"
        )
    return family


def meta_model(source: ModelSource | None, recipe, plugin):
    """The model a run starts from, on the meta device, from configs alone: no weight, tokenizer or
    data read (a fresh model whose vocabulary its tokenizer decides is counted without one). A GGUF's
    parsed header is cached, so the run's own read does not parse it again."""
    check_family(source, recipe, plugin)
    if source is None:
        cfg = plugin.model_shape(recipe)
        return on_meta(cfg if getattr(cfg, "vocab_size", 1) > 0 else recipes.replace(cfg, vocab_size=1))
    if source.is_run:
        return run_on_meta(source)[1]
    return on_meta(interop.read_pretrained(source.path, source.raw_config, source.is_gguf, shapes_only=True)[0])


def run_on_meta(source: ModelSource) -> tuple[Path, nn.Module]:
    """(the run directory of --from RUN's best checkpoint, its model on the meta device)."""
    run = checkpoint.run_dir_of(checkpoint.find(source.path, "best"))
    return run, on_meta(recipes.load_resolved(run / "config.yaml").model)


def load(source: ModelSource | None, recipe, plugin, rt: Runtime, shapes_only: bool = False) -> Backbone:
    """The backbone a training run starts from: `source` (--from) or a fresh model. The family is
    checked against the plug-in before anything is built or trained. shapes_only: the model on the
    meta device, no weight read or initialised (a memory plan)."""
    family = check_family(source, recipe, plugin)
    if source is None:
        return fresh(recipe, plugin, rt, shapes_only)
    if source.is_run and shapes_only:
        run, model = run_on_meta(source)
        tok = TextTokenizer.from_run(run) if (run / TOKENIZER_FILE).is_file() else None
        return Backbone(model, tok, str(source))
    if source.is_run:
        backbone = from_run(source.path)
        merged = merge_adapters(backbone.model)
        if merged and rt.is_main and not plugin.quiet:
            console.print(
                f"[yellow]note:[/] --from {source}: {merged} merged into its base; this run starts "
                f"from the merged model"
            )
        backbone.model.train().requires_grad_(True)  # what this run trains is its own strategy's to choose
        return backbone
    return from_hf(source, plugin.special_tokens(family), shapes_only)


def merge_adapters(model) -> str:
    """Fold a finetuning run's adapters into its base in place, so that a run trained from it sees one
    plain model, as `export --hf` writes it (TRL merges an SFT adapter the same way); say what was
    merged ('' when nothing was)."""
    kinds = {"LoRA": adapters.LoRALinear, "IA3": adapters.IA3Linear}
    counts = {name: sum(isinstance(m, cls) for m in model.modules()) for name, cls in kinds.items()}
    adapters.merge(model)
    return " and ".join(f"{name} adapters ({n} linears)" for name, n in counts.items() if n)


def with_vocab(cfg, tokenizer: TextTokenizer | None):
    """model.vocab_size 0 takes the tokenizer's; a smaller one than the tokenizer's is an error."""
    if tokenizer is None:
        return cfg
    if cfg.vocab_size <= 0:
        return recipes.replace(cfg, vocab_size=tokenizer.vocab_size)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size})")
    return cfg


def shared_tokenizer(recipe, plugin, rt: Runtime) -> TextTokenizer:
    """Rank 0 loads, or trains, the tokenizer the recipe describes; under DDP the others receive the
    same one. A trained tokenizer is cached by the data's fingerprint and the tokenizer settings: the
    same data gives the same vocabulary again (tokenizers' trainers break ties differently in every
    process, huggingface/tokenizers#1794), and without training it again."""
    cfg, specials, tok = recipe.tokenizer, plugin.special_tokens(recipe.model.family), None
    if is_store(recipe.data.source):  # a prepared store brings the tokenizer it was made with
        cfg = recipes.replace(cfg, kind="file", path=str(Path(recipe.data.source) / TOKENIZER_FILE))
    if rt.is_main:
        key = plugin.tokenizer_key(recipe) if cfg.kind != "file" else None
        cached = (
            cache_dir() / "tokenizers" / f"{hashlib.sha256(f'{key}|{cfg}|{specials}'.encode()).hexdigest()[:20]}.json"
        )
        if key and cached.is_file():
            tok = TextTokenizer(Tokenizer.from_file(str(cached)))
        else:
            with phase(f"{'loading' if cfg.kind == 'file' else 'training a ' + cfg.kind} tokenizer"):
                tok = build_tokenizer(
                    cfg.kind,
                    vocab_size=cfg.vocab_size,
                    path=cfg.path,
                    lowercase=cfg.lowercase,
                    texts=plugin.tokenizer_texts(recipe),
                    specials=specials,
                )
            if key:
                cached.parent.mkdir(parents=True, exist_ok=True)
                write_into_place(cached, lambda tmp: tok.tok.save(str(tmp)))
    if rt.distributed:
        tok = TextTokenizer(Tokenizer.from_str(rt.broadcast(tok.tok.to_str() if tok else None)))
    return tok
