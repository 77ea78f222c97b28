"""`python -m tfcli ...` (what torchrun runs: torchrun --nproc-per-node N -m tfcli pretrain ...)."""

from .cli import main

main()
