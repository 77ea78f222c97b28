"""Bert against transformers: identical logits on tiny random configs, both mapping directions."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli import recipe as recipes
from tfcli.hf import bert as hf_bert
from tfcli.models import build_model
from tfcli.models.bert import Bert, BertConfig
from tfcli.objectives.mlm_nsp import build_heads

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=40, type_vocab_size=2, hidden_act="gelu", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 99, (3, 17), generator=g)
    types = torch.zeros_like(ids)
    types[:, 9:] = 1
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # padded rows exercise the padding mask
    mask[2, 5:] = 0
    return ids, types, mask


def _ours_from(hf_model, heads_nsp=True):
    cfg = hf_bert.config_from_hf(TINY)
    model = Bert(cfg).eval()
    model_sd, heads_sd = hf_bert.from_hf(hf_model.state_dict(), cfg.n_layer)
    model.load_state_dict(model_sd)
    return cfg, model, heads_sd


def test_pretraining_logits_match_transformers():
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**TINY)).eval()
    with torch.no_grad():
        hf.cls.predictions.bias.normal_()  # a non-zero output bias must survive the mapping
    cfg, model, heads_sd = _ours_from(hf)
    heads = build_heads(cfg)
    heads.load_state_dict(heads_sd)
    ids, types, mask = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        hidden = model(ids, types, mask)
        mlm = heads["mlm"].logits(hidden, model.lm_head_weight)
        nsp = heads["nsp"](model.pool(hidden))
    keep = mask.bool()
    assert (mlm[keep] - ref.prediction_logits[keep]).abs().max() < 1e-4
    assert (nsp - ref.seq_relationship_logits).abs().max() < 1e-4


def test_sequence_classification_logits_match_and_round_trip():
    torch.manual_seed(1)
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**TINY, num_labels=3)).eval()
    cfg, model, heads_sd = _ours_from(hf)
    classifier = torch.nn.Linear(cfg.d_model, 3)
    classifier.load_state_dict({k[len("classifier."):]: v for k, v in heads_sd.items()})
    ids, types, mask = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        ours = classifier(model.pool(model(ids, types, mask)))
    assert (ours - ref).abs().max() < 1e-4
    back = hf_bert.to_hf(model.state_dict(), heads_sd, cfg.n_layer)
    theirs = hf.state_dict()
    assert set(back) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(back[k], v), k


def test_all_layers_and_padding_do_not_leak():
    cfg = BertConfig(n_layer=2, n_head=2, d_model=32, vocab_size=50, dropout=0.0)
    model = Bert(cfg).eval()
    ids = torch.randint(5, 50, (1, 10))
    mask = torch.ones_like(ids)
    mask[:, 6:] = 0
    with torch.no_grad():
        layers = model(ids, attention_mask=mask, all_layers=True)
        other = ids.clone()
        other[:, 6:] = 7  # changing padded tokens must not change real positions
        again = model(other, attention_mask=mask)
    assert len(layers) == 2 and layers[-1].shape == (1, 10, 32)
    assert torch.allclose(layers[-1][:, :6], again[:, :6], atol=1e-6)


def test_bert_base_recipe_has_paper_size():
    rec = recipes.load("bert-base")
    rec.model.vocab_size = 30522
    n = sum(p.numel() for p in build_model(rec.model).parameters())
    assert abs(n - 110e6) / 110e6 < 0.02, n


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="divisible"):
        BertConfig(d_model=30, n_head=4)


def test_hugging_face_dir_with_pytorch_model_bin_loads_with_its_heads(tmp_path):
    torch.manual_seed(2)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**TINY)).eval()
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # the older checkpoint format
    cfg, model_sd, heads_sd, _ = hf_bert.read_hf_dir(tmp_path)
    assert (cfg.n_layer, cfg.d_model, cfg.vocab_size) == (2, 32, 99)
    model = Bert(cfg).eval()
    model.load_state_dict(model_sd)
    assert {"mlm.dense.weight", "mlm.norm.weight", "mlm.bias", "nsp.weight"} <= set(heads_sd)
    ids, types, mask = _inputs()
    with torch.no_grad():
        ref = hf.bert(input_ids=ids, token_type_ids=types, attention_mask=mask).last_hidden_state
        ours = model(ids, types, mask)
    assert (ours - ref)[mask.bool()].abs().max() < 1e-4


def test_a_directory_without_weights_is_a_user_error(tmp_path):
    from tfcli.errors import UserError

    (tmp_path / "config.json").write_text('{"model_type": "bert", "num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"hidden_size": 8, "intermediate_size": 16, "vocab_size": 10}')
    with pytest.raises(UserError, match="no model.safetensors or pytorch_model.bin"):
        hf_bert.read_hf_dir(tmp_path)
