"""Tool-calling conversations as SFT data (issue 72, part 1): TRL's format (an assistant's `tool_calls`,
`tool` messages with the results, a row's `tools` schemas) rendered by the model's template exactly
as transformers' apply_chat_template renders it (the ids TRL's SFTTrainer trains on), the loss on the
assistant's turns (its tool calls included), never on tool results or the system's tool list; rows out
of order counted and skipped; a template without a tool format refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tfcli.data.chat import ChatTemplate
from tfcli.data.conversations import DecoderExamples
from tfcli.errors import UserError
from tfcli.tools import calls

from .conftest import invoke, write_jsonl
from .test_chat import hf_fast, hf_ids
from .test_chat import tokenizer as tokenizer  # noqa: F401  (the fixture)
from .test_gguf import chat_gguf_file

transformers = pytest.importorskip("transformers")

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def conversation(a: int = 123, b: int = 45) -> list[dict]:
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": f"What is {a} times {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": f"It is {a * b}."},
    ]


def test_a_tool_conversation_renders_as_transformers_and_trains_only_the_assistants_turns(tokenizer):  # noqa: F811
    template = ChatTemplate.load("qwen2.5-instruct")
    messages = conversation()
    hf = hf_fast(tokenizer, template.source)
    theirs = hf.apply_chat_template(messages, tools=[MULTIPLY], tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    ours = template.render(tokenizer, messages, tools=[MULTIPLY], bos_token="<s>", eos_token="</s>")
    assert ours.ids == theirs
    assert ours.ids != hf_ids(tokenizer, template.source, messages)  # the tools are listed: not the same text
    trained = tokenizer.decode([i for i, m in zip(ours.ids, ours.assistant_mask) if m], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 45}}\n</tool_call>' in trained
    assert "It is 5535." in trained and trained.count("<|im_end|>") == 2  # both turns, each with its end
    assert "5535\n</tool_response>" not in trained and "# Tools" not in trained and "times" not in trained
    assert sorted(set(ours.turns)) == [0, 1, 2]


def test_the_shipped_llama_3_1_template_renders_as_metas_and_trains_the_call(tokenizer):  # noqa: F811
    """tfcli's llama-3.1-instruct (its own text, MIT) renders Meta's Llama 3.1 template's ids (TRL's copy,
    through transformers) with and without a system message and a generation prompt; the call is
    trained as Llama writes it ({"name", "parameters"}), the ipython result and the tool list are not."""
    meta = trl_training_template("llama3_1")
    hf = hf_fast(tokenizer)
    template = ChatTemplate.load("llama-3.1-instruct")
    for messages in (conversation(), conversation()[1:], conversation()[:2]):
        for prompt in (False, True):
            theirs = hf.apply_chat_template(
                messages, tools=[MULTIPLY], tokenize=True, add_generation_prompt=prompt, chat_template=meta
            )
            theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
            assert template.render(tokenizer, messages, prompt, tools=[MULTIPLY], bos_token="<s>").ids == theirs
    rendered = template.render(tokenizer, conversation(), tools=[MULTIPLY])
    trained = tokenizer.decode(
        [i for i, m in zip(rendered.ids, rendered.assistant_mask) if m], skip_special_tokens=False
    )
    assert trained == '{"name": "multiply", "parameters": {"a": 123, "b": 45}}<|eot_id|>It is 5535.<|eot_id|>'
    assert template.writes_tool_calls and calls.format_of(template) == "llama3"  # GRPO reads its calls


# Mistral-7B-Instruct-v0.3's chat template (Apache-2.0), as a public transcription of its
# tokenizer_config.json gives it: the reference tfcli's own mistral-v3-instruct is checked against
MISTRAL_V3 = (
    '{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}'
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}'
    "{{- bos_token }}{%- for message in loop_messages %}"
    '{%- if message["role"] == "user" %}{%- if tools is not none and (message == user_messages[-1]) %}'
    '{{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{%- set tool = tool.function %}'
    """{{- '{"type": "function", "function": {' }}{%- for key, val in tool.items() if key != "return" %}"""
    """{%- if val is string %}{{- '"' + key + '": "' + val + '"' }}{%- else %}"""
    """{{- '"' + key + '": ' + val|tojson }}{%- endif %}{%- if not loop.last %}{{- ", " }}{%- endif %}"""
    '{%- endfor %}{{- "}}" }}{%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}'
    '{%- endfor %}{{- "[/AVAILABLE_TOOLS]" }}{%- endif %}'
    "{%- if loop.last and system_message is defined %}"
    '{{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}'
    '{%- else %}{{- "[INST] " + message["content"] + "[/INST]" }}{%- endif %}'
    '{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- "[TOOL_CALLS] [" }}'
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    '{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}'
    """{{- ', "id": "' + tool_call.id + '"}' }}{%- if not loop.last %}{{- ", " }}{%- else %}"""
    '{{- "]" + eos_token }}{%- endif %}{%- endfor %}'
    '{%- elif message["role"] == "assistant" %}{{- " " + message["content"]|trim + eos_token}}'
    '{%- elif message["role"] == "tool_results" or message["role"] == "tool" %}'
    "{%- if message.content is defined and message.content.content is defined %}"
    "{%- set content = message.content.content %}{%- else %}{%- set content = message.content %}{%- endif %}"
    """{{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}"""
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    '{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}'
    """{{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}"""
    '{%- elif message["role"] == "system" %}{%- endif %}{%- endfor %}'
)


def test_the_shipped_mistral_v3_template_renders_as_mistrals_with_ids_given_where_the_data_has_none(tokenizer):  # noqa: F811
    """tfcli's mistral-v3-instruct renders Mistral v0.3's ids (through transformers, the same ids given);
    TRL's rows carry no call ids, which Mistral's template requires: tfcli numbers them (call00001) and
    gives each result its call's id. The call is trained as [TOOL_CALLS] [...]</s>, the result is not;
    GRPO reads its calls (mistral) and continues a rollout after a result."""
    from tfcli.data.chat import stop_ids, with_call_ids
    from tfcli.tasks.grpo.turns import ToolTurns

    hf = hf_fast(tokenizer)
    template = ChatTemplate.load("mistral-v3-instruct")
    assert template.needs_call_ids and calls.format_of(template) == "mistral"
    for messages in (conversation()[1:], conversation()[1:3], conversation()[:2]):
        given = with_call_ids(messages)
        assert given[1:2] == messages[1:2] or given[1]["tool_calls"][0]["id"] == "call00001"
        theirs = hf.apply_chat_template(given, tools=[MULTIPLY], tokenize=True, chat_template=MISTRAL_V3)
        theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
        ours = template.render(tokenizer, messages, tools=[MULTIPLY], bos_token="<s>", eos_token="</s>")
        assert ours.ids == theirs
    rendered = template.render(tokenizer, conversation()[1:], tools=[MULTIPLY], bos_token="<s>", eos_token="</s>")
    trained = tokenizer.decode(
        [i for i, m in zip(rendered.ids, rendered.assistant_mask) if m], skip_special_tokens=False
    )
    call = '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 123, "b": 45}, "id": "call00001"}]</s>'
    assert trained == call + " It is 5535.</s>"
    assert '"call_id": "call00001"' in rendered.text and "[TOOL_RESULTS]" not in trained
    tokenizer.specials = tokenizer.specials.__class__(bos="<s>", eos="</s>")  # Mistral's, as its tokenizer has them
    turns = ToolTurns(template, tokenizer, stop_ids(tokenizer), 3)
    result = turns.tool_ids([{"role": "tool", "name": "multiply", "content": "5535"}])
    assert (
        tokenizer.decode(result, skip_special_tokens=False)
        == '[TOOL_RESULTS] {"content": 5535, "call_id": "call00001"}[/TOOL_RESULTS]'
    )


def trl_training_template(name: str = "qwen2_5_training") -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def test_a_template_with_generation_markers_trains_what_they_mark_as_transformers_does(tokenizer):  # noqa: F811
    """tfcli's own convention (no markers): the reply and its end-of-turn token, the tokens the model
    samples. TRL's SFTTrainer (assistant_only_loss) swaps in its qwen2_5_training.jinja, whose markers
    also take the line break after the assistant's header and the one after <|im_end|>: given that
    template, tfcli's mask is transformers' `assistant_masks`, token for token."""
    source = trl_training_template()
    messages = conversation()
    hf = hf_fast(tokenizer)
    out = hf.apply_chat_template(
        messages, tools=[MULTIPLY], tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        chat_template=source,
    )  # fmt: skip
    marked = ChatTemplate(source).render(tokenizer, messages, tools=[MULTIPLY])
    assert marked.ids == list(out["input_ids"]) and marked.assistant_mask == list(out["assistant_masks"])
    assert sorted(set(marked.turns)) == [0, 1, 2]
    ours = ChatTemplate.load("qwen2.5-instruct").render(tokenizer, messages, tools=[MULTIPLY])
    assert ours.ids == marked.ids
    only_theirs = [i for i, a, b in zip(ours.ids, marked.assistant_mask, ours.assistant_mask) if a and not b]
    assert all(a for a, b in zip(marked.assistant_mask, ours.assistant_mask) if b)  # ours within theirs
    assert set(tokenizer.decode([i]) for i in only_theirs) == {"\n"} and len(only_theirs) == 4
    nested = "{% generation %}{% generation %}{{ messages[0].content }}{% endgeneration %}{% endgeneration %}"
    with pytest.raises(UserError, match="nested or unclosed"):
        ChatTemplate(nested).render(tokenizer, messages[:2])


def test_sft_loss_and_gradients_on_tool_chats_equal_trls_sfttrainer(tmp_path):
    """The same tool conversations, TRL's training template on both sides: SFTTrainer(assistant_only_loss)
    tokenizes them to the ids and labels tfcli trains, and one batch's loss and gradients are equal."""
    from dataclasses import replace

    import datasets

    from tfcli.hf import convert
    from tfcli.hf import interop as hf
    from tfcli.hf import llama as llama_table
    from tfcli.tasks.reply_batches import PaddedReplies, decoder_loss

    from .test_dpo import every_pair
    from .test_gguf import tiny_backbone

    trl = pytest.importorskip("trl")
    source = trl_training_template()
    backbone = tiny_backbone(max_seq_len=512)
    # transformers gives the embedding's pad row no gradient: pad with a token the text never holds
    backbone.tokenizer.specials = replace(backbone.tokenizer.specials, pad="<|endoftext|>")
    rows = [{"messages": conversation(100 + 7 * i, 20 + i), "tools": [MULTIPLY]} for i in range(3)]
    rows[1]["messages"] = rows[1]["messages"][1:]  # one without a system message
    examples = DecoderExamples(backbone.tokenizer, ChatTemplate(source), "assistant", 512).build_all(rows).examples
    pad = backbone.tokenizer.token_id("<|endoftext|>")
    batch = PaddedReplies(examples, pad).batch(every_pair(len(examples)))
    model = backbone.model.train()
    ours, _ = decoder_loss(model, None, batch)
    ours.backward()

    hf.export(backbone, None, tmp_path / "policy")
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backbone.tokenizer.tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = source
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], use_cpu=True,
        per_device_train_batch_size=len(rows), max_length=None, bf16=False, fp16=False,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{**r, "tools": json.dumps(r["tools"])} for r in rows])
    trainer = trl.SFTTrainer(model=theirs_model, args=args, train_dataset=dataset, processing_class=tok)
    processed = [trainer.train_dataset[i] for i in range(len(rows))]
    for e, row in zip(examples, processed):
        assert e.ids.tolist() == row["input_ids"]
        assert e.trained[1:].tolist() == [int(label != -100) for label in row["labels"][1:]]
    theirs_batch = trainer.data_collator(processed)
    theirs_model.train()
    theirs = trainer.compute_loss(theirs_model, theirs_batch)
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5) and float(ours.detach()) > 1.0
    grads = convert.to_hf({f"model.{n}": p.grad for n, p in model.named_parameters()}, llama_table.rules(model.cfg))
    their_grads = {n: p.grad for n, p in theirs_model.named_parameters() if p.grad is not None}
    assert set(grads) == set(their_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, their_grads[name], atol=1e-5, rtol=1e-4)


def test_rows_of_tool_calls_are_built_and_bad_ones_counted_by_reason(tokenizer):  # noqa: F811
    builder = DecoderExamples(tokenizer, ChatTemplate.load("qwen2.5-instruct"), "assistant", 1024)
    tool_first = [
        {"role": "user", "content": "q"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    user_calls = [{"role": "user", "content": "q", "tool_calls": conversation()[2]["tool_calls"]}]
    rows = [
        {"messages": conversation(), "tools": [MULTIPLY]},
        {"messages": conversation(7, 8), "tools": json.dumps([MULTIPLY])},  # TRL's datasets store it as JSON
        {"messages": tool_first, "tools": [MULTIPLY]},
        {"messages": user_calls + [{"role": "assistant", "content": "x"}]},
    ]
    built = builder.build_all(rows)
    assert len(built.examples) == 2
    assert built.skipped == {"roles out of order": 1, "malformed tool_calls": 1}
    with pytest.raises(UserError, match="is not JSON"):
        builder.build_all([{"messages": conversation(), "tools": "{not json"}])
    chatml = DecoderExamples(tokenizer, ChatTemplate.load("chatml"), "assistant", 1024)
    with pytest.raises(UserError, match="has no tool format"):
        chatml.build_all(rows[:1])


def test_finetune_sft_trains_on_tool_calls_and_a_template_without_them_is_one_line(tmp_path_factory, tmp_path):
    model = chat_gguf_file(tmp_path_factory, max_seq_len=512)
    rows = [{"messages": conversation(100 + i, 20 + i), "tools": [MULTIPLY]} for i in range(12)]
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    common = ["finetune", "sft", "--from", model, "--data", data, "--steps", 2, "--batch-size", 4, "--quiet"]
    common += ["--set", "sft.generate_limit=0"]
    result = invoke(*common, "--chat-template", "qwen2.5-instruct", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    refused = invoke(*common, "--chat-template", "chatml", "--out", tmp_path / "refused")
    assert refused.exit_code == 2 and "has no tool format" in refused.output, refused.output
    assert refused.output.count("\n") == 1 and not (tmp_path / "refused").exists()
