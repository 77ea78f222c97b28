"""Data: sources read as streams, tokenizers, token stores (cached, read from disk, made by worker
processes), the held-out split on the mapped stream, and document-aware packing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tfcli.data import documents, packing, store, tokenize_worker
from tfcli.data.documents import open_source
from tfcli.data.sources import builtin_documents, write_into_place
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
    texts = list(open_source(str(tmp_path / "a.txt")).documents())
    assert texts == ["first document\nwith two lines"]  # a text file is one document, newlines kept
    texts = sorted(open_source(f"{tmp_path}/*.jsonl,{tmp_path}/c.csv,{tmp_path}/d.parquet", "body").documents())
    assert texts == ["csv row", "json row one", "parquet row", "two"]
    sub = tmp_path / "dir" / "nested"
    sub.mkdir(parents=True)
    (sub / "x.txt").write_text("nested text")
    assert list(open_source(str(tmp_path / "dir")).documents()) == ["nested text"]


@pytest.mark.parametrize(
    "source,message",
    [
        ("/no/such/file.txt", "data not found: /no/such/file.txt"),
        ("/no/such/*.txt", "no files match"),
    ],
)
def test_missing_data_is_a_user_error(source, message):
    with pytest.raises(UserError, match=message):
        open_source(source)


def test_missing_text_field_names_the_columns(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match="no 'text' field \\(columns: body\\)"):
        list(open_source(str(tmp_path / "a.jsonl")).documents())


@pytest.mark.slow
def test_hub_dataset_offline_is_a_clear_error(monkeypatch):
    """datasets and huggingface_hub read HF_HUB_OFFLINE when first imported: in a process where another
    test imported them, setting it later changes nothing and the load waits on the unreachable hub's
    retries before the same error. Their constants are set too."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for constants in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="could not load Hugging Face dataset 'surely-not/here'"):
        list(open_source("hf:surely-not/here").documents())


def test_char_tokenizer_round_trips_text_with_newlines():
    text = "ROMEO:\nBut soft!  what light?\n"
    tok = build_tokenizer("char", vocab_size=0, path="", lowercase=False, texts=[text], specials=["<|endoftext|>"])
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_id == 0


def test_trained_bpe_round_trips(small_text):
    tok = build_tokenizer(
        "bpe", vocab_size=400, path="", lowercase=False, texts=[small_text.read_text()], specials=["<|endoftext|>"]
    )
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


def char_tokenizer(text: str) -> TextTokenizer:
    return build_tokenizer("char", vocab_size=0, path="", lowercase=False, texts=[text], specials=["<|endoftext|>"])


def test_a_store_is_made_once_read_from_disk_and_holds_every_document(tmp_path, small_text, monkeypatch):
    monkeypatch.setenv("TFCLI_CACHE", str(tmp_path / "cache"))
    (tmp_path / "docs").mkdir()
    texts = [small_text.read_text()[:5000], "second document.", small_text.read_text()[5000:9000]]
    for i, t in enumerate(texts):
        (tmp_path / "docs" / f"{i}.txt").write_text(t)
    source, tok = open_source(str(tmp_path / "docs")), char_tokenizer(small_text.read_text())
    first = store.cached_store(source, tok, workers=1, quiet=True)
    assert isinstance(first.tokens, store.DiskArray) and first.tokens.dtype == np.uint16
    expected = np.concatenate([tok.encode(t) + [tok.eos_id] for t in texts])
    assert np.array_equal(first.tokens[:], expected) and first.n_docs == 3
    assert first.tokens[-1] == tok.eos_id and np.array_equal(first.tokens.view(3, 10)[2:5], expected[5:8])
    assert first.doc_ends.tolist() == np.cumsum([len(t) + 1 for t in texts]).tolist()
    calls = []
    monkeypatch.setattr(tokenize_worker, "encode", lambda batch: calls.append(1))
    again = store.cached_store(open_source(str(tmp_path / "docs")), tok, workers=1, quiet=True)
    assert calls == [] and again.root == first.root  # the same data and tokenizer: read from the cache


def test_two_workers_make_the_same_store_as_one(tmp_path, small_text, monkeypatch):
    monkeypatch.setattr(store, "BATCH_CHARS", 4000)  # many tasks, so both processes work
    monkeypatch.setattr(documents, "PIECE_CHARS", 1500)  # a text file read in pieces
    source, tok = open_source(str(small_text)), char_tokenizer(small_text.read_text())
    one = store.prepare(source, tok, tmp_path / "one", workers=1, quiet=True)
    two = store.prepare(source, tok, tmp_path / "two", workers=2, quiet=True)
    assert np.array_equal(one.tokens, two.tokens) and np.array_equal(one.doc_ends, two.doc_ends)
    whole = tok.encode(small_text.read_text()) + [tok.eos_id]  # pieces tokenize as the whole file
    assert np.array_equal(one.tokens, whole) and one.n_docs == 1
    assert not list(tmp_path.glob(".*tmp*"))


def test_auto_workers_start_processes_only_for_a_source_of_several_batches(tmp_path, small_text, monkeypatch):
    """workers 0 keeps a source of fewer than POOL_MIN_BATCHES batches in this process (a pool of
    spawned processes costs more to start than tokenizing it takes: python -m benchmarks store) and
    spreads a larger one over default_workers() processes; both make the store one process makes."""
    monkeypatch.setattr(documents, "PIECE_CHARS", 1500)
    pools, context = [], store.multiprocessing.get_context

    class Counted:  # the context store.py asks for, counting the pools it starts
        def __init__(self, method):
            self.context = context(method)

        def Pool(self, processes, *args):  # noqa: N802 (multiprocessing's name)
            pools.append(processes)
            return self.context.Pool(processes, *args)

    monkeypatch.setattr(store.multiprocessing, "get_context", Counted)
    monkeypatch.setattr(store, "default_workers", lambda: 2)
    source, tok = open_source(str(small_text)), char_tokenizer(small_text.read_text())
    one = store.prepare(source, tok, tmp_path / "one", workers=1, quiet=True)
    monkeypatch.setattr(store, "BATCH_CHARS", len(small_text.read_text()) // (store.POOL_MIN_BATCHES - 1) + 1)
    small = store.prepare(source, tok, tmp_path / "small", workers=0, quiet=True)
    assert pools == []  # 60k characters in fewer batches than POOL_MIN_BATCHES: no process started
    monkeypatch.setattr(store, "BATCH_CHARS", 4000)
    large = store.prepare(source, tok, tmp_path / "large", workers=0, quiet=True)
    assert pools == [2]
    assert np.array_equal(one.tokens, small.tokens) and np.array_equal(one.tokens, large.tokens)


def test_a_sentence_store_keeps_sentence_and_document_boundaries(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "One two. Three four five!"})
        + "\n"
        + json.dumps({"text": "   "})
        + "\n"
        + json.dumps({"text": "Six."})
        + "\n"
    )
    tok = char_tokenizer("One two. Three four five! Six.")
    s = store.prepare(
        open_source(str(tmp_path / "a.jsonl")), tok, tmp_path / "s", mode="sentences", eos=False, workers=1, quiet=True
    )
    assert s.n_docs == 2 and s.sent_ends.tolist() == [8, 24, 28] and s.doc_sents.tolist() == [2, 3]
    assert tok.decode(s.tokens[8:24].tolist()) == "Three four five!"


def test_an_empty_corpus_leaves_no_store(tmp_path):
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(UserError, match="no text"):
        store.prepare(
            open_source(str(tmp_path / "e.jsonl")), char_tokenizer("ab"), tmp_path / "s", workers=1, quiet=True
        )
    assert not list(tmp_path.glob("*s*")) or not (tmp_path / "s").exists()


def test_the_held_out_split_is_the_tail_of_the_mapped_stream(tmp_path, small_text):
    tok = char_tokenizer(small_text.read_text())
    s = store.prepare(open_source(str(small_text)), tok, tmp_path / "s", workers=1, quiet=True)
    train, val = packing.split_stores(s, None, 0.1, block=16)
    assert len(val) == int(len(s) * 0.1) and len(train) + len(val) == len(s)
    assert np.array_equal(np.concatenate([train.tokens, val.tokens]), s.tokens)
    with pytest.raises(UserError, match="fewer than one block"):
        packing.split_stores(s, None, 0.1, block=len(s))


def test_unreachable_hub_fails_fast_in_one_line(monkeypatch):
    from tfcli.data import sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(
        UserError,
        match="^could not load Hugging Face dataset 'wikitext:wikitext-2-raw-v1': "
        "the hub is unreachable from here; use local files instead",
    ) as e:
        list(open_source("hf:wikitext:wikitext-2-raw-v1").documents())
    assert "\n" not in str(e.value)


def test_prepare_then_pretrain_on_the_store(tmp_path, small_text):
    from .conftest import invoke, read_metrics

    out = tmp_path / "owt"
    result = invoke("prepare", "--data", small_text, "--tokenizer", "gpt2", "--out", out, "--workers", 2, "--quiet")
    assert result.exit_code == 0, result.output
    prepared = store.TokenStore.open(out)
    assert (
        prepared.tokens.dtype == np.uint16
        and prepared.index["vocab_size"] == 50257
        and (out / "tokenizer.json").is_file()
    )
    result = invoke(
        "pretrain",
        "--data",
        out,
        "--steps",
        2,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "model.n_layer=1",
        "--set",
        "model.d_model=32",
        "--set",
        "model.n_head=2",
        "--set",
        "data.seq_len=32",
        "--set",
        "model.max_seq_len=32",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.eval_batches=1",
    )
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r.get("split") == "train"][-1] == 2
    result = invoke(
        "pretrain", "--objective", "mlm", "--data", out, "--steps", 1, "--out", tmp_path / "bert", "--quiet"
    )
    assert result.exit_code == 2 and "which BERT needs" in result.output  # a GPT-2 store cannot feed a BERT


def _write_slowly(path, text, started=None, go_on=None):
    """A cache writer that stops half-way, until told to go on, with its temporary file open."""

    def write(tmp):
        with tmp.open("w") as f:
            f.write(text[: len(text) // 2])
            f.flush()
            if started is not None:
                started.set()
                go_on.wait(20)
            f.write(text[len(text) // 2 :])

    write_into_place(path, write)


def test_two_processes_filling_one_cache_entry_at_once_both_succeed_and_leave_it_whole(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    path = tmp_path / "entry.json"
    started, go_on = ctx.Event(), ctx.Event()
    first = ctx.Process(target=_write_slowly, args=(path, "A" * 10_000, started, go_on))
    first.start()
    assert started.wait(20)
    _write_slowly(path, "B" * 10_000)  # the second writer finishes while the first is half-way
    go_on.set()
    first.join(20)
    assert first.exitcode == 0
    assert path.read_text() in ("A" * 10_000, "B" * 10_000)
    assert [p.name for p in tmp_path.iterdir()] == ["entry.json"]
