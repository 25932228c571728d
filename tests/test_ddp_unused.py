"""torch's DDP under the Trainer (zero=0, dp > 1) looks for unused parameters only where there are some: the first
step runs without DDP and its gradients decide (``shardlib/train/dataparallel.py``, module docstring). On a pool of
two gloo ranks (dp=2 alone):

* a BERT classifier's fit prints no "find_unused_parameters=True was specified" warning (torch's C++ warning, read
  from the ranks' stderr file descriptor), builds DDP without the walk and trains as the unsharded model;
* a BertModel whose loss leaves the pooler out trains as the unsharded model: every gradient (the pooler's None) and
  every weight after each of three AdamW steps, with the pooler left out of DDP;
* ``find_unused_parameters=False`` given for that model fails at once with the parameters named, not in a hang.

Tolerances: float64, the dp sum adds the two halves' gradients in another order than one backward over the global
batch: rank_tasks.TOL (rtol 1e-9 / atol 1e-11); losses rtol 1e-10 as tests/test_train.py.
"""

from __future__ import annotations

import pytest

import ddp_tasks
import train_tasks
from harness import RankPool
from shardlib.train.dataparallel import unused_settings
from test_train import BERT, RUN, close

BERT_MODEL = {"family": "bert", "cls": "BertModel", "seq": 8, "seed": 3, "batch": 8, "dtype": "float64",
              "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 24, "vocab": 41}}


@pytest.fixture(scope="module")
def pool2():
    """Two gloo ranks: dp=2 alone."""
    p = RankPool(world_size=2)
    p.start()
    yield p
    p.stop()


def test_unused_settings():
    """Per parameter DDP would sum, how many of dp=4 ranks gave it a gradient in the first step."""
    assert unused_settings([4, 4, 4], 4) == ([], False)  # all used everywhere: no walk
    assert unused_settings([4, 0, 4, 0], 4) == ([1, 3], False)  # unused everywhere: left out, still no walk
    assert unused_settings([4, 2, 0], 4) == ([2], True)  # used by some ranks only: the data decides, DDP walks
    assert unused_settings([], 4) == ([], False)


def test_classifier_fit_at_dp2_prints_no_unused_parameter_warning(pool2):
    spec = {**BERT, **RUN, "dtype": "float64", "steps": 3, "layout": {"dp": 2}}
    expected = train_tasks.reference_run(spec)["losses"]
    ranks = pool2.run(ddp_tasks.classifier_fit, spec)
    for rank, got in enumerate(ranks):
        assert got["ddp"] and got["find_unused"] is False and got["left_out_of_ddp"] == 0, got
        assert ddp_tasks.WARNING not in got["fit"]["stderr"], got["fit"]["stderr"]
        assert not any("find_unused" in w for w in got["fit"]["warnings"]), got["fit"]["warnings"]
        # the control: the capture sees torch's warning, and the fit had not spent its one print
        assert ddp_tasks.WARNING in got["control"]["stderr"], got["control"]
        decisions = [m for m in got["fit"]["log"] if m.startswith("data parallel")]
        assert decisions == ([] if rank else [
            "data parallel (dp=2): 0 parameter(s) got no gradient on any rank in the first step; DDP sums 41 "
            "parameter(s) with find_unused_parameters=False"]), decisions
        for step, (a, b) in enumerate(zip(got["losses"], expected)):
            assert close(a, b, 1e-10), f"rank {rank} step {step}: {a!r} != {b!r}"
        assert len(got["losses"]) == 3


@pytest.mark.parametrize("find_unused", [None, True], ids=["decided", "given"])
def test_unused_pooler_trains_as_unsharded(pool2, find_unused):
    """Decided (the default): the pooler is left out of DDP, which runs without the walk; given True: DDP as it was
    built before (the walk, the pooler in DDP). Both equal the unsharded model, two microbatches per rank."""
    spec = {**BERT_MODEL, "steps": 3, "microbatches": 2, "find_unused": find_unused}
    pooler = ["pooler.dense.bias", "pooler.dense.weight"]
    for rank, got in enumerate(pool2.run(ddp_tasks.unused_pooler_steps, spec)):
        assert sorted(got["unused"]) == pooler
        assert got["compared"] == 3 * 39, got["compared"]  # 39 parameters, each step
        first, *later = got["states"]
        if find_unused is None:
            assert not first["ddp"], first  # the first step decides, without DDP
            for state in later:
                assert state == {"ddp": True, "find_unused": False, "ignored": pooler, "left_out": 2,
                                 "in_ddp": 37}, state
            decisions = [m for m in got["out"]["log"] if m.startswith("data parallel")]
            assert decisions == ([] if rank else [
                "data parallel (dp=2): 2 parameter(s) got no gradient on any rank in the first step "
                "(pooler.dense.weight, pooler.dense.bias), left out of DDP; DDP sums 37 parameter(s) with "
                "find_unused_parameters=False"]), decisions
        else:
            for state in got["states"]:
                assert state == {"ddp": True, "find_unused": True, "ignored": [], "left_out": 0, "in_ddp": 39}, state


def test_given_false_with_an_unused_pooler_names_it(pool2):
    for message in pool2.run(ddp_tasks.forced_off_with_unused_pooler, BERT_MODEL):
        assert message.startswith("2 parameter(s) that torch's DDP sums got no gradient in this step"), message
        assert "(pooler.dense.weight, pooler.dense.bias)" in message and "(as given)" in message, message
        assert "find_unused_parameters=True" in message, message
