"""The global sample order of ``fit`` (shardlib.train.data): a function of the seed and the epoch only; each
data-parallel rank reads its contiguous share of every global batch; training drops the last partial batch,
evaluation keeps it and counts every sample once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from shardlib.train.data import EpochData, GlobalBatchSampler, dp_share, epoch_order


class _Mesh:
    def __init__(self, dp: int, rank: int):
        self.dp, self.rank = dp, rank

    def local_rank(self, dim):
        return self.rank


def _global_batches(length, batch, dp, seed, epoch, drop_last, start=0):
    """Every global batch of an epoch, as the concatenation of the dp ranks' shares."""
    shares = []
    for rank in range(dp):
        sampler = GlobalBatchSampler(length, batch, dp, rank, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch, start)
        shares.append(list(sampler))
    return shares


@given(length=st.integers(1, 60), batch=st.integers(1, 16), dp=st.sampled_from([1, 2, 3, 4]),
       seed=st.integers(0, 3), epoch=st.integers(0, 3), drop_last=st.booleans())
def test_global_batches_do_not_depend_on_dp(length, batch, dp, seed, epoch, drop_last):
    order = epoch_order(length, seed, epoch).tolist()
    full, rest = divmod(length, batch)
    expected = [order[b * batch:(b + 1) * batch] for b in range(full + (1 if rest and not drop_last else 0))]
    shares = _global_batches(length, batch, dp, seed, epoch, drop_last)
    rebuilt = []
    for b, global_batch in enumerate(expected):
        parts = [dp_share(len(global_batch), dp, r) for r in range(dp)]
        assert [len(p) for p in parts] == sorted((len(p) for p in parts), reverse=True)  # even, then one fewer
        # a rank with an empty share of the tail yields nothing for it, so index the shares by batch
        rebuilt.append(sum((shares[r][b] for r in range(dp) if len(parts[r])), []))
    assert rebuilt == expected
    seen = sorted(i for g in rebuilt for i in g)
    assert seen == (sorted(order[:full * batch]) if drop_last else sorted(order))  # no sample twice, none added


def test_order_is_a_function_of_seed_and_epoch():
    assert torch.equal(epoch_order(50, 1, 2), epoch_order(50, 1, 2))
    assert not torch.equal(epoch_order(50, 1, 2), epoch_order(50, 1, 3))
    assert not torch.equal(epoch_order(50, 1, 2), epoch_order(50, 2, 2))
    assert torch.equal(epoch_order(7, 0, 0, shuffle=False), torch.arange(7))


def test_resume_mid_epoch_continues_with_the_same_batches():
    full = _global_batches(40, 8, 2, seed=3, epoch=1, drop_last=True)
    later = _global_batches(40, 8, 2, seed=3, epoch=1, drop_last=True, start=2)
    assert [s[2:] for s in full] == later


def _items(n):
    return [{"x": torch.tensor([i]), "labels": torch.tensor(i)} for i in range(n)]


def _iterable(n):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_items(n))
    return Stream()


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_shares_follow_the_stream(workers):
    """An iterable is read in its own order: rank r collates its share of each run of batch_size items (worker w
    of W takes global batches w, w + W, ...; the loader interleaves them back in order)."""
    for dp in (1, 2):
        got = []
        for rank in range(dp):
            data = EpochData(_iterable(21), 4, _Mesh(dp, rank), num_workers=workers, drop_last=True)
            got.append([b["x"].flatten().tolist() for b in data.batches(0, start=1)])
        rebuilt = [sum((got[r][b] for r in range(dp)), []) for b in range(len(got[0]))]
        assert rebuilt == [list(range(4 * b, 4 * b + 4)) for b in range(1, 5)], (dp, workers, rebuilt)


def test_map_dataset_loader_and_bad_data():
    data = EpochData(_items(10), 4, _Mesh(2, 1), seed=0)
    batches = list(data.batches(0))
    assert data.steps_per_epoch() == 2 and [len(b["x"]) for b in batches] == [2, 2]
    assert sorted(set(torch.cat([b["labels"] for b in batches]).tolist())) == sorted(
        epoch_order(10, 0, 0)[[2, 3, 6, 7]].tolist())
    with pytest.raises(ValueError, match="train_data is empty"):
        EpochData([], 4, _Mesh(1, 0))
    with pytest.raises(ValueError, match="train_data has 3 samples, fewer than one global batch of 4"):
        EpochData(_items(3), 4, _Mesh(1, 0))
    tuples = EpochData([(torch.tensor(1), torch.tensor(2))] * 4, 2, _Mesh(1, 0))
    with pytest.raises(TypeError, match="a batch must be a dict of tensors"):
        next(tuples.batches(0))
