"""What a tokenizing process does with a batch of document pieces. Kept apart from the rest of
tfcli so that a worker process imports only numpy and tokenizers (it starts in well under a second).

A batch is a list of (text, ends its document) pieces. Each piece becomes segments: the piece
itself, or its sentences (for BERT's segment pairs), or its paragraphs' sentences (with every
paragraph a document of its own). The result is the ids of every segment end to end (an EOS id
after each document when asked), each segment's length, and which segments end a document.
"""

from __future__ import annotations

import os
import re

import numpy as np

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")
_PARAGRAPH = re.compile(r"\n\s*\n")
_state: dict = {}


def split_sentences(text: str) -> list[str]:
    """Sentence-ending punctuation followed by space, or a blank line, ends a sentence."""
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text)) if s]


def start(tokenizer_json: str, eos: int, mode: str) -> None:
    """Pool initializer: one thread per process (the processes are the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _state.update(tok=Tokenizer.from_str(tokenizer_json), eos=eos, mode=mode)


def segments(text: str, ends_doc: bool, mode: str) -> list[tuple[str, bool]]:
    """A piece -> (segment text, ends a document) in order."""
    if mode == "text":
        return [(text, ends_doc)]
    if mode == "sentences":
        sents = split_sentences(text)
        return [(s, ends_doc and i == len(sents) - 1) for i, s in enumerate(sents)] or [("", ends_doc)]
    out: list[tuple[str, bool]] = []  # paragraphs: each one a document of sentences
    for para in _PARAGRAPH.split(text):
        sents = split_sentences(para)
        out += [(s, i == len(sents) - 1) for i, s in enumerate(sents)]
    return out or [("", ends_doc)]


def encode(batch: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (ids uint32, segment lengths int64, segment ends a document bool)."""
    tok, eos, mode = _state["tok"], _state["eos"], _state["mode"]
    segs = [s for text, ends in batch for s in segments(text, ends, mode)]
    encoded = tok.encode_batch([s for s, _ in segs], add_special_tokens=False) if segs else []
    ids, lengths, ends = [], [], []
    for (_, doc_end), e in zip(segs, encoded):
        seg = e.ids + ([eos] if doc_end and eos >= 0 else [])
        ids.extend(seg)
        lengths.append(len(seg))
        ends.append(doc_end)
    return np.array(ids, dtype=np.uint32), np.array(lengths, dtype=np.int64), np.array(ends, dtype=bool)
