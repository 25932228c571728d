"""Every refusal of the core modules that no other test triggers: each case checks the exception type and the text
that names the offending module, size or value, and where the refusal promises it, that nothing changed. One
process; ``OfflineMesh`` for sharding without processes, ``fake_world`` where a mesh needs a process group. The
table of every refusal of these modules and the test of each: docs/bad-input.md."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel, BertModel, T5Config, T5ForConditionalGeneration
from transformers.pytorch_utils import Conv1D

import shardlib
from shardlib.analysis.metarun import PlanInputError
from shardlib.parallel.mesh import MeshError, OfflineMesh, fake_world, init_mesh
from shardlib.parallel.styles import ColwiseParallel
from shardlib.policies import Policy, policy_for, policy_for_class_name
from shardlib.sharding.plan import AttentionSite, LossItems, LossSpec, PlanError

BERT = dict(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
T5 = dict(vocab_size=32, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2, decoder_start_token_id=0,
          pad_token_id=0)
IDS = torch.zeros(1, 4, dtype=torch.long)


def bert(cls=BertForMaskedLM, **overrides):
    torch.manual_seed(0)
    return cls(BertConfig(**{**BERT, **overrides}))


def t5():
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(**T5))


def edited(model, edit) -> Policy:
    """The model's registered policy with ``edit(plan)`` applied to its plan (a policy author's mistake)."""
    base = policy_for(model)
    return Policy(name="edited", model_classes=(), make_plan=lambda m, tp: edit(base.plan(m, tp)))


def snapshot(model):
    return ([(name, type(m), id(m)) for name, m in model.named_modules()], type(model),
            {k: v.clone() for k, v in model.state_dict().items()}, model.config._attn_implementation)


def assert_unchanged(model, before):
    modules, cls, state, attention = snapshot(model)
    assert (modules, cls, attention) == before[:2] + before[3:]
    assert state.keys() == before[2].keys() and all(torch.equal(state[k], before[2][k]) for k in state)
    assert shardlib.shard_state(model, required=False) is None


# -------------------------------------------------------------------------------------------------- parallel/mesh.py
def test_init_mesh_refusal_names_dp_and_leaves_no_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MeshError, match=r"dp must be a positive integer, got 0 \(this process is a world of one"):
        init_mesh(dp=0)
    assert not dist.is_initialized()


def test_incomplete_launcher_environment_names_the_missing_variables(monkeypatch):
    for var in ("WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(MeshError, match="launcher environment is incomplete \\(missing WORLD_SIZE, MASTER_ADDR\\)"):
        init_mesh(tp=2)
    assert not dist.is_initialized()


@pytest.mark.parametrize("tp, rank", [(0, 0), (2, 2), (2, -1)])
def test_offline_mesh_refuses_a_rank_outside_tp(tp, rank):
    with pytest.raises(MeshError, match=f"offline mesh needs tp >= 1 and 0 <= tp_rank < tp, got tp={tp}, rank={rank}"):
        OfflineMesh(tp=tp, tp_rank=rank)


# ------------------------------------------------------------------------- sharding/plan.py, parallel/layout.py, ...
def _refuse(problems: list[str]):
    """A style check's problems raised as shard() reports them."""
    if problems:
        raise PlanError("; ".join(problems))


@pytest.mark.parametrize("make, error, message", [
    (lambda: LossItems(key="mask", count="mask"), PlanError, "LossItems.count must be 'targets' or 'true', got 'mask'"),
    (lambda: shardlib.Layout((2, 3), shard_dim=2), ValueError, r"shard_dim 2 out of range for shape \(2, 3\)"),
    (lambda: shardlib.Layout((4,), shard_dim=0, num_shards=0), ValueError, "num_shards must be >= 1, got 0"),
    (lambda: shardlib.Layout((4,), shard_dim=0, num_shards=2).shard(torch.zeros(5), 0), ValueError,
     r"tensor of shape \(5,\) does not match layout \(4,\)"),
    (lambda: policy_for_class_name("GPT2Model"), PlanError, "no shardlib policy for model class GPT2Model"),
    (lambda: shardlib.Layout((8, 18), shard_dim=1, num_shards=4, blocks=3), ValueError,
     r"a dim of 3 blocks must divide into 3 x 4 equal parts, got shape \(8, 18\) split on dim 1"),
    (lambda: _refuse(ColwiseParallel(blocks=3).check("h.0.attn.c_attn", Conv1D(18, 8), 4)), PlanError,
     r"h\.0\.attn\.c_attn: out_features 18 is not divisible by tp=4 in each of its 3 fused blocks"),
], ids=["loss-items-count", "layout-dim", "layout-shards", "layout-shape", "policy-by-name", "layout-blocks",
        "fused-projection-blocks"])
def test_plain_data_refusals(make, error, message):
    with pytest.raises(error, match=message):
        make()


# ------------------------------------------------------------------------------------------------ parallel/random.py
def test_rng_tracker_refusals():
    tracker = shardlib.RNGStatesTracker()
    tracker.add("tensor-parallel", 1)
    with pytest.raises(ValueError, match="RNG state 'tensor-parallel' already exists"):
        tracker.add("tensor-parallel", 2)
    with pytest.raises(ValueError, match=r"RNG stream 'sp': rank index 2 is not in \[0, 2\)"):
        tracker.add("sp", 1, index=2, count=2)
    assert not tracker.has("sp")
    with pytest.raises(KeyError, match="RNG state 'sequence-parallel' was never added"):
        with tracker.fork("sequence-parallel"):
            pass


# ------------------------------------------------------------------------------------------- parallel/collectives.py
def test_collectives_refuse_a_size_the_group_does_not_divide():
    from shardlib.parallel.collectives import all_to_all_single, split

    with fake_world(2):
        group = dist.group.WORLD
        with pytest.raises(ValueError, match="all-to-all: size 3 of dim 0 is not divisible by 2 ranks"):
            all_to_all_single((torch.zeros(3, 2),), 0, 1, group)
        with pytest.raises(ValueError, match="cannot split size 5 of dim 1 evenly over 2 ranks"):
            split(torch.zeros(2, 5), 1, group)


# ------------------------------------------------------------------------------------------------- sharding/state.py
@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.update(extra=torch.zeros(1)), "unexpected key 'extra'"),
    (lambda sd: sd.pop("bert.embeddings.LayerNorm.weight"), "missing parameter 'bert.embeddings.LayerNorm.weight'"),
    (lambda sd: sd.update({"bert.embeddings.word_embeddings.weight": torch.zeros(62, 16)}),
     r"bert.embeddings.word_embeddings.weight: shape \(62, 16\) != model \(61, 16\)"),
], ids=["unexpected", "missing", "shape"])
def test_load_full_state_dict_refuses_before_copying_anything(change, message):
    model = shardlib.shard(bert(), OfflineMesh(tp=2))
    full = {name: p.detach() + 1 for name, p in bert().named_parameters()}  # every value differs from the model's
    change(full)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"cannot load state dict:\n  {message}"):
        shardlib.load_full_state_dict(model, full)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ shard(): sequence, all-to-all, pipeline, kernels
def _no_trunk(plan):
    return dataclasses.replace(plan, trunk=())


def _stacks_without_end(plan):
    first, *rest = plan.trunk
    return dataclasses.replace(plan, trunk=(dataclasses.replace(first, end=None), *rest))


SHARD_REFUSALS = {
    "sp-without-trunk": (bert, OfflineMesh(tp=2), dict(sequence_parallel=True), _no_trunk,
                         r"sequence_parallel needs the policy's layer trunk \(Plan.trunk\)"),
    "sequence-dropout-not-dropout": (
        bert, OfflineMesh(tp=2), dict(sequence_parallel=True),
        lambda plan: dataclasses.replace(plan, sequence_dropout=("bert.encoder.layer.*.output.dense",)),
        "bert.encoder.layer.0.output.dense: sequence_dropout applies to torch.nn.Dropout, found torch.nn.Linear"),
    "all-to-all-no-attention": (bert, OfflineMesh(sp=2), dict(sequence_parallel="all_to_all"),
                                lambda plan: dataclasses.replace(plan, attention={}),
                                r"the policy of BertForMaskedLM lists no attention modules \(Plan.attention\)"),
    "all-to-all-kv-input": (
        bert, OfflineMesh(sp=2), dict(sequence_parallel="all_to_all"),
        lambda plan: dataclasses.replace(plan, attention={
            "bert.encoder.layer.*.attention.self": AttentionSite("num_attention_heads", kv_input="memory")}),
        r"bert.encoder.layer.1.attention.self: forward has no argument 'memory' \(AttentionSite.kv_input\)"),
    "zero-stages": (bert, OfflineMesh(pp=2), dict(stages_per_rank=0), None,
                    "the number of pipeline stages must be >= 1, got 0"),
    "pipeline-without-trunk": (bert, OfflineMesh(pp=2), {}, _no_trunk,
                               "BertForMaskedLM: the policy declares no layer trunk, so it cannot be pipelined"),
    "stack-without-end": (t5, OfflineMesh(pp=2), {}, _stacks_without_end,
                          "stack encoder.block is followed by another stack but names no end module and output_arg"),
    "trunk-without-layers": (lambda: bert(num_hidden_layers=0), OfflineMesh(pp=2), {}, None,
                             "BertForMaskedLM: the trunk has no layers"),
}


@pytest.mark.parametrize("case", SHARD_REFUSALS, ids=str)
def test_shard_refusals_change_nothing(case):
    make, mesh, options, edit, message = SHARD_REFUSALS[case]
    model = make()
    before = snapshot(model)
    policy = edited(model, edit) if edit else None
    with pytest.raises(PlanError, match=f"cannot shard {type(model).__name__} with policy '[a-z0-9]+' "
                                        f"[^\n]*:\n(  .*\n)*  {message}"):
        shardlib.shard(model, mesh, policy, **options)
    assert_unchanged(model, before)


def _attach_epilogue(model):
    model.bert.encoder.layer[1].intermediate.dense.epilogue = shardlib.kernels.epilogues.BiasGELU()


def _replace_dropout(model):
    model.bert.encoder.layer[1].output.dropout = nn.Identity()


@pytest.mark.parametrize("kernels, tamper, message", [
    (dict(bias_gelu=True), _attach_epilogue,
     r"bert.encoder.layer.1.intermediate.dense: already has an epilogue \(BiasGELU\(approximate='none'\)\)"),
    (dict(dropout_add=True), _replace_dropout,
     "bert.encoder.layer.1.output.dropout: dropout_add needs an nn.Dropout, found Identity"),
    (dict(dropout_add=True), "digest",
     "bert.encoder.layer.0.attention.output: BertSelfOutput.forward is not the transformers 5.23 forward the "
     "fused dropout_add restates"),
], ids=["second-epilogue", "not-dropout", "forward-changed"])
def test_kernel_refusals_change_nothing(monkeypatch, kernels, tamper, message):
    from shardlib.kernels import Kernels, epilogues

    model = bert()
    if tamper == "digest":  # what a transformers release that rewrote the stock forward looks like
        monkeypatch.setattr(epilogues, "_source_digest", lambda stock: "changed")
    else:
        tamper(model)
    before = snapshot(model)
    with pytest.raises(PlanError, match=message):
        shardlib.shard(model, OfflineMesh(), kernels=Kernels(**kernels))
    assert_unchanged(model, before)


# ------------------------------------------------------------------------------------------ kernels, called directly
@pytest.mark.parametrize("call, message", [
    (lambda E: E.bias_gelu(torch.zeros(2, 3), None, approximate="exact"),
     "bias_gelu: approximate must be 'none' or 'tanh', got 'exact'"),
    (lambda E: E.BiasGELU("exact"), "BiasGELU: approximate must be 'none' or 'tanh', got 'exact'"),
], ids=["function", "module"])
def test_bias_gelu_refuses_an_unknown_approximation(call, message):
    from shardlib.kernels import epilogues

    with pytest.raises(ValueError, match=message):
        call(epilogues)


def _sparse_weight(m):
    m.weight = nn.Parameter(m.weight.detach().to_sparse())


def _three_d_weight(m):
    m.weight = nn.Parameter(torch.zeros(16, 32, 1))


def _double_bias(m):
    m.bias = nn.Parameter(m.bias.detach().double())


def _own_forward(m):
    m.forward = lambda x: x


@pytest.mark.parametrize("tamper, message", [
    (_own_forward, r"k: forward is overridden on the instance \(<function"),
    (_three_d_weight, r"k: weight is not a 2-D tensor \(shape \(16, 32, 1\)\)"),
    (_double_bias, "k: bias is torch.float64 on cpu but weight is torch.float32 on cpu"),
    (_sparse_weight, "k: weight layout torch.sparse_coo is not strided"),
], ids=["instance-forward", "3d-weight", "bias-dtype", "sparse-weight"])
def test_fused_qkv_refusals_install_nothing(tamper, message):
    from shardlib.kernels.fused_qkv import fuse_linears

    q, k = nn.Linear(32, 16), nn.Linear(32, 16)
    tamper(k)
    with pytest.raises(ValueError, match=f"cannot fuse these linears into one GEMM:\n  {message}"):
        fuse_linears([q, k], names=["q", "k"])
    assert "forward" not in q.__dict__


@pytest.mark.parametrize("mode", ["all_to_all", "ring"])
def test_sequence_parallelism_refuses_to_reuse_a_split_kv_cache(mode):
    """Incremental decoding by hand on a cache a split forward filled (each rank holds its chunk of it): refused at
    the stack entry, for BERT's decoder and T5's (generate() decodes unsplit: test_ring_attention.py). The error
    comes through unchanged (no hook error on top)."""
    import warnings

    message = r"this key/value cache was filled by a forward that split the sequence \(2 tokens"
    with fake_world(2):
        model = shardlib.shard(bert(BertLMHeadModel, is_decoder=True).eval(), init_mesh(sp=2),
                               sequence_parallel=mode)
        cache = model(input_ids=IDS, use_cache=True).past_key_values
        with pytest.raises(RuntimeError, match=message):
            model(input_ids=IDS[:, :1], past_key_values=cache, use_cache=True)
        model = shardlib.shard(t5().eval(), init_mesh(sp=2), sequence_parallel=mode)
        cache = model(input_ids=IDS, decoder_input_ids=IDS, use_cache=True).past_key_values
        with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match=message):
            warnings.simplefilter("always")
            model(input_ids=IDS, decoder_input_ids=IDS[:, :1], past_key_values=cache, use_cache=True)
    assert not [w for w in caught if "always_call" in str(w.message)]


# ------------------------------------------------------------------------------------------------ sharding/losses.py
def test_unknown_loss_kind_installs_nothing():
    from shardlib.sharding.losses import install_vocab_parallel_loss

    model = bert()
    with pytest.raises(ValueError, match=r"unknown loss kind 'bogus'; known: \['causal_lm', 'masked_lm'"):
        install_vocab_parallel_loss(model, LossSpec(kind="bogus", head="cls.predictions.decoder"), None)
    assert type(model) is BertForMaskedLM


# ---------------------------------------------------------------------------------------------------- train/optim.py
def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _used_sgd(params):
    optimizer = _sgd(params)
    optimizer.state[params[0]]["momentum_buffer"] = torch.zeros_like(params[0])
    return optimizer


@pytest.mark.parametrize("call, error, message", [
    (lambda o: o.base_optimizer(lambda p: "sgd", [nn.Parameter(torch.zeros(2))]),
     TypeError, "optimizer\\(params\\) gave a str, not a torch.optim.Optimizer"),
    (lambda o: o.build_optimizer(_used_sgd([nn.Parameter(torch.zeros(2))]), master_weights=True, zero=0),
     ValueError, "SGD built by optimizer\\(params\\) already holds state"),
    (lambda o: o.check_zero(2, False, OfflineMesh(dp=2), _sgd, base=torch.optim.LBFGS([nn.Parameter(
        torch.zeros(2))])), ValueError, "zero=2 partitions every parameter by elements .* LBFGS is not one of them"),
    (lambda o: o.check_zero(1, True, OfflineMesh(dp=2), _sgd), ValueError,
     "offload=True is FSDP2's CPUOffloadPolicy and needs zero=3 \\(got zero=1\\)"),
    (lambda o: o.check_zero(3, True, OfflineMesh(dp=2), _sgd), ValueError,
     "offload=True moves zero=3's parameters, gradients and optimizer state from the GPU to host memory, but this "
     "mesh runs on 'cpu', where they already are"),
    (lambda o: o.check_zero(1, False, OfflineMesh(dp=2), None), ValueError,
     r"zero=1 partitions an optimizer: pass Trainer\(model, optimizer=lambda params: ...\)"),
    (lambda o: o.check_zero(3, False, OfflineMesh(dp=2), _sgd, master_weights=True), ValueError,
     "zero=3 with master_weights: FSDP2 keeps the sharded parameters in their own dtype"),
    (lambda o: o.check_zero(0, False, OfflineMesh(dp=2), _sgd, overlap=True), ValueError,
     "overlap_param_gather overlaps zero=1/2's parameter all-gather with the next forward; zero=0 has none"),
    (lambda o: o.check_zero(1, False, OfflineMesh(dp=2), _sgd, overlap=True, compiled=True), ValueError,
     "overlap_param_gather waits for each bucket in module forward hooks, which torch.compile would trace"),
    (lambda o: o.MasterWeightsOptimizer([nn.Parameter(torch.zeros(2).half())], torch.optim.SGD, lr=0.1).state_dict(),
     NotImplementedError, r"save through shardlib.checkpoint.save\(model, dir, optimizer=...\)"),
    (lambda o: o.MasterWeightsOptimizer([nn.Parameter(torch.zeros(2).half())], torch.optim.SGD,
                                        lr=0.1).load_state_dict({}),
     NotImplementedError, r"load through shardlib.checkpoint.load\(model, dir, optimizer=...\)"),
], ids=["not-an-optimizer", "used-optimizer", "zero-not-elementwise", "offload-without-zero3", "offload-without-cuda",
        "zero-without-optimizer", "zero3-master-weights", "overlap-without-zero12", "overlap-compiled", "master-save",
        "master-load"])
def test_optimizer_refusals(call, error, message):
    from shardlib.train import optim

    with pytest.raises(error, match=message):
        call(optim)


# ------------------------------------------------------------------------------------------------ analysis/export.py
class _ReturnsAnObject(nn.Module):
    def forward(self, x):
        return type("Output", (), {"x": x})()


class _ReadsAPointer(nn.Module):
    def forward(self, x):
        x.data_ptr()
        return x + 1


@pytest.mark.parametrize("model, message", [
    (_ReturnsAnObject(), "cannot export _ReturnsAnObject: RuntimeError: Found <class '.*Output'> in output, which is "
                         "not a known type.*\n  hint: the forward returns an object that is not a pytree"),
    (_ReadsAPointer(), r"cannot export _ReadsAPointer: module \(the root model\) \(_ReadsAPointer\) cannot be traced, "
                       r"in .*test_refusals.py:\d+ in forward: RuntimeError: Cannot access data pointer.*"
                       r"\n  raised at .*test_refusals.py:\d+ in forward\n  hint: the code reads a tensor's storage"),
], ids=["not-a-pytree", "data-pointer"])
def test_export_failures_name_the_cause_and_hint(model, message):
    from shardlib.analysis.export import ExportError, export

    with pytest.raises(ExportError, match=message):
        export(model, (torch.ones(2),))


# --------------------------------------------------------------------------- analysis/dryrun.py, analysis/metarun.py
def _bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    return tmp_path / "config.json"


@pytest.mark.parametrize("source, options, message", [
    (_bad_json, {}, "config.json: cannot read a model config"),
    (lambda tmp: BertConfig(**BERT), {}, r"the BertConfig names no model class \(architectures\): pass the class"),
    (lambda tmp: shardlib.shard(bert(), OfflineMesh()), {}, "this BertForMaskedLM is sharded already: plan its config"),
    (lambda tmp: T5Config(**T5), {"cls": "BertModel"},
     "cannot build BertModel from a T5Config: 'T5Config' object has no attribute"),
    (lambda tmp: T5Config(**T5), {"cls": "T5ForSequenceClassification"},
     "T5ForSequenceClassification cannot run on the meta device, so it cannot be planned: aten::unique_consecutive"),
], ids=["unreadable-config", "no-architectures", "sharded-model", "wrong-class", "meta-only-op"])
def test_plan_input_refusals(tmp_path, source, options, message):
    with pytest.raises(PlanInputError, match=message):
        shardlib.plan(source(tmp_path), batch=1, seq=4, **options)


def test_plan_inside_a_real_run_refuses_a_policy_object():
    model = bert()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(PlanInputError, match="goes to a subprocess, which cannot take a policy object"):
            shardlib.plan(model, policy=policy_for(model))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------- pipeline/
def test_pipeline_runtime_refusals():
    from shardlib.pipeline import PipelineRunner

    with fake_world(2):
        model = shardlib.shard(bert(), init_mesh(pp=2))
        split = shardlib.shard_state(model).pipeline
        with pytest.raises(RuntimeError, match="BertForMaskedLM is split into 2 pipeline stages; run it with "
                                               "shardlib.Trainer"):
            model(input_ids=IDS)
        with pytest.raises(ValueError, match=r"schedule 'interleaved_1f1b' with 1 stage\(s\) per rank: interleaved "
                                             r"schedules need shard\(..., stages_per_rank >= 2\)"):
            PipelineRunner(split, "interleaved_1f1b")
        with pytest.raises(ValueError, match="pipeline schedule '1f1b' with 1 microbatches over 2 stages: Number of "
                                             "microbatches"):
            PipelineRunner(split, "1f1b").step({"input_ids": IDS}, 1, lambda out, target: out, IDS[:, 0])
        model = shardlib.shard(bert(num_hidden_layers=4), init_mesh(pp=2), stages_per_rank=2)
        with pytest.raises(ValueError, match=r"schedule 'gpipe' with 2 stage\(s\) per rank"):
            PipelineRunner(shardlib.shard_state(model).pipeline, "gpipe")


def test_pipeline_carry_of_a_missing_output_names_the_layer():
    """A policy whose Stack.carry asks for a second output of BERT layers (they return one tensor)."""
    model = bert(BertModel)
    policy = edited(model, lambda plan: dataclasses.replace(plan, trunk=tuple(
        dataclasses.replace(stack, carry=((0, 0), (1, 1))) for stack in plan.trunk)))
    with fake_world(2):
        shardlib.shard(model, init_mesh(pp=2), policy)
        stage = shardlib.shard_state(model).pipeline.stage_modules[0]
        stage.input_name = "input_ids"
        with pytest.raises(PlanError, match=r"a pipeline carry \(Stack.carry\) asks for output 1 of "
                                            "encoder.layer.0, which returns one tensor"):
            stage(IDS)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """Every refusal leaves the process as it was: no default process group behind it."""
    yield
    assert not dist.is_initialized()


def test_plan_of_a_model_whose_forward_refuses_its_config_is_a_plan_input_error():
    """T5ForSequenceClassification without ``decoder_start_token_id``: HF's own forward fails (was a raw error
    out of ``shardlib.plan``)."""
    from transformers import T5Config

    from shardlib.analysis.dryrun import PlanInputError

    config = T5Config(vocab_size=45, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2,
                      decoder_start_token_id=None)
    with pytest.raises(PlanInputError, match=r"T5ForSequenceClassification's forward failed on the planning batch"):
        shardlib.plan(config, cls="T5ForSequenceClassification", batch=1, seq=4)


def test_load_full_state_dict_on_an_offline_mesh_keeps_that_ranks_rows():
    """``OfflineMesh(tp=2, tp_rank=1)`` has no process group: the rank comes from the mesh (was: rank 0's rows)."""
    from transformers import BertConfig, BertForMaskedLM

    from shardlib.parallel.mesh import OfflineMesh

    config = BertConfig(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=32)
    full = BertForMaskedLM(config).state_dict()
    model = shardlib.shard(BertForMaskedLM(config), OfflineMesh(tp=2, tp_rank=1))
    shardlib.load_full_state_dict(model, full)
    query = model.bert.encoder.layer[0].attention.self.query.weight
    assert torch.equal(query, full["bert.encoder.layer.0.attention.self.query.weight"][8:])
