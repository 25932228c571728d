"""Ring attention (``sequence_parallel="ring"``) in the planner: the dry run records the ring's K/V transfers and the
compute of its blocks on the busiest rank; the cost model hides the transfers under that compute; the search
enumerates ring layouts where all-to-all cannot split the heads and ``--layout auto`` picks one where a long
sequence fits no other layout; ``shardlib plan --sp ring N`` and ``--sequence-parallel ring``. That the dry run's
activation term equals what a real gloo ring step saves is tests/test_search.py's (bert-ring, t5-ring)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import BertConfig

import shardlib
from shardlib import cli
from shardlib.analysis.costmodel import predict
from shardlib.analysis.layout import Layout
from shardlib.analysis.profile import LinkFit, default_profile
from shardlib.analysis.search import search

B, H, D = 2, 2, 8  # microbatch, heads (sp=4 cannot split them: all-to-all is refused), head dim


def _bert(cls: str = "BertForMaskedLM", seq: int = 16, dropout: float = 0.0) -> BertConfig:
    return BertConfig(vocab_size=64, hidden_size=H * D, num_hidden_layers=2, num_attention_heads=H,
                      intermediate_size=32, max_position_embeddings=seq, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout, is_decoder=cls == "BertLMHeadModel", architectures=[cls])


def _ring_plan(config, sp: int = 4, seq: int = 16):
    return shardlib.plan(config, sp=sp, sequence_parallel="ring", batch=B, seq=seq)


def test_the_dry_run_records_the_rings_transfers_and_the_busiest_ranks_blocks():
    """Per layer and microbatch at sp=4: forward 3 sends of the local K/V block [2, b, h, L/4, d], backward 3 again
    and 4 of its fp32 dK/dV. The blocks' FLOPs (``LayerWork.ring``): bidirectional, 1/sp of the whole attention's
    (forward and backward, 14 b h L^2 d); under a causal mask (a BERT decoder) no more, the future being skipped.
    A layer saves bytes linear in the length: no [L, L] scores are kept."""
    L, sp = 16, 4
    block = 2 * B * H * (L // sp) * D * 4
    flops = {}
    for cls in ("BertForMaskedLM", "BertLMHeadModel"):
        report = _ring_plan(_bert(cls))
        stage = report.stages[0]
        assert report.sequence_parallel == "ring"
        for entry, work in zip(stage.collectives[:2], stage.work[:2], strict=True):
            sends = [(c.phase, c.bytes, c.dim) for c in entry.collectives if c.op == "send_recv"]
            assert sends == [("forward", block, "sp")] * 3 + [("backward", block, "sp")] * 7, cls
            flops[cls] = sum(f * n for f, n in work.ring)
    assert flops["BertForMaskedLM"] == 14 * B * H * L * L * D // sp
    assert 0 < flops["BertLMHeadModel"] <= flops["BertForMaskedLM"]
    saved = [_ring_plan(_bert(seq=n), seq=n).stages[0].work[0].saved for n in (64, 128)]
    assert saved[1] == 2 * saved[0]


def test_the_rings_transfers_hide_under_its_block_compute():
    """A ring step sends a block on while it computes with the one it holds: the transfers cost only what outlasts
    the blocks' compute, per layer (``max(0, transfers - compute)``), and nothing on a fast link."""
    report = _ring_plan(_bert())
    layout = Layout(sp=4, sequence_parallel="ring", batch=B, seq=16)
    profile = default_profile()
    stage = report.stages[0]

    def with_link(fit: LinkFit):
        p = replace(profile, collectives={**profile.collectives, "send_recv": {2: fit}})
        return p, predict(report, p, layout)

    fast_profile, fast = with_link(LinkFit(1e-12, 1e18))
    assert fast.time["sp ring send_recv"] == 0.0
    slow_profile, slow = with_link(LinkFit(0.05, 1e6))
    expected = 0.0
    for entry, work in zip(stage.collectives, stage.work):
        transfers = sum(slow_profile.collective_seconds("send_recv", 2, c.bytes)
                        for c in entry.collectives if c.op == "send_recv")
        compute = sum(n * slow_profile.gemm_seconds(f) for f, n in work.ring)
        expected += max(0.0, transfers - compute)
    assert 0 < slow.time["sp ring send_recv"] == pytest.approx(expected)
    assert slow.time["compute"] == fast.time["compute"]
    assert slow.step_s - fast.step_s == pytest.approx(expected)


def test_the_search_picks_a_ring_where_a_long_sequence_fits_nothing_else():
    """2 heads on 4 ranks at 2048 tokens: the search prices ring layouts at sp=2 and sp=4 (all-to-all at sp=4 is
    refused: the heads), and under a budget below every other layout's peak (checkpointed or not) ``--layout auto``
    finds only rings and takes one."""
    from shardlib.train import TrainingArguments
    from shardlib.train.autolayout import choose_layout

    seq = 2048
    config = _bert(seq=seq, dropout=0.1)
    result = search(config, 4, global_batch=4, seq=seq, checkpointing=(False,))
    ring = [p for p in result.ranked if p.layout.sequence_parallel == "ring"]
    others = [p for p in result.ranked if p.layout.sequence_parallel != "ring"]
    assert {p.layout.sp for p in ring} == {2, 4} and others
    assert all("sp ring send_recv" in p.time for p in ring) and not any("sp ring send_recv" in p.time for p in others)
    refused = dict(result.refused)
    assert "is not divisible by tp(1) * sp(4)" in refused["dp1 pp1 tp1 sp4-a2a"]
    smallest = min(p.peak_bytes for p in ring)
    budget = (smallest + min(p.peak_bytes for p in others)) // 2
    assert smallest < budget < min(p.peak_bytes for p in others)
    args = TrainingArguments(layout="auto", memory=str(budget), batch_size=4)
    best, chosen = choose_layout(args, config, 4, seq)
    assert chosen.ranked and all(p.layout.sequence_parallel == "ring" for p in chosen.ranked)
    assert (args.sequence_parallel, args.sp) == ("ring", best.layout.sp) and args.sp > 1


def test_layouts_arguments_and_the_cli_know_the_ring(tmp_path, capsys):
    """``Layout`` names the ring ``spN-ring`` and hands shard() and the Trainer "ring"; ``--sequence-parallel ring``
    parses; ``shardlib plan --sp ring N`` dry-runs it and prices the ring, ``--sp ring`` without N is bad input."""
    from shardlib.train import parse_args

    layout = Layout(dp=1, sp=4, sequence_parallel="ring")
    assert "sp4-ring" in layout.name() and layout.shard_mode() == "ring"
    assert layout.training_args()["sequence_parallel"] == "ring"
    args = parse_args(args=["--sp", "4", "--sequence-parallel", "ring"], launch=False)
    assert (args.sp, args.sequence_parallel) == (4, "ring")
    _bert().save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--sp", "ring", "4", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel: ring" in out and "send_recv" in out and "sp ring send_recv" in out, out
    assert cli.main(["plan", str(tmp_path), "--sp", "ring"]) == 1
    assert "'--sp ring N'" in capsys.readouterr().err
