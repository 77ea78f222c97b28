"""BERT segment pairs (MLM + NSP) and RoBERTa full segments, built example by example from a
sentence store (tfcli.data.store, mode 'sentences' or 'paragraphs').

A document is a row of the data (a whole file for plain text) or, with documents='paragraphs',
each blank-line-separated paragraph. The store keeps every sentence's ids end to end with the
sentence and document boundaries, read from disk per example; nothing here holds the corpus or an epoch of
pairs in memory. Example i of an epoch starts at the sentence holding token offset(epoch) +
i x max_tokens of the corpus (the grid shifts every epoch), and is built from there:

  pair     sentences from that one on, within its document, until a target length (max_tokens, or
           with short_seq_prob a random shorter one); A ends at a random sentence boundary; B is the
           rest (IsNext) or, exactly half the time, text from a random other document (NotNext).
           A one-sentence chunk is split inside the sentence. A is trimmed from its front and B
           from its back, so an IsNext pair is always truly consecutive text (BERT's
           create_pretraining_data.py, with the coin flip exact).
  segment  whole sentences from that one on, crossing documents with an extra [SEP], up to
           max_tokens (RoBERTa's FULL-SENTENCES); a longer sentence is cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from .store import TokenStore


@dataclass(frozen=True)
class Corpus:
    """Documents [first_doc, last_doc) of a sentence store."""

    store: TokenStore
    first_doc: int
    last_doc: int

    @property
    def n_docs(self) -> int:
        return self.last_doc - self.first_doc

    def doc_sentences(self, d: int) -> range:
        """The store's sentence numbers of document d (counted within this corpus)."""
        g = self.first_doc + d
        return range(int(self.store.doc_sents[g - 1]) if g > 0 else 0, int(self.store.doc_sents[g]))

    def sentence_start(self, s: int) -> int:
        return int(self.store.sent_ends[s - 1]) if s > 0 else 0

    def sentence(self, s: int) -> np.ndarray:
        return np.asarray(self.store.tokens[self.sentence_start(s) : int(self.store.sent_ends[s])], dtype=np.int64)

    @property
    def first_sentence(self) -> int:
        return self.doc_sentences(0).start

    @property
    def last_sentence(self) -> int:  # exclusive
        return self.doc_sentences(self.n_docs - 1).stop

    @property
    def token_range(self) -> tuple[int, int]:
        return self.sentence_start(self.first_sentence), int(self.store.sent_ends[self.last_sentence - 1])

    @property
    def n_tokens(self) -> int:
        a, b = self.token_range
        return b - a

    def sentence_at(self, offset: int) -> int:
        """The sentence holding token `offset` (counted from this corpus's first token)."""
        s = int(np.searchsorted(self.store.sent_ends, self.token_range[0] + offset, side="right"))
        return min(max(s, self.first_sentence), self.last_sentence - 1)

    def doc_of_sentence(self, s: int) -> int:
        return int(np.searchsorted(self.store.doc_sents, s, side="right")) - self.first_doc


def split_corpus(store: TokenStore, val_fraction: float) -> tuple[Corpus, Corpus]:
    """The training documents and the last `val_fraction` of them, held out."""
    n = store.n_docs
    n_val = int(n * val_fraction) if val_fraction > 0 else 0
    return Corpus(store, 0, n - n_val), Corpus(store, n - n_val, n)


def pair_at(
    corpus: Corpus, offset: int, max_tokens: int, rng: np.random.Generator, short_seq_prob: float = 0.1
) -> tuple[np.ndarray, np.ndarray, int]:
    """(A, B, label) for the example at token `offset`: label 0 = IsNext, 1 = NotNext;
    len(A) + len(B) <= max_tokens."""
    target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
    s = corpus.sentence_at(offset)
    for _ in range(corpus.last_sentence - corpus.first_sentence):
        d = corpus.doc_of_sentence(s)
        chunk, length = [], 0
        for t in range(s, corpus.doc_sentences(d).stop):
            chunk.append(t)
            length += int(corpus.store.sent_ends[t]) - corpus.sentence_start(t)
            if length >= target:
                break
        pair = _make_pair(corpus, d, chunk, target, rng)
        if pair is not None:
            return pair
        s = s + 1 if s + 1 < corpus.last_sentence else corpus.first_sentence  # too short: the next sentence
    raise UserError("no sentence pair can be made: every document is shorter than two tokens")


def _make_pair(corpus: Corpus, doc: int, chunk: list[int], target: int, rng: np.random.Generator):
    is_next = rng.random() < 0.5 or corpus.n_docs < 2
    text = np.concatenate([corpus.sentence(s) for s in chunk])
    if len(text) < 2:
        return None
    if len(chunk) >= 2:
        a_end = int(rng.integers(1, len(chunk)))
        cut = corpus.sentence_start(chunk[a_end]) - corpus.sentence_start(chunk[0])
    else:
        cut = int(rng.integers(1, len(text)))  # one long sentence: split inside it
    a = text[:cut] if is_next or len(chunk) >= 2 else text
    b = text[cut:] if is_next else _random_segment(corpus, doc, max(1, target - len(a)), rng)
    a, b = _truncate(a, b, target)
    return a, b, 0 if is_next else 1


def _random_segment(corpus: Corpus, doc: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`length` tokens (or the rest of the document) from a random sentence of another document."""
    other = int(rng.integers(0, corpus.n_docs - 1))
    other += other >= doc  # never the same document
    sents = corpus.doc_sentences(other)
    start = corpus.sentence_start(int(rng.integers(sents.start, sents.stop)))
    end = corpus.sentence_start(sents.stop)
    return np.asarray(corpus.store.tokens[start : min(end, start + length)], dtype=np.int64)


def _truncate(a: np.ndarray, b: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Trim the longer segment until both fit: A from its front, B from its back (they stay adjacent)."""
    la, lb = len(a), len(b)
    while la + lb > max_tokens:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[len(a) - la :], b[:lb]


def segment_at(corpus: Corpus, offset: int, max_tokens: int, sep_id: int) -> np.ndarray:
    """RoBERTa FULL-SENTENCES from the sentence at token `offset`: whole sentences up to max_tokens,
    an extra separator at each document boundary; a sentence longer than max_tokens is cut."""
    s = corpus.sentence_at(offset)
    parts, n = [], 0
    while s < corpus.last_sentence and n < max_tokens:
        sent = corpus.sentence(s)
        if n + len(sent) > max_tokens:
            if not parts:
                parts.append(sent[:max_tokens])
            break
        parts.append(sent)
        n += len(sent)
        if s == corpus.doc_sentences(corpus.doc_of_sentence(s)).stop - 1 and 0 < n < max_tokens:
            parts.append(np.array([sep_id], dtype=np.int64))  # document boundary
            n += 1
        s += 1
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
