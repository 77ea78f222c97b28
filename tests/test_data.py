"""Data: sources, tokenizers, cached tokenization, packing and the resumable sampler."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tfcli.data import packing
from tfcli.data.sources import builtin_documents, load_documents
from tfcli.data.tokenizers import TextTokenizer, build_tokenizer, load_tokenizer_files
from tfcli.errors import UserError


def test_builtin_corpus_is_real_english_of_useful_size():
    docs = builtin_documents()
    text = " ".join(docs)
    assert len(docs) > 300 and len(text) > 1_500_000
    assert text.count(" the ") > 10_000


def test_local_formats_globs_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nwith two lines")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "json row one"}) + "\n" + json.dumps({"body": "two"}) + "\n")
    (tmp_path / "c.csv").write_text("body,other\ncsv row,1\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["parquet row"]}), tmp_path / "d.parquet")
    texts = sorted(load_documents(str(tmp_path / "a.txt"))["text"])
    assert texts == ["first document\nwith two lines"]  # a text file is one document, newlines kept
    texts = sorted(load_documents(f"{tmp_path}/*.jsonl,{tmp_path}/c.csv,{tmp_path}/d.parquet", "body")["text"])
    assert texts == ["csv row", "json row one", "parquet row", "two"]
    sub = tmp_path / "dir" / "nested"
    sub.mkdir(parents=True)
    (sub / "x.txt").write_text("nested text")
    assert load_documents(str(tmp_path / "dir"))["text"] == ["nested text"]


@pytest.mark.parametrize("source,message", [
    ("/no/such/file.txt", "data not found: /no/such/file.txt"),
    ("/no/such/*.txt", "no files match"),
])
def test_missing_data_is_a_user_error(source, message):
    with pytest.raises(UserError, match=message):
        load_documents(source)


def test_missing_text_field_names_the_columns(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match="no 'text' field \\(columns: body\\)"):
        load_documents(str(tmp_path / "a.jsonl"))


def test_hub_dataset_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="could not load Hugging Face dataset 'surely-not/here'"):
        load_documents("hf:surely-not/here")


def test_char_tokenizer_round_trips_text_with_newlines():
    text = "ROMEO:\nBut soft!  what light?\n"
    tok = build_tokenizer("char", vocab_size=0, path="", lowercase=False, texts=[text], specials=["<|endoftext|>"])
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_id == 0


def test_trained_bpe_round_trips(small_text):
    tok = build_tokenizer("bpe", vocab_size=400, path="", lowercase=False, texts=[small_text.read_text()],
                          specials=["<|endoftext|>"])
    sample = "Whither wilt thou, Caius? — naïve café"
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.vocab_size <= 400


def test_gpt2_files_give_the_real_gpt2_ids(shared_data):
    tok = load_tokenizer_files(str(shared_data / "tokenizers" / "gpt2"), ["<|endoftext|>"])
    assert tok.encode("Hello world!") == [15496, 995, 0]
    assert tok.eos_id == 50256 and tok.vocab_size == 50257


def test_bert_vocab_txt_loads(shared_data):
    tok = load_tokenizer_files(str(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt"), [])
    assert tok.token_id("[CLS]") == 101 and tok.encode("the") == [1996]


def test_tokenization_is_cached_between_runs(tmp_path, small_text, monkeypatch):
    docs = load_documents(str(small_text))
    tok = build_tokenizer("char", vocab_size=0, path="", lowercase=False, texts=docs["text"],
                          specials=["<|endoftext|>"])
    first = packing.token_stream(packing.tokenize(docs, tok))
    calls = []
    original = TextTokenizer.encode_batch
    monkeypatch.setattr(TextTokenizer, "encode_batch", lambda self, t: calls.append(1) or original(self, t))
    again = packing.token_stream(packing.tokenize(load_documents(str(small_text)), tok))
    assert calls == [] and np.array_equal(first, again)
    assert first[-1] == tok.eos_id and len(first) == len(small_text.read_text()) + 1


def test_split_holds_out_the_tail():
    stream = np.arange(1000)
    train, val = packing.split_stream(stream, 0.1, seq_len=16)
    assert np.array_equal(np.concatenate([train, val]), stream) and len(val) == 100
    with pytest.raises(UserError, match="fewer than one block"):
        packing.split_stream(np.arange(20), 0.1, seq_len=16)


def test_unreachable_hub_fails_fast_in_one_line(monkeypatch):
    from tfcli.data import sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(UserError, match="^could not load Hugging Face dataset 'wikitext:wikitext-2-raw-v1': "
                                        "the hub is unreachable from here; use local files instead") as e:
        load_documents("hf:wikitext:wikitext-2-raw-v1")
    assert "\n" not in str(e.value)
