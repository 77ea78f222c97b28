"""The llama family against transformers on the same weights: Llama, Qwen2, Mistral and Qwen3 tiny
random configs made by transformers; logits within 1e-5 (fp32), greedy generation identical for 32
tokens at batch 1 and batch 4 (left padding), export reloaded by transformers with the same logits,
and a LoRA-adapted model merged and exported the same way; the rope scalings HF configs carry."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli import adapters  # noqa: E402
from tfcli.generate import generate_batch  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.models import build_model, kinds  # noqa: E402
from tfcli.models.llama import Llama, LlamaConfig  # noqa: E402
from tfcli.plugin import Backbone  # noqa: E402
from tfcli.recipe import AdapterConfig  # noqa: E402

from .conftest import close  # noqa: E402

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
ARCHITECTURES = {  # each exercises its architecture's own switches
    "llama": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True)),  # qkv bias, multi-query
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=6, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),  # q/k norm
}


def spread_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that logits differ in more than rounding and greedy decoding wanders."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)


def hf_model(arch: str, **extra):
    name, kw = ARCHITECTURES[arch]
    return random_causal_lm(getattr(transformers, name)(**{**BASE, **kw, **extra}))


def random_causal_lm(config):
    """transformers' causal LM of `config`, seeded, eager attention, its weights spread_ (eval mode)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    spread_(model)
    return model


def tfcli_model(directory) -> Llama:
    cfg, state = hf.read_pretrained(directory)
    model = build_model(cfg).eval()
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items()})
    return model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def pair(request, tmp_path_factory):
    """(architecture, transformers model, the tfcli model read from its saved directory)."""
    theirs = hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(directory)
    return request.param, theirs, tfcli_model(directory)


IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers(pair):
    arch, theirs, ours = pair
    assert ours.kind == kinds.DECODER and ours.cfg.hf_model_type == arch
    with torch.no_grad():
        want = theirs(IDS).logits
        got = ours.logits(ours(IDS))
    assert got.shape == want.shape == (2, 24, 96)
    assert close(got, want, 1e-5)
    assert want.std() > 0.5  # not a model whose logits are all alike


def test_greedy_generation_matches_at_batch_1_and_4(pair):
    arch, theirs, ours = pair
    prompts = [[5, 9, 13, 2, 7, 30, 31, 8], [4], [11, 12, 13], [40, 41, 42, 43, 44]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = theirs.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        want = [row[width:].tolist() for row in out]
        one = theirs.generate(
            input_ids=torch.tensor([prompts[0]]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompts[0]) :].tolist()
        got4 = generate_batch(ours, prompts, max_new_tokens=32, pad_id=0)
        got1 = generate_batch(ours, prompts[:1], max_new_tokens=32, pad_id=0)
    assert got1 == [one] and len(one) == 32 and len(set(one)) > 3
    assert got4 == want


def export_and_reload(model: Llama, out):
    arch, _ = hf.export(Backbone(model=model, tokenizer=None, source="test"), None, out)
    return arch, transformers.AutoModelForCausalLM.from_pretrained(out).eval()


def test_export_reloads_in_transformers_with_the_same_logits(pair, tmp_path):
    arch, theirs, ours = pair
    name, reloaded = export_and_reload(ours, tmp_path / "out")
    assert name == type(theirs).__name__ and type(reloaded) is type(theirs)
    with torch.no_grad():
        assert close(reloaded(IDS).logits, theirs(IDS).logits, 1e-5)


def test_a_lora_model_merges_and_exports_with_its_logits(pair, tmp_path):
    arch, theirs, _ = pair
    theirs.save_pretrained(tmp_path / "src")
    ours = tfcli_model(tmp_path / "src")
    adapters.apply(ours, "lora", AdapterConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down")))
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, adapters.LoRALinear):
                m.lora_b.normal_(0, 0.05)  # trained adapters: non-zero updates
        adapted = ours.logits(ours(IDS))
        assert (adapted - theirs(IDS).logits).abs().max() > 1e-2  # the adapters change the model
    qkv = ours.blocks[0].attn.qkv
    assert qkv.widths == (32 if arch != "qwen3" else 64, *(2 * [qkv.base.out_features - qkv.widths[0] >> 1]))
    _, reloaded = export_and_reload(ours, tmp_path / "out")  # merges the adapters into `ours`
    assert not any(isinstance(m, adapters.LoRALinear) for m in ours.modules())
    with torch.no_grad():
        merged = ours.logits(ours(IDS))
        assert close(reloaded(IDS).logits, merged, 1e-5)
        assert (merged - adapted).abs().max() < 1e-4  # folding W + BA rounds once more


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_rope_scalings_match_transformers(rope, tmp_path):
    theirs = hf_model("llama", rope_parameters={"rope_theta": 500.0, **rope}, max_position_embeddings=16)
    theirs.save_pretrained(tmp_path)
    ours = tfcli_model(tmp_path)
    ids = IDS[:, :16]
    if rope["rope_type"] == "dynamic":  # grows past the trained 16 positions once the context allows it
        ours.cfg = replace(ours.cfg, max_seq_len=24)
        ids = IDS
    with torch.no_grad():
        assert close(ours.logits(ours(ids)), theirs(ids).logits, 1e-5)


def test_grouped_query_attention_is_checked():
    with pytest.raises(ValueError, match="multiple of model.n_kv_head"):
        LlamaConfig(n_head=4, n_kv_head=3, vocab_size=10)
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig(vocab_size=10, rope=LlamaConfig().rope.__class__(type="su"))


def test_ia3_scales_the_narrower_keys_and_values_and_merges_exactly(pair):
    """IA3 under grouped-query attention: its k and v vectors have the key/value width, not q's."""
    arch, theirs, _ = pair
    ours = copy.deepcopy(pair[2])
    adapters.apply(ours, "ia3", None)
    qkv = ours.blocks[0].attn.qkv
    assert qkv.widths == (ours.cfg.n_head * ours.cfg.head_dim, *2 * [ours.cfg.n_kv_head * ours.cfg.head_dim])
    assert qkv.ia3.numel() == 2 * ours.cfg.n_kv_head * ours.cfg.head_dim
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, adapters.IA3Linear):
                m.ia3.uniform_(0.5, 1.5)
        adapted = ours.logits(ours(IDS))
        adapters.merge(ours)
        assert not any(isinstance(m, adapters.IA3Linear) for m in ours.modules())
        assert close(ours.logits(ours(IDS)), adapted, 1e-5)
        assert (adapted - theirs(IDS).logits).abs().max() > 1e-2


def _tied_step(model, batches, plain: bool):
    """The tied table's gradient after one backward over `batches` (their losses summed), through
    _TiedLookup or (plain) autograd's own embedding and output layer."""
    from tfcli.objectives.next_token import loss

    model.zero_grad(set_to_none=True)
    if plain:
        model.tied.lookup = lambda ids, w: torch.nn.functional.embedding(ids, w)
    sum(loss(model, None, b)[0] for b in batches).backward()
    model.tied.__dict__.pop("lookup", None)
    return model.wte.weight.grad.clone()


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_a_tied_table_gets_autograds_gradient_with_one_table_sized_tensor(family):
    """Tied embeddings on the CPU: the rows' gradient is added into the output layer's in place
    (_TiedLookup), equal to autograd's own sum of the two; two passes before one backward too (the
    first pass's output layer read the second's alias); frozen, without gradients or copied, the model
    reads the table itself."""
    import copy

    from tfcli.models.gpt import GPT, GPTConfig
    from tfcli.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if family == "llama":
        model = Llama(LlamaConfig(n_layer=2, n_head=2, d_model=32, vocab_size=100, max_seq_len=32, embed_scale=5.7))
    else:
        model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, vocab_size=100, max_seq_len=32, dropout=0.0))
    ids = torch.randint(0, 100, (2, 3, 17))
    batches = [{"input_ids": i[:, :-1], "targets": i[:, 1:]} for i in ids]
    for passes in (batches[:1], batches):
        ours, plain = _tied_step(model, passes, False), _tied_step(model, passes, True)
        assert close(ours, plain, 1e-6) and plain.abs().max() > 1e-3
    out = model(batches[0]["input_ids"])
    assert model.tied.alias is not None and copy.deepcopy(model).tied.alias is None
    model.logits(out).sum().backward()
    assert model.tied.alias is None  # spent by its backward: nothing reads a used pass again
    model.zero_grad(set_to_none=True)
    model(batches[0]["input_ids"]).pow(2).sum().backward()  # no output layer (a classifier's pass)
    rows = model.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model.tied.lookup = lambda ids, w: torch.nn.functional.embedding(ids, w)
    model(batches[0]["input_ids"]).pow(2).sum().backward()
    assert torch.equal(rows, model.wte.weight.grad) and rows.abs().max() > 0
    del model.tied.lookup
    with torch.no_grad():
        model(batches[0]["input_ids"])
        assert model.tied.alias is None and model.lm_head_weight is model.wte.weight
    model.requires_grad_(False)
    model(batches[0]["input_ids"])
    assert model.tied.alias is None
