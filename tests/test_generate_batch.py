"""Batched generation: left-padded decoder prompts and right-padded encoder-decoder inputs, one cache
row per prompt, a set of stop tokens, each row ending on its own; greedy output equals batch-1 output
row by row, for GPT and T5."""

from __future__ import annotations

import pytest
import torch

from tfcli.generate import draw, generate_batch, generate_seq2seq, generate_tokens
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config


def spread_(model: torch.nn.Module) -> None:
    """Weights large enough that greedy decoding wanders (a fresh tiny model repeats one token)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


PROMPTS = [[5, 9, 13, 2, 7, 30, 31], [4], [11, 12, 13], [40, 41, 42, 43, 44]]


def cut(row: list[int], stop: set[int]) -> list[int]:
    return next((row[:i] for i, t in enumerate(row) if t in stop), row)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=64, vocab_size=50)).eval()
    spread_(model)
    return model


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    model = T5(
        T5Config(n_layer=2, n_decoder_layer=2, n_head=2, d_model=32, d_ff=64, vocab_size=50, max_seq_len=64)
    ).eval()
    spread_(model)
    return model


def test_a_decoder_batch_of_left_padded_prompts_generates_what_each_alone_does(gpt):
    alone = [list(generate_tokens(gpt, torch.tensor([p]), max_new_tokens=32, temperature=0.0)) for p in PROMPTS]
    assert generate_batch(gpt, PROMPTS, max_new_tokens=32) == alone
    assert all(len(row) == 32 for row in alone) and len({tuple(r) for r in alone}) > 1 and len(set(alone[0])) > 2
    stop = {alone[0][5], alone[2][9]}  # end of turn and end of text, say: each row ends at its first
    assert generate_batch(gpt, PROMPTS, max_new_tokens=32, stop_ids=stop) == [cut(r, stop) for r in alone]


def test_a_draw_takes_each_id_with_its_probability_and_never_an_excluded_one():
    """generate.draw (one uniform number a row against the running sum): 40,000 draws of
    (0.5, 0, 0.3, 0.2, 0) land within 1.5 points of each probability (4 standard errors), never on
    the zero ones; the same seed draws the same ids."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]).expand(40_000, 5)
    ids = draw(probs, torch.Generator().manual_seed(0))
    share = torch.bincount(ids, minlength=5).float() / len(ids)
    assert share[1] == 0 and share[4] == 0
    torch.testing.assert_close(share, probs[0], atol=0.015, rtol=0)
    assert torch.equal(ids, draw(probs, torch.Generator().manual_seed(0)))


def test_a_prompt_asked_several_times_is_read_once_and_continued_in_each_row(gpt):
    """GRPO's G completions of one prompt: the prompts' pass reads each distinct prompt once (2 rows
    here, not 5), its cache copied to the rows that asked it; greedy rows are each prompt's alone, and
    sampled rows of one prompt differ from each other."""
    asked = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0], PROMPTS[2]]
    alone = {
        i: list(generate_tokens(gpt, torch.tensor([PROMPTS[i]]), max_new_tokens=16, temperature=0.0)) for i in (0, 2)
    }
    read = []
    hook = gpt.register_forward_hook(lambda m, args, out: read.append(args[0].shape))
    try:
        assert generate_batch(gpt, asked, max_new_tokens=16) == [alone[i] for i in (0, 2, 0, 0, 2)]
        assert read[0] == (2, len(PROMPTS[0])) and all(shape == (5, 1) for shape in read[1:])
        sampled = generate_batch(gpt, asked, max_new_tokens=16, temperature=1.0, seed=0)
    finally:
        hook.remove()
    assert len({tuple(sampled[i]) for i in (0, 2, 3)}) == 3


def test_an_encoder_decoder_batch_generates_what_each_alone_does(t5):
    alone = [
        list(generate_seq2seq(t5, torch.tensor([p]), start_id=0, max_new_tokens=32, temperature=0.0)) for p in PROMPTS
    ]
    assert generate_batch(t5, PROMPTS, max_new_tokens=32, start_id=0) == alone
    assert len({tuple(r) for r in alone}) > 1 and len(set(alone[0])) > 2
    stop = {alone[1][3]}
    assert generate_batch(t5, PROMPTS, max_new_tokens=32, start_id=0, stop_ids=stop) == [cut(r, stop) for r in alone]


def lora_model(gpt):
    """A copy of the GPT with LoRA on q, k, v, up and down, B random (an update that changes outputs)."""
    import copy

    from tfcli import adapters
    from tfcli.recipe import AdapterConfig

    model = copy.deepcopy(gpt)
    adapters.apply(model, "lora", AdapterConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "up", "down")))
    loras = [m for m in model.modules() if isinstance(m, adapters.LoRALinear)]
    with torch.no_grad():
        for m in loras:
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    return model.eval(), loras


def generated_beside(model, exported, names: set[str], prompts, max_new_tokens: int):
    """Sample from `model` and from `exported` with the same seed (asserting the same ids) -> (the
    ids, the outputs of `model`'s modules `names` at every forward, those of `exported`'s)."""
    outputs: dict[str, list] = {"model": [], "exported": []}
    hooks = [
        m.register_forward_hook(lambda _m, _a, out, into=into: outputs[into].append(out))
        for into, source in (("model", model), ("exported", exported))
        for name, m in source.named_modules()
        if name in names
    ]
    try:
        sampled = generate_batch(model, prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=3)
        assert sampled == generate_batch(exported, prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=3)
    finally:
        for h in hooks:
            h.remove()
    return sampled, outputs["model"], outputs["exported"]


def test_a_lora_generation_on_the_cpu_reads_the_weights_export_merges(gpt):
    """On the CPU a LoRA model generates from each linear's base and update merged once per generation
    (adapters.held_for_generation): the two small products a LoRA linear adds at every token cost a
    sixth of a LoRA-adapted SmolLM2's decoding. The merged weights are those export writes
    (adapters.merge), bit for bit: every adapted linear's output while generating, and so the sampled
    ids, are the merged model's; nothing is held after it."""
    import copy

    from tfcli import adapters

    model, loras = lora_model(gpt)
    exported = adapters.merge(copy.deepcopy(model))
    names = {name for name, m in model.named_modules() if isinstance(m, adapters.LoRALinear)}
    sampled, ours, theirs = generated_beside(model, exported, names, PROMPTS, 24)
    assert len(ours) == len(theirs) > 20 * len(loras)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(m.held_weight is None and m.held_b is None for m in loras)
    assert len({tuple(r) for r in sampled}) > 1


def test_a_lora_generation_forms_each_update_once_and_samples_what_forming_it_per_token_does(gpt, monkeypatch):
    """Where the merged copy is not made (a GPU, a sharded base, more than MERGED_GENERATION_BYTES),
    each LoRA linear holds its scaled B while a batch generates instead of forming it at every token
    (a quarter of a LoRA linear's time at 8 rows): once per linear per generation, the same sampled
    ids as forming it per token, and nothing held after it, so the next training step forms B with
    its gradient again (also inside a generation)."""
    from tfcli import adapters, generate

    model, loras = lora_model(gpt)
    monkeypatch.setattr(adapters, "MERGED_GENERATION_BYTES", 0)  # the held-B path (a larger model's)
    formed = []
    scaled_b = adapters.LoRALinear.scaled_b
    monkeypatch.setattr(adapters.LoRALinear, "scaled_b", lambda self: formed.append(self) or scaled_b(self))
    held = generate_batch(model, PROMPTS, max_new_tokens=24, temperature=1.0, seed=3)
    assert len(formed) == len(loras) == 2 * 3 and all(m.held_b is None for m in loras)
    monkeypatch.setattr(generate, "held_for_generation", lambda m: __import__("contextlib").nullcontext())
    formed.clear()
    per_token = generate_batch(model, PROMPTS, max_new_tokens=24, temperature=1.0, seed=3)
    assert per_token == held and len(formed) > 20 * len(loras), len(formed)
    assert len({tuple(r) for r in held}) > 1
    model.train()
    with adapters.held_for_generation(model):  # a step inside one: B formed with its gradient
        model(torch.tensor([PROMPTS[0]])).sum().backward()
    assert all(m.lora_b.grad is not None and m.lora_b.grad.abs().sum() > 0 for m in loras)
