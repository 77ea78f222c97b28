"""Tokenizers: trained on the training text (byte-level BPE, WordPiece, Unigram, characters)
or loaded from files (tokenizer.json, GPT-2 vocab.json + merges.txt, BERT vocab.txt, T5 spiece.model).

Everything is a `tokenizers.Tokenizer` underneath, so a run saves exactly one tokenizer.json.
The objective decides the special tokens (GPT: <|endoftext|>; BERT: [CLS] [SEP] ...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import UserError
from .special_tokens import CONFIG_FILE, SpecialTokens, config_text, read_config

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids the objectives need, and (where its
    directory says) its special tokens and chat template (data.special_tokens)."""

    def __init__(self, tok: Tokenizer, specials: SpecialTokens | None = None, chat_template: str | None = None):
        self.tok = tok
        self.specials = specials or SpecialTokens()
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def special_id(self, *candidates: str) -> int | None:
        """The id of the first of `candidates` that the vocabulary has."""
        for c in candidates:
            i = self.tok.token_to_id(c)
            if i is not None:
                return i
        return None

    @property
    def eos_id(self) -> int | None:
        """The recorded end-of-sequence token's id, else the first of the families' own that exists."""
        recorded = self.specials.eos and self.tok.token_to_id(self.specials.eos)
        return recorded if recorded is not None else self.special_id("<|endoftext|>", "</s>", "[SEP]")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def save(self, directory: Path) -> None:
        """tokenizer.json, and tokenizer_config.json when there are special tokens or a template to keep;
        each replaced whole (the other ranks of a resumed run read them while rank 0 writes them again)."""
        directory = Path(directory)
        tmp = directory / f".{TOKENIZER_FILE}.tmp"
        self.tok.save(str(tmp))
        os.replace(tmp, directory / TOKENIZER_FILE)
        if self.specials != SpecialTokens() or self.chat_template:
            tmp = directory / f".{CONFIG_FILE}.tmp"
            tmp.write_text(config_text(self.specials, self.chat_template))
            os.replace(tmp, directory / CONFIG_FILE)

    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]

    @classmethod
    def from_run(cls, directory: Path) -> TextTokenizer:
        path = Path(directory) / TOKENIZER_FILE
        try:
            return cls(Tokenizer.from_file(str(path)), *read_config(Path(directory)))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise UserError(
                f"{path}: not a readable tokenizer ({str(e).splitlines()[0][:150] if str(e) else e})"
            ) from None


def build_tokenizer(
    kind: str, *, vocab_size: int, path: str, lowercase: bool, texts: Iterable[str], specials: list[str]
) -> TextTokenizer:
    """Train or load the tokenizer a recipe's `tokenizer` section describes."""
    if kind == "file":
        return load_tokenizer_files(path, specials)
    if kind == "char":
        return _char_tokenizer(texts, specials, lowercase)
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=_unk(specials)))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False, unk_token=_unk(specials)
        )
    else:
        raise UserError(f"tokenizer.kind: unknown kind {kind!r}")
    if lowercase:
        tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    tok.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tok)


def _unk(specials: list[str]) -> str:
    return next((s for s in specials if "unk" in s.lower()), "[UNK]")


def _char_tokenizer(texts: Iterable[str], specials: list[str], lowercase: bool) -> TextTokenizer:
    """One id per character seen in the training text (nanoGPT's shakespeare_char)."""
    chars: set[str] = set()
    for t in texts:
        chars.update(t.lower() if lowercase else t)
    unk = "<unk>"
    vocab = {s: i for i, s in enumerate(dict.fromkeys(specials + [unk]))}
    for c in sorted(chars):
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")  # (?m): '.' matches \n too
    tok.decoder = decoders.Fuse()
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.add_special_tokens(list(dict.fromkeys(specials + [unk])))
    return TextTokenizer(tok)


def load_tokenizer_files(path: str, specials: list[str]) -> TextTokenizer:
    """tokenizer.json; or a directory holding one, or vocab.json + merges.txt (GPT-2), or vocab.txt (BERT).
    Padding and truncation a file may switch on are switched off: tfcli pads and cuts its own batches."""
    tok = _load_files(path, specials)
    tok.tok.no_padding()
    tok.tok.no_truncation()
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    if not path.startswith("builtin:") and directory.is_dir():
        tok.specials, tok.chat_template = read_config(directory)
    return tok


def _load_files(path: str, specials: list[str]) -> TextTokenizer:
    if path.startswith("builtin:"):  # a vocabulary that ships with tfcli: builtin:gpt2, builtin:bert-base-uncased
        from .sources import asset

        path = str(asset(path[len("builtin:") :]))
    p = Path(path)
    if not path or not p.exists():
        raise UserError(f"tokenizer.path: not found: {path or '(empty)'}")
    if p.is_dir():
        if (p / TOKENIZER_FILE).is_file():
            p = p / TOKENIZER_FILE
        elif (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            return _gpt2_files(p / "vocab.json", p / "merges.txt", specials)
        elif (p / "vocab.txt").is_file():
            return _wordpiece_vocab(p / "vocab.txt", p)
        elif (p / "spiece.model").is_file():
            return _sentencepiece(p / "spiece.model", specials)
        else:
            raise UserError(
                f"tokenizer.path: {path} holds no tokenizer.json, vocab.json+merges.txt, vocab.txt or spiece.model"
            )
    if p.name == "vocab.txt":
        return _wordpiece_vocab(p, p.parent)
    if p.suffix == ".model":
        return _sentencepiece(p, specials)
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:
        raise UserError(f"tokenizer.path: {path} is not a tokenizer.json ({str(e).splitlines()[0][:200]})") from None
    return TextTokenizer(tok)


def _gpt2_files(vocab: Path, merges: Path, specials: list[str]) -> TextTokenizer:
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    present = [s for s in specials if tok.token_to_id(s) is not None]
    tok.add_special_tokens(present or specials)
    return TextTokenizer(tok)


def _wordpiece_vocab(vocab: Path, directory: Path) -> TextTokenizer:
    lowercase = True
    config = directory / "tokenizer_config.json"
    if config.is_file():
        lowercase = bool(json.loads(config.read_text()).get("do_lower_case", True))
    from tokenizers.implementations import BertWordPieceTokenizer

    impl = BertWordPieceTokenizer(str(vocab), lowercase=lowercase)
    return TextTokenizer(impl._tokenizer)


def _sentencepiece(path: Path, specials: list[str]) -> TextTokenizer:
    """A SentencePiece Unigram model (T5's spiece.model), parsed as data with sentencepiece's protobuf
    schema and rebuilt as a `tokenizers` Unigram exactly as transformers' converter does; a T5's 100
    <extra_id_N> sentinels follow the pieces (<extra_id_0> last, as in T5's vocabulary)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as spm_pb2
    except ImportError:
        raise UserError(
            f"{path}: reading spiece.model needs the sentencepiece package "
            f"(pip install 'tfcli[spm]'), or give a tokenizer.json"
        ) from None
    proto = spm_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception:
        raise UserError(f"{path}: not a SentencePiece model") from None
    if proto.trainer_spec.model_type != 1:
        raise UserError(
            f"{path}: a SentencePiece {spm_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)} "
            f"model; tfcli reads Unigram models (T5's), or a tokenizer.json"
        )
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    known = {piece for piece, _ in vocab}
    sentinels = (
        [f"<extra_id_{i}>" for i in range(99, -1, -1)]
        if "<extra_id_0>" in specials and "<extra_id_0>" not in known
        else []
    )
    tok = Tokenizer(
        models.Unigram(vocab + [(t, 0.0) for t in sentinels], unk_id=proto.trainer_spec.unk_id, byte_fallback=False)
    )
    charsmap = proto.normalizer_spec.precompiled_charsmap
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Precompiled(charsmap)] if charsmap else [])
        + [normalizers.Strip(left=False, right=True), normalizers.Replace(Regex(" {2,}"), "▁")]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_tokens(
        [
            AddedToken(piece.piece, normalized=False, special=piece.type == 3)
            for piece in proto.pieces
            if piece.type in (3, 4)
        ]
    )  # control and user-defined pieces
    tok.add_special_tokens(sentinels)
    return TextTokenizer(tok)
