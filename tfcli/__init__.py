"""tfcli: pretrain and finetune transformers from the command line."""

__version__ = "0.2.0"
