"""The one sampler: epochs, exact resume, the global batch sliced per rank, per-example randomness
that does not depend on the number of processes, length grouping, fixed held-out batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfcli.data.image_batches import ImageSource, ImageTransform
from tfcli.data.images import ImageSet
from tfcli.data.packing import BlockSource, WindowSource
from tfcli.data.sampler import PaddingBatch, Sampler, grouped_order, sequential_batches
from tfcli.objectives.mlm_nsp import Masker, PairSource

IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def pair_source(seed=0) -> PairSource:
    """MLM+NSP pairs from a store of 40 documents of random sentences, masked per example."""
    from types import SimpleNamespace

    from tfcli.data.segments import Corpus

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 15, size=400)  # 400 sentences, 10 to a document
    tokens = rng.integers(5, 300, size=int(lengths.sum())).astype(np.uint16)
    fake = SimpleNamespace(tokens=tokens, sent_ends=np.cumsum(lengths), doc_sents=np.arange(10, 401, 10), n_docs=40)
    return PairSource(Corpus(fake, 0, 40), 30, True, 0.1, IDS, Masker(4, [0, 1, 2, 3, 4], 300), seed)


def images() -> ImageSource:
    data = ImageSet(np.random.default_rng(0).integers(0, 256, (10, 12, 12, 3), dtype=np.uint8), np.arange(10))
    return ImageSource(data, ImageTransform(8, (0.5,) * 3, (0.2,) * 3, train=True), noise_patches=4)


SOURCES = {
    "blocks": lambda: BlockSource(np.arange(5_000), 16, seed=1),
    "windows": lambda: WindowSource(np.arange(5_000), 16),
    "mlm": pair_source,
    "images": images,
}


def test_blocks_are_contiguous_with_shifted_targets_and_cover_an_epoch_once():
    source = BlockSource(np.arange(10_000), 16, seed=0)
    sampler = Sampler(source, batch_size=8, seed=0)
    n = source.epoch_size(0)
    starts = []
    for _ in range(n // 8):
        b = sampler.next_batch()
        assert b["input_ids"].shape == (8, 16)
        assert np.array_equal(b["targets"].numpy(), b["input_ids"].numpy() + 1)
        assert np.all(np.diff(b["input_ids"].numpy(), axis=1) == 1)
        starts += b["input_ids"][:, 0].tolist()
    assert len(set(starts)) == len(starts)  # no block twice within an epoch
    assert all((s - source.offset(0)) % 16 == 0 for s in starts)
    assert len({source.offset(e) for e in range(10)}) > 1  # later epochs shift the block grid


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_resume_continues_exactly_and_ranks_split_the_global_batch(kind):
    a = Sampler(SOURCES[kind](), batch_size=6, seed=1)
    for _ in range(40):  # past an epoch boundary for every source but the long block stream
        a.next_batch()
    b = Sampler(SOURCES[kind](), batch_size=6, seed=1)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        x, y = a.next_batch(), b.next_batch()
        assert all(torch.equal(x[k], y[k]) for k in x)
    # two processes at batch 3 see exactly the single process's batch of 6, randomness included
    whole = Sampler(SOURCES[kind](), 6, seed=1).next_batch()
    halves = [Sampler(SOURCES[kind](), 3, seed=1, rank=r, world_size=2).next_batch() for r in range(2)]
    for k in whole:
        if whole[k].dim() > 1 and kind == "mlm":  # rows padded to their own batch's longest
            whole_rows = [row[row != 0] for row in whole[k]] if k == "input_ids" else None
            if whole_rows is not None:
                half_rows = [row[row != 0] for h in halves for row in h[k]]
                assert all(torch.equal(p, q) for p, q in zip(whole_rows, half_rows))
            continue
        assert torch.equal(torch.cat([h[k] for h in halves]), whole[k]), k


def test_epochs_are_new_orders_and_draws_of_the_same_data():
    s = Sampler(images(), batch_size=5, seed=3)
    first = torch.cat([s.next_batch()["labels"] for _ in range(2)])
    second = torch.cat([s.next_batch()["labels"] for _ in range(2)])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist()
    assert s.state_dict() == {"epoch": 1, "index": 10}  # the next epoch begins at the next draw


def test_a_batch_spanning_two_epochs_takes_the_rest_of_one_and_the_start_of_the_next():
    s = Sampler(images(), batch_size=4, seed=0)
    labels = [s.next_batch()["labels"].tolist() for _ in range(5)]  # 20 examples = 2 epochs of 10
    flat = sum(labels, [])
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10))


def test_grouped_order_makes_batches_of_similar_length():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=1003)
    order = grouped_order(lengths, np.random.default_rng(1), batch=8, group=10)
    assert sorted(order.tolist()) == list(range(1003))
    batches = order[:1000].reshape(-1, 8)
    spread = np.mean([lengths[b].max() - lengths[b].min() for b in batches])
    random_spread = np.mean([np.ptp(lengths[rng.permutation(1003)[:8]]) for _ in range(200)])
    assert spread < random_spread / 3  # ~8/80 of the range within a mega-batch of 80, against all of it


def test_held_out_batches_cover_every_example_once_the_same_every_time():
    source = images()
    a, b = list(sequential_batches(source, 3, seed=0)), list(sequential_batches(source, 3, seed=0))
    assert [x["labels"].tolist() for x in a] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert all(torch.equal(x["noise"], y["noise"]) and torch.equal(x["pixels"], y["pixels"]) for x, y in zip(a, b))
    assert len(list(sequential_batches(source, 3, seed=0, max_batches=2))) == 2
    ranks = [list(sequential_batches(source, 2, seed=0, rank=r, world_size=2)) for r in range(2)]
    counted = [x for r in ranks for x in r if not isinstance(x, PaddingBatch)]
    assert sorted(sum((x["labels"].tolist() for x in counted), [])) == list(range(10))
    # every rank runs as many batches (under FSDP each forward is a collective); rank 1's last pads
    assert [len(r) for r in ranks] == [3, 3] and isinstance(ranks[1][-1], PaddingBatch)


def test_masking_statistics_over_a_large_sample():
    masker = Masker(mask_id=4, special_ids=[0, 1, 2, 3, 4], vocab_size=1000)
    rng = np.random.default_rng(1)
    chosen = swapped = kept = masked = candidates = 0
    for _ in range(400):
        row = rng.integers(5, 1000, size=120)
        row[[0, 60, 119]] = [2, 3, 3]  # [CLS] .. [SEP] .. [SEP]
        out, labels = masker(row, rng)
        pick = labels != -100
        assert not pick[[0, 60, 119]].any(), "a special token was chosen"
        assert np.array_equal(labels[pick], row[pick]) and np.array_equal(out[~pick], row[~pick])
        assert not np.isin(out[pick & (out != 4)], [0, 1, 2, 3]).any()
        candidates += 117
        chosen += pick.sum()
        masked += (out[pick] == 4).sum()
        kept += (out[pick] == row[pick]).sum()
    swapped = chosen - masked - kept
    assert abs(chosen / candidates - 0.15) < 0.005
    assert abs(masked / chosen - 0.8) < 0.02 and abs(kept / chosen - 0.1) < 0.02 and abs(swapped / chosen - 0.1) < 0.02
    electra = Masker(4, [0, 1, 2, 3, 4], 1000, replace=(0.85, 0.0))
    row = rng.integers(5, 1000, size=2000)
    out, labels = electra(row, rng)
    pick = labels != -100
    assert abs((out[pick] == 4).mean() - 0.85) < 0.04 and ((out[pick] == 4) | (out[pick] == row[pick])).all()
