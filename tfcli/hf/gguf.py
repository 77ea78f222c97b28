"""GGUF files (llama.cpp, Ollama, LM Studio) in and out, through the llama family's own table.

Reading turns a GGUF into what a Hugging Face directory holds (a transformers-style config dict and
transformers-named tensors, dequantized by the `gguf` package), so `hf/llama.py` maps it like any
Llama/Qwen2/Qwen3 directory; the tokenizer is rebuilt from `tokenizer.ggml.*` with `tokenizers` (a
byte-level BPE of the tokens and merges, control tokens kept whole) and the chat template taken from
`tokenizer.chat_template`. Nothing in a GGUF is executed: gguf's reader memory-maps the file and
parses its header and tensor table; the template is rendered later in jinja2's sandbox.

llama.cpp stores a `llama` model's q and k rows permuted for its rotary layout (interleaved pairs);
they are permuted back here, and again on writing (transformers' GGUF loader does the same).
"""

from __future__ import annotations

import json
import re
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..data.special_tokens import SpecialTokens
from ..errors import UserError
from . import registry
from .gguf_archs import ARCHS, NO_PREFIX_SPACE, PREFIX_NORMALIZER, rope_dimensions
from .traits import Experts

SUFFIX = ".gguf"
SENTENCEPIECE, BYTE_BPE = "llama", "gpt2"  # tokenizer.ggml.model's names for the two tokenizers read
# GGUF general.architecture -> transformers model_type (llama with experts: Mixtral), from the records;
# gguf_archs.py says how each differs from the llama architecture
MODEL_TYPES = registry.gguf_model_types()
ARCHITECTURES = tuple(MODEL_TYPES)
GGUF_ARCH = {r.model_type: r.gguf for r in registry.RECORDS if r.gguf}  # transformers model_type -> GGUF's
# llama.cpp's mixtures renormalise their top-k weights or not by architecture, not by a key
# (None: a key says, deepseek2's expert_weights_norm)
NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False, "gpt-oss": True, "deepseek2": None}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # stacked (E, out, in)
DENSE = Experts()  # the default names (a dense model has no experts to name)
MIXTURES = [r.traits.experts for r in registry.RECORDS if r.traits is not None and r.traits.experts is not None]
# every architecture's names for its experts' parts and feed-forward block -> the default ones (Mixtral's
# w1 / w3 / w2 under block_sparse_moe: gate_proj / up_proj / down_proj under mlp)
EXPERT_PARTS = {theirs: part for e in MIXTURES for theirs, part in zip(e.parts, Experts().parts)}
EXPERT_BLOCKS = {e.block for e in MIXTURES} - {Experts().block}
LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BYTE_LEVEL_SPLITS = {  # tokenizer.ggml.pre -> the split regex its merges were learned with (else GPT-2's)
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
}
BYTE_LEVEL_SPLITS["llama3"] = BYTE_LEVEL_SPLITS["llama-v3"] = BYTE_LEVEL_SPLITS["llama-bpe"]
WRITE_TYPES = ("f32", "f16", "q8_0")


def _opened(path: Path) -> tuple[Any, dict[str, Any]]:
    """(gguf's reader, the metadata) of a file, parsed once however often a command asks (the family,
    the weights, the tokenizer): parsing a header takes seconds. Keyed by size and mtime, so a
    rewritten file is read again."""
    stat = Path(path).stat()
    return _open_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> tuple[Any, dict[str, Any]]:
    reader = _reader(Path(path))
    return reader, _metadata(reader)


def forget_parsed() -> None:
    """Parse files again on the next read (a benchmark timing cold loads)."""
    _open_cached.cache_clear()


class Truncated(Exception):
    """A GGUF whose tensor table reaches past the end of the file: (bytes it needs, bytes it has)."""


def _reader(path: Path):
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            """The tensor table's end checked against the file's size before any tensor is viewed (a
            short file otherwise fails in numpy, with a message about reshaping)."""
            end = start_offs
            for field in fields:
                _, _, _, dims, raw_dtype, offset = field.parts
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
                end = max(end, start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block)
            if end > len(self.data):
                raise Truncated(end, len(self.data))
            super()._build_tensors(start_offs, fields)

    size = Path(path).stat().st_size
    try:
        return CheckedReader(str(path), "r")
    except Truncated as e:
        needs, has = e.args
        raise UserError(
            f"{path}: truncated GGUF file: its tensors need {needs:,} bytes, the file has {has:,} "
            f"(an interrupted download or copy?)"
        ) from None
    except Exception as e:  # a wrong magic number, a bad header
        if isinstance(e, (IndexError, ValueError)) and size and "magic" not in str(e).lower():
            raise UserError(
                f"{path}: not a readable GGUF file: it ends inside its header ({size:,} bytes; truncated?)"
            ) from None
        raise UserError(
            f"{path}: not a readable GGUF file ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})"
        ) from None


def _metadata(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field of a type this gguf version cannot decode: not one tfcli reads
            continue
    return out


def read_config(path: Path) -> dict:
    """A GGUF's architecture and hyperparameters as a transformers config.json would hold them."""
    return _config(_opened(path)[1], path)


def _config(meta: dict, path: Path, layers_with_experts: set[int] | None = None, factors: dict | None = None) -> dict:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values: one model-wide value or a refusal
            if len(set(value)) != 1:
                raise UserError(f"{path}: {arch}.{key} differs between layers, which tfcli's llama family cannot hold")
            value = value[0]
        return float(f"{value:.7g}") if isinstance(value, float) else value  # stored as float32: 1e-05, not 9.99e-06

    n_head, d = get("attention.head_count"), get("embedding_length")
    if n_head is None or d is None or get("block_count") is None:
        raise UserError(f"{path}: GGUF lacks {arch}.block_count, embedding_length or attention.head_count")
    if not (get("vocab_size") or meta.get("tokenizer.ggml.tokens")):
        raise UserError(
            f"{path}: GGUF has neither {arch}.vocab_size nor a tokenizer token list "
            f"(tokenizer.ggml.tokens), so its vocabulary size is unknown"
        )
    raw = {
        "model_type": MODEL_TYPES[arch],
        "num_hidden_layers": get("block_count"),
        "hidden_size": d,
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": get("attention.head_count_kv", n_head),
        "head_dim": get("attention.key_length", d // n_head),
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "vocab_size": get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []),
        "attention_bias": False,
    }
    if get("expert_count"):
        raw.update(_experts(arch, get, raw, layers_with_experts))
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        raw["rope_scaling"] = {
            "rope_type": scaling,
            "factor": get("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": get("rope.scaling.original_context_length", 0),
        }
    raw.update(ARCHS[arch].config_extras(get, raw, factors or {}))
    return raw


def _experts(arch: str, get, raw: dict, layers_with_experts: set[int] | None) -> dict:
    """A mixture's config.json entries from a GGUF's expert_* keys (and, for Qwen's, which layers hold
    experts: the others are dense)."""
    model_type = registry.gguf_model_type(arch, experts=True)  # llama with experts: Mixtral
    kind = registry.decoder_traits(model_type).experts or Experts()
    out = {"model_type": model_type, "num_experts_per_tok": get("expert_used_count"), "norm_topk_prob": NORM_TOPK[arch]}
    out[kind.count_key] = get("expert_count")
    if kind.qwen_layout:
        dense = sorted(set(range(raw["num_hidden_layers"])) - (layers_with_experts or set()))
        out.update(moe_intermediate_size=get("expert_feed_forward_length"), mlp_only_layers=dense)
    if kind.shared_expert:
        out["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length", 0)
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order (pairs interleaved per head) -> transformers' (halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' rotary row order -> llama.cpp's (the inverse of _unpermute)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read(path: Path, shapes_only: bool = False) -> tuple[dict, dict[str, Tensor]]:
    """A GGUF -> (transformers-style config, transformers-named fp32 tensors); read_tokenizer gives its
    tokenizer. shapes_only: meta tensors of their shapes, nothing dequantized (a memory plan)."""
    import gguf

    path = Path(path)
    reader, meta = _opened(path)
    names = {t.name for t in reader.tensors}
    routed = {int(n.split(".")[1]) for n in names if n.startswith("blk.") and ".ffn_gate_inp." in n}
    factors = {  # Phi-3's LongRoPE factors: configuration, not weights
        f"{t.name.split('.')[0].removeprefix('rope_factors_')}_factor": [float(x) for x in np.asarray(t.data).ravel()]
        for t in reader.tensors
        if t.name.startswith("rope_factors_")
    }
    raw = _config(meta, path, routed, factors)
    arch, traits = meta.get("general.architecture"), registry.decoder_traits(raw["model_type"])
    expert_names = traits.experts or DENSE  # how transformers names its experts' parts
    if "rope_freqs.weight" in names:
        raise UserError(
            f"{path}: rope frequency factors (Llama 3.1's rope scaling as llama.cpp stores it) are not supported"
        )
    raw["tie_word_embeddings"] = "output.weight" not in names
    _check_expert_count(reader, raw, path, arch)
    state = {}
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]
        if t.name.startswith("rope_factors_"):
            continue
        if shapes_only:
            meta_tensor = torch.empty(shape, device="meta")
            state.update(_hf_tensors(t.name, meta_tensor, path, expert_names, arch))
            continue
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        except Exception as e:
            raise UserError(f"{path}: tensor {t.name} is unreadable ({type(e).__name__}); a truncated file?") from None
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        if ARCHS[arch].permuted and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = raw["num_attention_heads"] if "attn_q" in t.name else raw["num_key_value_heads"]
            values = _unpermute(values, heads)
        if ARCHS[arch].norm_offset and t.name.endswith("norm.weight"):
            values = values - np.float32(ARCHS[arch].norm_offset)
        tensor = torch.from_numpy(values if values.flags.writeable else values.copy())
        state.update(_hf_tensors(t.name, tensor, path, expert_names, arch))
    state = ARCHS[arch].from_llama_names(state)
    raw["qkv_bias"] = any(k.endswith("q_proj.bias") for k in state)  # Qwen2-MoE's name for it
    if raw["qkv_bias"]:
        own = traits.value("qkv_bias") or traits.reads("qkv_bias")  # Qwen2's q/k/v biases: no attention_bias
        raw["attention_bias"] = not own and any(k.endswith("o_proj.bias") for k in state)
    return raw, state


def _expert_count(c: dict) -> int:
    """A config's number of experts, under its architecture's key (0: a dense model)."""
    kind = registry.decoder_traits(c["model_type"]).experts if c.get("model_type") in registry.NATIVE else None
    return c.get(kind.count_key if kind else "num_experts") or c.get("num_experts") or 0


def _check_expert_count(reader, raw: dict, path: Path, arch: str) -> None:
    """A file whose expert_count disagrees with its stacked expert tensors: one line naming both counts
    (a missing expert's tensor, named later, would not say why)."""
    count = _expert_count(raw)
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in EXPERTS:
            stacked = int(t.shape[-1])  # GGUF lists dimensions innermost first: the experts' is last
            if stacked != count:
                raise UserError(f"{path}: {arch}.expert_count is {count}, but tensor {t.name} stacks {stacked} experts")


def _layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor -> transformers module, for `arch`."""
    return {**LAYER, **ARCHS[arch].layer}


def _hf_tensors(
    name: str, tensor: Tensor, path: Path, names: Experts = DENSE, arch: str = "llama"
) -> dict[str, Tensor]:
    """One GGUF tensor under transformers' name(s): a stack of experts (E, out, in) as one tensor per
    expert, its parts named as the architecture names them (`names`)."""
    parts, layer = name.split("."), _layer_names(arch)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in EXPERTS:
        block, part = names.block, names.parts[list(EXPERTS).index(parts[2])]
        stem = f"model.layers.{parts[1]}.{block}.experts"
        return {f"{stem}.{j}.{part}.{parts[3]}": expert for j, expert in enumerate(tensor.unbind(0))}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer:
        module = layer[parts[2]]
        if parts[2] == "ffn_gate_inp":
            module = f"{names.block}.gate"
        if parts[2] == "ffn_gate_inp_shexp":
            tensor = tensor.reshape(1, -1)  # (1, D) in transformers, a vector in some converters' files
        return {f"model.layers.{parts[1]}.{module}.{parts[3]}": tensor}
    if len(parts) == 2 and parts[0] in GLOBAL:
        return {f"{GLOBAL[parts[0]]}.{parts[1]}": tensor}
    raise UserError(f"{path}: tensor {name!r} is not one of a llama-family model's")


# --- the tokenizer ----------------------------------------------------------------------------


def read_tokenizer(path: Path):
    """A GGUF's tokenizer alone (its metadata; no tensor is dequantized)."""
    return tokenizer(_opened(path)[1], path)


def tokenizer(meta: dict, path: Path):
    """tokenizer.ggml.* -> TextTokenizer: byte-level BPE (tokenizer.ggml.model gpt2) of the file's
    tokens and merges, control tokens whole, the file's special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise UserError(
            f"{path}: GGUF tokenizer {kind!r} is not supported (tfcli reads byte-level BPE, 'gpt2', as "
            f"SmolLM, Llama 3 and Qwen files have, and SentencePiece BPE, 'llama', as Llama 2, Mistral, "
            f"Gemma and Phi-3 files have)"
        )
    tokens, merges = list(meta.get("tokenizer.ggml.tokens") or []), list(meta.get("tokenizer.ggml.merges") or [])
    if kind == SENTENCEPIECE:
        return _finish(sentencepiece(meta, tokens, merges, path), meta, tokens, None)
    if not tokens or not merges:
        raise UserError(f"{path}: GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()) for t in tokens]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(spelled)}, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False
        )
    )
    split = BYTE_LEVEL_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    tok.decoder = decoders.ByteLevel()
    return _finish(tok, meta, tokens, alphabet)


def _finish(tok, meta: dict, tokens: list[str], spelled: set[str] | None):
    """The file's control tokens kept whole (special), its user-defined ones whole (not special), its
    special tokens and chat template: a TextTokenizer. `spelled`: what a token of the vocabulary may be
    made of (byte-level BPE: the byte alphabet, a control token spelled otherwise being a mislabel;
    None: anything)."""
    from tokenizers import AddedToken

    from ..data.tokenizers import TextTokenizer

    types = list(meta.get("tokenizer.ggml.token_type") or [])
    ok = lambda t: spelled is None or set(t) <= spelled  # noqa: E731
    control = [t for t, k in zip(tokens, types) if k == 3 and ok(t)]  # 3: CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types) if k == 4 and ok(t)]  # 4: USER_DEFINED
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def named(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    specials = SpecialTokens(bos=named("bos"), eos=named("eos"), pad=named("padding"), unk=named("unknown"))
    template = meta.get("tokenizer.chat_template")
    return TextTokenizer(tok, specials, template if isinstance(template, str) else None)


def sentencepiece(meta: dict, tokens: list[str], merges: list[str], path: Path):
    """tokenizer.ggml.model 'llama': SentencePiece's BPE as transformers' LlamaTokenizer builds it (a
    leading "▁" and "▁" for spaces, byte fallback through <0xNN> tokens), the merges the file gives or,
    as most such files give none, the ones its vocabulary and scores imply (the way transformers' GGUF
    loader recovers them); Gemma's and Phi-3's files with the differences transformers applies to them."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    if not tokens:
        raise UserError(f"{path}: GGUF lacks tokenizer.ggml.tokens")
    arch = ARCHS.get(meta.get("general.architecture"), ARCHS["llama"])
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    if arch.tokenizer == NO_PREFIX_SPACE:  # runs of spaces stored as spaces; merges in file order
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _implied_merges(vocab, dict(zip(tokens, scores)))
    unk = tokens[meta["tokenizer.ggml.unknown_token_id"]] if "tokenizer.ggml.unknown_token_id" in meta else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch.tokenizer == NO_PREFIX_SPACE:  # no prefix space: spaces become "▁" where they are (GemmaTokenizer)
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif (
        arch.tokenizer == PREFIX_NORMALIZER
    ):  # the prefix space from a normalizer, as Phi-3's own tokenizer.json has it
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:  # Llama 2, Mistral: LlamaTokenizer's
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _implied_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, best-scored merged token first (as
    transformers' generate_merges orders them)."""
    found = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes -> printable characters (the byte-level BPE alphabet)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


# --- writing ----------------------------------------------------------------------------------


def write(hf_config: dict, hf_state: dict[str, Tensor], tok, out: Path, dtype: str = "f16") -> None:
    """A llama-family model as transformers names it (config and tensors) and its tokenizer -> a GGUF
    llama.cpp, tfcli and transformers read. Norms stay f32 (as llama.cpp writes them); matrices are
    `dtype`: f32, f16 or q8_0. Written to a temporary file and renamed: never half a file."""
    import gguf

    if dtype not in WRITE_TYPES:
        raise UserError(f"--gguf-type {dtype}: choose {', '.join(WRITE_TYPES)}")
    arch = GGUF_ARCH.get(hf_config["model_type"])
    if arch is None:
        raise UserError(f"GGUF export writes {', '.join(GGUF_ARCH)} models; this is a {hf_config['model_type']}")
    ARCHS[arch].check_writable(hf_config)
    _check_experts(hf_config, arch)
    hf_state = _stacked_experts(ARCHS[arch].to_llama_names(hf_state, hf_config))
    out = Path(out)
    if out.exists():
        raise UserError(f"{out} exists; choose a new --gguf file")
    vocab = _vocab(tok)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _write_metadata(writer, hf_config, tok, vocab, arch)
    extra = ARCHS[arch].write_extras(writer, hf_config)
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    for name, tensor in hf_state.items():
        values = tensor.detach().float().cpu().numpy()
        if "shared_expert_gate" in name:
            values = values.reshape(-1)  # llama.cpp holds Qwen2-MoE's shared-expert gate as a vector (n_embd)
        proj = name.split(".")[-2]
        if ARCHS[arch].permuted and proj in heads and name.endswith(".weight"):
            values = _permute(values, heads[proj])
        if ARCHS[arch].norm_offset and name.endswith("norm.weight"):
            values = values + np.float32(ARCHS[arch].norm_offset)
        qtype = gguf.GGMLQuantizationType.F32
        if values.ndim == 2 and dtype != "f32" and not name.endswith(".bias"):  # (E, F) expert biases stay f32
            qtype = gguf.GGMLQuantizationType.F16 if dtype == "f16" else gguf.GGMLQuantizationType.Q8_0
        if qtype == gguf.GGMLQuantizationType.Q8_0 and values.shape[-1] % 32:
            qtype = gguf.GGMLQuantizationType.F16  # Q8_0 needs rows of whole 32-value blocks
        data = (
            values.astype(np.float16)
            if qtype == gguf.GGMLQuantizationType.F16
            else gguf.quants.quantize(values, qtype)
            if qtype == gguf.GGMLQuantizationType.Q8_0
            else values
        )
        writer.add_tensor(_gguf_name(name, arch), data, raw_dtype=qtype)
    for name, values in extra.items():
        writer.add_tensor(name, values, raw_dtype=gguf.GGMLQuantizationType.F32)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def _check_experts(c: dict, arch: str) -> None:
    """One line for a mixture llama.cpp's architecture cannot run as it is."""
    if not _expert_count(c):
        return
    kind = registry.decoder_traits(c["model_type"]).experts or Experts()
    norm = kind.renormalises or bool(c.get("norm_topk_prob"))
    if NORM_TOPK[arch] is not None and norm != NORM_TOPK[arch]:
        raise UserError(
            f"GGUF export: llama.cpp's {arch} {'renormalises' if NORM_TOPK[arch] else 'keeps'} the top-k "
            f"expert weights, and this model {'does' if norm else 'does not'}; no GGUF key says otherwise"
        )
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise UserError(f"GGUF export: llama.cpp's {arch} has experts in every layer, and this model has dense ones")


def _stacked_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' one tensor per expert -> GGUF's stacks (E, out, in), under a `...experts.<part>`
    name _gguf_name knows."""
    out, stacks = {}, {}
    for name, tensor in state.items():
        stem, _, rest = name.partition(".experts.")
        if not rest:
            out[name] = tensor
            continue
        j, part, kind = rest.split(".")
        part = EXPERT_PARTS.get(part, part)
        stacks.setdefault(f"{stem}.experts.{part}.{kind}", {})[int(j)] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[j] for j in range(len(experts))])
    return out


def _vocab(tok) -> dict:
    """The tokenizer's byte-level BPE (tokens by id, merges, special tokens), or a one-line refusal."""
    if tok is None:
        raise UserError("GGUF export needs the run's tokenizer")
    raw = json.loads(tok.tok.to_str())
    model = raw.get("model") or {}
    sentencepiece = model.get("type") == "BPE" and bool(model.get("byte_fallback"))
    if model.get("type") != "BPE" or not (sentencepiece or "ByteLevel" in json.dumps(raw.get("pre_tokenizer"))):
        raise UserError(
            "GGUF export writes byte-level BPE and SentencePiece BPE (byte fallback) tokenizers; this run's is neither"
        )
    vocab = dict(model["vocab"])
    for added in raw.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    special = {a["content"] for a in raw.get("added_tokens") or [] if a.get("special")}
    out = {"tokens": tokens, "merges": merges, "special": special, "kind": SENTENCEPIECE if sentencepiece else BYTE_BPE}
    if sentencepiece:  # llama.cpp merges SentencePiece pieces by score: the earlier a merge, the higher
        rank = {"".join(m.split(" ", 1)): i for i, m in reversed(list(enumerate(merges)))}
        out["scores"] = [-float(rank[t]) if t in rank else 0.0 for t in tokens]
    return out


def _write_metadata(writer, c: dict, tok, vocab: dict, arch: str) -> None:
    import gguf

    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    if not ARCHS[arch].own_head_keys:
        writer.add_head_count_kv(c["num_key_value_heads"])
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
        writer.add_rope_dimension_count(rope_dimensions(c))
    full = (c.get("rope_parameters") or {}).get("full_attention") or {}  # Gemma 3's global layers
    writer.add_rope_freq_base(float(c.get("rope_theta") or full.get("rope_theta") or 10000.0))
    scaling = (
        {}
        if ARCHS[arch].own_rope_keys
        else c.get("rope_scaling") or (full if full.get("rope_type") != "default" else {})
    )
    if scaling.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        if scaling.get("original_max_position_embeddings"):
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif scaling:
        raise UserError(f"GGUF export: rope scaling {scaling.get('rope_type')!r} has no GGUF field tfcli writes")
    writer.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    writer.add_vocab_size(c["vocab_size"])
    experts = _expert_count(c)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c["num_experts_per_tok"])
        if c.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(vocab["kind"])
    writer.add_token_list(vocab["tokens"])
    if vocab["kind"] == BYTE_BPE:
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(vocab["merges"])
    else:  # SentencePiece: scores instead of merges, the <0xNN> pieces marked as bytes
        writer.add_token_scores(vocab["scores"])
    byte = re.compile(r"^<0x[0-9A-F]{2}>$")
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL
            if t in vocab["special"]
            else gguf.TokenType.BYTE
            if vocab["kind"] == SENTENCEPIECE and byte.match(t)
            else gguf.TokenType.NORMAL
            for t in vocab["tokens"]
        ]
    )
    for key, text in (
        ("bos", tok.specials.bos),
        ("eos", tok.specials.eos or tok.tok.id_to_token(tok.eos_id or 0)),
        ("pad", tok.specials.pad),
        ("unk", tok.specials.unk),
    ):
        i = tok.token_id(text) if text else None
        if i is not None:
            getattr(writer, f"add_{key}_token_id")(i)
    writer.add_add_bos_token(False)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


@cache
def _inverse_names(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """transformers' module -> llama.cpp's tensor, per layer and model-wide, for `arch` (once per
    architecture, not once per tensor)."""
    layer = {v: k for k, v in _layer_names(arch).items()} | {f"mlp.experts.{v}": k for k, v in EXPERTS.items()}
    return layer, {v: k for k, v in GLOBAL.items()}


def _gguf_name(name: str, arch: str = "llama") -> str:
    """transformers' tensor name (a stack of experts: _stacked_experts') -> llama.cpp's (the inverse of
    _hf_tensors)."""
    inverse_layer, inverse_global = _inverse_names(arch)
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        block, _, inner = module.partition(".")
        module = f"{Experts().block}.{inner}" if block in EXPERT_BLOCKS else module
        return f"blk.{i}.{inverse_layer[module]}.{kind}"
    module, kind = name.rsplit(".", 1)
    return f"{inverse_global[module]}.{kind}"
