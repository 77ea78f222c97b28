"""Chat templates: every template tfcli ships (../shared/data/chat_templates) and a model's own from
tokenizer_config.json render the ids transformers' apply_chat_template renders, on three multi-turn
conversations; the assistant mask covers exactly the replies and their end-of-turn token; a template
that reaches for Python internals is refused in one line."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from tfcli.data.chat import ChatTemplate, shipped_templates
from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.errors import UserError

transformers = pytest.importorskip("transformers")

SPECIALS = [
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    *(
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    ),
]  # (Mistral's control tokens are special in its tokenizer)
END_OF_TURN = {
    "chatml": "<|im_end|>",
    "qwen2.5-instruct": "<|im_end|>",
    "llama-3-instruct": "<|eot_id|>",
    "llama-3.1-instruct": "<|eot_id|>",
    "gemma-it": "<end_of_turn>",
    "phi-3": "<|end|>",
}  # the others end a reply with eos_token
CONVERSATIONS = [
    [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "That makes 20."},
    ],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a short joke."},
        {"role": "assistant", "content": "I would, but it is too long."},
        {"role": "user", "content": "Fine."},
        {"role": "assistant", "content": "Thanks for asking."},
    ],
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    tok.tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


_FAST: dict = {}


def hf_fast(tokenizer, template: str | None = None):
    """transformers' tokenizer over `tokenizer`'s own (bos <s>, eos </s>), made once per tokenizer: it
    deep-copies the 50k vocabulary, 0.2 s each time; the chat template is set on every call."""
    held = _FAST.get(id(tokenizer.tok))
    if held is None or held[0] is not tokenizer.tok:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok, bos_token="<s>", eos_token="</s>")
        held = _FAST[id(tokenizer.tok)] = (tokenizer.tok, fast)
    held[1].chat_template = template
    return held[1]


def hf_ids(tokenizer, template: str, conversation: list[dict]):
    hf = hf_fast(tokenizer, template)
    out = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=False)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", shipped_templates())
@pytest.mark.parametrize("n", range(len(CONVERSATIONS)))
def test_rendered_ids_match_transformers_and_the_mask_is_the_replies(name, n, tokenizer):
    template, conversation = ChatTemplate.load(name), CONVERSATIONS[n]
    try:
        theirs = hf_ids(tokenizer, template.source, conversation)
    except Exception as e:  # the template refuses this conversation (e.g. no system role): so must tfcli
        with pytest.raises(UserError):
            template.render(tokenizer, conversation, bos_token="<s>", eos_token="</s>")
        pytest.skip(f"{name} refuses conversation {n}: {e}")
    if not keeps_prefixes(template, conversation):  # (Mistral v3 moves its system text to the last turn)
        with pytest.raises(UserError, match="rendering a longer conversation changes what came before"):
            template.render(tokenizer, conversation, bos_token="<s>", eos_token="</s>")
        return
    ours = template.render(tokenizer, conversation, bos_token="<s>", eos_token="</s>")
    assert ours.ids == theirs
    masked = [i for i, m in zip(ours.ids, ours.assistant_mask) if m]
    masked_text = tokenizer.decode(masked, skip_special_tokens=False)
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    others = [m["content"] for m in conversation if m["role"] != "assistant"]
    assert all(r in masked_text for r in replies), masked_text
    assert not any(o in masked_text for o in others), masked_text
    end = tokenizer.token_id(END_OF_TURN.get(name, "</s>"))
    assert masked.count(end) == len(replies)  # each reply's end-of-turn token is learned, once
    # nothing after a reply's end-of-turn token, up to the next turn, is in the mask
    for i, (token, m) in enumerate(zip(ours.ids, ours.assistant_mask)):
        if m and token == end and i + 1 < len(ours.ids):
            assert ours.assistant_mask[i + 1] == 0


def keeps_prefixes(template, conversation) -> bool:
    """Whether the conversation up to each reply renders as the start of the conversation through it
    (what telling the replies apart by prefix differencing needs)."""
    texts = [
        template.text(conversation[:i], bos_token="<s>", eos_token="</s>") for i in range(1, len(conversation) + 1)
    ]
    return all(b.startswith(a.rstrip()) for a, b in zip(texts, texts[1:]))


def test_a_models_own_template_from_its_tokenizer_config(tmp_path, tokenizer):
    source = (ChatTemplate.load("chatml")).source
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source, "eos_token": "</s>"}))
    template = ChatTemplate.load(str(tmp_path / "tokenizer_config.json"))
    ours = template.render(tokenizer, CONVERSATIONS[0], bos_token="<s>", eos_token="</s>")
    assert ours.ids == hf_ids(tokenizer, source, CONVERSATIONS[0])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set x = messages.append({'role': 'user'}) %}",
    ],
)
def test_a_template_that_reaches_for_python_internals_is_refused(source):
    with pytest.raises(UserError, match="refused") as e:
        ChatTemplate(source, "evil.jinja").text([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and str(e.value).startswith("evil.jinja: refused")


def test_bad_templates_and_messages_are_one_line_errors(tokenizer):
    with pytest.raises(UserError, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}", "broken.jinja")
    with pytest.raises(UserError, match="Conversation roles must alternate"):
        ChatTemplate.load("chatml").text([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}])
    with pytest.raises(UserError, match="message 1: expected"):
        ChatTemplate.load("chatml").render(tokenizer, [{"role": "robot", "content": "x"}])
    with pytest.raises(UserError, match="no such file or shipped template"):
        ChatTemplate.load("no-such-template")


def test_special_tokens_and_the_template_travel_from_a_model_directory_to_a_run_and_an_export(tmp_path, tokenizer):
    """A Hugging Face directory's tokenizer_config.json names its special tokens and chat template:
    tfcli reads them (and eos follows them), keeps them beside a run's tokenizer.json, and export
    writes the template back, so transformers renders the same conversation."""
    from tfcli.data.special_tokens import SpecialTokens
    from tfcli.data.tokenizers import TextTokenizer, load_tokenizer_files

    source = ChatTemplate.load("chatml").source
    model = tmp_path / "model"
    model.mkdir()
    tokenizer.save(model)
    (model / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": source, "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "</s>"}
        )
    )
    tok = load_tokenizer_files(str(model), [])
    assert tok.specials == SpecialTokens(eos="<|im_end|>", pad="</s>") and tok.chat_template == source
    assert tok.eos_id == tokenizer.token_id("<|im_end|>")
    run = tmp_path / "run"
    run.mkdir()
    tok.save(run)
    again = TextTokenizer.from_run(run)
    assert again.specials == tok.specials and again.chat_template == source
    # export writes the template back: transformers renders the conversation as tfcli does
    from tfcli.hf import interop as hf
    from tfcli.models.gpt import GPT, GPTConfig
    from tfcli.plugin import Backbone

    model_ = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, max_seq_len=16, vocab_size=tok.vocab_size))
    hf.export(Backbone(model_, again), None, tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert exported["chat_template"] == source and exported["eos_token"] == "<|im_end|>"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(
        CONVERSATIONS[0], tokenize=True
    )
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    assert ChatTemplate(source).render(again, CONVERSATIONS[0], bos_token=exported["bos_token"]).ids == theirs


# Each shipped template against its model family's documented prompt format, written out by hand (not
# transformers rendering the same file, which would reproduce a stray indent or line break in it):
# a system message, a user turn, a reply, a second user turn, and the generation prompt.
S, U, A, U2 = "You answer briefly.", "Capital of France?", "Paris.", "And of Italy?"
DOCUMENTED = {
    # ChatML (OpenAI; Qwen, SmolLM2): no BOS, each turn `<|im_start|>role\n...<|im_end|>\n`
    "chatml": (
        "<s>",
        "</s>",
        f"<|im_start|>system\n{S}<|im_end|>\n<|im_start|>user\n{U}<|im_end|>\n"
        f"<|im_start|>assistant\n{A}<|im_end|>\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n",
    ),
    "qwen2.5-instruct": (
        "<s>",
        "</s>",
        f"<|im_start|>system\n{S}<|im_end|>\n<|im_start|>user\n{U}<|im_end|>\n"
        f"<|im_start|>assistant\n{A}<|im_end|>\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n",
    ),
    # Meta Llama 3 model card
    "llama-3-instruct": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{S}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{U}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{A}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{U2}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    # Meta Llama 3.1 / 3.2 (their template's text; without tools, a dated system turn)
    "llama-3.1-instruct": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n{S}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{U}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n{A}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{U2}<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    # Mistral-7B-Instruct-v0.3: the system text in the last user turn when it ends the conversation
    "mistral-v3-instruct": ("<s>", "</s>", f"<s>[INST] {U}[/INST] {A}</s>[INST] {S}\n\n{U2}[/INST]"),
    # HuggingFaceH4/zephyr-7b-beta
    "zephyr": (
        "<s>",
        "</s>",
        f"<|system|>\n{S}</s>\n<|user|>\n{U}</s>\n<|assistant|>\n{A}</s>\n<|user|>\n{U2}</s>\n<|assistant|>\n",
    ),
    # Mistral-7B-Instruct: `<s>[INST] ... [/INST] reply</s>[INST] ... [/INST]`; the system text leads
    "mistral-instruct": ("<s>", "</s>", f"<s>{S}\n\n[INST] {U} [/INST] {A}</s>[INST] {U2} [/INST]"),
    # Llama 2 chat: the system prompt inside the first [INST], each exchange its own <s>...</s>
    "llama-2-chat": ("<s>", "</s>", f"<s>[INST] <<SYS>>\n{S}\n<</SYS>>\n\n{U} [/INST] {A} </s><s>[INST] {U2} [/INST]"),
    # Gemma instruction-tuned: <bos>, roles user and model, the system text in the first user turn
    "gemma-it": (
        "<bos>",
        "<eos>",
        f"<bos><start_of_turn>user\n{S}\n\n{U}<end_of_turn>\n<start_of_turn>model\n{A}"
        f"<end_of_turn>\n<start_of_turn>user\n{U2}<end_of_turn>\n<start_of_turn>model\n",
    ),
    # Phi-3
    "phi-3": (
        "<s>",
        "<|endoftext|>",
        f"<|system|>\n{S}<|end|>\n<|user|>\n{U}<|end|>\n<|assistant|>\n{A}<|end|>\n"
        f"<|user|>\n{U2}<|end|>\n<|assistant|>\n",
    ),
    # Stanford Alpaca's instruction format
    "alpaca": (
        "<s>",
        "</s>",
        f"<s>{S}\n\n### Instruction:\n{U}\n\n### Response:\n{A}</s>\n\n### Instruction:\n{U2}\n\n### Response:\n",
    ),
}


def test_every_shipped_template_has_a_documented_reference():
    assert sorted(DOCUMENTED) == shipped_templates()


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_a_shipped_template_renders_its_models_documented_format(name):
    bos, eos, expected = DOCUMENTED[name]
    messages = [
        {"role": "system", "content": S},
        {"role": "user", "content": U},
        {"role": "assistant", "content": A},
        {"role": "user", "content": U2},
    ]
    assert ChatTemplate.load(name).text(messages, add_generation_prompt=True, bos_token=bos, eos_token=eos) == expected
