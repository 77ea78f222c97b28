"""The decoder: causality, the KV cache, published size, a run exported to transformers (parity: test_hf)."""

from __future__ import annotations

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.generate import generate_tokens
from tfcli.models.gpt import GPT, GPTConfig

from .conftest import close


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(**{"n_layer": 2, "n_head": 4, "d_model": 32, "max_seq_len": 48, "vocab_size": 97, **kw})
    ).eval()


def test_changing_a_later_token_never_changes_earlier_logits():
    model = tiny()
    ids = torch.randint(0, 97, (2, 40))
    changed = ids.clone()
    changed[:, 25:] = (changed[:, 25:] + 1) % 97
    with torch.no_grad():
        a, b = model.logits(model(ids)), model.logits(model(changed))
    assert torch.equal(a[:, :25], b[:, :25])
    assert not torch.allclose(a[:, 25:], b[:, 25:])


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, top_p=0.9, seed=3)])
def test_generation_with_cache_equals_generation_without(sampling):
    model = tiny()
    prompt = torch.randint(0, 97, (1, 7))
    with_cache = list(generate_tokens(model, prompt, max_new_tokens=60, use_cache=True, **sampling))
    without = list(generate_tokens(model, prompt, max_new_tokens=60, use_cache=False, **sampling))
    assert len(with_cache) == 60  # runs past the 48-token context: the window slides
    assert with_cache == without


def test_cached_logits_match_full_forward():
    model = tiny()
    ids = torch.randint(0, 97, (1, 20))
    caches = model.new_caches()
    with torch.no_grad():
        full = model.logits(model(ids))
        prefix = model.logits(model(ids[:, :12], caches))
        steps = [model.logits(model(ids[:, t : t + 1], caches)) for t in range(12, 20)]
    incremental = torch.cat([prefix] + steps, dim=1)
    assert close(full, incremental, 1e-5)


def test_gpt2_small_recipe_has_the_published_parameter_count():
    cfg = recipes.replace(recipes.load("gpt2-small").model, vocab_size=50257)  # what the GPT-2 tokenizer gives
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 124e6) / 124e6 < 0.02, n


def test_context_overflow_is_an_error():
    model = tiny()
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 49, dtype=torch.long))


def test_export_writes_a_directory_transformers_loads_with_identical_logits(tmp_path, small_text):
    import yaml
    from typer.testing import CliRunner

    transformers = pytest.importorskip("transformers")
    from tfcli.cli import app
    from tfcli.engine.backbone import from_run as load_run

    from .conftest import tiny_gpt_recipe

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text, train={"steps": 3})))
    runner = CliRunner()
    assert (
        runner.invoke(app, ["pretrain", "--recipe", str(recipe), "--out", str(tmp_path / "run"), "--quiet"]).exit_code
        == 0
    )
    result = runner.invoke(app, ["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = load_run(tmp_path / "run").model
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 32))
    with torch.no_grad():
        assert (ours.logits(ours(ids)) - hf(ids).logits).abs().max().item() < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("ROMEO:")["input_ids"] == load_run(tmp_path / "run").tokenizer.encode("ROMEO:")
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")


def test_the_cpu_decoding_head_gives_the_models_logits():
    """Generation on the CPU reads the LM head as (D, V) column blocks, one per thread (faster for one
    position at a time): the logits are the model's own, for a tied GPT and both kinds of T5 head,
    whether or not the blocks divide the vocabulary, for one row or several."""
    from tfcli.generate import ColumnSplitHead, decode_logits
    from tfcli.models.t5 import T5, T5Config

    torch.manual_seed(0)
    models = [GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=8, vocab_size=97))] + [
        T5(T5Config(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=97, tie_word_embeddings=tied))
        for tied in (True, False)
    ]
    for model in models:
        for rows in (1, 3):
            hidden = torch.randn(rows, 16)
            expected = model.logits(hidden)
            assert torch.allclose(decode_logits(model, torch.device("cpu"))(hidden), expected, atol=1e-5)
            for parts in (1, 2, 3, 4, 97):
                assert torch.allclose(ColumnSplitHead(model.lm_head_weight, parts)(hidden), expected, atol=1e-5)


def test_the_cpu_decoding_head_is_laid_out_once_per_weight_version():
    """Laying the head out again for every generation cost a page-faulted copy of the whole (V, D)
    weight per call (0.7 s of each on-policy distillation step on SmolLM2): a frozen head (LoRA, a
    teacher) is laid out once; a head that changed in place (a full finetuning step) is laid out anew,
    so the logits are always the model's own."""
    from tfcli.generate import decode_logits

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=8, vocab_size=97))
    cpu, hidden = torch.device("cpu"), torch.randn(3, 16)
    assert decode_logits(model, cpu) is not decode_logits(model, cpu)  # trained: a fused optimizer may not bump
    model.requires_grad_(False)
    first = decode_logits(model, cpu)
    assert decode_logits(model, cpu) is first
    with torch.no_grad():
        model.lm_head_weight.mul_(2.0)  # a frozen head changed in place (a weight loaded into it)
    again = decode_logits(model, cpu)
    assert again is not first and torch.allclose(again(hidden), model.logits(hidden), atol=1e-5)
    other = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=8, vocab_size=97))
    assert torch.allclose(decode_logits(other, cpu)(hidden), other.logits(hidden), atol=1e-5)


def test_sequence_logprobs_equal_the_full_logits_way_values_and_gradients():
    """objectives.losses.sequence_logprobs: per sequence, the summed log-probability of its targets
    (ignored positions left out), in chunks, against log_softmax of the whole logits."""
    from tfcli.objectives import losses

    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (3, 7))
    targets[0, :3] = losses.IGNORE  # a prompt
    targets[2, 5:] = losses.IGNORE  # padding
    ref = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ref = (ref * (targets != losses.IGNORE)).sum(1)
    ref_grads = torch.autograd.grad((ref * torch.tensor([1.0, -2.0, 0.5])).sum(), (hidden, weight))
    ours = losses.sequence_logprobs(hidden, weight, targets)
    grads = torch.autograd.grad((ours * torch.tensor([1.0, -2.0, 0.5])).sum(), (hidden, weight))
    assert ours.shape == (3,) and torch.allclose(ours, ref, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, ref_grads))
    old = losses.ROW_BLOCK, losses.MIN_COLUMNS, losses.TILE_ELEMENTS
    losses.ROW_BLOCK, losses.MIN_COLUMNS, losses.TILE_ELEMENTS = 4, 9, 36  # several row blocks and tiles: the same
    try:
        assert torch.allclose(losses.sequence_logprobs(hidden, weight, targets), ref, atol=1e-5)
    finally:
        losses.ROW_BLOCK, losses.MIN_COLUMNS, losses.TILE_ELEMENTS = old
