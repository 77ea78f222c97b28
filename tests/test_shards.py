"""Sharded checkpoints (engine/shards.py) in one process: weights and optimizer states round-trip
through DCP's safetensors storage, a parameter that never had a gradient keeps no state, the files
hold no pickle, and a damaged shard is one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tfcli.engine import shards
from tfcli.errors import UserError


def trained_pair(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model[:3](torch.randn(5, 8)).pow(2).mean().backward()  # the last layer never gets a gradient
        opt.step()
        opt.zero_grad()
    return model, opt


def test_weights_and_optimizer_states_round_trip(tmp_path):
    model, opt = trained_pair(0)
    groups = shards.save(tmp_path, model, opt, None)
    files = list((tmp_path / shards.SHARDS).glob("*.safetensors"))
    assert files and not list((tmp_path / shards.SHARDS).glob(".metadata*"))  # safetensors only
    fresh, fresh_opt = trained_pair(1)
    fresh_opt.state.clear()
    shards.load(tmp_path, fresh, fresh_opt, groups, None)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert set(opt.state.get(p, {})) == set(fresh_opt.state.get(q, {}))  # none for the unused layer
        for key in opt.state.get(p, {}):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    whole = shards.consolidated(tmp_path)
    assert sorted(whole) == sorted(model.state_dict()) and torch.equal(whole["0.weight"], model[0].weight)


def test_a_damaged_shard_is_one_line(tmp_path):
    model, opt = trained_pair(0)
    shards.save(tmp_path, model, opt, None)
    file = next((tmp_path / shards.SHARDS).glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[:20])
    with pytest.raises(UserError, match=r"shards: unreadable"):
        shards.sizes(tmp_path)
