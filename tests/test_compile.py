"""train.compile=on for every shipped recipe: a few steps of each, shrunk, on tiny data.

torch.compile runs here with the aot_eager backend: dynamo traces the forward and AOTAutograd the
backward, which is where compile crashes of tfcli's own code arise (the chunked cross-entropy's
in-place gradient made dynamo fail on every GPT recipe); inductor's code generation is covered by
test_train's compiled-vs-eager GPT run. Each recipe starts with dynamo's caches reset, and the test
checks that a graph was really compiled (a fall-back to eager would pass silently otherwise).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tfcli import recipe as recipes

from .conftest import DEVICE, invoke, tiny_npz

SHIPPED = recipes.available()


def data_for(raw: dict, tmp_path, small_text, mnli_dir) -> tuple[list, list]:
    """(command, extra args) that train recipe `raw` for 2 steps on tiny data."""
    family, plugin = raw["model"]["family"], raw.get("objective") or raw.get("task")
    if family == "vlm":  # a vision-language model starts from one (a tiny LLaVA) and reads rows with images
        from .test_vlm import image_rows, save_vlm

        save_vlm("llava-clip", tmp_path / "llava")
        data = image_rows(tmp_path)
        return ["finetune", plugin], ["--from", tmp_path / "llava", "--data", data, "--set", "sft.generate_limit=0"]
    if family == "vit":
        npz = tiny_npz(tmp_path / "images.npz", n=8, size=32)
        return (["pretrain", "--objective", plugin] if raw.get("objective") else ["finetune", plugin]), [
            "--data",
            npz,
            "--set",
            "model.image_size=32",
        ]
    if plugin == "igpt":  # images as colours: a tiny palette of tiny images
        return ["pretrain", "--objective", plugin], [
            "--data",
            tiny_npz(tmp_path / "images.npz", n=16, size=16),
            "--set",
            "igpt.image_size=4",
            "--set",
            "igpt.palette=8",
            "--set",
            "igpt.kmeans_pixels=200",
        ]
    if raw.get("objective"):
        return ["pretrain", "--objective", plugin], ["--data", small_text, "--set", "tokenizer.train_chars=20000"]
    if plugin == "distill":  # a student that is its own teacher (one file: the same vocabulary)
        rows = [{"prompt": f"add {i} and 1", "completion": f"{i + 1}"} for i in range(24)]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        model = distill_model(family, tmp_path)
        return ["finetune", plugin], [
            "--from", model, "--teacher", model, "--data", tmp_path / "rows.jsonl", "--set", "data.val_fraction=0.2",
            "--set", "distill.max_completion_length=4",
        ]  # fmt: skip
    if plugin in ("sft", "dpo", "rm", "kto"):  # reply rows, pairs or labelled replies, a small vocabulary
        rows = [
            {"prompt": f"add {i} and 1", "completion": f"{i + 1}", "chosen": f"{i + 1}", "rejected": f"{i}"}
            | {"label": i % 2 == 0}
            for i in range(24)
        ]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return ["finetune", plugin], [
            "--data",
            tmp_path / "rows.jsonl",
            "--set",
            "tokenizer.vocab_size=300",
            "--set",
            "data.val_fraction=0.2",
        ] + (["--set", "sft.generate_limit=2", "--set", "sft.max_new_tokens=2"] if plugin == "sft" else [])
    if plugin == "grpo":  # prompts with answers, a small vocabulary learned from them, short completions
        rows = [{"prompt": f"add {i} and 1", "answer": f"{i + 1}"} for i in range(24)]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return ["finetune", plugin], [
            "--data", tmp_path / "rows.jsonl", "--reward", "contains", "--set", "tokenizer.vocab_size=300",
            "--set", "data.val_fraction=0.2", "--set", "grpo.max_completion_length=4", "--set", "grpo.num_generations=2",
            "--set", "grpo.eval_prompts=2",
        ]  # fmt: skip
    preset = (raw.get(plugin) or {}).get("preset")
    if preset == "mnli":
        return ["finetune", "mnli"], ["--data", mnli_dir, "--limit", 16]
    rows = "".join(f"good thing {i},pos\nbad thing {i},neg\n" for i in range(12))
    (tmp_path / "rows.csv").write_text("text,label\n" + rows)
    return ["finetune", plugin], ["--data", tmp_path / "rows.csv", "--text-fields", "text", "--label-field", "label"]


def distill_model(family: str, tmp_path):
    """A tiny model of the family, with a chat template, as a file tfcli reads."""
    from tfcli.hf import interop as hf
    from tfcli.models.gpt import GPT, GPTConfig
    from tfcli.plugin import Backbone

    from .test_gguf import tiny_backbone

    backbone = tiny_backbone()
    if family == "gpt":
        cfg = GPTConfig(
            n_layer=1, n_head=2, d_model=32, d_ff=64, vocab_size=backbone.tokenizer.vocab_size, max_seq_len=64
        )
        hf.export(Backbone(GPT(cfg), backbone.tokenizer), None, tmp_path / "gpt")
        return tmp_path / "gpt"
    hf.export_gguf(backbone, None, tmp_path / "llama.gguf", "f32")
    return tmp_path / "llama.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_trains_compiled(name, tmp_path, small_text, mnli_dir, monkeypatch):
    raw = recipes.load_raw(name)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    torch._dynamo.reset()
    command, extra = data_for(raw, tmp_path, small_text, mnli_dir)
    model = raw["model"]
    shrink = {"model.n_layer": 1, "model.d_model": 64, "model.n_head": 2, "model.d_ff": 128}
    if model["family"] == "vlm" or raw.get("task") == "distill":  # its model is the --from file's, already tiny
        shrink = {}
    if model["family"] == "t5":
        shrink["model.n_decoder_layer"] = 1
    if model["family"] == "vit" and raw.get("objective"):
        shrink["model.decoder_n_layer"] = 1
    if model["family"] not in ("vit", "vlm"):
        shrink.update({"data.seq_len": 32})
    args = [
        *command,
        "--recipe",
        name,
        *extra,
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "train.compile=on",
        "--set",
        "train.eval_interval=2",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.ckpt_interval=2",
        "--set",
        f"train.device={DEVICE}",
        *[a for k, v in shrink.items() for a in ("--set", f"{k}={v}")],
    ]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert graphs, "nothing was compiled"


def test_a_compiled_training_step_compiles_once():
    """The compiled module's later passes reuse the first pass's graph: no state the first pass set
    (the MoE layers, found then) fails a guard and traces the whole model again (seen on step 2 of the
    GPU lease's SFT rows at smoke shapes on the CPU: 3.6 s more for 24 layers). A
    mixture of experts is left out: its routing breaks the graph (bincount's data-dependent shape) and
    each block's frame compiles once more when the layer index turns dynamic."""
    from tfcli.engine.compiling import keep_out_of_compiled_graphs
    from tfcli.engine.trainer import ObjectiveModule
    from tfcli.models import build_model
    from tfcli.objectives.next_token import loss

    cfg = recipes.load("llama-mini", {"model.n_layer": 2, "model.vocab_size": 64}).model
    torch.manual_seed(0)
    module = ObjectiveModule(build_model(cfg), torch.nn.ModuleDict(), lambda m, h, b: loss(m, h, b))
    ids = torch.randint(0, 64, (2, 9))
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    torch._dynamo.reset()
    keep_out_of_compiled_graphs()  # as trainer.compiled does: the fused loss runs eagerly
    step = torch.compile(module, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            step(batch)[0].backward()
