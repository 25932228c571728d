"""Ulysses x ring (``shard(..., sequence_parallel="ring", ulysses=N)``) and packed documents in the planner: the dry
run records the Ulysses group's all-to-alls and a ring over sp / N positions; the search lists Ulysses x ring
layouts where the heads allow them and says why not elsewhere, names them as ``--sp ring N --ulysses U`` asks for
them, and one it proposes trains on gloo ranks; ``shardlib plan --sp ring N --ulysses U``; rows packed with documents
cost ring attention seq x (mean document length) of its FLOPs, not seq^2. That the dry run's activation term equals
what a real Ulysses x ring step saves is tests/test_search.py's (bert-ulysses)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from transformers import BertConfig

import plan_tasks
import shardlib
from rank_tasks import cases
from shardlib import cli
from shardlib.analysis.layout import Layout
from shardlib.analysis.profile import LinkFit, default_profile
from shardlib.analysis.search import packed_attention, price, search

B, H, D = 2, 2, 8  # microbatch, heads (sp=4 cannot split them: all-to-all is refused), head dim


def _bert(seq: int = 16, layers: int = 2) -> BertConfig:
    return BertConfig(vocab_size=64, hidden_size=H * D, num_hidden_layers=layers, num_attention_heads=H,
                      intermediate_size=32, max_position_embeddings=seq, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, architectures=["BertForMaskedLM"])


def test_the_dry_run_records_the_ulysses_group_and_a_shorter_ring():
    """sp=4 as 2 x 2: per layer the Ulysses group (2 ranks) exchanges q, k and v for heads, and the output back
    (backward: the same, reversed); the ring has 2 positions: forward 1 send of the K/V block (its 1/2 of the heads
    over the position's 2 chunks: the plain ring's block size), backward 1 + 2 of dK/dV. The blocks' FLOPs are the
    plain ring's in half as many calls twice the size, and the saved activations and peak are the plain ring's."""
    L = 16
    ring, ulysses = (shardlib.plan(_bert(), sp=4, sequence_parallel="ring", ulysses=u, batch=B, seq=L) for u in (1, 2))
    assert ulysses.mesh == {"dp": 1, "pp": 1, "sp": 4, "tp": 1, "ulysses": 2} and ulysses.sequence_parallel == "ring"
    assert "Ulysses x ring: 2 ranks per position x 2 ring positions" in str(ulysses)
    qkv, block = 3 * B * (L // 4) * H * D * 4, 2 * B * (H // 2) * (L // 2) * D * 4
    assert block == 2 * B * H * (L // 4) * D * 4
    for layer in range(2):
        entry, work = ulysses.stages[0].collectives[layer], ulysses.stages[0].work[layer]
        attention = [(c.op, c.phase, c.bytes, c.group_size) for c in entry.collectives
                     if c.module.endswith("attention.self")]
        assert attention == [
            ("all_to_all_single", "forward", qkv, 2), ("send_recv", "forward", block, 2),
            ("all_to_all_single", "forward", qkv // 3, 2), ("all_to_all_single", "backward", qkv // 3, 2),
            *[("send_recv", "backward", block, 2)] * 3, ("all_to_all_single", "backward", qkv, 2)]
        plain = ring.stages[0].work[layer]
        assert sum(f * n for f, n in work.ring) == sum(f * n for f, n in plain.ring) == 14 * B * H * L * L * D // 4
        assert sum(n for _, n in work.ring) * 2 == sum(n for _, n in plain.ring)
        assert work.saved == plain.saved
    assert ulysses.stages[0].memory.activation_bytes == ring.stages[0].memory.activation_bytes
    assert ulysses.stages[0].memory.peak_bytes == ring.stages[0].memory.peak_bytes


def test_the_search_lists_ulysses_by_ring_where_the_heads_allow_it():
    """2 heads on 8 ranks: all-to-all splits them at tp x sp = 2 only, so rings are searched at sp 4 and 8; Ulysses x
    ring at ulysses 2 (tp 1: 1 x 2 divides the heads) over rings of 2 and 4 positions, priced with the group's
    all-to-all and the ring's transfers; refused with shard()'s reason where tp x ulysses does not divide the heads,
    and with the search's where all-to-all splits them. Without ``ulysses=True`` (``--layout auto``'s search) none."""
    config = _bert(seq=64)
    result = search(config, 8, global_batch=8, seq=64, checkpointing=(False,), ulysses=True)
    found = {(p.layout.tp, p.layout.sp, p.layout.ulysses) for p in result.ranked if p.layout.ulysses > 1}
    assert found == {(1, 4, 2), (1, 8, 2)}
    named = next(p for p in result.ranked if p.layout.ulysses > 1)
    assert f"sp{named.layout.sp}-ring ulysses2" in named.layout.name()
    assert {"sp all_to_all_single", "sp ring send_recv"} <= set(named.time)
    refused = dict(result.refused)
    assert "is not divisible by tp(1) * ulysses(4) = 4" in refused["dp1 pp1 tp1 sp8-ring ulysses4"]
    assert "is not divisible by tp(2) * ulysses(2) = 4" in refused["dp1 pp1 tp2 sp4-ring ulysses2"]
    assert refused["dp4 pp1 tp1 sp2-ring"].startswith("all-to-all splits the heads at tp=1 x sp=2")
    plain = search(config, 8, global_batch=8, seq=64, checkpointing=(False,))
    assert not any(p.layout.ulysses > 1 for p in plain.ranked + plain.over_budget)
    assert not any("ulysses" in what for what, _ in plain.refused)


def test_a_ulysses_layout_the_search_proposes_trains(pool):
    """The search's Ulysses x ring layout of 4 ranks (2 heads: all-to-all refused at sp=4) is one shard() builds
    and the Trainer steps: one step on 4 gloo ranks, its loss finite on every rank."""
    spec = {"family": "bert", "cls": "BertForMaskedLM", "seq": 16, "seed": 3,
            "config": {"heads": 2, "head_dim": 4, "layers": 2, "intermediate": 16, "vocab": 41}}
    model = cases(spec).make_model(spec)
    result = search(model, 4, global_batch=4, seq=16, checkpointing=(False,), ulysses=True)
    layout = next(p.layout for p in result.ranked if p.layout.ulysses > 1)
    assert (layout.dp, layout.pp, layout.tp, layout.sp, layout.ulysses) == (1, 1, 1, 4, 2)
    run = {**spec, "layout": {"dp": 1, "pp": 1, "tp": 1, "sp": 4}, "shard": layout.shard_options(),
           "trainer": {"microbatches": layout.microbatches}, "batch": layout.batch}
    assert run["shard"] == {"sequence_parallel": "ring", "ulysses": 2}
    for rank in pool.run(plan_tasks.step_layout, run):
        assert math.isfinite(rank["loss"]), rank


def test_layouts_and_the_cli_know_ulysses(tmp_path, capsys):
    """``Layout`` names Ulysses x ring as ``--sp ring N --ulysses U`` asks for it and hands shard() ``ulysses`` (JSON
    and the Trainer's arguments carry it only where set); ``shardlib plan --sp ring 4 --ulysses 2`` dry-runs and prices
    it; ``--ulysses`` without a ring is shard()'s refusal (exit 2), with ``--world`` bad input (the search enumerates
    it), as is ``--jobs 0``."""
    layout = Layout(sp=8, sequence_parallel="ring", ulysses=2)
    assert layout.name() == "dp1 pp1 tp1 sp8-ring ulysses2 zero0 mb1"
    assert layout.shard_options() == {"sequence_parallel": "ring", "ulysses": 2}
    assert layout.to_dict()["ulysses"] == 2 and layout.training_args()["ulysses"] == 2
    plain = replace(layout, ulysses=1)
    assert "ulysses" not in plain.to_dict() and "ulysses" not in plain.training_args()
    assert plain.shard_options() == {"sequence_parallel": "ring"}
    _bert().save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--sp", "ring", "4", "--ulysses", "2", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "(Ulysses x ring: 2 ranks per position x 2 ring positions)" in out
    assert "predicted for dp1 pp1 tp1 sp4-ring ulysses2 zero0 mb1" in out and "sp all_to_all_single" in out, out
    assert cli.main(["plan", str(tmp_path), "--sp", "all_to_all", "2", "--ulysses", "2", "--seq", "16"]) == 2
    assert "ulysses=2 applies to sequence_parallel='ring'" in capsys.readouterr().err
    assert cli.main(["plan", str(tmp_path), "--world", "8", "--ulysses", "2"]) == 1
    assert "enumerates ep (dropless) and Ulysses x ring itself" in capsys.readouterr().err
    assert cli.main(["plan", str(tmp_path), "--world", "4", "--jobs", "0"]) == 1
    assert "--jobs must be >= 1, got 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ packed rows
def test_packed_documents_cost_ring_attention_their_own_squares():
    """``packed_attention``: every call of the ring's blocks at mean document length / seq of its FLOPs (the
    documents of a row against themselves: seq x d, not seq^2), in ``gemms`` too; every other GEMM, the transfers and
    the memory as they were."""
    L = 64
    report = shardlib.plan(_bert(seq=L), sp=4, sequence_parallel="ring", batch=B, seq=L)
    packed = packed_attention(report, 0.25)
    for before, after in zip(report.stages[0].work, packed.stages[0].work):
        ring = sum(f * n for f, n in before.ring)
        assert sum(f * n for f, n in after.ring) == pytest.approx(ring / 4, rel=1e-6)
        assert after.flops == pytest.approx(before.flops - ring * 3 / 4, rel=1e-9)
        assert (after.traffic, after.saved, after.ops) == (before.traffic, before.saved, before.ops)
    assert packed.stages[0].collectives == report.stages[0].collectives
    assert packed.stages[0].memory == report.stages[0].memory
    assert packed_attention(report, 1.0) == report


def test_packing_lowers_the_ring_layouts_attention_time_only():
    """Rows of 256 tokens packed with documents of 32 on average: the search's ring layouts (Ulysses x ring too)
    compute 1/8 of their attention, so on a machine whose links hide the ring's transfers they are faster; a layout
    whose attention builds a dense document mask (all-to-all) costs what it did, and no peak changes."""
    L, mean = 256, 32
    profile = replace(default_profile(), collectives={**default_profile().collectives,
                                                      "send_recv": {2: LinkFit(1e-9, 1e15)}})
    layouts = [Layout(sp=4, sequence_parallel="ring", batch=B, seq=L),
               Layout(sp=4, sequence_parallel="ring", ulysses=2, batch=B, seq=L),
               Layout(sp=2, sequence_parallel="all_to_all", batch=B, seq=L)]
    padded = price(_bert(seq=L), layouts, profile)
    packed = price(_bert(seq=L), layouts, profile, mean_tokens=mean)
    for before, after in zip(padded[:2], packed[:2]):
        assert after.time["compute"] < before.time["compute"] and after.step_s < before.step_s
        assert after.time["sp ring send_recv"] == before.time["sp ring send_recv"] == 0.0
        assert after.peak_bytes == before.peak_bytes
    assert packed[2].step_s == padded[2].step_s and packed[2].peak_bytes == padded[2].peak_bytes
