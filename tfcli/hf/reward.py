"""A reward model (tasks/reward_model.py) as transformers writes one: the family's
*ForSequenceClassification with one label, its base model's weights as the causal LM's (less the LM
head), `score.weight` the scalar head. transformers reads the score at the last token that is not
padding (config.pad_token_id), so the pad written must be a token no conversation holds (pad_token);
without one, none is written, and transformers scores one conversation at a time (it refuses more)."""

from __future__ import annotations

import json

from torch import Tensor

from .. import display
from ..data.chat import ChatTemplate
from ..errors import UserError
from .convert import Export

# the causal LM's architecture -> transformers' class of the same base with a sequence score
SCORED = {"ForCausalLM": "ForSequenceClassification", "LMHeadModel": "ForSequenceClassification"}
# *ForSequenceClassification classes transformers 5 has for the architectures tfcli writes natively
HAS_SCORE = {
    "LlamaForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
    "MistralForSequenceClassification", "Gemma2ForSequenceClassification",
    "Gemma3TextForSequenceClassification", "Phi3ForSequenceClassification",
    "SmolLM3ForSequenceClassification", "Olmo2ForSequenceClassification", "GPT2ForSequenceClassification",
    "Qwen3MoeForSequenceClassification", "MixtralForSequenceClassification",
    "Qwen2MoeForSequenceClassification", "GptOssForSequenceClassification",
    "DeepseekV3ForSequenceClassification",
}  # fmt: skip
LM_HEADS = ("lm_head.weight", "lm_head.bias")


def is_reward_model(backbone) -> bool:
    return "score.weight" in backbone.heads


def scored_architecture(causal: str, generic: bool) -> str:
    """transformers' sequence-scoring class of a causal LM's architecture, or one line saying there is
    none (the generic path asks transformers itself)."""
    suffix = next((s for s in SCORED if causal.endswith(s)), None)
    name = causal[: -len(suffix)] + SCORED[suffix] if suffix else ""
    if generic and name:
        import transformers

        known = hasattr(transformers, name)
    else:
        known = name in HAS_SCORE
    if not known:
        raise UserError(f"export of a reward model: transformers has no sequence classifier for {causal}")
    return name


def pad_token(tokenizer) -> str | None:
    """A pad transformers can tell from the text: a special token that a conversation in the run's
    template (or the base format: the reply, then end of text) does not hold, so it never ends one
    and its embedding row (transformers' padding_idx, which gets no gradient) is no real token's.
    The tokenizer's pad first, then its unk, its end of text, the other special tokens; else None."""
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    if tokenizer.chat_template:
        used = set(ChatTemplate(tokenizer.chat_template).render(tokenizer, conversation).ids)
    else:
        used = set(tokenizer.encode("q\n") + tokenizer.encode("a") + [tokenizer.eos_id])
    s = tokenizer.specials
    candidates = [s.pad, s.unk, s.eos] + [t.content for t in tokenizer.tok.get_added_tokens_decoder().values()]
    for token in candidates:
        if token and tokenizer.token_id(token) is not None and tokenizer.token_id(token) not in used:
            return token
    return None


def as_reward_model(spec: Export, state: dict[str, Tensor], backbone, generic: bool = False):
    """(spec, state) of the causal LM -> those of its *ForSequenceClassification with the run's score."""
    arch = scored_architecture(spec.config["architectures"][0], generic)
    pad = pad_token(backbone.tokenizer)
    if pad is None:
        display.note(
            "reward model export: every special token of the tokenizer is in its conversations, so none can "
            "pad; written without a pad_token_id (transformers then scores one conversation at a time)"
        )
    config = {
        **spec.config,
        "architectures": [arch],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "pad_token_id": backbone.tokenizer.token_id(pad) if pad else None,
    }
    state = {k: v for k, v in state.items() if k not in LM_HEADS}
    state["score.weight"] = backbone.heads["score.weight"].float()
    return Export(config, files=spec.files, rules=spec.rules), state  # extra tensors, conversion: applied


def with_pad(tokenizer_config: str, config: dict, tokenizer) -> str:
    """tokenizer_config.json padding with the pad config.json names: the tokenizer pads a batch with
    the token the model skips when it looks for each row's last."""
    if config.get("pad_token_id") is None:
        return tokenizer_config
    pad = tokenizer.tok.id_to_token(config["pad_token_id"])
    return json.dumps({**json.loads(tokenizer_config), "pad_token": pad}, indent=2)
