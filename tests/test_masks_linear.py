"""Attention whose memory follows what tokens see (docs/long-sequences.md): no rank allocates an L x L tensor (or,
under sequence parallelism over sp ranks, one of L x L / (2 sp) elements) for padding or packed documents, forward or
backward, at a length where such a tensor would be the largest by far. The control: an unmasked row; then padded
rows and packed documents, at a world of one (``Kernels(attention="blocks")``) and under ring attention."""

from __future__ import annotations

import pytest

import mask_tasks

LENGTH = 2048


@pytest.mark.parametrize("sp,sequence", [(1, False), (4, "ring")])
def test_an_unmasked_row_allocates_nothing_quadratic(pool, sp, sequence):
    """The probe's control: with neither padding nor documents the attention runs fused (no scores, no mask)."""
    found = pool.run(mask_tasks.square_tensors, LENGTH, sp, sequence)
    assert not any(found), found[0]


@pytest.mark.parametrize("masking", [{"padding": 0.1}, {"documents": 8}], ids=["padding", "documents"])
@pytest.mark.parametrize("sp,sequence,attention", [(1, False, "blocks"), (4, "ring", None)], ids=["blocks", "ring"])
def test_a_masked_row_allocates_nothing_quadratic(pool, sp, sequence, attention, masking):
    found = pool.run(mask_tasks.square_tensors, LENGTH, sp, sequence, attention=attention, **masking)
    assert not any(found), found[0]


def test_the_probe_sees_a_dense_mask(pool):
    """The probe can fail: a padded row under plain SDPA builds transformers' [1, 1, L, L] mask."""
    found = pool.run(mask_tasks.square_tensors, LENGTH, 1, False, padding=0.1)
    assert any(shape[-2:] == (LENGTH, LENGTH) for _, shape in found[0]), found[0]
