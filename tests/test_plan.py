"""``shardlib.plan`` / ``shardlib plan`` (shardlib.analysis.dryrun): the dry run's numbers equal a real run's.

Real runs happen on the pool's 4 gloo ranks (tasks defined here): parameter, gradient and AdamW bytes per rank
(plain, ZeRO-2, and per pipeline stage), and every collective of a forward and backward by op, mesh dim and bytes,
recorded by the project's CollectiveCounter extended with sizes (written here, independently of the recorder in
shardlib.analysis.metarun). The dry runs happen in this process with no ranks."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from transformers import BertConfig, T5Config

import shardlib
from shardlib import cli
from shardlib.analysis.dryrun import PlanInputError, PlanReport, TensorSpec
from shardlib.sharding.plan import PlanError
from shardlib.train.fsdp import local

from profiles import ci_only
from rank_tasks import CollectiveCounter

BERT = dict(vocab_size=51, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, architectures=["BertForMaskedLM"])  # 51: a padded vocab at tp=2
BATCH, SEQ = 2, 7  # 7: sequence parallelism pads the sequence to a multiple of tp


# ------------------------------------------------------------------------------------------- in the ranks
class SizedCounter(CollectiveCounter):
    """CollectiveCounter that also keeps (op, mesh dim, bytes this rank puts in) of every collective."""

    OUTPUT_FIRST = ("_allgather_base_", "_reduce_scatter_base_")  # c10d ops whose input is their second argument

    def __init__(self, dims: dict):
        super().__init__()
        self.dims, self.sizes = dims, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES and func._opname not in self.NOT_COLLECTIVES:
            sent = args[1] if func._opname in self.OUTPUT_FIRST else args[0]
            sent = sent if isinstance(sent, (list, tuple)) else [sent]
            group = next(a for a in args if isinstance(a, torch.ScriptObject)) if func.namespace == "c10d" else \
                [a for a in args if isinstance(a, str)][-1]
            name = group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name
            self.sizes.append((self.SAME.get(func._opname, func._opname), self.dims[name],
                               sum(t.numel() * t.element_size() for t in sent)))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _as_planned(seen):
    """Counts ({op: n}) or sizes ([(op, dim, bytes)]) with the ops named as the plan names them: on gloo shardlib's
    reduce-scatter runs as an all-to-all (``collectives.start_reduce_scatter``), and these Megatron runs have no
    other all-to-all; the plan names the collective, not gloo's wire op."""
    rename = {"all_to_all_single": "reduce_scatter_tensor"}
    if isinstance(seen, dict):
        return {rename.get(op, op): n for op, n in seen.items()}
    return [(rename.get(op, op), *rest) for op, *rest in seen]


def _unique_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors if t is not None}.values())


def _state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state on this rank (of a ZeRO-3 DTensor, its local shard)."""
    return sum(local(t).numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t))


def _real_model(spec: dict, mesh):
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    return shardlib.shard(BertForMaskedLM(BertConfig(**BERT)), mesh, sequence_parallel=spec["sp"])


def _batch(batch: int) -> dict:
    ids = torch.randint(0, BERT["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def real_step(spec: dict) -> dict:
    """This rank's bytes and collectives in a real forward + backward + AdamW step, and its bytes after a Trainer
    step under ZeRO-2 and (without sequence parallelism) ZeRO-3 (tp x dp layouts); its stage's bytes after a
    Trainer step (pp x tp layouts)."""
    from harness import mesh as pool_mesh

    mesh = pool_mesh(pp=spec["pp"], tp=spec["tp"])
    model = _real_model(spec, mesh)
    result = {"pp": mesh.local_rank("pp"), "dp": mesh.local_rank("dp"),
              "parameters": shardlib.report(model).local_bytes}
    if spec["pp"] > 1:
        trainer = shardlib.Trainer(model, torch.optim.AdamW, microbatches=2, schedule="gpipe",
                                   zero=spec.get("zero", 0))
        trainer.train_step(_batch(2 * BATCH))
        params = shardlib.shard_state(model).pipeline.local_parameters()
        return result | {"held parameters": _unique_bytes(local(p) for p in params),
                         "gradients": _unique_bytes(local(p.grad) for p in params if p.grad is not None),
                         "optimizer": _state_bytes(trainer.optimizer)}
    dims = {mesh.group(d).group_name: d for d in ("dp", "pp", "tp") if mesh.size(d) > 1}
    batch = _batch(BATCH)
    with SizedCounter(dims) as forward:
        loss = model(**batch).loss
    with SizedCounter(dims) as backward:
        loss.backward()
    result |= {"gradients": _unique_bytes(p.grad for p in model.parameters())}
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    result |= {"optimizer": _state_bytes(optimizer),
               "counts": {"forward": _as_planned(forward.counts), "backward": _as_planned(backward.counts)},
               "sizes": {"forward": sorted(_as_planned(forward.sizes)), "backward": sorted(_as_planned(backward.sizes))}}
    for zero in (2, 3) if not spec["sp"] else (2,):
        zero_model = _real_model(spec, mesh)
        trainer = shardlib.Trainer(zero_model, torch.optim.AdamW, zero=zero)
        trainer.train_step(batch)
        if zero == 2:  # flat buckets: the gradient shards persist, the full gradients are freed in backward
            grads = [b.grad_shard for b in trainer.optimizer.buckets if b.grad_shard is not None]
            stepped = trainer.optimizer.inner
        else:
            grads, stepped = [local(p.grad) for p in zero_model.parameters() if p.grad is not None], trainer.optimizer
        result[f"zero{zero}"] = [_unique_bytes(local(p) for p in zero_model.parameters()), _unique_bytes(grads),
                                 _state_bytes(stepped)]
    return result


# ------------------------------------------------------------------------------------------------ the tests
_REAL: dict = {}


def _real(pool, spec: dict) -> list[dict]:
    """Every rank's real_step for ``spec``, run once per session."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _REAL:
        _REAL[key] = pool.run(real_step, spec)
    return _REAL[key]


def _planned(report: PlanReport, phase: str) -> list:
    return [c for entry in report.stages[0].collectives for c in entry.collectives if c.phase == phase]


def _plan_tp2(sp: bool) -> PlanReport:
    return shardlib.plan(BertConfig(**BERT), tp=2, dp=2, sequence_parallel=sp, batch=BATCH, seq=SEQ)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-megatron-sp"])
def test_bytes_and_collectives_equal_a_real_run(pool, sp):
    report = _plan_tp2(sp)
    stage = report.stages[0]
    phases = ("forward", "backward") if not sp else ("forward",)  # SP backward: the test below
    for real in _real(pool, {"tp": 2, "pp": 1, "sp": sp}):
        assert (real["parameters"], real["gradients"], real["optimizer"]) == \
            (stage.parameter_bytes, stage.gradient_bytes, stage.optimizer_bytes)
        for zero in stage.zero[1:] if not sp else stage.zero[1:2]:  # 2 (its AdamW state is ZeRO-1's) and 3
            assert real[f"zero{zero.zero}"] == [zero.parameters[real["dp"]], zero.gradients[real["dp"]],
                                                zero.optimizer[real["dp"]]], zero.zero
        for phase in phases:
            planned = _planned(report, phase)
            assert dict(Counter(c.op for c in planned)) == real["counts"][phase], phase
            assert sorted((c.op, c.dim, c.bytes) for c in planned) == [tuple(s) for s in real["sizes"][phase]], phase
    assert sum(z.optimizer[0] < stage.optimizer_bytes for z in stage.zero) == 3  # ZeRO 1, 2, 3 all save


def test_sequence_parallel_backward_equals_a_real_run(pool):
    """The backward re-gathers of saved sequence shards too (matched by storage on meta tensors as on real ones)."""
    report = _plan_tp2(True)
    for real in _real(pool, {"tp": 2, "pp": 1, "sp": True}):
        planned = _planned(report, "backward")
        assert sorted((c.op, c.dim, c.bytes) for c in planned) == [tuple(s) for s in real["sizes"]["backward"]]


def test_pipeline_stage_bytes_equal_a_real_pipeline(pool):
    report = shardlib.plan(BertConfig(**BERT), tp=2, pp=2, batch=BATCH, seq=SEQ)
    reals = pool.run(real_step, {"tp": 2, "pp": 2, "sp": False})
    for real in reals:
        stage = report.stages[real["pp"]]
        assert (real["parameters"], real["gradients"], real["optimizer"]) == \
            (stage.parameter_bytes, stage.gradient_bytes, stage.optimizer_bytes)
    assert len({r["parameters"] for r in reals}) == 2  # the stages differ: the comparison is not vacuous
    hidden = BERT["hidden_size"]
    assert report.stages[0].sends == [TensorSpec((BATCH, SEQ, hidden), "float32", BATCH * SEQ * hidden * 4, True)]
    assert report.stages[0].layers == ["bert.encoder.layer.0"] and report.stages[1].sends == []
    step = report.stages[0].step
    assert [(c.op, c.dim) for c in step] == [("all_reduce", "pp")]  # the tied word embeddings' gradient


def test_zero3_pipeline_stage_bytes_equal_a_real_pipeline(pool):
    """pp=2 x dp=2 at zero=3: each stage's FSDP2 shards of parameters, gradients and AdamW state after a Trainer
    step, as the dry run predicts them for that stage and dp rank."""
    report = shardlib.plan(BertConfig(**BERT), pp=2, dp=2, batch=BATCH, seq=SEQ)
    reals = pool.run(real_step, {"tp": 1, "pp": 2, "sp": False, "zero": 3})
    for real in reals:
        stage = report.stages[real["pp"]]
        zero3 = next(z for z in stage.zero if z.zero == 3)
        assert (real["held parameters"], real["gradients"], real["optimizer"]) == \
            (zero3.parameters[real["dp"]], zero3.gradients[real["dp"]], zero3.optimizer[real["dp"]])
        assert real["held parameters"] < 0.6 * stage.parameter_bytes


def test_t5_every_layer_of_a_stack_gets_its_own_collectives():
    """Backward collectives go to the layer whose forward made them, also where T5's layers share a position bias
    and the encoder output (torch's ModTracker would keep earlier layers 'running' there)."""
    config = T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=3, num_heads=4,
                      feed_forward_proj="gated-gelu", architectures=["T5ForConditionalGeneration"])
    report = shardlib.plan(config, tp=2, pp=2, batch=2, seq=6)
    for stage in report.stages:
        for entry in stage.collectives:
            if not entry.layer:
                continue
            relative = Counter((c.phase, c.module[len(entry.layer):]) for c in entry.collectives)
            regions = 3 if entry.layer.startswith("decoder") else 2  # attention(s) and MLP
            assert sum(n for (phase, _), n in relative.items() if phase == "forward") == regions, entry
            # cross-attention's backward: the query only (the encoder states enter once, at the decoder stack)
            assert sum(n for (phase, _), n in relative.items() if phase == "backward") == regions, entry


def test_report_round_trips_through_json_and_renders():
    report = shardlib.plan(BertConfig(**BERT), tp=2, dp=2, batch=BATCH, seq=SEQ)
    again = PlanReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    text = str(report)
    assert "bert.encoder.layer.0..1, each:" in text and "zero-3" in text and "all_reduce" in text
    half = shardlib.plan(BertConfig(**BERT), tp=2, dp=2, batch=BATCH, seq=SEQ, dtype="bfloat16").stages[0]
    assert 2 * half.parameter_bytes == report.stages[0].parameter_bytes


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_on_a_config_file_and_a_saved_model(tmp_path, capsys):
    from transformers import BertForMaskedLM

    BertConfig(**BERT).to_json_file(tmp_path / "config.json")
    BertForMaskedLM(BertConfig(**BERT)).save_pretrained(tmp_path / "saved")
    code, text, _ = _cli(capsys, tmp_path / "config.json", "--tp", 2, "--sp", "megatron", "--seq", SEQ)
    assert code == 0 and "sequence parallel: megatron" in text and "reduce_scatter_tensor" in text
    code, out, _ = _cli(capsys, tmp_path / "saved", "--tp", 2, "--pp", 2, "--seq", SEQ, "--json")
    report = PlanReport.from_dict(json.loads(out))
    assert code == 0 and report.mesh == {"dp": 1, "pp": 2, "sp": 1, "tp": 2} and len(report.stages) == 2


def test_cli_refused_layout_prints_the_plan_error_and_exits_2(tmp_path, capsys):
    from transformers import BertForMaskedLM

    from shardlib.parallel.mesh import fake_world

    BertConfig(**BERT).to_json_file(tmp_path / "config.json")
    with torch.device("meta"):
        model = BertForMaskedLM(BertConfig(**BERT))
    with fake_world(3), pytest.raises(PlanError) as refused:
        shardlib.shard(model, shardlib.init_mesh(tp=3))
    code, out, err = _cli(capsys, tmp_path / "config.json", "--tp", 3, "--seq", SEQ)
    assert code == 2 and out == "" and err == f"shardlib plan: {refused.value}\n"
    assert "num_attention_heads = 4 is not divisible by tp=3" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["{tmp}/missing/config.json"], "{tmp}/missing/config.json: no such file or directory"),
    (["{tmp}/config.json", "--class", "NoSuchModel"], "transformers has no model class 'NoSuchModel'"),
    (["{tmp}/config.json", "--tp", "0"], "tp must be a positive integer, got 0"),
    (["{tmp}/config.json", "--sp", "all_to_all"], "--sp all_to_all: expected"),
], ids=["missing", "unknown-class", "zero-tp", "sp-size"])
def test_cli_bad_input_is_one_line(tmp_path, capsys, argv, message):
    BertConfig(**BERT).to_json_file(tmp_path / "config.json")
    code, out, err = _cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 1 and out == "" and err.count("\n") == 1 and message.format(tmp=tmp_path) in err


def test_a_class_without_policy_is_planned_by_its_inferred_plan(tmp_path, capsys):
    """The CLI resolves the plan as shard() does: GPT-2 has no hand policy, so its inferred plan is dry-run (a class
    with neither: tests/test_plan_inferred.py)."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, architectures=["GPT2LMHeadModel"]).to_json_file(tmp_path / "c.json")
    code, out, err = _cli(capsys, tmp_path / "c.json")
    assert code == 0 and "GPT2LMHeadModel" in out and "inferred" in out, (out, err)


def test_plan_function_and_plan_module_do_not_collide():
    """``shardlib.plan`` is the dry run's function; the plan's data types live in ``shardlib.sharding.plan``."""
    import importlib

    from shardlib.sharding.plan import Plan, PlanError, Stack

    assert callable(shardlib.plan) and shardlib.plan.__module__ == "shardlib.analysis.dryrun"
    module = importlib.import_module("shardlib.sharding.plan")
    assert (module.Plan, module.PlanError, module.Stack) == (Plan, PlanError, Stack)
    assert (Plan, PlanError, Stack) == (shardlib.Plan, shardlib.PlanError, shardlib.Stack)


@ci_only("about 7 s: a subprocess that imports torch and transformers")
def test_inside_a_real_run_the_dry_run_goes_to_a_subprocess():
    options = dict(tp=2, batch=BATCH, seq=SEQ, activation_checkpointing=True, precision="bf16")
    expected = shardlib.plan(BertConfig(**BERT), **options)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert shardlib.plan(BertConfig(**BERT), **options) == expected
    finally:
        dist.destroy_process_group()


def test_the_subprocess_gets_every_option(monkeypatch):
    """Every option of plan() reaches the subprocess's command line (activation checkpointing was once dropped)."""
    import subprocess

    from shardlib.analysis import dryrun

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **k: seen.append(argv) or subprocess.CompletedProcess(
        argv, 1, "", "shardlib plan: stop here"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(PlanInputError):
        shardlib.plan(BertConfig(**BERT), tp=2, pp=2, batch=3, seq=5, microbatches=2, activation_checkpointing=True,
                      precision="fp16", device_type="cuda")
    argv = seen[0]
    for flag in ("--tp=2", "--pp=2", "--batch=3", "--seq=5", "--microbatches=2", "--activation-checkpointing",
                 "--precision=fp16", "--device-type=cuda"):
        assert flag in argv, (flag, argv)


@pytest.mark.parametrize("code, error", [(2, PlanError), (1, PlanInputError)])
def test_the_subprocess_errors_come_back_as_the_same_exceptions(monkeypatch, code, error):
    import subprocess

    from shardlib.analysis import dryrun

    stderr = "some warning\nshardlib plan: cannot shard BertForMaskedLM at tp=3:\n  problem one\n  problem two\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, code, "", stderr))
    with pytest.raises(error) as raised:
        dryrun._plan_in_subprocess(BertConfig(**BERT), None, None, None, dict(tp=3, sp=1, sequence_parallel=None))
    assert str(raised.value) == "cannot shard BertForMaskedLM at tp=3:\n  problem one\n  problem two"


def test_bert_large_plans_in_under_10_seconds():
    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                        architectures=["BertForMaskedLM"])
    start = time.perf_counter()
    report = shardlib.plan(config, tp=8, pp=4)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert [len(s.layers) for s in report.stages] == [6, 7, 7, 4]  # cost model: embeddings and the head weigh


def test_bad_sizes_are_refused_before_anything_runs():
    with pytest.raises(PlanInputError, match="batch must be a positive integer"):
        shardlib.plan(BertConfig(**BERT), batch=0)
    with pytest.raises(PlanInputError, match="max_position_embeddings=16"):
        shardlib.plan(BertConfig(**BERT), seq=17)
