"""Mixtures of experts natively (models/moe.py) against transformers on the same weights: Qwen3-MoE
(renormalised top-k, a dense layer among the sparse ones), Qwen2-MoE (the shared expert and its gate),
Mixtral and OLMoE, tiny random configs made by transformers. In fp32: logits within 1e-4, greedy
generation through tfcli's KV cache identical for 24 tokens, one training step's loss (the load-balancing
loss included, transformers' output_router_logits) and every gradient within 1e-4, `export --hf`
reloaded by transformers with the same logits; the balancing loss equal to transformers' function;
expert load counted; what tfcli does not implement refused in one line."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli.errors import UserError  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.models import moe  # noqa: E402
from tfcli.models.llama import Llama, LlamaConfig  # noqa: E402
from tfcli.plugin import Backbone  # noqa: E402

from .conftest import close, invoke, near  # noqa: E402
from .test_families import BASE as DENSE  # noqa: E402
from .test_families import (  # noqa: E402
    assert_greedy_generation_matches,
    assert_lora_step_matches_peft,
    assert_refused_in_one_line,
    our_loss,
    saved_pair,
    theirs_named,
)
from .test_llama import random_causal_lm, tfcli_model  # noqa: E402

VOCAB = 96
BASE = {**DENSE, "num_hidden_layers": 3, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.05}
ARCHITECTURES = {  # model_type -> the switches that make it itself
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24),
    "mixtral": dict(num_local_experts=4, tie_word_embeddings=False),
    "olmoe": dict(num_experts=4, intermediate_size=16, tie_word_embeddings=False),
    # sinks, biases everywhere, the clamped SwiGLU, sliding and full layers (a window shorter than IDS)
    "gpt_oss": dict(num_local_experts=4, intermediate_size=16, sliding_window=8, tie_word_embeddings=False),
    # latent attention (a query bottleneck, interleaved rotary pairs), a dense first layer, 8 experts in
    # 4 groups of which 2 compete, sigmoid scores with a correction bias, a shared expert
    "deepseek_v3": dict(
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=16,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        kv_lora_rank=12,
        q_lora_rank=10,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        routed_scaling_factor=2.5,
        router_aux_loss_coef=0.0,
    ),
}


def hf_model(arch: str, **extra):
    model = random_causal_lm(transformers.AutoConfig.for_model(arch, **{**BASE, **ARCHITECTURES[arch], **extra}))
    g = torch.Generator().manual_seed(2)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek's: moves which experts are chosen
            buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.5)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def pair(request, tmp_path_factory):
    return saved_pair(request.param, hf_model(request.param), tmp_path_factory)


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def test_the_config_is_the_architectures(pair):
    arch, _, _, ours = pair
    cfg = ours.cfg
    expected = {
        "qwen3_moe": dict(n_experts=4, expert_d_ff=16, norm_topk=True, dense_layers=(1,), qk_norm=True),
        "qwen2_moe": dict(n_experts=4, expert_d_ff=16, norm_topk=False, shared_expert_d_ff=24, qkv_bias=True),
        "mixtral": dict(n_experts=4, expert_d_ff=48, norm_topk=True, qk_norm=False),
        "olmoe": dict(n_experts=4, expert_d_ff=16, norm_topk=False, qk_norm_whole=True),
        "gpt_oss": dict(
            n_experts=4,
            expert_d_ff=16,
            norm_topk=True,
            attn_sinks=True,
            expert_bias=True,
            swiglu_limit=7.0,
            layer_types=("sliding", "full", "sliding"),
            sliding_window=8,
            qkv_bias=True,
            out_bias=True,
        ),
        "deepseek_v3": dict(
            n_experts=8,
            expert_d_ff=16,
            norm_topk=True,
            kv_lora_rank=12,
            q_lora_rank=10,
            head_dim=24,
            rope_head_dim=8,
            v_head_dim=16,
            rope_interleave=True,
            router_score="sigmoid",
            expert_groups=4,
            expert_groups_used=2,
            routed_scale=2.5,
            shared_expert_d_ff=16,
            shared_expert_gate=False,
            dense_layers=(0,),
        ),
    }[arch]
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.experts_per_token == 2 and cfg.router_aux_coef == (0.0 if arch == "deepseek_v3" else 0.05)
    kinds = [type(block.mlp).__name__ for block in ours.blocks]
    dense = {"qwen3_moe": 1, "deepseek_v3": 0}.get(arch)
    assert kinds == ["MLP" if i == dense else "MoE" for i in range(3)]


def test_logits_match_transformers(pair):
    arch, theirs, _, ours = pair
    with torch.no_grad():
        want = theirs(IDS).logits
        got = ours.logits(ours(IDS))
    assert got.shape == want.shape == (2, 24, VOCAB)
    assert (got - want).abs().max() < 1e-4
    assert want.std() > 0.3


def test_greedy_generation_matches_through_the_kv_cache(pair):
    assert_greedy_generation_matches(*pair[1::2])


def test_a_training_step_with_the_balancing_loss_gives_transformers_loss_and_gradients(pair):
    arch, theirs, _, ours = pair
    theirs.train(), ours.train()
    out = theirs(IDS, labels=IDS, output_router_logits=True)
    out.loss.backward()
    layers = moe.moe_layers(ours)
    moe.routing_losses(layers)
    got = our_loss(ours, IDS)
    extra, metrics = moe.routing_losses(layers)
    if arch == "deepseek_v3":  # a sigmoid router: no balancing loss on either side
        assert extra is None and out.aux_loss is None
        extra = torch.zeros(())
    else:
        assert near(metrics["router_aux"].item(), out.aux_loss.item())
        assert out.aux_loss.item() > 1.0  # random routers are unbalanced: the loss is not at its floor
    (got + extra).backward()
    assert abs((got + extra).item() - out.loss.item()) < 1e-4
    grads = theirs_named({n: p.grad for n, p in ours.named_parameters()}, ours.cfg, hf.registry.NATIVE[arch].table)
    reference = {n: p.grad for n, p in theirs.named_parameters()}
    if theirs.config.tie_word_embeddings:
        reference.pop("lm_head.weight", None)
    # transformers keeps the experts stacked in memory and splits them per expert only on saving
    reference = _per_expert(reference, arch)
    assert grads.keys() == reference.keys()
    worst = max((grads[n] - reference[n]).abs().max().item() for n in grads)
    assert worst < 1e-4
    router = next(
        n for n in grads if n.endswith(("gate.weight", "router.weight")) and "experts" not in n and "shared" not in n
    )
    assert grads[router].abs().max() > 0  # the routers learn (from the balancing loss and the weighting)
    theirs.zero_grad(), theirs.eval()


def test_a_lora_step_on_attention_gives_the_loss_and_gradients_of_peft(pair):
    """peft adapts modules, and transformers holds the experts as stacked parameters: the attention's
    adapters are compared (LoRA on the experts: the test below, against its per-expert definition)."""
    latent = ("q_a", "q_b", "kv_a", "kv_b", "o")  # DeepSeek's latent attention's projections
    assert_lora_step_matches_peft(pair[0], pair[2], latent if pair[0] == "deepseek_v3" else ("q", "k", "v", "o"))


def _per_expert(state: dict, arch: str) -> dict:
    """transformers' in-memory expert tensors (experts.gate_up_proj (E, 2F, D), experts.down_proj) as its
    checkpoints name them (experts.{j}.gate_proj.weight, ...; Mixtral's block_sparse_moe.experts.{j}.w1)."""
    if arch == "gpt_oss":  # its checkpoints hold the stacks as they are in memory
        return state
    out = {}
    mixtral = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if arch == "mixtral" else {}
    for name, t in state.items():
        if mixtral and ".mlp." in name:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        stem, _, leaf = name.rpartition(".experts.")
        if not stem:
            out[name] = t
            continue
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}[leaf]
        for j, expert in enumerate(t):
            for part, piece in zip(parts, expert.chunk(len(parts), dim=0)):
                out[f"{stem}.experts.{j}.{mixtral.get(part, part)}.weight"] = piece
    return out


def test_export_reloads_in_transformers_with_the_same_logits(pair, tmp_path):
    arch, theirs, _, ours = pair
    name, _ = hf.export(Backbone(model=ours, tokenizer=None, source="test"), None, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert name == type(theirs).__name__ and type(reloaded) is type(theirs)
    with torch.no_grad():
        assert (reloaded.eval()(IDS).logits - theirs(IDS).logits).abs().max() < 1e-4
    assert tfcli_model(tmp_path / "out").cfg == ours.cfg


def test_the_balancing_loss_is_transformers_function():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(20, 8, generator=g) * s for s in (0.5, 2.0, 4.0)]
    want = load_balancing_loss_func(tuple(logits), 8, 2)
    assert abs(moe.balancing_loss(logits, 8, 2).item() - want.item()) < 1e-6
    balanced = [torch.zeros(16, 4)]  # every expert equally likely: the loss at its floor of top_k
    assert abs(moe.balancing_loss(balanced, 4, 2).item() - 2.0) < 1e-6


def test_expert_load_counts_every_routed_token():
    model = Llama(LlamaConfig(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4)).eval()
    layers = moe.moe_layers(model)
    with moe.expert_load(layers) as load, torch.no_grad():
        model(torch.randint(0, 50, (3, 10)))
    assert len(load) == 2 and all(sum(row) == 3 * 10 * 2 for row in load)
    assert moe.imbalance([10, 10, 10, 10]) == 1.0 and moe.imbalance([40, 0, 0, 0]) == 4.0
    assert all(layer.load is None for layer in layers)  # counting ends with the block


def test_only_active_experts_count_in_the_flops():
    dense = Llama(LlamaConfig(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=50))
    sparse = Llama(LlamaConfig(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4))
    # top-2 of 4 experts of the dense MLP's width: twice the dense MLP's FLOPs, plus the router's
    router = 6.0 * 2 * 16 * 4
    assert sparse.flops_per_token(8) == pytest.approx(dense.flops_per_token(8) + 6.0 * 2 * 3 * 16 * 32 + router)


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not implemented"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv 8.0 is not implemented"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "experts_per_token must be between 1 and model.n_experts (4)"),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window is not implemented"),
        ("gpt_oss", {"swiglu_limit": 0}, "gpt_oss: swiglu_limit 0 is not implemented"),
        ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "gpt_oss: quantization 'fp8' is not read"),
        ("gpt_oss", {"layer_types": ["chunked_attention"] * 3}, "layer_types names 'chunked_attention'"),
        ("deepseek_v3", {"num_key_value_heads": 2}, "deepseek_v3: num_key_value_heads 2 is not implemented"),
        (
            "deepseek_v3",
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
            "blocks [64, 64]",
        ),
        ("deepseek_v3", {"n_group": 3}, "model.expert_groups must divide n_experts"),
    ],
)
def test_what_tfcli_does_not_implement_is_refused_in_one_line(arch, change, message, tmp_path):
    assert_refused_in_one_line(hf_model(arch), change, message, tmp_path)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("model.n_experts=-1", "model.n_experts, router_aux_coef and router_z_coef must be >= 0"),
        ("model.experts_per_token=9", "model.experts_per_token must be between 1 and model.n_experts (8), got 9"),
        ("model.dense_layers=[7]", "model.dense_layers must be layer numbers below 4"),
        ("model.sparse_step=0", "model.sparse_step must be >= 1"),
    ],
)
def test_a_mixture_tfcli_cannot_build_is_refused_before_anything_is_created(setting, message, tmp_path):
    result = invoke("pretrain", "--recipe", "moe-mini", "--steps", 1, "--set", setting, "--out", tmp_path / "run")
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_qwen2_moe_refuses_a_shared_expert_without_its_gate():
    """DeepSeek's ungated shared experts cannot be written as Qwen2-MoE's gated one."""
    cfg = LlamaConfig(
        n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4, shared_expert_d_ff=16,
        shared_expert_gate=False, hf_model_type="qwen2_moe", qkv_bias=True,
    )  # fmt: skip
    with pytest.raises(UserError, match="sets model.shared_expert_gate, which transformers' Qwen2MoeForCausalLM"):
        hf.export(Backbone(model=Llama(cfg), tokenizer=None, source="test"), None, "/nonexistent/never-written")


def test_a_dense_architecture_refuses_a_model_with_experts():
    model = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4))
    with pytest.raises(UserError, match="sets model.n_experts, which transformers' LlamaForCausalLM cannot hold"):
        hf.export(Backbone(model=model, tokenizer=None, source="test"), None, "/nonexistent/never-written")


def test_the_grouped_product_and_its_gradients_are_autograds():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 6, generator=g, requires_grad=True), torch.randn(4, 5, 6, generator=g, requires_grad=True)
    counts = [3, 0, 4, 0]
    out = moe.GroupedProduct.apply(x, w, counts)
    want = torch.cat([x[:3] @ w[0].t(), x[3:] @ w[2].t()])
    assert torch.allclose(out, want, atol=1e-6)
    grad = torch.randn(7, 5, generator=g)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    wx, ww = torch.autograd.grad(want, (x, w), grad)
    assert torch.allclose(dx, wx, atol=1e-5) and torch.allclose(dw, ww, atol=1e-5) and dw[1].abs().sum() == 0


def test_lora_on_experts_matches_a_per_expert_lora_written_out_and_merges_exactly():
    """adapter.experts: expert e's gate computes x W_e^T + (alpha/r) x A_e^T B_e^T, its own A and B; the
    router and base experts frozen; merge folds each expert's update into its stack."""
    from tfcli import adapters
    from tfcli.recipe import AdapterConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4))
    adapters.apply(model, "lora", AdapterConfig(rank=2, alpha=4, targets=("q", "v", "gate", "down"), experts=True))
    stack = model.blocks[0].mlp.experts
    assert set(stack.adapters.lora_a) == {"gate", "down"} and stack.adapters.lora_a["gate"].shape == (4, 2, 16)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any("router" in n or n.endswith(("experts.gate", "experts.up", "experts.down")) for n in trained)
    assert any("lora_a.gate" in n for n in trained)
    with torch.no_grad():
        for p in stack.adapters.lora_b.values():
            p.normal_(0, 0.5)
    x = torch.randn(5, 16)  # rows 0-1 routed to expert 0, rows 2-4 to expert 2
    a, b = stack.adapters.lora_a["gate"], stack.adapters.lora_b["gate"]
    want = [x[:2] @ stack.gate[0].t() + 2.0 * (x[:2] @ a[0].t()) @ b[0].t()]
    want.append(x[2:] @ stack.gate[2].t() + 2.0 * (x[2:] @ a[2].t()) @ b[2].t())
    assert torch.allclose(stack.product(x, [2, 0, 3, 0], "gate"), torch.cat(want), atol=1e-6)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model.logits(model(ids))
        with adapters.disabled(model):
            base = model.logits(model(ids))
        adapters.merge(model)
        after = model.logits(model(ids))
    assert (before - base).abs().max() > 1e-3  # the expert adapters change the model
    assert close(after, before, 1e-5) and stack.adapters is None


def test_qlora_holds_the_experts_in_nf4_and_full_training_can_freeze_the_router():
    from tfcli import adapters
    from tfcli.recipe import AdapterConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=64, d_ff=128, vocab_size=50, n_experts=4))
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        want = model.logits(model(ids))
    adapters.apply(model, "qlora", AdapterConfig(rank=2, alpha=4, targets=("q", "gate"), experts=True))
    stack = model.blocks[0].mlp.experts
    assert stack.quantized and type(stack.gate[0]).__name__ == "NF4Tensor"
    x = torch.randn(5, 64)
    with torch.no_grad():
        got = model.logits(model(ids))
        plain = x @ stack.gate[1].get_original_weight().t()  # the 4-bit weight, dequantized
        assert close(stack.product(x, [0, 5, 0, 0], "gate"), plain, 1e-5)  # B = 0: the base expert alone
    assert 0 < (got - want).abs().max() < 0.25 * want.abs().max()  # 4-bit weights: close, not equal
    loss = model.logits(model(ids)).logsumexp(-1).mean()
    loss.backward()
    assert stack.adapters.lora_a["gate"].grad is not None and stack.adapters.lora_b["gate"].grad.abs().sum() > 0

    full = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4))
    adapters.apply(full, "all", AdapterConfig(), freeze_router=True)
    assert not full.blocks[0].mlp.router.weight.requires_grad and full.blocks[0].mlp.experts.gate.requires_grad


def test_lora_on_experts_without_expert_parts_is_refused_in_one_line():
    from tfcli import adapters
    from tfcli.recipe import AdapterConfig

    model = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4))
    with pytest.raises(UserError, match="adapter.experts puts LoRA on the experts' gate, up and down"):
        adapters.apply(model, "lora", AdapterConfig(targets=("q", "v"), experts=True))
    with pytest.raises(UserError, match="use --train lora or qlora"):  # IA3 has no low-rank adapters
        adapters.apply(model, "ia3", AdapterConfig(targets=("q", "gate"), experts=True))
    dense = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=50))
    with pytest.raises(UserError, match="adapter.experts: this model has no mixture of experts"):
        adapters.apply(dense, "lora", AdapterConfig(targets=("q", "gate"), experts=True))


def directory_with_tokenizer(arch: str, path, **extra):
    """A tiny transformers mixture of `arch` with GPT-2's tokenizer (its vocabulary), as a user's directory."""
    from tfcli.data.tokenizers import load_tokenizer_files

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    hf_model(arch, vocab_size=tok.vocab_size, max_position_embeddings=256, **extra).save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.slow  # 6-13 s: the fast tier keeps under 3 minutes
def test_sft_logs_the_routers_and_the_expert_load_and_dpo_trains(tmp_path):
    from tfcli.engine.plots import read_metrics

    from .conftest import write_jsonl
    from .test_from_runs import ROWS

    model = directory_with_tokenizer("qwen3_moe", tmp_path / "model")
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = ["sft", "--from", model, "--data", data, "--train", "all", "--batch-size", 4, "--steps", 2, "--quiet"]
    args += ["--set", "sft.generate_limit=0", "--set", "train.eval_interval=2", "--out", tmp_path / "sft"]
    result = invoke("finetune", *args)
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "sft")
    train = [r for r in rows if r["split"] == "train"]
    assert train and all(r["router_aux"] >= 1.0 for r in train)  # the balancing loss (1.0 at best) was logged
    load = next(r["load"] for r in rows if r["split"] == "experts")
    assert len(load) == 2 and len(load[0]) == 4 and len({sum(layer) for layer in load}) == 1  # MoE layers 0, 2
    assert next(r for r in rows if r["split"] == "val")["expert_imbalance"] >= 1.0
    assert (tmp_path / "sft" / "experts.png").is_file()
    prefs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": "No."} for r in ROWS]
    dpo = ["dpo", "--from", model, "--data", write_jsonl(tmp_path / "prefs.jsonl", prefs), "--train", "lora"]
    result = invoke("finetune", *dpo, "--steps", 2, "--batch-size", 4, "--quiet", "--out", tmp_path / "dpo")
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_classification_and_grpo_train_a_mixture(tmp_path):
    from .conftest import SHARED

    model = directory_with_tokenizer("olmoe", tmp_path / "model")
    oss = directory_with_tokenizer("gpt_oss", tmp_path / "gpt-oss")
    deepseek = directory_with_tokenizer("deepseek_v3", tmp_path / "deepseek")
    mnli = ["mnli", "--from", model, "--data", SHARED / "mnli", "--steps", 2, "--batch-size", 4, "--quiet"]
    mnli += ["--set", "finetune.limit=32", "--set", "finetune.eval_limit=4", "--set", "finetune.report_limit=4"]
    result = invoke("finetune", *mnli, "--train", "lora", "--out", tmp_path / "mnli")
    assert result.exit_code == 0, result.output
    grpo = ["grpo", "--data", SHARED / "sft" / "gsm8k", "--steps", 1, "--batch-size", 2]
    grpo += ["--set", "grpo.preset=gsm8k", "--set", "grpo.max_completion_length=8", "--set", "grpo.num_generations=2"]
    grpo += ["--set", "finetune.limit=8", "--train", "lora", "--quiet"]
    for source, out in ((model, "grpo"), (oss, "grpo-gpt-oss"), (deepseek, "grpo-deepseek")):
        result = invoke("finetune", *grpo, "--from", source, "--out", tmp_path / out)
        assert result.exit_code == 0, result.output


@pytest.mark.slow  # whole suite only: the parity tests above exercise the modules
@pytest.mark.parametrize(
    "arch, train",
    [
        ("qwen2_moe", "lora"),
        ("mixtral", "all"),
        ("olmoe", "qlora"),
        ("gpt_oss", "qlora"),  # LoRA on the experts too, over their NF4 weights
        ("deepseek_v3", "qlora"),  # and on the latent attention's projections
    ],
)
def test_sft_trains_resumes_bit_for_bit_and_exports(arch, train, tmp_path):
    from .conftest import write_jsonl
    from .test_from_runs import ROWS
    from .test_resume_matrix import assert_resumes_exactly

    extra = dict(hidden_size=64, head_dim=16) if train == "qlora" else {}  # NF4 needs whole blocks of 64
    if arch == "deepseek_v3" and train == "qlora":  # and so do the latent attention's projections
        extra = dict(hidden_size=64, kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=8, v_head_dim=16)
    model = directory_with_tokenizer(arch, tmp_path / "model", **extra)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = ["sft", "--from", model, "--data", data, "--train", train, "--batch-size", 4, "--lr", 1e-2]
    args += ["--set", "sft.generate_limit=2", "--set", "sft.max_new_tokens=4"]
    if train != "all":
        attention = "q_a,q_b,kv_a,kv_b,o" if arch == "deepseek_v3" else "q,v"
        args += ["--set", f"adapter.targets=[{attention},gate,up,down]", "--set", "adapter.experts=true"]
    assert_resumes_exactly("finetune", args, tmp_path)
    exported = invoke("export", "--checkpoint", tmp_path / "whole", "--hf", tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.model_type == arch


@pytest.mark.slow
@pytest.mark.parametrize("train", ["all", "qlora"])
def test_fsdp_shards_the_experts_with_their_block_and_trains_as_one_process(train, tmp_path):
    """Full: the stacked experts sharded and their gradients reduced; QLoRA: each expert's NF4 weight
    sharded (a width whose scales split in two), with LoRA on the experts."""
    from .conftest import write_jsonl
    from .test_ddp import run_tfcli, train_rows
    from .test_from_runs import ROWS

    wide = (
        dict(hidden_size=128, head_dim=32, intermediate_size=128, moe_intermediate_size=64) if train == "qlora" else {}
    )
    model = directory_with_tokenizer("qwen3_moe", tmp_path / "model", router_aux_loss_coef=0.0, **wide)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    common = ["finetune", "sft", "--from", model, "--data", data, "--train", train, "--steps", 3, "--quiet"]
    if train == "qlora":
        common += ["--set", "adapter.targets=[q,v,gate,up,down]", "--set", "adapter.experts=true"]
    common += ["--set", "train.log_interval=1", "--set", "sft.generate_limit=0", "--lr", 1e-3]
    run_tfcli([*common, "--out", tmp_path / "one", "--batch-size", 4], nproc=1)
    run_tfcli([*common, "--out", tmp_path / "fsdp", "--batch-size", 2, "--set", "train.strategy=fsdp"], nproc=2)
    one, fsdp = train_rows(tmp_path / "one"), train_rows(tmp_path / "fsdp")
    assert sorted(one) == [1, 2, 3] and all(near(one[s], fsdp[s], 1e-5) for s in one), (one, fsdp)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"])
def test_a_gguf_export_reads_back_with_the_same_logits(arch, tmp_path):
    """llama.cpp's names and layout: experts stacked (E, out, in) as ffn_{gate,up,down}_exps, the router
    ffn_gate_inp, Mixtral a llama with experts (its q/k rows permuted), Qwen2-MoE's shared expert."""
    import gguf

    extra = {"mlp_only_layers": []} if arch == "qwen3_moe" else {}  # llama.cpp's qwen3moe: experts everywhere
    extra |= {"num_key_value_heads": 4} if arch == "olmoe" else {}  # its k norm spans every head (no grouping)
    theirs = hf_model(arch, **extra)
    theirs.save_pretrained(tmp_path / "hf")
    ours = tfcli_model(tmp_path / "hf")
    out = tmp_path / "m.gguf"
    hf.export_gguf(Backbone(model=ours, tokenizer=_tokenizer(), source="test"), None, out, "f32")
    names = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in gguf.GGUFReader(str(out)).tensors}
    first = int(arch == "deepseek_v3")  # its first layer is dense
    assert names[f"blk.{first}.ffn_gate_exps.weight"][0] == ours.cfg.n_experts
    assert f"blk.{first}.ffn_gate_inp.weight" in names
    assert set(names) <= llama_cpp_names(hf.gguf.GGUF_ARCH[arch], ours.cfg.n_layer)
    again = tfcli_model_from_gguf(out)
    from dataclasses import replace

    assert (
        again.cfg.router_aux_coef == hf.registry.decoder_traits(arch).experts.aux_default
    )  # a training setting no GGUF key holds
    assert replace(again.cfg, router_aux_coef=ours.cfg.router_aux_coef) == ours.cfg
    with torch.no_grad():
        assert close(again.logits(again(IDS)), ours.logits(ours(IDS)), 1e-5)


def _tokenizer():
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_gguf import small_gpt2

    return load_tokenizer_files(small_gpt2(200), ["<|endoftext|>"])  # GPT-2's BPE cut short: a quick GGUF


def llama_cpp_names(arch: str, n_layer: int) -> set[str]:
    """Every tensor name llama.cpp's `arch` declares (gguf's MODEL_TENSORS), weights and biases."""
    import gguf

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    stems = [gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[kind]]
    names = {s.format(bid=i) for s in stems for i in range(n_layer)}
    return {f"{n}.{kind_}" for n in names for kind_ in ("weight", "bias")}


def tfcli_model_from_gguf(path):
    from tfcli.models import build_model

    cfg, state = hf.read_pretrained(path, from_gguf=True)
    model = build_model(cfg).eval()
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items()})
    return model


def test_a_gguf_export_refuses_what_llama_cpp_cannot_run(tmp_path):
    theirs = hf_model("qwen3_moe", norm_topk_prob=False, mlp_only_layers=[])
    theirs.save_pretrained(tmp_path / "hf")
    ours = Backbone(model=tfcli_model(tmp_path / "hf"), tokenizer=_tokenizer(), source="test")
    with pytest.raises(UserError, match="llama.cpp's qwen3moe renormalises the top-k expert weights"):
        hf.export_gguf(ours, None, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()
    hf_model("deepseek_v3", q_lora_rank=None).save_pretrained(tmp_path / "direct-queries")
    ours = Backbone(model=tfcli_model(tmp_path / "direct-queries"), tokenizer=_tokenizer(), source="test")
    with pytest.raises(UserError, match="gives queries a low-rank bottleneck .q_lora_rank. by its layer count"):
        hf.export_gguf(ours, None, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_nf4_experts_fsdp_cannot_split_are_named_before_anything_runs():
    """QLoRA's NF4 experts under FSDP: each expert's NF4 weight must split into equal shares (its rows,
    its codes and scales); one that cannot is named (runtime.FSDP.wrap refuses it in one line)."""
    from tfcli import adapters
    from tfcli.models import nf4
    from tfcli.recipe import AdapterConfig

    small = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=64, d_ff=32, vocab_size=50, n_experts=4))
    adapters.apply(small, "qlora", AdapterConfig(targets=("q", "gate")))
    assert nf4.unshardable(small, 2) == "blocks.0.mlp.experts.gate.0 (32 x 64)"  # 32 blocks: one scale group
    large = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=128, d_ff=64, vocab_size=50, n_experts=4))
    adapters.apply(large, "qlora", AdapterConfig(targets=("q", "gate")))
    assert nf4.unshardable(large, 2) == ""


@pytest.mark.parametrize(
    "change",
    [
        {"q_lora_rank": None},  # queries straight from the hidden state (DeepSeek-V2-Lite)
        {"rope_interleave": False},
        {"attention_bias": True},
        {  # DeepSeek-V3's yarn: mscale_all_dim scales the queries too
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 0.7,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "rope_theta": 10000.0,
            }
        },
    ],
)
def test_deepseek_variants_match_transformers_and_export_as_they_came(change, tmp_path):
    theirs = hf_model("deepseek_v3", **change)
    theirs.save_pretrained(tmp_path / "in")
    ours = tfcli_model(tmp_path / "in")
    with torch.no_grad():
        assert close(ours.logits(ours(IDS)), theirs(IDS).logits, 1e-5)
    hf.export(Backbone(model=ours, tokenizer=None, source="test"), None, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        assert close(reloaded.eval()(IDS).logits, theirs(IDS).logits, 1e-5)


def test_deepseek_generation_caches_the_compressed_latent_not_the_heads(tmp_path):
    """Latent attention's KV cache holds one latent (kv_lora_rank) and one rotated key (rope_head_dim)
    a token, for all heads: 12 + 8 numbers where the heads' keys and values would be 4 x (24 + 16)."""
    theirs = hf_model("deepseek_v3")
    theirs.save_pretrained(tmp_path)
    ours = tfcli_model(tmp_path)
    caches = ours.new_caches(32)
    with torch.no_grad():
        ours(IDS[:, :10], caches=caches)
        ours(IDS[:, 10:11], caches=caches)
    latent = caches[1]
    assert latent.length == 11 and latent.k.shape == (2, 1, 32, 12) and latent.v.shape == (2, 1, 32, 8)


def test_deepseek_fp8_weights_are_read_dequantized_by_their_block_scales(tmp_path):
    """DeepSeek-V3's and Kimi K2's releases: every projection FP8 (e4m3) with an inverse scale per
    128 x 128 block (`weight_scale_inv`, quantization_config fp8): read as the product, the model
    transformers holds after dequantizing (its logits)."""
    import json

    from safetensors.torch import load_file, save_file

    hf_model("deepseek_v3", hidden_size=160, intermediate_size=144).save_pretrained(tmp_path / "plain")
    state = load_file(str(tmp_path / "plain" / "model.safetensors"))  # per-expert, as checkpoints name them
    plain = dict(state)  # what the FP8 file means, for transformers
    for name in [k for k in state if k.endswith("proj.weight") and "layers." in k]:
        w = state[name]
        blocks = torch.zeros(-(-w.shape[0] // 128), -(-w.shape[1] // 128))  # 160 and 144 wide: 2 x 2
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max() / 448
        scale = blocks.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        quantized = (w / scale).to(torch.float8_e4m3fn)
        state[name], state[f"{name}_scale_inv"] = quantized, blocks
        plain[name] = quantized.float() * scale
    save_file(plain, str(tmp_path / "plain" / "model.safetensors"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="eager")
    (tmp_path / "fp8").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "fp8" / "model.safetensors"))
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    config = json.loads((tmp_path / "plain" / "config.json").read_text()) | {"quantization_config": quant}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    ours = tfcli_model(tmp_path / "fp8")
    assert any(v.dtype == torch.float8_e4m3fn for v in load_file(str(tmp_path / "fp8" / "model.safetensors")).values())
    with torch.no_grad():
        assert close(ours.logits(ours(IDS)), theirs.eval()(IDS).logits, 1e-5)


def test_the_memory_plan_probes_a_mixture_with_dense_first_layers_by_its_mixture_layers():
    """DeepSeek-V3's first 3 of 61 layers are dense: probes of its first one and two layers held no
    experts at all (a plan of 61 dense layers, and QLoRA with adapter.experts refused in the probe)."""
    from tfcli.engine.memory import probe_config

    cfg = LlamaConfig(n_layer=6, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4, dense_layers=(0, 1))
    assert all(probe_config(cfg, n).has_experts(i) for n in (1, 2) for i in range(n))
    elsewhere = LlamaConfig(n_layer=6, n_head=2, d_model=16, d_ff=32, vocab_size=50, n_experts=4, dense_layers=(1,))
    assert not probe_config(elsewhere, 2).has_experts(1)  # a dense layer among them: probed as it is


def test_gpt_oss_mxfp4_experts_are_read_as_transformers_dequantizes_them(tmp_path):
    """The released gpt-oss checkpoints hold the experts in MXFP4 (`*_blocks`, `*_scales`, uint8):
    tfcli's dequantization equals transformers' convert_moe_packed_tensors, and a directory of them
    loads as the model transformers holds after dequantizing (its logits)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tfcli.hf import gpt_oss

    g = torch.Generator().manual_seed(0)
    theirs = hf_model("gpt_oss", intermediate_size=32)  # MXFP4 blocks are 32 values of a row
    state = {k: v.clone() for k, v in theirs.state_dict().items()}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = state[name].shape
        blocks = torch.randint(0, 256, (e, d_out, d_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 128, (e, d_out, d_in // 32), dtype=torch.uint8, generator=g)
        want = convert_moe_packed_tensors(blocks, scales)  # (E, in, out), bf16
        assert torch.equal(gpt_oss.dequantize_mxfp4(blocks, scales), want)
        state.pop(name)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        theirs.get_parameter(name).data.copy_(want.float())
    (tmp_path / "mxfp4").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "mxfp4" / "model.safetensors"))
    config = theirs.config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    assert any(v.dtype == torch.uint8 for v in load_file(str(tmp_path / "mxfp4" / "model.safetensors")).values())
    ours = tfcli_model(tmp_path / "mxfp4")
    with torch.no_grad():
        assert close(ours.logits(ours(IDS)), theirs(IDS).logits, 1e-5)
    cfg, shapes = hf.read_pretrained(tmp_path / "mxfp4", shapes_only=True)  # the memory plan's reading
    assert shapes["model.blocks.0.mlp.experts.gate"].shape == ours.blocks[0].mlp.experts.gate.shape
