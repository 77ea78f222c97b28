"""Hugging Face interop: load transformers checkpoints into tfcli models and export them back.

One module per family (gpt2.py, bert.py, t5.py, vit.py), each a pair of pure functions that
rename and reshape state dicts, plus config translation.
"""
