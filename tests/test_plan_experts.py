"""Expert parallelism in the planner (shardlib.analysis.expert_cost) and the layout search: ``shardlib plan --ep``
prices the experts at 1/ep per rank and the all-to-all exchange, refuses an ep that cannot run in one line (exit 2),
and the search (with ``--layout auto``) enumerates ep for models with mixture-of-experts layers only. The figures
are checked against the model's own shapes here; against measured memory by ``benchmarks/plan_accuracy.py --ep``
(docs/moe.md, "Planning")."""

from __future__ import annotations

import json

import pytest
from transformers import BertConfig, MixtralConfig, SwitchTransformersConfig

import shardlib
from shardlib import cli
from shardlib.analysis.costmodel import predict
from shardlib.analysis.layout import Layout
from shardlib.analysis.profile import default_profile
from shardlib.analysis.search import candidate_layouts, price, search

HIDDEN, INTER, LAYERS, TOP_K, BATCH, SEQ = 32, 64, 2, 2, 2, 8
TINY = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=TOP_K, vocab_size=64, max_position_embeddings=64,
            architectures=["MixtralForCausalLM"])


BERT = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64,
                  architectures=["BertForMaskedLM"])


def mixtral(experts: int = 4) -> MixtralConfig:
    return MixtralConfig(**TINY, num_local_experts=experts)


def expert_bytes(experts: int = 4) -> int:
    """Every layer's fused expert weights, from the config: gate_up [E, 2I, H] and down [E, H, I], float32."""
    return LAYERS * experts * 3 * INTER * HIDDEN * 4


@pytest.fixture(scope="module")
def dry_runs():
    """The dry run of dp=4 at ep 1, 2 and 4 (shardlib.plan's ep)."""
    return {ep: shardlib.plan(mixtral(), dp=4, batch=BATCH, seq=SEQ, ep=ep) for ep in (1, 2, 4)}


def test_ep_divides_the_experts_and_adds_the_exchange(dry_runs):
    """Each rank holds E/ep of every layer's experts: parameters and gradients fall by exactly what the config's
    expert weights lose, AdamW's state with them; four all-to-alls per MoE layer carry tokens x top-k rows of the
    hidden size, (ep - 1) / ep of them leaving the rank, and none at ep = 1."""
    base = dry_runs[1].stages[0]
    for ep, report in dry_runs.items():
        stage = report.stages[0]
        gone = expert_bytes() - expert_bytes() // ep
        assert stage.parameter_bytes == base.parameter_bytes - gone
        assert stage.gradient_bytes == base.gradient_bytes - gone
        assert stage.optimizer_bytes == pytest.approx(base.optimizer_bytes - 2 * gone, abs=64)  # AdamW: 2 per weight
        prediction = predict(report, default_profile(), Layout(dp=4, batch=BATCH, seq=SEQ, ep=ep))
        assert prediction.experts["expert_bytes"] == pytest.approx(4 * expert_bytes() / ep, rel=1e-4)
        rows = BATCH * SEQ * TOP_K * HIDDEN * 4 * LAYERS  # one exchange's rows, every layer
        assert prediction.experts["all_to_all_bytes"] == 4 * rows * (ep - 1) // ep
        exchanges = [t for t in report.totals() if t.op == "all_to_all_single" and t.dim == "ep"]
        assert (len(exchanges) > 0) == (ep > 1)
        if ep > 1:
            assert "ep all_to_all_single" in prediction.time and f"ep={ep} within dp" in str(report)
    peaks = [predict(r, default_profile(), Layout(dp=4, batch=BATCH, seq=SEQ, ep=ep)).peak_bytes
             for ep, r in dry_runs.items()]
    assert peaks[0] > peaks[1] > peaks[2]
    layout = Layout(dp=4, batch=BATCH, seq=SEQ, ep=2)  # the search's layer table: the same experts and exchange
    searched, exact = price(mixtral(), [layout])[0], predict(dry_runs[2], default_profile(), layout)
    assert searched.experts == exact.experts and searched.memory["parameters"] == exact.memory["parameters"]


def test_switch_experts_are_planned_too():
    """Switch Transformers' experts (a ModuleDict of MLPs, run on the meta device with each expert given its share
    of the tokens): ep=2 halves their bytes per rank; its all-to-all rows are top-1."""
    config = SwitchTransformersConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                                      num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2, vocab_size=64,
                                      architectures=["SwitchTransformersForConditionalGeneration"])
    one, two = (shardlib.plan(config, dp=2, batch=BATCH, seq=SEQ, ep=ep) for ep in (1, 2))
    experts = 2 * 4 * 2 * 32 * 64 * 4  # 2 sparse layers x 4 experts x (wi, wo) x d_model x d_ff, float32
    assert one.stages[0].parameter_bytes - two.stages[0].parameter_bytes == experts // 2
    assert [m.top_k for m in one.stages[0].moe] == [1, 1] and all(m.saved > 0 for m in one.stages[0].moe)


def test_static_capacity_pads_the_exchange(dry_runs):
    """expert_capacity=c: every rank sends each expert ceil(c x pairs / E) rows, so the exchange grows by c and the
    peak by the padded buffers; the experts still compute only the routed rows."""
    layout = Layout(dp=4, batch=BATCH, seq=SEQ, ep=2)
    dropless = predict(dry_runs[1], default_profile(), layout)
    static = predict(dry_runs[1], default_profile(), Layout(dp=4, batch=BATCH, seq=SEQ, ep=2, expert_capacity=2.0))
    assert static.experts["all_to_all_bytes"] == 2 * dropless.experts["all_to_all_bytes"]
    assert static.peak_bytes > dropless.peak_bytes and static.layout.name() == "dp4 pp1 tp1 ep2-cap2 zero0 mb1"
    assert static.memory["parameters"] == dropless.memory["parameters"]


def _plan(capsys, tmp_path, config, *flags) -> tuple[int, str, str]:
    config.save_pretrained(tmp_path)
    status = cli.main(["plan", str(tmp_path), "--batch", str(BATCH), "--seq", str(SEQ), *flags])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_prices_ep_and_refuses_what_cannot_run(tmp_path, capsys):
    """`shardlib plan --ep N`: the prediction names the experts; an ep that does not divide dp, or the experts, ep on
    a dense model and a capacity without ep: exit 2, one line naming the value and the fix."""
    status, out, err = _plan(capsys, tmp_path / "moe", mixtral(), "--dp", "4", "--ep", "2", "--zero", "1", "--json")
    assert status == 0, err
    assert json.loads(out)["prediction"]["experts"]["ep"] == 2 and json.loads(out)["mesh"]["ep"] == 2
    refusals = [(mixtral(), ("--dp", "4", "--ep", "3"), "ep=3 does not divide dp=4"),
                (mixtral(6), ("--dp", "4", "--ep", "4"), "ep=4 does not divide the 6 experts of model.layers.0"),
                (mixtral(), ("--dp", "2", "--expert-capacity", "1.5"), "give ep > 1 too (--ep N)"),
                (BERT, ("--dp", "2", "--ep", "2"), "BertForMaskedLM has no mixture-of-experts layer to split; "
                 "leave ep out")]
    for i, (config, flags, message) in enumerate(refusals):
        status, out, err = _plan(capsys, tmp_path / str(i), config, *flags)
        assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def moe_search():
    """The search of an 8-expert Mixtral on 2 ranks, no budget."""
    return search(mixtral(8), 2, global_batch=8, seq=SEQ)


def test_search_enumerates_ep_for_moe_models_only(moe_search):
    """Candidates: ep over the divisors of dp that divide every layer's expert count, with every ZeRO stage; none
    for a dense model. The search prices them, and a dense model's search holds no ep."""
    dense = candidate_layouts(4, 8, SEQ)
    assert {la.ep for la in dense} == {1}
    moe = candidate_layouts(4, 8, SEQ, experts=[4, 4])
    assert {la.ep for la in moe if la.dp == 4} == {1, 2, 4} and {la.ep for la in moe if la.dp == 2} == {1, 2}
    assert {la.ep for la in candidate_layouts(4, 8, SEQ, experts=[4, 6])} == {1, 2}
    assert {la.zero for la in moe if la.ep == 4} == {0, 1, 2, 3}
    assert [la for la in moe if la.ep == 1] == dense  # a dense model's enumeration, in its order
    assert {p.layout.ep for p in moe_search.ranked} == {1, 2}
    assert {p.layout.ep for p in search(BERT, 2, global_batch=8, seq=SEQ).ranked} == {1}


def test_layout_auto_passes_ep_to_the_ranks(moe_search, capsys):
    """--layout auto on an MoE model under a budget at which the fastest layout that fits has ep > 1 (without
    checkpointing, which a budgeted search also prices): the arguments take that ep, and the ranks it launches get it
    as an explicit --ep."""
    from shardlib.train import parse_args
    from shardlib.train.args import _choose_layout

    ranked = moe_search.ranked  # fastest first
    budget = next(b for b in sorted(p.peak_bytes for p in ranked)
                  if next(q for q in ranked if q.peak_bytes <= b).layout.ep > 1)
    argv = ["--layout", "auto", "--memory", str(budget), "--nproc", "2", "--batch_size", "8"]
    args = parse_args(args=["--nproc", "2", "--batch_size", "8"], launch=False)
    args.layout, args.memory = "auto", str(budget)
    ranks_argv = _choose_layout(args, mixtral(8), SEQ, argv)  # what parse_args(argv) does before launching
    assert args.ep > 1 and args.dp % args.ep == 0 and f" ep{args.ep} " in capsys.readouterr().out
    assert ranks_argv[ranks_argv.index("--ep") + 1] == str(args.ep)
    assert parse_args(args=ranks_argv[1:], launch=False).ep == args.ep
