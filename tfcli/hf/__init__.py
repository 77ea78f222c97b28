"""Hugging Face and GGUF interop: interop.py reads and exports, convert.py is the engine, one table
module per family; hub.py resolves hub ids."""
