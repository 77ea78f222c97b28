"""Bert on its own: padding never leaks, the published size, shape checks (parity: test_hf)."""

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.models import build_model
from tfcli.models.bert import Bert, BertConfig


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
    assert len(layers) == 3 and layers[-1].shape == (1, 10, 32)  # the embeddings, then each block
    assert torch.allclose(layers[-1][:, :6], again[:, :6], atol=1e-6)


@pytest.mark.slow
def test_bert_base_recipe_has_paper_size():
    cfg = recipes.replace(recipes.load("bert-base").model, vocab_size=30522)
    n = sum(p.numel() for p in build_model(cfg).parameters())
    assert abs(n - 110e6) / 110e6 < 0.02, n


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="divisible"):
        BertConfig(d_model=30, n_head=4)
