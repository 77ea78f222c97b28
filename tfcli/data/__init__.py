"""Data: sources, tokenizers, token stores, packing, labelled rows, images and chat templates."""

IGNORE = -100  # a target position without a loss (prompt, padding): cross-entropy's ignore_index
