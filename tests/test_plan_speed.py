"""What makes the layout search fast changes none of its answers: the meta kernels remembered
(shardlib.analysis.meta_kernels) against the kernels run every time, worker processes dry-running the layer tables
against one process, and a table's dry runs independent of what the process ran before. The search's time itself is
a benchmark figure (docs/planning.md, "The search"), not a test."""

from __future__ import annotations

import torch
from transformers import BertConfig, T5Config

from shardlib.analysis import meta_kernels
from shardlib.kernels import ring_geometry
from shardlib.analysis.layertable import LayerTable
from shardlib.analysis.metarun import meta_model, planned_policy
from shardlib.analysis.search import search

SEQ = 64


def _bert() -> BertConfig:  # 2 heads: rings from sp 4 on, Ulysses x ring at ulysses 2
    return BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      max_position_embeddings=SEQ, architectures=["BertForMaskedLM"])


def _t5() -> T5Config:  # the ring's relative bias per distance: explicit-math pieces, in-place index clamps
    return T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=8,
                    architectures=["T5ForConditionalGeneration"])


def _answer(**options) -> dict:
    """BERT's search of 4 ranks under a budget about half of its layouts miss (so checkpointed twins are priced
    too), as JSON less its own time."""
    result = search(_bert(), 4, global_batch=8, seq=SEQ, ulysses=True, memory_bytes=580_000, **options)
    return {k: v for k, v in result.to_dict().items() if k != "seconds"}


def _t5_ring(checkpointing: bool = True) -> list:
    """The counts of a T5 layer table at Ulysses x ring 2 x 2 (the ring's relative bias per distance: explicit-math
    pieces, in-place clamps, index gathers), per microbatch size and root."""
    full = meta_model(_t5())
    table = LayerTable(full, planned_policy(full, None), tp=1, sp=4, mode="ring", mode_name="ring",
                       activation_checkpointing=checkpointing, seq=SEQ, ulysses=2)
    return [(run.memory, {root: (r.work.gemms, r.work.traffic, r.work.ops, r.work.saved, r.ring.gemms, r.collectives)
                          for root, r in run.by_root.items()}) for run in table.runs]


def test_remembered_meta_kernels_give_the_kernels_answers(monkeypatch):
    """Every op on meta tensors run by its kernel (SHARDLIB_PLAN_META_CACHE=0) or answered from memory: the same
    ranked, over-budget and refused layouts, every prediction equal (BERT: rings, Ulysses x ring, pipelines, ZeRO,
    checkpointing), and the same counts of a checkpointed T5 Ulysses x ring table."""
    remembered, t5 = _answer(), _t5_ring()
    assert remembered["ranked"] and remembered["over_budget"] and remembered["dominated"]
    assert any(p["layout"].get("ulysses", 1) > 1 for p in remembered["ranked"] + remembered["over_budget"])
    monkeypatch.setenv("SHARDLIB_PLAN_META_CACHE", "0")
    assert _answer() == remembered
    assert _t5_ring() == t5


def test_worker_processes_give_one_processs_answer():
    """Two forked workers dry-running the layer tables: the answer of one process, to the byte."""
    assert _answer(workers=2) == _answer()


def test_a_tables_dry_runs_do_not_depend_on_what_ran_before():
    """A ring table built twice in one process counts the same both times: the ring's zigzag indices, cached for the
    process by the kernel, are built (and counted) in every dry run, not only in the first of the process."""
    ring_geometry._zigzag.cache_clear()  # as in a fresh process
    assert _t5_ring(checkpointing=False) == _t5_ring(checkpointing=False)


def test_a_remembered_op_is_remade_as_its_kernel_makes_it():
    """Outputs from memory have the kernel's shape, stride, offset, dtype and storage size, in place ops return
    their argument, and an op whose output aliases its input (``_unsafe_view``) is never remembered."""
    a = torch.empty(3, 5, device="meta").t()
    b = torch.empty(5, 3, device="meta")
    for func, args in ((torch.ops.aten.add.Tensor, (a, b)), (torch.ops.aten.mul.Tensor, (a, 2.0)),
                       (torch.ops.aten.native_layer_norm.default, (b, [3], None, None, 1e-5)),
                       (torch.ops.aten.index.Tensor, (b, [torch.zeros(4, dtype=torch.long, device="meta")]))):
        first, again = (meta_kernels.run(func, args, {}) for _ in range(2))
        for x, y in zip(*((o if isinstance(o, tuple) else (o,)) for o in (first, again))):
            assert (x.shape, x.stride(), x.storage_offset(), x.dtype, x.untyped_storage().nbytes()) == \
                (y.shape, y.stride(), y.storage_offset(), y.dtype, y.untyped_storage().nbytes())
            assert x.untyped_storage()._cdata != y.untyped_storage()._cdata
    c = torch.empty(4, device="meta")
    assert meta_kernels.run(torch.ops.aten.clamp_.default, (c, 0, 1), {}) is c
    assert meta_kernels.run(torch.ops.aten.clamp_.default, (c, 0, 1), {}) is c
    meta_kernels.run(torch.ops.aten._unsafe_view.default, (c, [2, 2]), {})
    assert meta_kernels._kind(torch.ops.aten._unsafe_view.default) is None
