"""GGUF in and out, on tiny random llama-family models written with gguf's own writer (no download):
tfcli reads what it writes (f32 exactly, f16 and q8_0 within their rounding), transformers reads the
same file to the same logits and its tokenizer to the same ids, the chat template survives, q/k rows
go through llama.cpp's rotary permutation and back; the CLI exports, generates from and finetunes a
GGUF; unknown architectures, other tokenizers and truncated files are one-line errors."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tfcli.data.chat import ChatTemplate
from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.engine.backbone import for_inference
from tfcli.hf import interop as hf
from tfcli.models.llama import Llama, LlamaConfig
from tfcli.plugin import Backbone

from .conftest import close, invoke
from .test_llama import spread_

TEXTS = [
    "The capital of France is Paris.",
    "I have 12345 apples and 3 pears!",
    "  spaces\tand\nlines  ",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café – déjà vu",
]


@functools.cache
def small_gpt2(merges: int = 3000) -> str:
    """GPT-2's byte-level BPE cut to its first merges (the 256 bytes, then each merge's parts and
    result): the same kind of tokenizer, whose GGUF gguf's reader parses in a tenth of a second instead
    of five (GPT-2's 50,000 tokens and merges), and a vocabulary a tenth of the size to project onto."""
    from tfcli.data.sources import asset

    vocab = json.loads((asset("gpt2") / "vocab.json").read_text())
    lines = (asset("gpt2") / "merges.txt").read_text().splitlines()
    kept = dict.fromkeys(token for token, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i < 256)  # bytes
    for line in lines[1 : merges + 1]:
        a, b = line.split()
        kept.update(dict.fromkeys((a, b, a + b)))
    kept = {token: i for i, token in enumerate([*kept, "<|endoftext|>"])}
    out = Path(tempfile.mkdtemp(prefix="small-gpt2-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # a directory per process, not left in /tmp
    (out / "vocab.json").write_text(json.dumps(kept))
    (out / "merges.txt").write_text("\n".join(lines[: merges + 1]) + "\n")  # the #version line, then merges
    return str(out)


def tiny_backbone(arch: str = "llama", max_seq_len: int = 64, **cfg) -> Backbone:
    tok = load_tokenizer_files(small_gpt2(), ["<|endoftext|>"])
    tok.tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.specials = tok.specials.__class__(bos="<|im_start|>", eos="<|im_end|>", pad="<|im_end|>", unk="<|endoftext|>")
    tok.chat_template = ChatTemplate.load("chatml").source
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            d_model=64,
            d_ff=96,
            max_seq_len=max_seq_len,
            vocab_size=tok.vocab_size,
            hf_model_type=arch,
            **cfg,
        )
    ).eval()
    spread_(model)
    return Backbone(model, tok, "test")


IDS = torch.randint(0, 3257, (2, 16), generator=torch.Generator().manual_seed(3))


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids))


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,cfg",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": False}),
        ("qwen2", {"qkv_bias": True}),
        # transformers' GGUF reader takes Qwen3's head_dim from its default, 128
        ("qwen3", {"qk_norm": True, "head_dim": 128}),
    ],
)
def test_tfcli_and_transformers_read_a_written_gguf_alike(arch, cfg, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = tiny_backbone(arch, **cfg)
    want = logits(ours.model)
    out = tmp_path / "tiny.gguf"
    assert hf.export_gguf(ours, None, out, "f32") == arch and out.is_file()
    back = for_inference(out)
    assert back.cfg == ours.cfg
    assert close(logits(back.model), want, 1e-5)
    assert back.tokenizer.chat_template == ours.tokenizer.chat_template
    assert back.tokenizer.specials == ours.tokenizer.specials
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name).eval()
    with torch.no_grad():
        assert (theirs(IDS).logits - want).abs().max() < 1e-4
    their_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    for text in TEXTS:
        assert back.tokenizer.encode(text) == their_tok(text, add_special_tokens=False).input_ids, text
        assert back.tokenizer.encode(text) == ours.tokenizer.encode(text), text


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tolerance", [("f16", 0.05), ("q8_0", 0.15)])
def test_f16_and_q8_0_round_trip_within_their_rounding(dtype, tolerance, tmp_path):
    ours = tiny_backbone()
    out = tmp_path / f"tiny-{dtype}.gguf"
    hf.export_gguf(ours, None, out, dtype)
    want, got = logits(ours.model), logits(for_inference(out).model)
    assert (got - want).abs().max() < tolerance * want.abs().max()
    assert out.stat().st_size < (tmp_path / "f32.gguf").stat().st_size if (tmp_path / "f32.gguf").exists() else True
    import gguf

    types = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == {"F32", dtype.upper()}  # norms stay f32, matrices as asked


def test_llama_cpp_row_order_is_undone_on_reading():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3).numpy()  # 2 heads of 8 rows
    assert (hf.gguf._unpermute(hf.gguf._permute(w, 2), 2) == w).all()
    assert not (hf.gguf._permute(w, 2) == w).all()


def test_bad_gguf_files_are_one_line_errors(tmp_path):
    import gguf

    unknown = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(unknown), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    good = tmp_path / "good.gguf"
    hf.export_gguf(tiny_backbone(), None, good, "f32")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "text.gguf"
    garbage.write_text("not a gguf at all")
    no_tokens = tmp_path / "no-tokens.gguf"  # a llama without a vocabulary size or a token list
    writer = gguf.GGUFWriter(str(no_tokens), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    size = good.stat().st_size
    for path, message in (
        (unknown, "GGUF architecture 'mamba' is not supported"),
        (truncated, f"truncated GGUF file: its tensors need {size:,} bytes, the file has {size // 2:,}"),
        (garbage, "not a readable GGUF"),
        (no_tokens, "its vocabulary size is unknown"),
    ):
        result = invoke("generate", "--checkpoint", path, "--prompt", "hi", "--max-new-tokens", 2)
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_the_cli_exports_generates_from_and_finetunes_a_gguf(tmp_path, small_text, mnli_dir):
    from tfcli import recipe as recipes

    from .test_llama_cli import llama_recipe, pretrain

    run = pretrain(
        recipes.from_dict(llama_recipe(small_text, steps=4, ckpt_interval=4, eval_interval=4)), out=tmp_path / "run"
    )
    out = tmp_path / "model.gguf"
    result = invoke("export", "--checkpoint", run, "--gguf", out, "--gguf-type", "q8_0")
    assert result.exit_code == 0, result.output
    hint = next(line for line in result.output.splitlines() if "run it with:" in line).split("run it with:")[1].split()
    generated = invoke(*hint[1:], "--prompt", "The", "--max-new-tokens", 6, "--greedy")
    assert generated.exit_code == 0 and generated.output.startswith("The"), generated.output
    again = invoke("export", "--checkpoint", run, "--gguf", out)
    assert again.exit_code == 2 and "exists" in again.output
    hf = tmp_path / "from-gguf"  # a GGUF exports as what --checkpoint reads elsewhere: a transformers directory
    result = invoke("export", "--checkpoint", out, "--hf", hf)
    assert result.exit_code == 0 and (hf / "model.safetensors").is_file(), result.output
    import transformers

    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        ours = for_inference(out).model
        assert torch.allclose(ours.logits(ours(ids)), theirs, atol=1e-4)
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        out,
        "--data",
        mnli_dir,
        "--train",
        "lora",
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "ft",
        "--quiet",
        "--set",
        "finetune.eval_limit=6",
    )
    assert result.exit_code == 0, result.output
    shutil.rmtree(tmp_path / "ft")


def chat_gguf_file(tmp_path_factory, **cfg) -> Path:
    """A tiny random llama with ChatML (<|im_end|> ends a turn and the text), as a GGUF file."""
    out = tmp_path_factory.mktemp("chat") / "chat.gguf"
    hf.export_gguf(tiny_backbone(**cfg), None, out, "f32")
    return out


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory)


@pytest.mark.slow  # chat: test_sft.py and test_user_messages.py in the fast tier
def test_generate_chat_answers_one_templated_turn(chat_gguf):
    args = [
        "generate",
        "--checkpoint",
        chat_gguf,
        "--chat",
        "--prompt",
        "hello",
        "--system",
        "Be brief.",
        "--greedy",
        "--max-new-tokens",
        6,
    ]
    first, second = invoke(*args), invoke(*args)
    assert first.exit_code == 0, first.output
    assert first.output == second.output and "<|im_start|>" not in first.output and "hello" not in first.output


@pytest.mark.slow
def test_chat_keeps_the_conversation_and_starts_over_on_reset(chat_gguf):
    from tfcli.data.chat import ChatTemplate
    from tfcli.engine.backbone import for_inference
    from tfcli.generate import reply

    result = invoke(
        "chat",
        "--checkpoint",
        chat_gguf,
        "--greedy",
        "--max-new-tokens",
        5,
        input="hello\nhow are you\n/reset\nhello\n/exit\nnever read\n",
    )
    assert result.exit_code == 0, result.output
    first, second, reset, third = result.output.splitlines()[:4]
    assert reset == "[conversation reset]"
    assert third == first  # after /reset the same question gets the same greedy answer
    backbone = for_inference(chat_gguf)
    template = ChatTemplate(backbone.tokenizer.chat_template)
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "how are you"},
    ]
    sampling = dict(max_new_tokens=5, temperature=0.0, top_k=0, top_p=1.0)
    assert "".join(reply(backbone, template, history, **sampling)) == second  # the second turn saw the first


def test_chat_needs_a_template_and_a_decoder(tmp_path, small_text):
    from tfcli import recipe as recipes

    from .test_llama_cli import llama_recipe, pretrain

    run = pretrain(
        recipes.from_dict(llama_recipe(small_text, steps=2, ckpt_interval=2, eval_interval=2)), out=tmp_path / "run"
    )
    result = invoke("generate", "--checkpoint", run, "--chat", "--prompt", "hi")
    assert result.exit_code == 2 and "no chat template; pass --chat-template" in result.output, result.output
    result = invoke(
        "generate",
        "--checkpoint",
        run,
        "--chat",
        "--prompt",
        "hi",
        "--chat-template",
        "chatml",
        "--max-new-tokens",
        3,
        "--greedy",
    )
    assert result.exit_code == 0, result.output


def sentencepiece_gguf(directory: Path, arch: str) -> Path:
    """A tokenizer-only GGUF of tokenizer.ggml.model 'llama' (SentencePiece BPE with byte fallback, as
    Llama 2, Mistral, Gemma and Phi-3 files hold): a 600-piece BPE learned from War and Peace, the 256
    <0xNN> byte tokens, scores in merge order and no merges list (llama.cpp's converter writes none)."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    from .conftest import SHARED

    lines = (SHARED / "text" / "war_and_peace.txt").read_text()[:200_000].splitlines()
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(lines, vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    pieces = sorted(spm.get_vocab(), key=spm.get_vocab().get)
    tokens = pieces[:3] + [f"<0x{b:02X}>" for b in range(256)] + pieces[3:]
    writer = gguf.GGUFWriter(str(directory / "t.gguf"), arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces) - 3)])
    writer.add_token_types([3, 3, 3] + [6] * 256 + [1] * (len(pieces) - 3))  # control, byte, normal
    for key, i in (("unk", 0), ("bos", 1), ("eos", 2)):
        getattr(writer, f"add_{key}_token_id")(i)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return directory / "t.gguf"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_a_sentencepiece_gguf_tokenizes_as_transformers_reads_it(arch, tmp_path):
    """Llama 2's and Mistral's kind (a leading "▁"), Gemma's (no prefix space) and Phi-3's (the prefix
    from a normalizer): the ids and decoded texts of transformers' own GGUF tokenizer."""
    transformers = pytest.importorskip("transformers")
    path = sentencepiece_gguf(tmp_path, arch)
    ours = hf.gguf.read_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = [*TEXTS, "Hello world, said Pierre.", "  two  spaces", "Prince Andrew\nlooked", "</s> and <s> inside"]
    for text in texts:
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == want, text
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=True), text
    assert ours.specials.eos == "</s>" and ours.token_id("<0x41>") == 3 + 0x41


def test_a_model_with_a_sentencepiece_tokenizer_exports_to_gguf_and_reads_back_alike(tmp_path):
    """The export side: scores in merge order (llama.cpp merges SentencePiece pieces by score), byte
    pieces typed as bytes; read back, the same ids."""
    path = sentencepiece_gguf(tmp_path, "llama")
    tok = hf.gguf.read_tokenizer(path)
    model = Llama(LlamaConfig(n_layer=1, n_head=2, d_model=32, d_ff=64, vocab_size=tok.vocab_size)).eval()
    hf.export_gguf(Backbone(model, tok, "test"), None, tmp_path / "out.gguf", "f32")
    again = hf.gguf.read_tokenizer(tmp_path / "out.gguf")
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="out.gguf")
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text) == theirs.encode(text, add_special_tokens=False), text
