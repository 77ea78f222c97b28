"""export --peft: a LoRA run's adapters, unmerged, as a PEFT directory that peft applies to the
transformers model the run started from, giving tfcli's logits; other runs are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from tfcli.engine.backbone import from_run

from .conftest import close, hf_llama_dir, invoke

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return hf_llama_dir(tmp_path_factory.mktemp("base") / "llama", max_positions=128)


def test_a_lora_run_exports_adapters_peft_applies_to_the_base(hf_llama, mnli_dir, tmp_path):
    run = tmp_path / "lora"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        hf_llama,
        "--data",
        mnli_dir,
        "--train",
        "lora",
        "--steps",
        3,
        "--batch-size",
        4,
        "--lr",
        0.05,
        "--out",
        run,
        "--quiet",
        "--set",
        "finetune.eval_limit=6",
        "--set",
        "adapter.targets=[q,k,v,o,gate,up,down]",
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "adapter"
    result = invoke("export", "--checkpoint", run, "--peft", out)
    assert result.exit_code == 0, result.output
    assert (
        f"peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained('{hf_llama}')"
        in result.output
    )
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(hf_llama)
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama).eval()
    ids = torch.randint(0, 50000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, out).eval()(ids).logits
        ours = from_run(run).model
        want = ours.logits(ours(ids))
    assert (want - before).abs().max() > 1e-3  # the adapters learned something
    assert close(theirs, want, 1e-5)


@pytest.mark.slow  # whole suite only: other fast tests exercise its modules
def test_runs_that_are_not_lora_text_runs_are_refused(hf_llama, mnli_dir, tmp_path):
    for train, message in (("bitfit", "writes LoRA adapters; this run trained bitfit"),):
        run = tmp_path / train
        result = invoke(
            "finetune",
            "mnli",
            "--from",
            hf_llama,
            "--data",
            mnli_dir,
            "--train",
            train,
            "--steps",
            1,
            "--batch-size",
            4,
            "--out",
            run,
            "--quiet",
            "--set",
            "finetune.eval_limit=6",
        )
        assert result.exit_code == 0, result.output
        refused = invoke("export", "--checkpoint", run, "--peft", tmp_path / "out")
        assert refused.exit_code == 2 and message in refused.output and not (tmp_path / "out").exists()


def test_adapters_over_a_gguf_base_name_its_transformers_export_and_auto_peft_loads_them(tmp_path):
    from .test_gguf import chat_gguf_file

    class Factory:
        def mktemp(self, name):
            (tmp_path / name).mkdir()
            return tmp_path / name

    gguf = chat_gguf_file(Factory(), max_seq_len=128)
    rows = [{"prompt": f"What is {a} plus {b}?", "completion": f"It is {a + b}."} for a in range(5) for b in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "lora"
    args = ["finetune", "sft", "--from", gguf, "--data", tmp_path / "rows.jsonl", "--train", "lora", "--steps", 2]
    result = invoke(*args, "--lr", 0.05, "--out", run, "--quiet", "--set", "sft.generate_limit=1")
    assert result.exit_code == 0, result.output
    out = tmp_path / "adapter"
    result = invoke("export", "--checkpoint", run, "--peft", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "adapter-base").resolve())
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()  # the pair loads by itself
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = from_run(run).model
    with torch.no_grad():
        assert (theirs(ids).logits - ours.logits(ours(ids))).abs().max() < 1e-4
