"""`make bench`: every family's training step against its Hugging Face peer, same run, same config.

    python -m benchmarks            # all
    python -m benchmarks gpt bert   # some
"""
import importlib
import sys

import torch

ALL = ["gpt", "bert", "t5", "mae"]

if __name__ == "__main__":
    torch.set_num_threads(2)
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
