"""Hugging Face interop through the one converter: for every family, a transformers directory read
into tfcli gives the same logits (< 1e-4), and tfcli weights written out load in transformers with
the same logits; single, sharded and pytorch_model.bin checkpoints; one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tfcli.engine.backbone import from_hf
from tfcli.errors import UserError
from tfcli.hf import interop as hf
from tfcli.models import build_model
from tfcli.models.bert import Bert, BertConfig
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config
from tfcli.models.vit import MAEDecoder, ViT, ViTConfig, random_masking, sincos_2d
from tfcli.objectives import mae
from tfcli.objectives.mlm_nsp import SPECIAL_TOKENS, build_heads
from tfcli.plugin import Backbone

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def jiggle_(module: torch.nn.Module) -> None:
    """Random norms and biases too, so that a swapped or missed tensor cannot go unnoticed."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name.lower() else 0.0))


def read(directory):
    """A transformers directory -> (tfcli model with its weights, head weights)."""
    cfg, state = hf.read_pretrained(directory)
    model = build_model(cfg).eval()
    model.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")})
    return model, {k[6:]: v for k, v in state.items() if k.startswith("heads.")}


def write(model, heads: dict, out, labels=()):
    return hf.export(Backbone(model, None, heads=heads, labels=tuple(labels)), None, out)[0]


# --- GPT-2 ------------------------------------------------------------------------------------------


def test_gpt2_both_ways(tmp_path):
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=97, n_positions=40, n_embd=32, n_layer=2, n_head=4)
    ).eval()
    jiggle_(theirs)
    theirs.save_pretrained(tmp_path / "in")
    ours, _ = read(tmp_path / "in")
    ids = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        assert (ours.logits(ours(ids)) - theirs(ids).logits).abs().max() < TOL
        model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, max_seq_len=40, vocab_size=97)).eval()
        jiggle_(model)
        assert write(model, {}, tmp_path / "out") == "GPT2LMHeadModel"
        back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
        assert (model.logits(model(ids)) - back(ids).logits).abs().max() < TOL


def test_gpt2_directory_with_its_tokenizer_files_is_a_backbone(tmp_path, shared_data):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    ).save_pretrained(tmp_path)
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(shared_data / "tokenizers" / "gpt2" / f, tmp_path / f)
    backbone = from_hf(tmp_path, ["<|endoftext|>"])
    assert backbone.family == "gpt" and backbone.tokenizer.encode("Hello world!") == [15496, 995, 0]


# --- BERT -------------------------------------------------------------------------------------------

BERT = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=40,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def bert_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 99, (3, 17), generator=g)
    types = torch.zeros_like(ids)
    types[:, 9:] = 1
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # padded rows exercise the padding mask
    return ids, types, mask


def test_bert_for_pretraining_both_ways(tmp_path):
    torch.manual_seed(0)
    theirs = transformers.BertForPreTraining(transformers.BertConfig(**BERT)).eval()
    jiggle_(theirs)
    theirs.save_pretrained(tmp_path / "in")
    ours, head_sd = read(tmp_path / "in")
    heads = build_heads(ours.cfg)
    heads.load_state_dict(head_sd)
    ids, types, mask = bert_inputs()
    keep = mask.bool()
    with torch.no_grad():
        ref = theirs(input_ids=ids, token_type_ids=types, attention_mask=mask)
        hidden = ours(ids, types, mask)
        assert (heads["mlm"].logits(hidden, ours.lm_head_weight)[keep] - ref.prediction_logits[keep]).abs().max() < TOL
        assert (heads["nsp"](ours.pool(hidden)) - ref.seq_relationship_logits).abs().max() < TOL
        assert write(ours, head_sd, tmp_path / "out") == "BertForPreTraining"
        back = transformers.BertForPreTraining.from_pretrained(tmp_path / "out").eval()
        out = back(input_ids=ids, token_type_ids=types, attention_mask=mask)
        assert (out.prediction_logits[keep] - ref.prediction_logits[keep]).abs().max() < TOL


def test_bert_for_sequence_classification_both_ways(tmp_path):
    torch.manual_seed(1)
    theirs = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT, num_labels=3)).eval()
    jiggle_(theirs)
    theirs.save_pretrained(tmp_path / "in")
    ours, head_sd = read(tmp_path / "in")
    classifier = torch.nn.Linear(32, 3)
    classifier.load_state_dict({k[len("classifier.") :]: v for k, v in head_sd.items()})
    ids, types, mask = bert_inputs()
    with torch.no_grad():
        ref = theirs(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        assert (classifier(ours.pool(ours(ids, types, mask))) - ref).abs().max() < TOL
        assert write(ours, head_sd, tmp_path / "out", labels=["x", "y", "z"]) == "BertForSequenceClassification"
        back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "out").eval()
        assert back.config.id2label == {0: "x", 1: "y", 2: "z"}
        assert (back(input_ids=ids, token_type_ids=types, attention_mask=mask).logits - ref).abs().max() < TOL


def test_bert_model_alone_from_pytorch_model_bin(tmp_path, shared_data):
    torch.manual_seed(2)
    theirs = transformers.BertModel(transformers.BertConfig(**{**BERT, "vocab_size": 30522})).eval()
    theirs.config.save_pretrained(tmp_path)
    torch.save(theirs.state_dict(), tmp_path / "pytorch_model.bin")  # the older format, no 'bert.' prefix
    shutil.copy(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt", tmp_path / "vocab.txt")
    backbone = from_hf(tmp_path, SPECIAL_TOKENS)
    assert backbone.heads == {} and backbone.tokenizer.token_id("[CLS]") == 101
    ids, types, mask = bert_inputs()
    with torch.no_grad():
        ref = theirs(input_ids=ids, token_type_ids=types, attention_mask=mask).last_hidden_state
        assert (backbone.model.eval()(ids, types, mask) - ref)[mask.bool()].abs().max() < TOL


# --- T5 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v11", [False, True], ids=["t5-v1-relu-tied", "t5-v1.1-gated-untied"])
def test_t5_both_ways(tmp_path, v11):
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=101,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu" if v11 else "relu",
        tie_word_embeddings=not v11,
        dropout_rate=0.0,
    )
    theirs = transformers.T5ForConditionalGeneration(cfg).eval()
    jiggle_(theirs)
    theirs.save_pretrained(tmp_path / "in")
    ours, _ = read(tmp_path / "in")
    assert ours.cfg.feed_forward == ("gated-gelu" if v11 else "relu") and ours.cfg.tie_word_embeddings == (not v11)
    ids, dec = torch.randint(0, 101, (3, 30)), torch.randint(0, 101, (3, 25))  # past max_distance: log buckets
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[1, 22:] = 0
    with torch.no_grad():
        ref = theirs(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        assert (ours.logits(ours(ids, mask, dec)) - ref).abs().max() < TOL
        write(ours, {}, tmp_path / "out")
        back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
        assert (back(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits - ref).abs().max() < TOL


def test_t5_sharded_safetensors(tmp_path):
    torch.manual_seed(3)
    model = T5(T5Config(n_layer=2, n_head=2, d_model=32, d_ff=64, vocab_size=64)).eval()
    write(model, {}, tmp_path / "one")
    transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "one").save_pretrained(
        tmp_path / "sharded", max_shard_size="20KB"
    )
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    again, _ = read(tmp_path / "sharded")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


# --- ViT and ViT-MAE --------------------------------------------------------------------------------

TINY_MAE = dict(
    image_size=16,
    patch_size=4,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    decoder_hidden_size=32,
    decoder_num_hidden_layers=1,
    decoder_num_attention_heads=2,
    decoder_intermediate_size=64,
    layer_norm_eps=1e-12,
)


def compare_mae(enc, dec, theirs):
    cfg = enc.cfg
    x, noise = torch.randn(3, 3, cfg.image_size, cfg.image_size), torch.rand(3, cfg.n_patches)
    with torch.no_grad():
        out = theirs(pixel_values=x, noise=noise)
        ids_keep, ids_restore, mask = random_masking(noise, cfg.mask_ratio)
        pred = dec(enc.forward_features(x, ids_keep), ids_restore)
        loss, _ = mae.loss(enc, torch.nn.ModuleDict({"decoder": dec}), {"pixels": x, "noise": noise})
    assert torch.equal(mask, out.mask) and torch.equal(ids_restore, out.ids_restore)
    assert (pred - out.logits).abs().max() < TOL and abs(float(loss) - float(out.loss)) < TOL


@pytest.mark.parametrize("positions", ["sincos", "learned"])
def test_vit_mae_both_ways(tmp_path, positions):
    torch.manual_seed(1)
    theirs = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**TINY_MAE, norm_pix_loss=True)).eval()
    jiggle_(theirs)
    with torch.no_grad():
        if positions == "sincos":  # as in MAE checkpoints
            theirs.vit.embeddings.position_embeddings.copy_(sincos_2d(4, 32))
            theirs.decoder.decoder_pos_embed.copy_(sincos_2d(4, 32))
        else:  # anything else is kept as learned positions
            theirs.vit.embeddings.position_embeddings.normal_()
    theirs.save_pretrained(tmp_path / "in")
    enc, head_sd = read(tmp_path / "in")
    assert enc.cfg.pos_embed == positions and enc.cfg.norm_pix_loss
    dec = MAEDecoder(enc.cfg).eval()
    dec.load_state_dict({k[len("decoder.") :]: v for k, v in head_sd.items()})
    compare_mae(enc, dec, theirs)
    assert write(enc, head_sd, tmp_path / "out") == "ViTMAEForPreTraining"
    compare_mae(enc, dec, transformers.ViTMAEForPreTraining.from_pretrained(tmp_path / "out").eval())
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")
    assert processor.size == {"height": 16, "width": 16}


def test_vit_for_image_classification_both_ways(tmp_path):
    torch.manual_seed(2)
    theirs = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
            layer_norm_eps=1e-12,
        )
    ).eval()
    jiggle_(theirs)
    theirs.save_pretrained(tmp_path / "in")
    enc, head_sd = read(tmp_path / "in")
    head = torch.nn.Linear(32, 3)
    head.load_state_dict({k[len("classifier.") :]: v for k, v in head_sd.items()})
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = theirs(pixel_values=x).logits
        assert (head(ViT.pool(enc.forward_features(x), "cls")) - ref).abs().max() < TOL
        assert write(enc, head_sd, tmp_path / "out", labels="abc") == "ViTForImageClassification"
        back = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
        assert (back(pixel_values=x).logits - ref).abs().max() < TOL and back.config.id2label[2] == "c"


def test_mae_written_from_tfcli_with_sincos_positions(tmp_path):
    cfg = ViTConfig(
        **{
            k: v
            for k, v in dict(
                image_size=16,
                patch_size=4,
                n_layer=2,
                n_head=2,
                d_model=32,
                d_ff=64,
                decoder_d_model=32,
                decoder_n_layer=1,
                decoder_n_head=2,
                decoder_d_ff=64,
            ).items()
        }
    )
    torch.manual_seed(0)
    enc, dec = ViT(cfg).eval(), MAEDecoder(cfg).eval()
    jiggle_(enc), jiggle_(dec)
    write(enc, {f"decoder.{k}": v for k, v in dec.state_dict().items()}, tmp_path / "out")
    compare_mae(enc, dec, transformers.ViTMAEForPreTraining.from_pretrained(tmp_path / "out").eval())


# --- what is refused --------------------------------------------------------------------------------


def test_directory_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        hf.read_pretrained(tmp_path / "nothing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "hyena9"}))  # transformers has none either
    with pytest.raises(UserError, match="model_type 'hyena9' is not supported"):
        hf.read_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 1}))
    with pytest.raises(UserError, match="no model.safetensors, sharded safetensors or pytorch_model.bin"):
        hf.read_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        hf.read_pretrained(tmp_path)


def test_a_pickle_with_code_in_pytorch_model_bin_is_refused(tmp_path):
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 1, "n_embd": 4, "n_positions": 4, "vocab_size": 4})
    )
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Payload()}, f)
    with pytest.raises(UserError, match="refused or unreadable with weights_only=True"):
        hf.read_pretrained(tmp_path)


def test_export_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("")
    model = Bert(BertConfig(n_layer=1, n_head=2, d_model=8, vocab_size=10))
    with pytest.raises(UserError, match="not an empty directory"):
        write(model, {}, tmp_path / "x")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["file"]


def test_a_t5_spiece_model_tokenizes_as_transformers_does(tmp_path, shared_data):
    """A SentencePiece Unigram model (T5's spiece.model) read without a tokenizer.json: the same ids as
    transformers' T5 tokenizer, <extra_id_N> sentinels included."""
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "corpus.txt"
    text.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:100_000] + "\nNaïve café ﬁne.\n")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "spiece"),
        vocab_size=300,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        normalization_rule_name="nmt_nfkc",
        minloglevel=2,
    )
    d = tmp_path / "t5tok"
    d.mkdir()
    (tmp_path / "spiece.model").rename(d / "spiece.model")
    from tfcli.data.tokenizers import load_tokenizer_files
    from tfcli.objectives.span_corruption import SPECIAL_TOKENS

    ours = load_tokenizer_files(str(d), SPECIAL_TOKENS)
    theirs = transformers.T5Tokenizer.from_pretrained(d)  # converted from spiece.model by transformers
    assert ours.vocab_size == len(theirs) == 300 + 100
    for s in ["The cat sat.", "  two  spaces   here ", "Naïve café ﬁne <extra_id_0> and <extra_id_7>!", "ünïcödé 123"]:
        assert ours.encode(s) + [ours.eos_id] == theirs(s)["input_ids"], s
