"""Documents -> sentences -> BERT segment pairs (MLM + NSP) or RoBERTa full segments (MLM only).

A document is a row of the data (a whole file for plain text) or, with documents='paragraphs',
each blank-line-separated paragraph of a row. Documents are split into sentences, the sentences
tokenized (cached through `datasets.map`), and kept as flat numpy arrays:
    tokens      all sentence ids end to end
    sent_start  (n_sent + 1,) offsets of each sentence in `tokens`
    doc_start   (n_doc + 1,)  index of each document's first sentence
Pair building follows BERT's create_pretraining_data.py, with two changes that the spec asks for:
IsNext/NotNext is exactly a coin flip (a one-sentence chunk is split inside the sentence), and A is
trimmed from its front and B from its back, so an IsNext pair is always truly consecutive text.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from ..display import phase
from .tokenizers import TextTokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")
_PARAGRAPH = re.compile(r"\n\s*\n")


def split_sentences(text: str) -> list[str]:
    """Sentence-ending punctuation followed by space, or a blank line, ends a sentence."""
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text)) if s]


@dataclass
class Corpus:
    tokens: np.ndarray
    sent_start: np.ndarray
    doc_start: np.ndarray

    @property
    def n_docs(self) -> int:
        return len(self.doc_start) - 1

    def sentence(self, i: int) -> np.ndarray:
        return self.tokens[self.sent_start[i]: self.sent_start[i + 1]]

    def doc_sentences(self, d: int) -> range:
        return range(int(self.doc_start[d]), int(self.doc_start[d + 1]))

    def subset(self, docs: range) -> "Corpus":
        """Documents [docs.start, docs.stop) as a Corpus of their own (for a held-out split)."""
        s0, s1 = int(self.doc_start[docs.start]), int(self.doc_start[docs.stop])
        t0, t1 = int(self.sent_start[s0]), int(self.sent_start[s1])
        return Corpus(self.tokens[t0:t1], self.sent_start[s0: s1 + 1] - t0, self.doc_start[docs.start: docs.stop + 1] - s0)


def tokenize_sentences(docs, tokenizer: TextTokenizer, paragraphs: bool = False) -> Corpus:
    """Dataset of `text` -> Corpus. Tokenization is cached by (data, tokenizer) fingerprint."""
    def encode(batch):
        out = []
        for text in batch["text"]:
            parts = _PARAGRAPH.split(text) if paragraphs else [text]
            for part in parts:
                sents = split_sentences(part)
                if sents:
                    out.append([s for s in tokenizer.encode_batch(sents) if s])
        return {"sentences": [d for d in out if d]}

    key = f"{docs._fingerprint}|{tokenizer.fingerprint()}|{paragraphs}|sentences-v1"
    with phase(f"splitting {len(docs):,} documents into sentences"):
        ds = docs.map(encode, batched=True, batch_size=64, remove_columns=docs.column_names,
                      new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16], desc="splitting sentences")
    col = ds.data.column("sentences").combine_chunks()  # list<list<int>>
    sentences = col.flatten()
    return Corpus(tokens=sentences.flatten().to_numpy().astype(np.int64),
                  sent_start=sentences.offsets.to_numpy().astype(np.int64) - int(sentences.offsets[0].as_py()),
                  doc_start=col.offsets.to_numpy().astype(np.int64) - int(col.offsets[0].as_py()))


def sentence_pairs(corpus: Corpus, max_tokens: int, rng: np.random.Generator,
                   short_seq_prob: float = 0.1) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(A, B, label) triples, label 0 = IsNext, 1 = NotNext; len(A) + len(B) <= max_tokens."""
    pairs = []
    for d in range(corpus.n_docs):
        sents = list(corpus.doc_sentences(d))
        target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
        chunk, length, i = [], 0, 0
        while i < len(sents):
            chunk.append(sents[i])
            length += corpus.sent_start[sents[i] + 1] - corpus.sent_start[sents[i]]
            if i == len(sents) - 1 or length >= target:
                pair = _make_pair(corpus, d, chunk, target, rng)
                if pair is not None:
                    a, b, label, unused = pair
                    pairs.append((a, b, label))
                    i -= unused  # sentences not used by a NotNext pair go back into the document
                chunk, length = [], 0
                target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
            i += 1
    return pairs


def _make_pair(corpus: Corpus, doc: int, chunk: list[int], target: int, rng: np.random.Generator):
    is_next = rng.random() < 0.5 or corpus.n_docs < 2
    text = np.concatenate([corpus.sentence(s) for s in chunk])
    if len(text) < 2:
        return None
    if len(chunk) >= 2:
        a_end = int(rng.integers(1, len(chunk)))
        cut = int(corpus.sent_start[chunk[a_end]] - corpus.sent_start[chunk[0]])
    else:
        a_end, cut = 1, int(rng.integers(1, len(text)))  # one long sentence: split inside it
    a = text[:cut] if is_next or len(chunk) >= 2 else text
    unused = 0
    if is_next:
        b = text[cut:]
    else:
        b = _random_segment(corpus, doc, max(1, target - len(a)), rng)
        unused = len(chunk) - a_end
    a, b = _truncate(a, b, target)
    return a, b, 0 if is_next else 1, unused


def _random_segment(corpus: Corpus, doc: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`length` tokens (or the rest of the document) from a random sentence of another document."""
    other = int(rng.integers(0, corpus.n_docs - 1))
    other += other >= doc  # never the same document
    sents = corpus.doc_sentences(other)
    start = int(corpus.sent_start[int(rng.integers(sents.start, sents.stop))])
    end = int(corpus.sent_start[sents.stop])
    return corpus.tokens[start: min(end, start + length)]


def _truncate(a: np.ndarray, b: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Trim the longer segment until both fit: A from its front, B from its back (they stay adjacent)."""
    la, lb = len(a), len(b)
    while la + lb > max_tokens:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[len(a) - la:], b[:lb]


def full_segments(corpus: Corpus, max_tokens: int, sep_id: int) -> list[np.ndarray]:
    """RoBERTa FULL-SENTENCES: whole sentences packed contiguously up to max_tokens, crossing
    document boundaries with an extra separator; a sentence longer than max_tokens is cut in pieces."""
    out, cur = [], []
    for d in range(corpus.n_docs):
        for s in corpus.doc_sentences(d):
            sent = corpus.sentence(s)
            for k in range(0, len(sent), max_tokens):
                piece = sent[k: k + max_tokens]
                if sum(map(len, cur)) + len(piece) > max_tokens and cur:
                    out.append(np.concatenate(cur))
                    cur = []
                cur.append(piece)
        if cur and sum(map(len, cur)) < max_tokens:
            cur.append(np.array([sep_id], dtype=np.int64))  # document boundary
    if cur:
        out.append(np.concatenate(cur))
    return out
