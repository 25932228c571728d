"""Attention whose memory follows what tokens see (docs/long-sequences.md): no rank allocates an L x L tensor (or,
under sequence parallelism over sp ranks, one of L x L / (2 sp) elements) for padding or packed documents, forward or
backward, at a length where such a tensor would be the largest by far. Rows without a mask pass today; the masked
ones are strict xfails that each step of carrying masks as lengths and document ids turns into passes."""

from __future__ import annotations

import pytest

import mask_tasks

LENGTH = 2048
DENSE = "masks are still expanded to L x L (transformers' sdpa_mask, documents.document_mask, the ring's mask rows)"


@pytest.mark.parametrize("sp,sequence", [(1, False), (4, "ring")])
def test_an_unmasked_row_allocates_nothing_quadratic(pool, sp, sequence):
    """The probe's control: with neither padding nor documents the attention runs fused (no scores, no mask)."""
    found = pool.run(mask_tasks.square_tensors, LENGTH, sp, sequence)
    assert not any(found), found[0]


@pytest.mark.xfail(strict=True, reason=DENSE)
@pytest.mark.parametrize("sp,sequence,masking", [(1, False, {"padding": 0.1}), (4, "ring", {"padding": 0.1}),
                                                 (4, "ring", {"documents": 8})])
def test_a_masked_row_allocates_nothing_quadratic(pool, sp, sequence, masking):
    found = pool.run(mask_tasks.square_tensors, LENGTH, sp, sequence, **masking)
    assert not any(found), found[0]
