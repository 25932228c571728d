"""Machine profiles (shardlib.analysis.profile) and their measurement (shardlib.analysis.calibrate): the JSON round
trip, the lookups the cost model makes (interpolation, clamping, fallbacks), the reader's one-line refusals naming
file and field, and one real quick calibration on two gloo ranks."""

import argparse
import copy
import dataclasses
import json
import math

import pytest

from shardlib.analysis import calibrate as calibration
from shardlib.analysis import rank_timing
from shardlib.analysis.calibrate import CalibrationError, add_calibrate_parser, calibrate, calibrate_command
from shardlib.analysis.profile import (COLLECTIVES, SHARED_MEMORY_OPS, LinkFit, Profile, ProfileError,
                                       default_profile, load_profile)

VALID = {
    "shardlib_profile": 1, "machine": "test box", "backend": "gloo", "device": "cpu", "world_size": 4,
    "gemm": {"float32": [[1e6, 1e9], [1e8, 3e9]], "bfloat16": [[1e6, 5e8]]},
    "memory_bytes_per_s": 1e10,
    "collectives": {op: {"2": {"latency_s": 1e-4, "bytes_per_s": 1e9}, "4": {"latency_s": 2e-4, "bytes_per_s": 5e8}}
                    for op in COLLECTIVES},
}


def _write(tmp_path, data, name="profile.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _changed(path: str, value):
    """VALID with the field at dotted ``path`` set to ``value`` (or removed, for ``...``)."""
    data = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is ...:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return data


def _refusal(tmp_path, data, **kwargs) -> str:
    """The one-line message load_profile refuses ``data`` (JSON data, text or bytes) with."""
    path = tmp_path / "profile.json"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        _write(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


# ------------------------------------------------------------------------------------------------ round trip
def test_save_and_load_round_trip(tmp_path):
    for profile in (default_profile(), Profile.from_dict(VALID)):
        path = tmp_path / "p.json"
        path.write_text("old")  # replaced atomically
        profile.save(path)
        assert load_profile(path) == profile
        assert Profile.from_dict(profile.to_dict()) == profile
        assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left behind


def test_default_profile_is_labelled_and_for_any_world(tmp_path):
    profile = default_profile()
    assert profile.machine == "built-in nominal (uncalibrated)" and profile.world_size is None
    profile.save(tmp_path / "d.json")
    assert load_profile(tmp_path / "d.json", world_size=16) == profile


# ----------------------------------------------------------------------------------------------------- lookups
def test_gemm_seconds_interpolates_in_log_flops_and_clamps():
    profile = Profile.from_dict(VALID)
    assert profile.gemm_seconds(1e7, "float32") == pytest.approx(1e7 / 2e9)  # halfway in log(flops): mean rate
    assert profile.gemm_seconds(1e4, "float32") == pytest.approx(1e4 / 1e9)  # below the smallest: its rate
    assert profile.gemm_seconds(1e10, "float32") == pytest.approx(1e10 / 3e9)  # above the largest: its rate
    assert profile.gemm_seconds(1e8, "torch.float32") == pytest.approx(1e8 / 3e9)
    assert profile.gemm_seconds(1e8, "bfloat16") == pytest.approx(1e8 / 5e8)  # one point: flat
    assert profile.gemm_seconds(1e7, "float16") == profile.gemm_seconds(1e7, "float32")  # not measured: float32
    assert profile.gemm_seconds(0, "float32") == 0.0


def test_elementwise_seconds():
    assert Profile.from_dict(VALID).elementwise_seconds(3e10) == pytest.approx(3.0)


def test_optimizer_seconds_at_the_adamw_rate_else_elementwise(tmp_path):
    older = Profile.from_dict(VALID)  # no AdamW rate measured: the element-wise bandwidth
    assert older.optimizer_bytes_per_s == 0.0 and older.optimizer_seconds(3e10) == pytest.approx(3.0)
    measured = Profile.from_dict({**VALID, "optimizer_bytes_per_s": 5e9})
    assert measured.optimizer_seconds(3e10) == pytest.approx(6.0)
    assert "AdamW step        5.00 GB/s per rank" in measured.summary()
    measured.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == measured
    assert "field 'optimizer_bytes_per_s' must be a positive number" in _refusal(
        tmp_path, {**VALID, "optimizer_bytes_per_s": -1.0})


def test_collective_seconds_names_and_group_sizes():
    profile = Profile.from_dict(_changed("collectives.all_to_all.2", {"latency_s": 1e-3, "bytes_per_s": 1e8}))
    assert profile.collective_seconds("all_reduce", 2, 1e9) == pytest.approx(1e-4 + 1.0)
    assert profile.collective_seconds("broadcast", 4, 1e9) == profile.collective_seconds("all_reduce", 4, 1e9)
    for functional, op in (("all_gather_into_tensor", "all_gather"), ("reduce_scatter_tensor", "reduce_scatter"),
                           ("all_to_all_single", "all_to_all")):
        assert profile.collective_seconds(functional, 2, 1e6) == profile.collective_seconds(op, 2, 1e6)
    assert profile.collective_seconds("all_to_all", 2, 1e8) == pytest.approx(1e-3 + 1.0)
    assert profile.collective_seconds("all_reduce", 1, 1e9) == 0.0  # a group of one sends nothing
    assert profile.collective_seconds("all_reduce", 3, 1e9) == profile.collective_seconds("all_reduce", 4, 1e9)
    assert profile.collective_seconds("all_reduce", 8, 1e9) == profile.collective_seconds("all_reduce", 4, 1e9)
    assert profile.collective_seconds("send_recv", 2, 0) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        profile.collective_seconds("gather", 2, 1.0)


def test_tp_and_sp_collectives_are_priced_over_shared_memory_where_measured(tmp_path):
    fast = {"2": {"latency_s": 1e-5, "bytes_per_s": 1e10}}
    data = {**VALID, "shared_memory": {op: fast for op in SHARED_MEMORY_OPS}, "shared_memory_slot_bytes": 1 << 20}
    profile = Profile.from_dict(data)
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter"):
        for dim in ("tp", "sp"):
            assert profile.collective_seconds(op, 2, 1e6, dim) == pytest.approx(1e-5 + 1e-4)
        gloo = profile.collective_seconds(op, 2, 1e6)
        assert gloo == pytest.approx(1e-4 + 1e-3)  # no dim, or a dp / pp group: the backend's
        assert profile.collective_seconds(op, 2, 1e6, "dp") == gloo
        assert profile.collective_seconds(op, 2, 2e6, "tp") == profile.collective_seconds(op, 2, 2e6)  # > a slot
    # the transport serves no all-to-all: priced as the backend's
    assert profile.collective_seconds("all_to_all", 2, 1e6, "sp") == profile.collective_seconds("all_to_all", 2, 1e6)
    assert "(tp/sp over shared memory)" in profile.summary()
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    assert "unknown field 'shared_memory.all_to_all'" in _refusal(
        tmp_path, {**data, "shared_memory": {"all_to_all": fast}})
    assert "field 'shared_memory_slot_bytes' must be a positive integer" in _refusal(
        tmp_path, {**data, "shared_memory_slot_bytes": 0})
    assert Profile.from_dict(VALID).collective_seconds("all_reduce", 2, 1e6, "tp") == pytest.approx(1e-4 + 1e-3)


def test_link_fit_recovers_a_line_and_clamps():
    samples = [(x, 5e-5 + x / 2e9) for x in (4096, 65536, 1 << 20, 16 << 20)]
    fit = LinkFit.fit(samples)
    assert fit.latency_s == pytest.approx(5e-5) and fit.bytes_per_s == pytest.approx(2e9)
    flat = LinkFit.fit([(1e3, 1e-3), (1e6, 1e-3)])  # time not growing with bytes: bandwidth of the largest sample
    assert flat.bytes_per_s == pytest.approx(1e9) and flat.latency_s > 0
    assert LinkFit.fit([(1e3, 1e-6), (1e6, 1e-3)]).latency_s == pytest.approx(1e-6)  # latency <= 0: 1 us


# ---------------------------------------------------------------------------------------------------- refusals
def test_refuses_what_is_not_json(tmp_path):
    assert "not JSON (line 3" in _refusal(tmp_path, '{\n "shardlib_profile": 1,\n oops\n}')
    assert "not JSON" in _refusal(tmp_path, bytes(range(256)) * 4)
    assert "not a shardlib profile" in _refusal(tmp_path, "[1, 2]")
    with pytest.raises(ProfileError, match=r"nowhere\.json: cannot read"):
        load_profile(tmp_path / "nowhere.json")


@pytest.mark.parametrize("field", list(VALID))
def test_refuses_a_missing_field(tmp_path, field):
    assert f"missing field '{field}'" in _refusal(tmp_path, _changed(field, ...))


@pytest.mark.parametrize("path, value, expected", [
    ("collectives.all_reduce.4.bytes_per_s", -3,
     "field 'collectives.all_reduce.4.bytes_per_s' must be a positive number, got -3"),
    ("collectives.send_recv.2.latency_s", 0, "field 'collectives.send_recv.2.latency_s' must be a positive number"),
    ("memory_bytes_per_s", 0, "field 'memory_bytes_per_s' must be a positive number, got 0"),
    ("memory_bytes_per_s", "1e10", "field 'memory_bytes_per_s' must be a positive number, got \"1e10\""),
    ("memory_bytes_per_s", True, "field 'memory_bytes_per_s' must be a positive number, got true"),
    ("memory_bytes_per_s", float("nan"), "field 'memory_bytes_per_s' must be a positive number, got NaN"),
    ("gemm.float32.1.1", -1.0, "field 'gemm.float32.1.1' must be a positive number"),
    ("gemm.float32.0", [1e6], "field 'gemm.float32.0' must be [flops_per_gemm, flops_per_s]"),
    ("gemm.float32", "fast", "field 'gemm.float32' must be a non-empty list"),
    ("gemm.float32", [[1e8, 1e9], [1e6, 1e9]], "field 'gemm.float32' must be sorted by flops_per_gemm"),
    ("gemm.int8", [[1e6, 1e9]], "field 'gemm.int8' must be one of"),
    ("gemm.float32", ..., "missing field 'gemm.float32'"),
    ("gemm", [], "field 'gemm' must be an object"),
    ("collectives.all_reduce.2", 5, "field 'collectives.all_reduce.2' must be an object"),
    ("collectives.all_reduce.1", {"latency_s": 1.0, "bytes_per_s": 1.0}, "group sizes are integers >= 2"),
    ("collectives.all_reduce.2.bytes_per_s", ..., "missing field 'collectives.all_reduce.2.bytes_per_s'"),
    ("collectives.all_to_all", ..., "missing field 'collectives.all_to_all'"),
    ("collectives.all_to_all", {}, "field 'collectives.all_to_all' has no group size"),
    ("collectives.gather", {}, "unknown field 'collectives.gather'"),
    ("backend", "mpi", "field 'backend' must be one of 'gloo', 'nccl', got \"mpi\""),
    ("device", None, "field 'device' must be one of 'cpu', 'cuda', got null"),
    ("world_size", "4", "field 'world_size' must be a positive integer or null, got \"4\""),
    ("world_size", 0, "field 'world_size' must be a positive integer or null, got 0"),
    ("machine", 3, "field 'machine' must be a string, got 3"),
    ("shardlib_profile", 2, "unknown profile version 2 in field 'shardlib_profile'"),
    ("extra", 1, "unknown field 'extra'"),
])
def test_refuses_a_bad_field(tmp_path, path, value, expected):
    assert expected in _refusal(tmp_path, _changed(path, value))


def test_refuses_a_profile_of_another_world_size(tmp_path):
    message = _refusal(tmp_path, _changed("world_size", 8), world_size=4)
    assert message.endswith("profile.json: measured on 8 ranks (field 'world_size'), this plan has 4: "
                            "run shardlib calibrate --world 4 there")
    assert load_profile(_write(tmp_path, VALID), world_size=4).world_size == 4


# ------------------------------------------------------------------------------------------------- calibration
def test_quick_calibration_on_two_gloo_ranks(tmp_path):
    profile = calibrate(2, quick=True, timeout_s=60)
    assert (profile.world_size, profile.backend, profile.device) == (2, "gloo", "cpu")
    numbers = [profile.memory_bytes_per_s] + [v for points in profile.gemm.values() for p in points for v in p]
    numbers += [v for fits in profile.collectives.values() for fit in fits.values() for v in fit]
    assert all(math.isfinite(v) and v > 0 for v in numbers)
    assert set(profile.gemm) == {"float32", "bfloat16"} and len(profile.gemm["float32"]) >= 2
    assert all(set(fits) == {2} for fits in profile.collectives.values())
    assert math.isfinite(profile.optimizer_bytes_per_s) and profile.optimizer_bytes_per_s > 0
    # the tp / sp groups' default transport on one host, timed too
    assert set(profile.shared_memory) == set(SHARED_MEMORY_OPS) and profile.shared_memory_slot_bytes > 0
    assert all(set(fits) == {2} and all(math.isfinite(v) and v > 0 for v in fits[2])
               for fits in profile.shared_memory.values())
    profile.save(tmp_path / "measured.json")
    assert load_profile(tmp_path / "measured.json", world_size=2) == profile


def test_a_one_rank_calibration_prices_work_but_no_collective(tmp_path):
    """One device (a single GPU): no collective is measured; the profile prices one-rank layouts, and asking it for
    a collective of two ranks names what to do."""
    profile = calibrate(1, quick=True, timeout_s=60)
    assert profile.world_size == 1 and not any(profile.collectives.values())
    assert profile.gemm_seconds(1e9) > 0 and profile.collective_seconds("all_reduce", 1, 1e6) == 0.0
    with pytest.raises(ProfileError, match="measured on one rank, this profile prices no all_reduce .*--world 2"):
        profile.collective_seconds("all_reduce", 2, 1e6)
    assert "collectives    none (measured on one rank)" in profile.summary()
    profile.save(tmp_path / "one.json")
    assert load_profile(tmp_path / "one.json", world_size=1) == profile
    data = {**profile.to_dict(), "world_size": 2}  # a profile of two ranks must have measured collectives
    message = _refusal(tmp_path, data, world_size=2)
    assert message.endswith("field 'collectives.all_reduce' has no group size"), message


def test_calibrate_refuses_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        calibrate(0)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        calibrate(2, backend="mpi")
    with pytest.raises(ValueError, match="shapes must be"):
        calibrate(2, shapes=[(1, 2)])


def test_a_failing_or_slow_rank_is_an_error_not_a_hang(tmp_path):
    settings = calibration._Settings(shapes=((8, 8, 8),), message_bytes=(64,), repeats=1, target_s=0.01, threads=1)
    config = {"world_size": 2, "backend": "nonsense", "settings": dataclasses.asdict(settings),
              "workdir": str(tmp_path), "out": str(tmp_path / "p.json"), "timeout_s": 30}
    with pytest.raises(CalibrationError, match=r"^calibrate: rank \d failed: \w+Error"):
        calibration._run_ranks(config)
    with pytest.raises(CalibrationError, match="did not finish within 0.2 s"):
        calibration._run_ranks({**config, "timeout_s": 0.2})


# --------------------------------------------------------------------------------------------------------- CLI
def _parse(argv):
    parser = argparse.ArgumentParser(prog="shardlib")
    add_calibrate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_arguments_and_summary(tmp_path, monkeypatch, capsys):
    args = _parse(["calibrate"])
    assert (args.world, args.backend, args.out, args.quick) == (4, "gloo", "shardlib-profile.json", False)
    monkeypatch.setattr(calibration, "calibrate", lambda world, **kwargs: default_profile())
    out = tmp_path / "p.json"
    assert calibrate_command(_parse(["calibrate", "--world", "2", "--quick", "--out", str(out)])) == 0
    text = capsys.readouterr().out
    assert "gemm float32" in text and "all_reduce" in text and f"profile written to {out}" in text
    assert load_profile(out) == default_profile()


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert calibrate_command(_parse(["calibrate", "--world", "0", "--out", str(tmp_path / "p.json")])) == 1
    assert capsys.readouterr().err == "shardlib calibrate: world_size must be a positive integer, got 0\n"
    assert calibrate_command(_parse(["calibrate", "--out", str(tmp_path / "no" / "p.json")])) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("shardlib calibrate: --out") and "no such directory" in err


def test_link_fit_prices_bytes():
    assert LinkFit(1e-3, 1e9).seconds(1e9) == pytest.approx(1.001)


def test_a_gemm_size_measured_far_below_the_one_before_is_timed_again():
    """Noise only slows a timing down: a size at under DROP of the previous size's rate is timed once more and the
    faster kept (a real cliff reads the same twice and stays)."""
    import torch

    shapes = ((8, 8, 8), (16, 16, 16))
    flops = [2.0 * 8 ** 3, 2.0 * 16 ** 3]

    class Clock:  # seconds() answers from a script of rates (GFLOP/s), per dtype in turn
        device = torch.device("cpu")

        def __init__(self, *rates):
            self.torch, self.calls = torch, 0
            self.times = iter([flops[min(i, 1)] / (r * 1e9) for i, r in enumerate(rates)] * 2)  # fp32, then bf16

        def seconds(self, run):
            self.calls += 1
            return next(self.times)

    disturbed = Clock(1.0, 0.3, 1.2)
    assert rank_timing.gemm_rates(disturbed, shapes)["float32"] == [[flops[0], pytest.approx(1e9)],
                                                                     [flops[1], pytest.approx(1.2e9)]]
    assert disturbed.calls == 6
    cliff = Clock(1.0, 0.3, 0.3)
    assert rank_timing.gemm_rates(cliff, shapes)["float32"][1][1] == pytest.approx(0.3e9)
    steady = Clock(1.0, 0.9)
    assert rank_timing.gemm_rates(steady, shapes)["float32"][1][1] == pytest.approx(0.9e9) and steady.calls == 4
