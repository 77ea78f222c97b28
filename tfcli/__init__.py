"""tfcli: pretrain and finetune transformers from the command line."""

import os

# CPU tensors of 2 MB and more on transparent huge pages: PyTorch's own switch, read once at its first
# allocation, so it is set here, before any tfcli module imports torch (THP_MEM_ALLOC_ENABLE=0 keeps the
# allocator as it comes). glibc's heap keeps freed activations resident between differently sized
# ones; on huge pages the peaks fall at about the same speed (figures: docs/guides/memory.md).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.2.0"
