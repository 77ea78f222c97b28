"""The generic path: architectures with no native family, through transformers' own modules (the
optional extra). Three decoders (StableLM, Starcoder2, OPT) and one encoder (DistilBERT), tiny random
configs transformers writes, fp32: logits equal transformers' own (it is their module: to rounding of
the same ops), three LoRA steps' losses equal transformers + peft's on the same batches (1e-4), greedy
generation through the cache equals `generate`; the CLI trains, resumes bit for bit and exports; a
config that asks for remote code, or a model_type transformers does not ship, is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tfcli import adapters  # noqa: E402
from tfcli.errors import UserError  # noqa: E402
from tfcli.generate import generate_batch  # noqa: E402
from tfcli.hf import interop as hf  # noqa: E402
from tfcli.objectives.losses import linear_cross_entropy, lm_head  # noqa: E402
from tfcli.recipe import AdapterConfig  # noqa: E402

from .conftest import close, invoke, near, write_jsonl  # noqa: E402
from .test_families import targets_of  # noqa: E402
from .test_llama import spread_, tfcli_model  # noqa: E402

VOCAB = 96
DECODERS = {
    "stablelm": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "starcoder2": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "opt": dict(
        hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32, dropout=0.0
    ),
}
TARGETS = {"stablelm": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TARGETS |= {"starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]}
TARGETS |= {"opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]}
OURS = {"stablelm": ("q", "k", "v", "o", "gate", "up", "down"), "starcoder2": ("q", "k", "v", "o", "up", "down")}
OURS |= {"opt": ("q", "k", "v", "o", "up", "down")}


def hf_decoder(arch: str, **extra):
    shape = dict(vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.AutoConfig.for_model(arch, **{**shape, **DECODERS[arch], **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    spread_(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(0.5)
    return model


@pytest.fixture(scope="module", params=sorted(DECODERS))
def pair(request, tmp_path_factory):
    theirs = hf_decoder(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(directory)
    return request.param, theirs, directory


IDS = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


def test_an_architecture_with_no_native_family_reads_as_the_generic_decoder(pair):
    arch, theirs, directory = pair
    ours = tfcli_model(directory)
    assert ours.cfg.family == "generic" and ours.kind == "decoder"
    with torch.no_grad():
        assert close(ours.logits(ours(IDS)), theirs(IDS).logits, 1e-5)


def test_greedy_generation_through_the_cache_equals_generate(pair):
    arch, theirs, directory = pair
    ours = tfcli_model(directory)
    prompts = [[5, 9, 13, 7], [4, 11]]
    with torch.no_grad():
        want = [
            theirs.generate(input_ids=torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
        got = [generate_batch(ours, [p], max_new_tokens=12, pad_id=0)[0] for p in prompts]
    assert got == want


def test_three_lora_steps_give_the_losses_of_transformers_and_peft(pair):
    arch, _, directory = pair
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    theirs = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[arch], lora_dropout=0.0)
    ).train()
    ours = tfcli_model(directory)
    assert adapters.apply(ours, "lora", AdapterConfig(rank=4, alpha=8, dropout=0.0, targets=OURS[arch])) == len(
        [n for n, m in base.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    )
    ours.train()
    params = dict(theirs.named_parameters())
    with torch.no_grad():  # the same adapters on both sides, B non-zero
        for name, module in ours.named_modules():
            if isinstance(module, adapters.LoRALinear):
                stem = "base_model.model." + name[len("inner.") :]
                params[f"{stem}.lora_B.default.weight"].normal_(0, 0.1)
                module.lora_a[0].copy_(params[f"{stem}.lora_A.default.weight"])
                module.lora_b.copy_(params[f"{stem}.lora_B.default.weight"])
    opt_theirs = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):  # one batch, seen three times: its loss falls whatever the order tests ran in
        ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10))
        want = theirs(ids, labels=ids).loss
        head = lm_head(ours, ours(ids))
        got = linear_cross_entropy(head.hidden, head.weight, targets_of(ids))[0]
        for loss, opt in ((want, opt_theirs), (got, opt_ours)):
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append((got.item(), want.item()))
    assert all(abs(a - b) < 1e-4 for a, b in losses) and losses[2][0] < losses[0][0], losses


FALCON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True, bias=False)


@pytest.mark.slow  # 6-13 s: the fast tier keeps under 3 minutes
def test_lora_reaches_every_linear_of_the_layers_as_peft_all_linear(tmp_path):
    """Falcon's attention is one fused query_key_value, its MLP dense_h_to_4h / dense_4h_to_h: names
    tfcli has no part for. The llama recipes' LoRA targets (every part) adapted its dense alone (0.06% of
    the parameters) with no word; all-linear now adapts every linear of the layers as peft's does, with
    peft's losses, says which in the run's first lines, and targets that match nothing are one line."""
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_from_runs import ROWS

    config = transformers.FalconConfig(vocab_size=VOCAB, **FALCON)
    torch.manual_seed(0)
    transformers.FalconForCausalLM(config).save_pretrained(tmp_path / "falcon")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "falcon", attn_implementation="sdpa")
    theirs = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    ).train()
    ours = tfcli_model(tmp_path / "falcon")
    layers = [n for n, m in base.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert (
        adapters.apply(ours, "lora", AdapterConfig(rank=4, alpha=8, dropout=0.0, targets=("all-linear",)))
        == len(layers)
        == 8
    )
    ours.train()
    params = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, adapters.LoRALinear):
                stem = "base_model.model." + name[len("inner.") :]
                params[f"{stem}.lora_B.default.weight"].normal_(0, 0.1)
                module.lora_a[0].copy_(params[f"{stem}.lora_A.default.weight"])
                module.lora_b.copy_(params[f"{stem}.lora_B.default.weight"])
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    want = theirs(ids, labels=ids).loss
    head = lm_head(ours, ours(ids))
    got = linear_cross_entropy(head.hidden, head.weight, targets_of(ids))[0]
    assert abs(got.item() - want.item()) < 1e-4 * max(1.0, abs(want.item()))
    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    config = transformers.FalconConfig(vocab_size=tok.vocab_size, **FALCON)
    transformers.FalconForCausalLM(config).save_pretrained(tmp_path / "model")
    tok.tok.save(str(tmp_path / "model" / "tokenizer.json"))
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = ["finetune", "sft", "--from", tmp_path / "model", "--data", data, "--train", "lora", "--steps", 1]
    args += ["--batch-size", 2, "--set", "sft.generate_limit=0", "--set", "finetune.eval_limit=2"]
    ran = invoke(*args, "--out", tmp_path / "run")
    assert ran.exit_code == 0, ran.output
    assert (
        "adapters on 8 modules: self_attention.query_key_value, self_attention.dense, mlp.dense_h_to_4h, "
        "mlp.dense_4h_to_h (in each of 2 layers)" in ran.output
    ), ran.output
    import subprocess
    import sys

    said = subprocess.run(
        [sys.executable, "-m", "tfcli", "generate", "--checkpoint", tmp_path / "model", "--prompt", "hi",
         "--greedy", "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert said.returncode == 0 and said.stdout.startswith("hi"), said.stderr
    assert said.stderr.strip() == "", said.stderr  # no torchao, _pytree or deprecation notes around the answer
    refused = invoke(*args, "--out", tmp_path / "none", "--set", "adapter.targets=[q,v]")
    assert refused.exit_code == 2 and "adapter.targets q, v match no linear" in refused.output, refused.output
    assert "query_key_value" in refused.output and not (tmp_path / "none").exists()


CONVERTED = {  # checkpoints transformers renames or converts on load
    "gpt_neox": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
    "glm4_moe": dict(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(CONVERTED))
def test_a_checkpoint_transformers_converts_on_load_reads_and_exports_as_transformers_does(arch, tmp_path):
    """GPT-NeoX's output layer is embed_out in its files, lm_head in the module; GLM-4-MoE's experts
    (and DeepSeek-V3's, native now) are one tensor per expert in the files, fused on load by transformers 5: each
    stopped with "not a matching checkpoint". They read as from_pretrained reads them: the same logits
    and greedy tokens, and the export is what transformers reads back (nothing missing, same logits)."""
    config = transformers.AutoConfig.for_model(arch, vocab_size=VOCAB, pad_token_id=0, **CONVERTED[arch])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    spread_(theirs)
    theirs.save_pretrained(tmp_path / "m")  # spread weights, as the files hold them
    ours = tfcli_model(tmp_path / "m")
    with torch.no_grad():
        want = theirs(IDS).logits
        assert (ours.logits(ours(IDS)) - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())
        greedy = theirs.generate(input_ids=IDS[:1, :6], max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert generate_batch(ours, [IDS[0, :6].tolist()], max_new_tokens=8, pad_id=0)[0] == greedy[0, 6:].tolist()
    from tfcli.plugin import Backbone

    hf.export(Backbone(model=ours, tokenizer=None, source="test"), None, tmp_path / "out")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (again.eval()(IDS).logits - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_an_encoder_with_no_fused_attention_runs_its_own_and_says_so(tmp_path, mnli_dir):
    """DeBERTa-v2 has no sdpa attention in transformers: the generic path asked for it and stopped with
    an internal error. It runs the architecture's eager attention, said in the run's first lines."""
    from tfcli.data.tokenizers import load_tokenizer_files

    tok = load_tokenizer_files("builtin:bert-base-uncased", [])
    config = transformers.DebertaV2Config(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, type_vocab_size=0,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.DebertaV2Model(config).eval()
    theirs.save_pretrained(tmp_path / "m")
    tok.tok.save(str(tmp_path / "m" / "tokenizer.json"))
    ours = tfcli_model(tmp_path / "m")
    ids = torch.randint(5, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(input_ids=ids).last_hidden_state).abs().max() < 1e-4
    result = invoke(
        "finetune", "mnli", "--from", tmp_path / "m", "--data", mnli_dir, "--train", "lora", "--steps", 1,
        "--batch-size", 4, "--out", tmp_path / "run", "--set", "data.seq_len=32", "--set", "finetune.eval_limit=4",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "transformers' DebertaV2Model, eager attention" in result.output
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["limit"] == 4  # the final report scores eval_limit's sample, not every held-out row


def test_the_memory_plans_probes_cut_every_per_layer_list(tmp_path):
    """EXAONE-4 names a kind per layer (layer_types): the memory plan's one- and two-layer probes kept the
    list at full length, and transformers' config check stopped every run with an internal error."""
    from tfcli.models import build_model

    config = transformers.AutoConfig.for_model(
        "exaone4", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg, _ = hf.read_pretrained(tmp_path / "m", shapes_only=True)
    for n in (1, 2, 6):
        probe = cfg.with_layers(n)
        assert probe.raw["layer_types"] == [config.layer_types[i % 4] for i in range(n)]
        with torch.device("meta"):
            assert len(build_model(probe).decoder_layers()) == n


def test_remote_code_and_unknown_architectures_are_refused_in_one_line(pair, tmp_path):
    arch, theirs, directory = pair
    raw = json.loads((directory / "config.json").read_text())
    for change, message in (
        ({"model_type": "my_model", "auto_map": {"AutoModelForCausalLM": "modeling.MyModel"}}, "asks for remote code"),
        ({"model_type": "my_model"}, "model_type 'my_model' is not supported"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(UserError, match=message):
            hf.read_pretrained(tmp_path)


@pytest.mark.slow  # whole suite only: the tests above exercise the modules
def test_sft_with_lora_trains_resumes_bit_for_bit_and_exports(pair, tmp_path):
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_from_runs import ROWS
    from .test_resume_matrix import assert_resumes_exactly

    arch, _, _ = pair
    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    model = tmp_path / "model"
    hf_decoder(arch, vocab_size=tok.vocab_size).save_pretrained(model)
    tok.tok.save(str(model / "tokenizer.json"))
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = ["sft", "--from", model, "--data", data, "--train", "lora", "--batch-size", 4, "--lr", 1e-2]
    args += ["--set", "sft.generate_limit=2", "--set", "sft.max_new_tokens=4", "--set", "sft.pack=false"]
    args += ["--set", f"adapter.targets=[{','.join(OURS[arch])}]"]
    assert_resumes_exactly("finetune", args, tmp_path)
    exported = invoke("export", "--checkpoint", tmp_path / "whole", "--hf", tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.model_type == arch


@pytest.mark.slow
def test_an_encoder_with_no_native_family_trains_mnli_with_a_head(mnli_dir, tmp_path):
    from tfcli.data.tokenizers import load_tokenizer_files

    tok = load_tokenizer_files("builtin:bert-base-uncased", [])
    config = transformers.DistilBertConfig(
        vocab_size=tok.vocab_size, dim=32, hidden_dim=48, n_layers=2, n_heads=4, max_position_embeddings=64
    )
    torch.manual_seed(0)
    transformers.DistilBertModel(config).save_pretrained(tmp_path / "model")
    tok.tok.save(str(tmp_path / "model" / "tokenizer.json"))
    result = invoke(
        "finetune", "mnli", "--from", tmp_path / "model", "--data", mnli_dir, "--train", "all", "--steps", 6,
        "--batch-size", 8, "--lr", 1e-3, "--out", tmp_path / "run", "--quiet", "--set", "data.seq_len=48",
        "--set", "finetune.eval_limit=16", "--pooling", "cls",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"][-1] == 6
    refused = invoke("export", "--checkpoint", tmp_path / "run", "--hf", tmp_path / "out")
    assert refused.exit_code == 2 and "classifier on a generic" in refused.output and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_every_method_grpo_and_dpo_train_it_and_packing_is_refused_in_one_line(tmp_path):
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_from_runs import ROWS

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    model = tmp_path / "model"
    hf_decoder("stablelm", vocab_size=tok.vocab_size).save_pretrained(model)
    tok.tok.save(str(model / "tokenizer.json"))
    sft = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": f"{a} plus {b}?", "answer": str(a + b)} for a in range(4) for b in range(4)],
    )
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": f"Q{i}", "chosen": "yes", "rejected": "no"} for i in range(16)]
    )
    (tmp_path / "r.py").write_text("def n(completions, **kw):\n    return [float(len(c) % 3) for c in completions]\n")
    grpo = [
        "--reward",
        f"{tmp_path}/r.py:n",
        "--set",
        "grpo.num_generations=4",
        "--set",
        "grpo.max_completion_length=8",
    ]
    runs = {
        "qlora": ["sft", "--data", sft, "--train", "qlora"],
        "ia3": ["sft", "--data", sft, "--train", "ia3"],
        "bitfit": ["sft", "--data", sft, "--train", "bitfit"],
        "recomputed": ["sft", "--data", sft, "--train", "all", "--set", "train.activation_checkpointing=blocks"],
        "grpo": ["grpo", "--data", prompts, "--train", "lora", *grpo, "--set", "grpo.eval_prompts=2"],
    }
    for name, args in runs.items():
        result = invoke(
            "finetune",
            args[0],
            "--from",
            model,
            *args[1:],
            "--steps",
            2,
            "--batch-size",
            4,
            "--out",
            tmp_path / name,
            "--quiet",
            "--set",
            "train.log_interval=1",
        )
        assert result.exit_code == 0, (name, result.output)
        losses = [
            json.loads(line)["loss"]
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if '"train"' in line
        ]
        assert len(losses) == 2 and all(loss == loss for loss in losses), name
    dpo = invoke(
        "finetune", "dpo", "--from", model, "--data", pairs, "--steps", 2, "--out", tmp_path / "dpo", "--quiet"
    )
    assert dpo.exit_code == 0, dpo.output  # a row per reply: the generic model reads no shared prompt
    assert "share_prompt: false" in (tmp_path / "dpo" / "config.yaml").read_text()
    packed = ["sft", "--data", sft, "--set", "sft.pack=true", "--out", tmp_path / "packed", "--quiet"]
    refused = invoke("finetune", *packed, "--from", model, "--steps", 2)
    assert refused.exit_code == 2 and "needs a native family" in refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "packed").exists()


@pytest.mark.slow
def test_fsdp_shards_its_decoder_layers_and_trains_as_one_process(tmp_path):
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_ddp import run_tfcli, train_rows
    from .test_from_runs import ROWS

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    model = tmp_path / "model"
    hf_decoder("stablelm", vocab_size=tok.vocab_size).save_pretrained(model)
    tok.tok.save(str(model / "tokenizer.json"))
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    common = ["finetune", "sft", "--from", model, "--data", data, "--train", "all", "--steps", 3, "--quiet"]
    common += ["--set", "train.log_interval=1", "--set", "sft.generate_limit=0", "--lr", 1e-3]
    run_tfcli([*common, "--out", tmp_path / "one", "--batch-size", 4], nproc=1)
    run_tfcli([*common, "--out", tmp_path / "fsdp", "--batch-size", 2, "--set", "train.strategy=fsdp"], nproc=2)
    one, fsdp = train_rows(tmp_path / "one"), train_rows(tmp_path / "fsdp")
    assert sorted(one) == [1, 2, 3] and all(near(one[s], fsdp[s], 1e-5) for s in one), (one, fsdp)


def test_a_generic_mixtures_flops_count_the_experts_a_token_meets_and_no_lookup_table(tmp_path):
    """MFU on the generic path counted every expert and the input table: a tiny gpt-oss (generic then)
    read 65% MFU on two CPU cores, gpt-oss-20b (3.6B of 21B parameters active) would read about six
    times too high. Of E experts a token meets k; an untied input table is a lookup. (GLM-4-MoE here:
    gpt-oss is native now.)"""
    config = transformers.AutoConfig.for_model("glm4_moe", vocab_size=VOCAB, pad_token_id=0, **CONVERTED["glm4_moe"])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    ours = tfcli_model(tmp_path / "m")
    inner = ours.inner
    experts = [m for n, m in inner.named_modules() if n.endswith(".experts")]
    assert len(experts) == 1 and all(m.gate_up_proj.shape[0] == 4 for m in experts)  # layer 0 is dense
    every = sum(p.numel() for p in ours.parameters())
    idle = sum(p.numel() for m in experts for p in m.parameters()) * (4 - 2) / 4
    table = inner.get_input_embeddings().weight.numel()  # untied: the output layer is its own tensor
    attention = 12.0 * 2 * 16 * 32
    assert ours.flops_per_token(16) == pytest.approx(6.0 * (every - table - idle) + attention)
