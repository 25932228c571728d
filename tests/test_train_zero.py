"""ZeRO-1/2/3 and mixed precision in ``Trainer.fit`` on the rank pool (tasks in train_tasks.py).

Tolerances. float64: a partitioned optimizer steps the same numbers as zero=0 (each parameter on one rank instead
of all), and the dp gradient sums are the same sums (a reduce instead of an all-reduce); only the gradient-norm sum
changes order (its squares are summed per dp rank, then over dp): rtol 1e-12 on every step's loss.
"""

from __future__ import annotations

import pytest

import train_tasks
from test_train import BERT, RUN, T5, close

ZERO_LAYOUTS = {"dp4": {"dp": 4}, "dp2_tp2": {"dp": 2, "tp": 2}}


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("layout", ZERO_LAYOUTS)
def test_zero_steps_equal_zero0_in_float64(pool, zero, layout):
    """Clipping on (max_grad_norm 1), 2 microbatches (accumulation), 4 steps: every step's loss equal."""
    spec = {**BERT, **RUN, "dtype": "float64", "steps": 4, "layout": ZERO_LAYOUTS[layout]}
    baseline = pool.run(train_tasks.fit_run, spec)
    partitioned = pool.run(train_tasks.fit_run, {**spec, "trainer": {"zero": zero}})
    for step, (a, b) in enumerate(zip(partitioned[0]["losses"], baseline[0]["losses"])):
        assert close(a, b, 1e-12), f"zero={zero} {layout} step {step}: {a!r} != {b!r}"
    dp = ZERO_LAYOUTS[layout]["dp"]
    full = baseline[0]["optimizer_bytes"]
    assert all(r["optimizer_bytes"] == full for r in baseline)
    # each dp rank holds about 1/dp of the state (whole parameters: ZeroRedundancyOptimizer's greedy partition)
    held = [r["optimizer_bytes"] for r in partitioned]
    assert max(held) < 0.6 * full and sum(held) == dp * full // dp * (len(held) // dp), (held, full)


def test_fp16_tracks_fp32(pool):
    spec = {**BERT, **RUN, "dtype": "float32", "steps": 20, "layout": {"dp": 2, "tp": 2}}
    fp32 = pool.run(train_tasks.fit_run, spec)[0]
    fp16 = pool.run(train_tasks.fit_run, {**spec, "trainer": {"precision": "fp16"}})[0]
    gaps = [abs(a - b) / abs(b) for a, b in zip(fp16["losses"], fp32["losses"])]
    print(max(gaps), fp16["scaler"], fp16["losses"][:3], fp32["losses"][:3])
    assert max(gaps) < 0.01


@pytest.mark.parametrize("where", ["tp", "pp", "dp"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(pool, where):
    layout = {"pp": {"dp": 1, "pp": 2, "tp": 2}}.get(where, {"dp": 2, "tp": 2})
    spec = {**BERT, **RUN, "dtype": "float32", "layout": layout, "inject": {where: 1}}
    ranks = pool.run(train_tasks.inject_inf, spec)
    assert sum(r["injected"] for r in ranks) == (2 if where != "pp" else 2), ranks
    for r in ranks:
        assert r["unchanged"], r
        # hysteresis 2: the first overflow skips without backing off, the second halves the scale
        assert r["scales"] == [(2.0 ** 16, True, 1), (2.0 ** 15, True, 2)], r
