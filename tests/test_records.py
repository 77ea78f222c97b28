"""One record per architecture (hf/record.py, hf/registry.py), read once: the registry is the one list
of what tfcli reads natively, and everything that lists architectures is generated from it."""

from __future__ import annotations

import builtins
import io
import re
import sys
from pathlib import Path

import pytest

from tfcli.hf import gguf_archs, registry
from tfcli.hf.record import Table
from tfcli.models import FAMILIES

from .conftest import hf_llama_dir, invoke, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_every_record_names_a_family_a_table_and_a_gguf_architecture_tfcli_has():
    assert len(registry.NATIVE) == len(registry.RECORDS), "a model_type recorded twice"
    for r in registry.RECORDS:
        assert r.family in FAMILIES, r
        assert isinstance(r.table, Table), r
        assert not r.gguf or r.gguf in gguf_archs.ARCHS, r
    assert {r.gguf for r in registry.RECORDS if r.gguf} == set(gguf_archs.ARCHS)


def test_tfcli_models_lists_every_record():
    result = invoke("models")
    assert result.exit_code == 0, result.output
    flat = re.sub(r"\s+", "", result.output)
    for r in registry.RECORDS:
        assert r.model_type.replace(" ", "") in flat, r.model_type


def test_the_readme_and_the_interop_page_carry_the_registrys_table():
    """`python docs/hooks/architectures.py` writes them again when this fails."""
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import architectures
    finally:
        sys.path.pop(0)
    for page in architectures.PAGES:
        text = page.read_text()
        assert architectures.MARKER in text, page
        assert architectures.with_table(text) == text, f"{page}: run python docs/hooks/architectures.py"


def test_the_decoder_parity_matrix_is_the_registrys_llama_family():
    """Each llama-family architecture has its logits, generation, training-step and export parity tests
    against transformers (tests/test_llama.py, test_families.py, test_moe.py): their matrix covers the
    registry's records, no more and no less."""
    from . import test_families, test_llama, test_moe

    tested = set(test_llama.ARCHITECTURES) | set(test_families.ARCHITECTURES) | set(test_moe.ARCHITECTURES)
    assert tested == {r.model_type for r in registry.of_family("llama")}


def test_every_other_native_architecture_is_read_by_a_test():
    """The encoders', T5's, ViT's and the vision-language models' records each appear in a test that
    reads a transformers directory of that architecture."""
    texts = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_records.py")
    for r in registry.RECORDS:
        if r.family != "llama":
            assert f'"{r.model_type}"' in texts or r.architecture in texts or r.name in texts, r.model_type


def test_an_unknown_model_type_is_one_line_naming_the_native_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_thing"}')
    result = invoke("generate", "--checkpoint", tmp_path, "--prompt", "a")
    assert result.exit_code == 2
    assert "no_such_thing" in result.output and "qwen3_moe" in result.output


@pytest.fixture
def config_reads(monkeypatch):
    """The paths of every config.json opened for reading while the test runs."""
    reads: list[Path] = []
    real = builtins.open

    def counting(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "config.json" and "r" in mode:
            reads.append(Path(file).resolve())
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return reads


def tiny_gpt_neox(path: Path) -> Path:
    """A tiny GPT-NeoX directory (the generic path: transformers reads its weights) with GPT-2's tokenizer."""
    import torch
    import transformers

    from tfcli.data.tokenizers import load_tokenizer_files

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    config = transformers.GPTNeoXConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("kind", ["native", "generic"])
def test_a_checkpoints_config_json_is_read_once_per_command(tmp_path, config_reads, kind):
    """The memory plan, the family check, the recipe choice, loading and export take the ModelSource,
    which parsed config.json once (the plan, the family and the load each read it again before); the
    generic path hands transformers the parsed config too."""
    model = hf_llama_dir(tmp_path / "m") if kind == "native" else tiny_gpt_neox(tmp_path / "m")
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a b", "completion": " c d"}] * 8)
    mine = (model / "config.json").resolve()
    for args in (
        ["finetune", "sft", "--from", model, "--data", rows, "--dry-run"],
        ["generate", "--checkpoint", model, "--prompt", "a", "--max-new-tokens", "2"],
        ["export", "--checkpoint", model, "--hf", tmp_path / "out"],
    ):
        config_reads.clear()
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert config_reads.count(mine) == 1, (args[0], config_reads)


@pytest.mark.parametrize("model_type", ["mistral", "mixtral"])
def test_an_export_its_class_cannot_hold_is_refused_not_written_without_its_biases(model_type):
    """transformers' Mistral and Mixtral have no attention biases; a model with them exported as either
    was written without them (its records now say which config.json keys each class reads)."""
    from tfcli.errors import UserError
    from tfcli.models.llama import LlamaConfig

    mixture = dict(n_experts=2, experts_per_token=1, expert_d_ff=64) if model_type == "mixtral" else {}
    cfg = LlamaConfig(
        n_layer=1, n_head=2, d_model=32, d_ff=64, vocab_size=32, qkv_bias=True, out_bias=True,
        hf_model_type=model_type, **mixture, norm_topk=True,
    )  # fmt: skip
    with pytest.raises(UserError, match="its biases"):
        registry.NATIVE[model_type].table.config_to_hf(cfg)
