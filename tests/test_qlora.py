"""QLoRA (--train qlora): LoRA beside a base whose block linears are frozen in NF4 (torchao). The base's
matrices take at most 30% of fp32's memory, the quantized model computes nearly what the base does,
a run trains, resumes bit for bit, and exports: --hf merges into full-precision weights (dequantized
base + update) that transformers loads with the same logits (1e-3), --peft writes the adapters. The
NF4 is peft's QLoRA's: bitsandbytes' codes, and the adapters on its base give the run's logits."""

from __future__ import annotations

import json

import pytest
import torch

from tfcli import adapters
from tfcli.engine.backbone import for_inference
from tfcli.models import nf4
from tfcli.models.llama import Llama, LlamaConfig
from tfcli.recipe import AdapterConfig

from .conftest import hf_llama_dir, invoke, write_jsonl
from .test_from_runs import ROWS
from .test_resume_matrix import assert_resumes_exactly

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")


def quantizable_llama() -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=128, d_ff=256, max_seq_len=32, vocab_size=300)
    return Llama(cfg).eval()


def test_every_block_linear_is_nf4_in_under_30_percent_of_fp32_and_computes_nearly_the_same():
    model = quantizable_llama()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model.logits(model(ids))
    fp32_bytes = sum(
        m.weight.numel() * 4
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2 and m.weight.shape[0] != 300
    )
    adapters.apply(model, "qlora", AdapterConfig(targets=("q", "v")))
    quantized = [m for m in model.modules() if isinstance(m, nf4.NF4Linear)]
    assert len(quantized) == 2 * 5  # qkv, out, gate, up, down of each block
    from tfcli.driver import quantized_note  # the run's header says it

    assert quantized_note(model).strip().startswith("10 block matrices of the base in NF4:")
    assert sum(m.weight_bytes() for m in quantized) <= 0.30 * fp32_bytes
    assert all(not p.requires_grad for m in quantized for p in m.parameters())
    assert {n.split(".")[-1] for n, p in model.named_parameters() if p.requires_grad} == {"lora_a", "lora_b"}
    with torch.no_grad():
        after = model.logits(model(ids))
    assert (after - before).abs().max() < 0.1 * before.abs().max()  # NF4's rounding, not another model
    adapters.merge(model)
    assert not any(isinstance(m, (nf4.NF4Linear, adapters.LoRALinear)) for m in model.modules())
    with torch.no_grad():
        assert torch.allclose(model.logits(model(ids)), after, atol=1e-4)  # B = 0: merged = dequantized base


def test_a_qlora_generation_on_the_cpu_dequantizes_once_and_reads_the_weights_export_writes(monkeypatch):
    """While a QLoRA model generates on the CPU (adapters.held_for_generation), no NF4 weight is
    dequantized at a token (that was 31 of a 2-step QLoRA SFT run's 42 s, its report's sampling): each
    LoRA linear holds its dequantized base merged with its update and each other NF4 linear its
    dequantized weight, the weights export writes (adapters.merge), bit for bit. Every linear's output
    while generating, and so the sampled ids, are the exported model's; nothing is held after it."""
    import copy

    from .test_generate_batch import generated_beside

    model = quantizable_llama()
    adapters.apply(model, "qlora", AdapterConfig(targets=("q", "v")))
    loras = [m for m in model.modules() if isinstance(m, adapters.LoRALinear)]
    with torch.no_grad():
        for m in loras:
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    exported = adapters.merge(copy.deepcopy(model))
    names = {n for n, m in model.named_modules() if isinstance(m, adapters.LoRALinear)}
    names |= {n for n, m in model.named_modules() if isinstance(m, nf4.NF4Linear) and not n.endswith(".base")}
    assert len(names) == 2 * 5
    dequantized_per_token = []
    linear_nf4 = nf4._nf4().linear_nf4
    monkeypatch.setattr(nf4._nf4(), "linear_nf4", lambda x, w: dequantized_per_token.append(w) or linear_nf4(x, w))
    prompts = [[5, 9, 13, 2, 7], [4], [11, 12, 13]]
    sampled, ours, theirs = generated_beside(model, exported, names, prompts, 16)
    assert not dequantized_per_token
    assert len(ours) == len(theirs) > 10 * len(names)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    quantized = [m for m in model.modules() if isinstance(m, nf4.NF4Linear)]
    assert all(m.held_weight is None and m.held_b is None for m in loras) and all(q.dense is None for q in quantized)
    assert len({tuple(r) for r in sampled}) > 1
    with torch.no_grad():  # outside a generation: dequantized at every forward again
        model(torch.tensor([prompts[0]]))
    assert len(dequantized_per_token) == len(quantized)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return hf_llama_dir(tmp_path_factory.mktemp("qlora") / "base", hidden=128, inner=256)


def qlora_args(base, data):
    return [
        "sft",
        "--from",
        base,
        "--data",
        data,
        "--train",
        "qlora",
        "--batch-size",
        4,
        "--lr",
        1e-2,
        "--set",
        "train.log_interval=1",
    ]


@pytest.fixture(scope="module")
def qlora_run(hf_base, tmp_path_factory):
    """A QLoRA SFT run of 6 steps, exported merged (--hf) and as adapters (--peft)."""
    tmp = tmp_path_factory.mktemp("qlora-run")
    data = write_jsonl(tmp / "rows.jsonl", ROWS)
    run = tmp / "run"
    result = invoke("finetune", *qlora_args(hf_base, data), "--steps", 6, "--out", run, "--quiet")
    assert result.exit_code == 0, result.output
    for kind in ("hf", "peft"):
        exported = invoke("export", "--checkpoint", run, f"--{kind}", tmp / kind)
        assert exported.exit_code == 0, exported.output
    return run


@pytest.mark.slow  # the fast tier keeps this module's cheaper tests
def test_a_qlora_run_trains_and_exports_merged_weights_transformers_loads(qlora_run):
    run = qlora_run
    losses = [
        json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line
    ]
    assert losses[-1] < losses[0]
    ours = for_inference(run).model  # the run as it trained: NF4 base + adapters
    assert any(isinstance(m, nf4.NF4Linear) for m in ours.modules())
    theirs = transformers.LlamaForCausalLM.from_pretrained(run.parent / "hf").eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours.logits(ours(ids)), atol=1e-3)
    assert (run.parent / "peft" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_its_adapters_on_peft_qlora_base_in_bitsandbytes_nf4_give_its_logits(hf_base, qlora_run):
    """peft's QLoRA: the same base loaded by transformers in bitsandbytes' NF4 (blocks of 64, scales
    quantized again), the run's --peft adapters on it. Both NF4s pick the same 4-bit codes (see below);
    they store the blocks' scales differently, so the logits agree far more closely than either agrees
    with the adapters on the unquantized base."""
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    run, adapters_dir = qlora_run, qlora_run.parent / "peft"
    nf4_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        hf_base, quantization_config=nf4_config, device_map="cpu"
    )
    assert isinstance(quantized.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    theirs = peft.PeftModel.from_pretrained(quantized, adapters_dir).eval()
    unquantized = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hf_base), adapters_dir
    ).eval()
    ours = for_inference(run).model
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.logits(ours(ids))
        gap_to_peft_qlora = (theirs(ids).logits - want).abs().max()
        gap_to_unquantized = (unquantized(ids).logits - want).abs().max()
    assert gap_to_peft_qlora < 0.1 * gap_to_unquantized  # measured: 0.60 against 12.2


def test_the_nf4_base_rounds_each_weight_to_the_4bit_code_bitsandbytes_picks():
    """NF4 as peft's QLoRA quantizes it (bitsandbytes): the same 16-value table, blocks of 64 weights
    scaled by their largest magnitude, the nearest value's code. A code differs only for a weight on the
    boundary between two values (the two tables are written to other digits), and then by one step."""
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)

    def codes(packed: torch.Tensor) -> torch.Tensor:  # two 4-bit codes a byte, the first in the high half
        packed = packed.flatten().long()
        return torch.stack([packed >> 4, packed & 15], 1).flatten()

    for out_features, in_features in ((128, 256), (576, 576)):  # scaler blocks of 64 and of 8
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        weight = linear.weight.detach()
        ours = nf4.NF4Linear(linear).weight
        packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")  # as peft loads it
        assert torch.allclose(ours.nf4, state.code, rtol=0, atol=1e-4)  # the same table (torchao: 5e-5 off)
        mine, theirs = codes(ours.quantized_data), codes(packed)
        blocks = weight.reshape(-1, 64)  # (blocks, 64)
        scaled = (blocks / blocks.abs().amax(1, keepdim=True)).flatten()  # in [-1, 1]
        boundaries = (state.code[1:] + state.code[:-1]) / 2
        to_boundary = (scaled[:, None] - boundaries[None]).abs().min(1).values
        differ = mine != theirs
        assert differ.sum() < 1e-3 * differ.numel()  # measured: 3 of 32,768 and 29 of 331,776
        assert ((mine - theirs)[differ].abs() == 1).all() and to_boundary[differ].max() < 1e-4


@pytest.mark.slow
def test_a_qlora_run_resumes_bit_for_bit(hf_base, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert_resumes_exactly("finetune", qlora_args(hf_base, data), tmp_path)


def test_a_matrix_whose_blocks_256_does_not_divide_takes_a_smaller_scaler_block_fsdp_can_split():
    """SmolLM2's 576 x 576 attention output: 5,184 blocks of 64, which 256 does not divide; scaler blocks
    of 8 give 648 groups of scales, which 2, 4 and 8 processes split evenly (64 would give 81)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 576, bias=False)
    assert nf4.scaler_block(linear) == 8 and nf4.scaler_block(torch.nn.Linear(512, 512)) == 256
    assert nf4.scaler_block(torch.nn.Linear(10, 10)) == 0  # not whole blocks: stays in full precision
    x = torch.randn(3, 576)
    with torch.no_grad():
        exact, quantized = linear(x), nf4.NF4Linear(linear)(x)
    assert (quantized - exact).norm() < 0.15 * exact.norm()
    model = torch.nn.Sequential(nf4.NF4Linear(linear), nf4.NF4Linear(torch.nn.Linear(64, 72, bias=False)))
    assert nf4.unshardable(model, 2) == "1 (72 x 64)"  # 72 blocks: 9 groups of 8 at best
    assert nf4.unshardable(model, 3) == "" and nf4.unshardable(model[:1], 8) == ""


@pytest.mark.slow
def test_dpo_with_qlora_reads_its_reference_as_the_nf4_base_with_the_adapters_off(hf_base, tmp_path):
    """At the first step the policy is the reference (B = 0, the same NF4 base): the DPO loss is ln 2.
    Eager: under torch.compile (CUDA's default) the two passes are different graphs that round apart in
    bf16 (0.685 on an H200; docs/guides/dpo.md)."""
    import math

    from .test_dpo import PAIRS

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 2)
    args = ["dpo", "--from", hf_base, "--data", data, "--train", "qlora", "--batch-size", 4, "--steps", 2]
    args += ["--set", "train.compile=off"]
    result = invoke("finetune", *args, "--set", "train.log_interval=1", "--out", tmp_path / "run", "--quiet")
    assert result.exit_code == 0, result.output
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-5)
