"""`make bench`: every family's training step against its Hugging Face peer, same run, same config;
the loop's overhead over the bare step; training beside another job on every core (busy); greedy generation against transformers' generate; on a
machine with a CUDA device, whole `tfcli pretrain` steps against transformers and nanoGPT (gpu) and
the memory plan against CUDA's own count (gpu_fit).

    python -m benchmarks            # all
    python -m benchmarks gpt bert   # some
"""

import importlib
import sys

import torch

ALL = [
    "gpt",
    "bert",
    "t5",
    "mae",
    "loop",
    "busy",
    "store",
    "generation",
    "smollm2",
    "families",
    "sft",
    "dpo",
    "grpo",
    "grpo_tools",
    "reward_model",
    "distill_chunks",
    "kto",
    "reference_free",
    "cpo_tokens",
    "distill",
    "preference_learning",
    "distill_learning",
    "evals",
    "lowbit",
    "llamacpp",
    "gpu",
    "gpu_fit",
]

if __name__ == "__main__":
    from benchmarks.common import machine_line

    torch.set_num_threads(2)
    print(machine_line())  # every ratio below holds for this machine
    names = sys.argv[1:] or ALL
    for name in names:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"benchmarks.{name}":
                print(f"{name}: no benchmark yet")
                continue
            raise
        module.main()
