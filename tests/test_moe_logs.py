"""A mixture of experts' training logs: ``fit``'s records carry the main loss and each auxiliary router loss apart
(equal to what the unsharded HF model's outputs give for the same batch, weighted over dp ranks and microbatches as
the loss is; main + terms == the logged loss), a dense model's records carry none, and ``shardlib plot`` draws the
loss curve with each MoE layer's load beside it."""

from __future__ import annotations

import json
import math

import pytest

import moe_log_tasks
from shardlib import cli
from shardlib.train.loss_terms import LossTerms, mean_terms
from shardlib.train.plots import imbalance, plot_log, series

#: float64 throughout for Switch (its router set to float64); the decoders compute their loss and load-balancing
#: loss in float32 (transformers' upcasts), whose rounding the sharded sums see in another order
TOL = {"switch": 1e-12, "mixtral": 1e-6}


def _check_records(result: dict, family: str) -> list[dict]:
    records, expected = result["records"], result["expected"]
    assert [r["step"] for r in records] == [1, 2], records
    terms = [k for k in expected if k != "loss"]
    for record in records:
        assert set(terms) | {"main_loss"} <= set(record), record
        parts = record["main_loss"] + sum(record[k] for k in terms)
        assert math.isclose(parts, record["loss"], rel_tol=1e-12), (parts, record)
        assert record["router_aux_loss"] > 0 and all(record[k] < record["loss"] for k in terms), record
    first = records[0]
    for key, value in expected.items():
        assert math.isclose(first[key], value, rel_tol=TOL[family]), (key, first[key], value)
    last = {k: records[-1][k] for k in ["main_loss", *terms]}
    assert result["last_terms"].keys() == last.keys()
    assert all(math.isclose(result["last_terms"][k], v, rel_tol=1e-12) for k, v in last.items()), result
    return records


def test_switch_fit_logs_its_router_losses_apart_and_the_plot_names_its_layers(pool, tmp_path):
    """Switch at dp=2 x tp=2 with 2 microbatches: z-loss and load-balancing loss of encoder and decoder, each times
    its coefficient, averaged over the 4 pieces of the global batch as the loss is; then the picture of the log."""
    result = pool.run(moe_log_tasks.fit_logs_router_losses, str(tmp_path), "switch")[0]
    records = _check_records(result, "switch")
    layers = list(records[0]["experts"])
    assert len(layers) == 4 and any(r["experts"][layers[0]]["dropped_share"] > 0 for r in records), records
    svg = plot_log(tmp_path, tmp_path / "train.svg").read_text()
    assert all(layer in svg for layer in layers) and "router_z_loss" in svg and "main_loss" in svg
    assert cli.main(["plot", str(tmp_path)]) == 0 and (tmp_path / "log.png").stat().st_size > 10_000


def test_decoder_fit_logs_its_load_balancing_loss_apart(pool, tmp_path):
    """Mixtral (config.output_router_logits) at dp=2 x tp=2, 2 microbatches: router_aux_loss alone."""
    result = pool.run(moe_log_tasks.fit_logs_router_losses, str(tmp_path), "mixtral")[0]
    records = _check_records(result, "mixtral")
    assert "router_z_loss" not in records[0] and len(records[0]["experts"]) == 2, records[0]


def test_dense_fit_logs_no_loss_terms_or_load(pool, tmp_path):
    records = pool.run(moe_log_tasks.fit_logs_of_a_dense_model, str(tmp_path))[0]
    assert len(records) == 2, records
    assert all(k in ("step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s") for r in records
               for k in r), records
    plot_log(tmp_path)  # the loss curve alone
    assert (tmp_path / "log.png").exists()


def test_loss_terms_sum_over_batches_and_average_over_a_log_interval():
    import torch

    terms = LossTerms(model=None, enabled=True)
    vectors = []
    for loss, aux in ((2.0, 0.25), (1.0, 0.5)):  # two batches of one step (gradient accumulation)
        terms._sums = {"router_aux_loss": torch.tensor(aux, dtype=torch.float64)}
        vectors.append(terms.append_to(torch.tensor([loss], dtype=torch.float64)))
    assert terms.read(vectors) == 3.0 and terms.last == {"main_loss": 2.25, "router_aux_loss": 0.75}
    assert terms.read([terms.append_to(torch.tensor([1.5], dtype=torch.float64))]) == 1.5 and terms.last is None
    steps = [{"main_loss": 1.0, "router_aux_loss": 0.5}, None, {"main_loss": 3.0, "router_aux_loss": 0.25}]
    assert mean_terms(steps) == {"main_loss": 2.0, "router_aux_loss": 0.375} and mean_terms([None]) == {}


def test_plot_series_imbalance_and_refusals(tmp_path):
    assert imbalance([2, 2, 2, 2]) == 1.0 and imbalance([8, 0, 0, 0]) == 4.0 and math.isnan(imbalance([0, 0]))
    records = [{"step": 1, "loss": 2.0, "main_loss": 1.5, "router_aux_loss": 0.5,
                "experts": {"m.0": {"tokens_per_expert": [3, 1], "dropped_share": 0.2}}},
               {"step": 1, "eval": True, "loss": 1.8, "samples": 4}, {"step": 2, "loss": "nan"}]
    drawn = series(records)
    assert drawn["loss"]["eval_loss"] == ([1], [1.8]) and math.isnan(drawn["loss"]["loss"][1][1])
    assert drawn["terms"] == {"router_aux_loss": ([1], [0.5])} and drawn["imbalance"] == {"m.0": ([1], [1.5])}
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "lo')  # a torn last line
    assert plot_log(log).name == "log.png"
    with pytest.raises(FileNotFoundError, match="no such log"):
        plot_log(tmp_path / "missing")
    log.write_text(json.dumps(records[1]) + "\n")
    assert cli.main(["plot", str(log)]) == 1
