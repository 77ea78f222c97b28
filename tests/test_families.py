"""The llama family's newer architectures against transformers on the same weights: Gemma 2, Gemma 3
(text), OLMo 2, SmolLM3, Granite and Phi-3 (partial rotary and LongRoPE), tiny random configs made by
transformers, each setting its architecture's own switches. In fp32: logits within 1e-4, greedy
generation through tfcli's KV cache identical for 24 tokens (batch 4, left padding), one full training
step's loss and every gradient within 1e-4 of transformers', one LoRA step's of transformers + peft,
`export --hf` reloaded by transformers with the same logits; and what tfcli does not implement refused
in one line."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli import adapters  # noqa: E402
from tfcli.data.tokenizers import load_tokenizer_files  # noqa: E402
from tfcli.errors import UserError  # noqa: E402
from tfcli.generate import generate_batch  # noqa: E402
from tfcli.hf import convert  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.objectives.losses import IGNORE, linear_cross_entropy, lm_head  # noqa: E402
from tfcli.plugin import Backbone  # noqa: E402
from tfcli.recipe import AdapterConfig  # noqa: E402

from .conftest import close, invoke  # noqa: E402
from .test_llama import spread_, tfcli_model  # noqa: E402

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
ARCHITECTURES = {  # model_type -> its switches, set so that each matters on 24 tokens
    "gemma2": dict(
        sliding_window=6, layer_types=SLIDING, query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
    ),
    "gemma3_text": dict(
        sliding_window=6, layer_types=SLIDING, query_pre_attn_scalar=12, tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "olmo2": dict(tie_word_embeddings=False),
    "smollm3": dict(no_rope_layers=[1, 0, 1, 0]),
    "granite": dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=16, tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5],
            "long_factor": [3.0, 5.0],
        },
    ),
}  # fmt: skip


def hf_model(arch: str, **extra):
    config = transformers.AutoConfig.for_model(arch, **{**BASE, **ARCHITECTURES[arch], **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    spread_(model)
    with torch.no_grad():  # weights smaller than spread_'s: Gemma's sqrt(d) embedding and caps stay unsaturated
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(0.5)
            elif arch.startswith("gemma"):
                p.sub_(1.0)  # Gemma's norms scale by 1 + w
    return model


def saved_pair(arch: str, theirs, tmp_path_factory):
    """(model_type, transformers model, its saved directory, the tfcli model read from it)."""
    directory = tmp_path_factory.mktemp(arch)
    theirs.save_pretrained(directory)
    return arch, theirs, directory, tfcli_model(directory)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def pair(request, tmp_path_factory):
    return saved_pair(request.param, hf_model(request.param), tmp_path_factory)


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers(pair):
    arch, theirs, _, ours = pair
    assert ours.cfg.hf_model_type == arch
    with torch.no_grad():
        want = theirs(IDS).logits
        got = ours.logits(ours(IDS))
    assert got.shape == want.shape == (2, 24, VOCAB)
    assert (got - want).abs().max() < 1e-4
    assert want.std() > 0.3  # not a model whose logits are all alike
    if ours.cfg.logit_softcap:  # and not all squashed flat against the cap
        assert (want.abs() < 0.8 * ours.cfg.logit_softcap).float().mean() > 0.5


def test_the_switches_are_the_architectures(pair):
    arch, _, _, ours = pair
    cfg = ours.cfg
    expected = {
        "gemma2": dict(norms="both", activation="gelu_tanh", attn_softcap=3.0, logit_softcap=5.0),
        "gemma3_text": dict(norms="both", qk_norm=True, local_rope_theta=10000.0),
        "olmo2": dict(norms="post", qk_norm=True, qk_norm_whole=True),
        "smollm3": dict(nope_layers=(1, 3)),
        "granite": dict(embed_scale=3.0, residual_scale=0.5, attn_scale=0.2, logit_scale=0.5),
        "phi3": dict(partial_rotary=0.5),
    }[arch]
    assert {k: getattr(cfg, k) for k in expected} == expected
    if arch.startswith("gemma"):
        assert [cfg.window_of(i) for i in range(4)] == [6, 0, 6, 0]
    if arch == "phi3":
        assert cfg.rope.type == "longrope" and cfg.rope.long_factor == (3.0, 5.0) and cfg.rope.original_max == 16


def test_greedy_generation_matches_through_the_kv_cache(pair):
    assert_greedy_generation_matches(*pair[1::2])


def assert_greedy_generation_matches(theirs, ours) -> None:
    """24 greedy tokens at batch 4 with left padding: tfcli's KV cache against transformers' generate."""
    prompts = [[5, 9, 13, 2, 7, 30, 31, 8], [4], [11, 12, 13], [40, 41, 42, 43, 44]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = theirs.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        want = [row[width:].tolist() for row in out]
        got = generate_batch(ours, prompts, max_new_tokens=24, pad_id=0)
    assert got == want and len({t for row in want for t in row}) > 3


def targets_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)  # (B, T) the next token


def our_loss(model, ids):
    head = lm_head(model, model(ids))
    return linear_cross_entropy(head.hidden, head.weight, targets_of(ids), softcap=head.softcap)[0]


def theirs_named(grads: dict, cfg, module) -> dict:
    """tfcli's gradients under transformers' names (a norm's offset moves its weight, not its gradient)."""
    rules = [replace(r, offset=0.0) for r in module.rules(cfg)]
    return convert.to_hf({f"model.{k}": v for k, v in grads.items()}, rules)


def test_a_training_step_gives_the_loss_and_gradients_of_transformers(pair):
    arch, theirs, _, ours = pair
    theirs.train(), ours.train()
    want = theirs(IDS, labels=IDS).loss
    want.backward()
    got = our_loss(ours, IDS)
    got.backward()
    assert abs(got.item() - want.item()) < 1e-4
    grads = theirs_named({n: p.grad for n, p in ours.named_parameters()}, ours.cfg, hf.registry.NATIVE[arch].table)
    reference = {n: p.grad for n, p in theirs.named_parameters()}
    if theirs.config.tie_word_embeddings:
        reference.pop("lm_head.weight", None)
    assert grads.keys() == reference.keys()
    worst = max((grads[n] - reference[n]).abs().max().item() for n in grads)
    assert worst < 1e-4
    theirs.zero_grad(), theirs.eval()


def test_a_lora_step_gives_the_loss_and_gradients_of_peft(pair):
    arch, _, directory, _ = pair
    fused = arch == "phi3"  # peft adapts Phi-3's qkv_proj and gate_up_proj whole: compare the rest
    assert_lora_step_matches_peft(
        arch, directory, ("o", "down") if fused else ("q", "k", "v", "o", "gate", "up", "down")
    )


def assert_lora_step_matches_peft(arch: str, directory, targets: tuple[str, ...]) -> None:
    """One LoRA step on `targets` of the model in `directory`: tfcli's loss and every adapter's
    gradients against transformers + peft's, the same adapters (B non-zero) on both sides."""
    peft = pytest.importorskip("peft")
    ours = tfcli_model(directory)  # its own copy: the adapters change it
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj"}
    names |= {"down": "down_proj", "q_a": "q_a_proj", "q_b": "q_b_proj", "kv_a": "kv_a_proj_with_mqa"}
    names["kv_b"] = "kv_b_proj"  # DeepSeek's latent attention
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    peft_model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[names[t] for t in targets], lora_dropout=0.0)
    ).train()
    adapters.apply(ours, "lora", AdapterConfig(rank=4, alpha=8, dropout=0.0, targets=targets))
    ours.train()
    rules = {r.ours: r for r in hf.registry.NATIVE[arch].table.rules(ours.cfg)}
    params = dict(peft_model.named_parameters())
    lora = {n: m for n, m in ours.named_modules() if isinstance(m, adapters.LoRALinear)}
    with torch.no_grad():  # the same adapters on both sides, B non-zero
        for name, module in lora.items():
            on = [t for t, e in zip(rules[f"model.{name}.weight"].theirs, module.enabled) if e]
            for i, theirs_name in enumerate(on):
                stem = "base_model.model." + theirs_name[: -len(".weight")]
                params[f"{stem}.lora_B.default.weight"].normal_(0, 0.1)
                module.lora_a[i].copy_(params[f"{stem}.lora_A.default.weight"])
            module.lora_b.copy_(torch.cat([params[f"base_model.model.{t[:-7]}.lora_B.default.weight"] for t in on]))
    want = peft_model(IDS, labels=IDS).loss
    want.backward()
    got = our_loss(ours, IDS)
    got.backward()
    assert abs(got.item() - want.item()) < 1e-4
    compared = 0
    for name, module in lora.items():
        on = [t for t, e in zip(rules[f"model.{name}.weight"].theirs, module.enabled) if e]
        stems = ["base_model.model." + t[: -len(".weight")] for t in on]
        want_a = torch.stack([params[f"{s}.lora_A.default.weight"].grad for s in stems])
        want_b = torch.cat([params[f"{s}.lora_B.default.weight"].grad for s in stems])
        assert (module.lora_a.grad - want_a).abs().max() < 1e-4
        assert (module.lora_b.grad - want_b).abs().max() < 1e-4
        compared += len(stems)
    assert compared == ours.cfg.n_layer * len(targets)


def test_export_reloads_in_transformers_with_the_same_logits(pair, tmp_path):
    arch, theirs, _, ours = pair
    name, _ = hf.export(Backbone(model=ours, tokenizer=None, source="test"), None, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert name == type(theirs).__name__ and type(reloaded) is type(theirs)
    with torch.no_grad():
        assert (reloaded.eval()(IDS).logits - theirs(IDS).logits).abs().max() < 1e-4
    again = tfcli_model(tmp_path / "out")  # and tfcli reads its own export as the same model
    assert again.cfg == ours.cfg


GGUF_AS_LLAMA_CPP = {  # the settings llama.cpp's graphs fix rather than read, set its way (gguf_archs.py)
    "gemma2": dict(query_pre_attn_scalar=8),
    "gemma3_text": dict(
        num_hidden_layers=6, query_pre_attn_scalar=8, layer_types=["sliding_attention"] * 5 + ["full_attention"]
    ),
    "olmo2": {},
    "phi3": {},  # LongRoPE: its factors as rope_factors_long / _short
    "granite": {},  # its four multipliers as attention.scale, embedding_scale, residual_scale, logit_scale
    "smollm3": dict(no_rope_layers=[1, 1, 1, 0]),
}


@pytest.mark.parametrize("arch", sorted(GGUF_AS_LLAMA_CPP))
def test_a_gguf_export_has_llama_cpps_names_and_reads_back_with_the_same_logits(arch, tmp_path):
    import gguf

    from .test_moe import _tokenizer, llama_cpp_names, tfcli_model_from_gguf

    theirs = hf_model(arch, **GGUF_AS_LLAMA_CPP[arch])
    theirs.save_pretrained(tmp_path / "hf")
    ours = tfcli_model(tmp_path / "hf")
    out = tmp_path / "m.gguf"
    written = hf.export_gguf(Backbone(model=ours, tokenizer=_tokenizer(), source="test"), None, out, "f32")
    assert written == arch
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == hf.gguf.GGUF_ARCH[arch]
    assert {t.name for t in reader.tensors} <= llama_cpp_names(hf.gguf.GGUF_ARCH[arch], ours.cfg.n_layer)
    again = tfcli_model_from_gguf(out)
    assert again.cfg == ours.cfg
    with torch.no_grad():
        assert close(again.logits(again(IDS)), ours.logits(ours(IDS)), 1e-5)
    if arch.startswith("gemma"):  # llama.cpp's Gemma norms hold the 1 + w they scale by
        stored = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
        hf_weight = theirs.model.layers[0].input_layernorm.weight.detach().numpy()
        assert abs(stored.data - (hf_weight + 1)).max() < 1e-6


@pytest.mark.parametrize(
    "arch, message",
    [
        ("gemma2", "llama.cpp's gemma2 scales queries by 8^-0.5; this model does not"),
        ("gemma3_text", "llama.cpp's gemma3 slides in all but every 6th layer; this model does not"),
        ("smollm3", "llama.cpp's smollm3 leaves rotary positions out of every 4th layer"),
    ],
)
def test_a_gguf_export_llama_cpp_would_run_differently_is_refused_in_one_line(arch, message, tmp_path):
    from .test_moe import _tokenizer

    theirs = hf_model(arch)
    theirs.save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match=re.escape(message)):
        hf.export_gguf(
            Backbone(model=tfcli_model(tmp_path / "hf"), tokenizer=_tokenizer(), source="t"), None, tmp_path / "m.gguf"
        )
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("phi3", {"rope_parameters": {"rope_type": "su-v2", "factor": 2.0}}, "rope_type 'su-v2' is not supported"),
        ("granite", {}, "its tokenizer has 50257 tokens, more than the model's vocab_size (96)"),
        ("gemma2", {"hidden_activation": "relu"}, "unsupported gemma2 activation 'relu'"),
        ("olmo2", {"model_type": "olmo9"}, "model_type 'olmo9' is not supported"),
    ],
)
def test_what_tfcli_does_not_implement_is_refused_in_one_line(arch, change, message, tmp_path):
    assert_refused_in_one_line(hf_model(arch), change, message, tmp_path)


def assert_refused_in_one_line(theirs, change: dict, message: str, tmp_path) -> None:
    """`tfcli generate` on the model saved with `change` in its config.json: one line, exit 2."""
    directory = tmp_path / "model"
    theirs.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **change}))
    load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"]).tok.save(str(directory / "tokenizer.json"))
    result = invoke("generate", "--checkpoint", directory, "--prompt", "hi", "--max-new-tokens", 2)
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1


def directory_with_tokenizer(arch: str, path):
    """A tiny transformers model of `arch` with GPT-2's tokenizer (its vocabulary), as a user's directory."""
    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    hf_model(arch, vocab_size=tok.vocab_size, max_position_embeddings=256).save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.slow  # whole suite only: the parity tests above exercise the modules
@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "olmo2", "phi3", "smollm3", "granite"])
def test_sft_with_lora_trains_resumes_bit_for_bit_and_exports(arch, tmp_path):
    from .conftest import write_jsonl
    from .test_from_runs import ROWS
    from .test_resume_matrix import assert_resumes_exactly

    model = directory_with_tokenizer(arch, tmp_path / "model")
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = ["sft", "--from", model, "--data", data, "--train", "lora", "--batch-size", 4, "--lr", 1e-2]
    args += ["--set", "sft.generate_limit=2", "--set", "sft.max_new_tokens=4"]
    assert_resumes_exactly("finetune", args, tmp_path)
    exported = invoke("export", "--checkpoint", tmp_path / "whole", "--hf", tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.model_type == arch


def test_models_lists_the_architectures_each_family_reads():
    result = invoke("models")
    assert result.exit_code == 0, result.output
    for arch in ARCHITECTURES:
        assert arch in result.output.replace("\n", " ").replace("│", " ")
    assert "any other architecture transformers ships" in " ".join(result.output.replace("│", " ").split())
    assert "pip install 'tfcli[transformers]'" in " ".join(result.output.split())  # rich's markup ate [...]


TRANSFORMERS_READS = {  # settings transformers' GGUF loader takes as its defaults, set its way
    "gemma2": dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(
        head_dim=256, num_hidden_layers=6, query_pre_attn_scalar=256, rope_parameters=None,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    ),
    "phi3": dict(partial_rotary_factor=1.0, rope_scaling=None, original_max_position_embeddings=128),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(TRANSFORMERS_READS))
def test_transformers_own_gguf_reader_takes_the_export_with_the_same_logits(arch, tmp_path):
    """An independent reader of llama.cpp's layout: transformers' GGUF loader (it maps Gemma's norms
    back from 1 + w, Phi-3's fused projections) gives transformers' own logits from tfcli's file."""
    from .test_moe import _tokenizer

    # Phi-3's config defaults its pad id to 32,000: a vocabulary above it (GPT-2's); a short one elsewhere
    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"]) if arch == "phi3" else _tokenizer()
    theirs = hf_model(arch, vocab_size=tok.vocab_size, **TRANSFORMERS_READS[arch])
    theirs.save_pretrained(tmp_path / "hf")
    hf.export_gguf(Backbone(model=tfcli_model(tmp_path / "hf"), tokenizer=tok, source="t"), None, tmp_path / "m.gguf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", attn_implementation="eager")
    with torch.no_grad():
        assert (back.eval()(IDS).logits - theirs(IDS).logits).abs().max() < 1e-2  # the file's f16 matrices
