"""A failed ``shard()`` changes nothing (shardlib.sharding.transaction), and a model whose attention is a custom
function registered in transformers' ``AttentionInterface`` shards and computes what it computes unsharded.

The property draws a model (BERT, ViT, T5 families, every head), a layout (tp 1/2/4, Megatron or all-to-all
sequence parallelism, pp 2), options, and one injected failure: an extra problem from the k-th pass's checks, or an
exception raised before, in the middle of or after the k-th install step (each pass's ``prepare`` and ``install``,
then attaching the shard state). After the exception the model's parameters (names, objects, bits, hooks), modules
(tree, classes, every attribute and container entry by identity), configs and the attention registries are exactly
as before, it computes what it computed, and it shards cleanly afterwards. The checks of every pass, which run
before the first install, are also seen to change nothing. Sharding runs on fake process groups (no ranks).
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedConfig

import rank_tasks
import shardlib
import strategies
from profiles import ci_only, examples
from shardlib.kernels.attention import registries
from shardlib.parallel.mesh import fake_world
from shardlib.sharding import passes as passes_module
from shardlib.sharding import sharder
from shardlib.sharding.sharded import ShardState
from test_kernels_attention import SPECS


class Injected(Exception):
    """The failure the test raises inside an install step."""


# ------------------------------------------------------------------------------------------------ fingerprint
def _ids(container):
    if isinstance(container, dict):
        return {k: id(v) for k, v in container.items()}
    return [id(v) for v in container] if isinstance(container, list) else sorted(map(id, container))


def _object(obj) -> tuple:
    """An object's class and every attribute by identity, one level into the containers it holds."""
    return type(obj), {k: (id(v), _ids(v) if isinstance(v, (dict, list, set)) else None)
                       for k, v in vars(obj).items()}


def _tensor(t: torch.Tensor) -> tuple:
    hooks = tuple(None if (h := getattr(t, n, None)) is None else _ids(h)
                  for n in ("_backward_hooks", "_post_accumulate_grad_hooks"))
    bits = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return id(t), t.dtype, tuple(t.shape), t.stride(), t.requires_grad, id(t.grad), hooks, _object(t), bits


def fingerprint(model: torch.nn.Module) -> dict:
    """Everything a failed shard() must leave as it was (module docstring), as comparable data."""
    modules = dict(model.named_modules(remove_duplicate=False))
    configs = {id(v): v for m in modules.values() for v in vars(m).values() if isinstance(v, PreTrainedConfig)}
    return {
        "modules": {n: (id(m), *_object(m)) for n, m in modules.items()},
        "parameters": {n: _tensor(p) for n, p in model.named_parameters(remove_duplicate=False)},
        "buffers": {n: _tensor(b) for n, b in model.named_buffers(remove_duplicate=False)},
        "configs": {k: (_object(c), c.to_dict()) for k, c in configs.items()},
        "registries": [dict(m) for m in registries()],
        "rng": torch.get_rng_state().numpy().tobytes(),
    }


def assert_same(before: dict, after: dict, when: str) -> None:
    for part, value in before.items():
        if after[part] == value:
            continue
        if isinstance(value, dict):
            changed = sorted(str(k) for k in value.keys() | after[part].keys() if value.get(k) != after[part].get(k))
            raise AssertionError(f"{when}: {part} changed: {changed[:5]}")
        raise AssertionError(f"{when}: {part} changed")


# ----------------------------------------------------------------------------------------------- the property
@st.composite
def cases(draw):
    """A model spec (tests/strategies.py) with its shard() options, a pipeline sometimes, and the failure."""
    family = draw(st.sampled_from(["bert", "vit", "t5"]))
    spec = draw({"bert": strategies.bert_specs, "vit": strategies.vit_specs, "t5": strategies.t5_specs}[family]())
    spec.update(family=family, meta=False)
    sp = spec.get("sp_size", 1) if spec.get("sp") in rank_tasks.SP_DIM_MODES else 1
    pp = draw(st.sampled_from([1, 2])) if sp == 1 else 1
    if pp > 1:
        spec["config"]["layers"] = 2
    options = dict(rank_tasks.shard_options(spec), check_replicated_inputs=draw(st.booleans()),
                   gather_logits=draw(st.sampled_from([None, True, False])))
    layout = dict(tp=spec["tp"], sp=sp, pp=pp, rank=draw(st.integers(0, spec["tp"] * sp * pp - 1)))
    # step: counted from the first install step, or from the last when negative (attach is -1), so that the
    # passes at both ends are drawn as often
    failure = dict(where=draw(st.sampled_from(["check", "before", "middle", "after"])), step=draw(st.integers(-8, 8)),
                   nth=draw(st.integers(0, 30)))
    return spec, layout, options, failure


def _steps(passes: list) -> list[tuple[object, str]]:
    """The install steps of a shard() call in the order it runs them (sharder._install, then attach)."""
    return [(p, "prepare") for p in passes if hasattr(p, "prepare")] + [(p, "install") for p in passes]


def _failing(real, where: str, name: str):
    def step(*args, **kwargs):
        if where == "before":
            raise Injected(f"before {name}")
        real(*args, **kwargs)
        raise Injected(f"after {name}")
    return step


@contextlib.contextmanager
def injected(failure: dict, model, before: dict):
    """Patch shard()'s passes so that the drawn failure happens (module docstring); the checks are verified to
    have changed nothing when the first install step starts."""
    real_passes_for, seen = sharder.passes_for, {}
    where = "before" if failure["where"] == "before" else "after"

    def verify_checks():
        if not seen.get("checked"):
            seen["checked"] = True
            assert_same(before, fingerprint(model), "after every pass's checks")

    def passes_for(r):
        passes = real_passes_for(r)
        if failure["where"] == "check":
            p = passes[failure["step"] % len(passes)]
            real = p.problems
            p.problems = lambda r: real(r) + [f"injected problem in {type(p).__name__}"]
            return passes
        steps = _steps(passes)
        k = failure["step"] % (len(steps) + 1)
        if k < len(steps):
            p, method = steps[k]
            setattr(p, method, _failing(getattr(p, method), where, f"{type(p).__name__}.{method}"))
        for p, method in steps:  # every step first verifies that the checks changed nothing
            setattr(p, method, _checked(getattr(p, method), verify_checks))
        return passes

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(sharder, "passes_for", passes_for))
        if failure["where"] == "middle":  # the n-th module replaced by the tensor-parallel install
            real_set, calls = passes_module._set_submodule, []

            def set_submodule(*args):
                calls.append(1)
                if len(calls) > failure["nth"] % 8:
                    raise Injected(f"in the middle of TensorParallel.install (module {len(calls)})")
                real_set(*args)

            stack.enter_context(mock.patch.object(passes_module, "_set_submodule", set_submodule))
        real_attach = ShardState.attach
        stack.enter_context(mock.patch.object(ShardState, "attach", _failing(real_attach, where, "attach")))
        yield


def _checked(real, verify):
    def step(*args, **kwargs):
        verify()
        return real(*args, **kwargs)
    return step


def _outputs(model, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(**batch)
    return [v for v in out.values() if torch.is_tensor(v)]


@settings(max_examples=examples(20, 400))
@given(case=cases())
def test_a_failed_shard_changes_nothing(case):
    spec, layout, options, failure = case
    family = rank_tasks.cases(spec)
    model = family.make_model(spec).eval()
    batch = rank_tasks.cast_batch(family.make_batch(spec, model.config), getattr(torch, spec["dtype"]))
    expected = _outputs(model, batch)
    before = fingerprint(model)
    world = layout["tp"] * layout["sp"] * layout["pp"]
    with fake_world(world, layout["rank"]):
        mesh = shardlib.init_mesh(pp=layout["pp"], tp=layout["tp"], sp=layout["sp"])
        with injected(failure, model, before), pytest.raises((Injected, shardlib.PlanError)) as raised:
            shardlib.shard(model, mesh, **options)
        if raised.type is Injected:
            event(f"failed {raised.value}".split(" (module")[0])
        else:
            event("refused by the checks" + (" (injected)" if "injected problem" in str(raised.value) else ""))
        assert_same(before, fingerprint(model), f"after {raised.value!r}")
        assert [torch.equal(a, b) for a, b in zip(_outputs(model, batch), expected)] == [True] * len(expected)
        if "injected problem" in str(raised.value) or raised.type is Injected:
            shardlib.shard(model, mesh, **options)  # untouched: it shards now
            assert shardlib.shard_state(model).mesh is mesh


# --------------------------------------------------------------------------------------- custom attention
@pytest.fixture
def registries_restored():
    """Whatever a test registers in transformers' attention registries (and shard() adds for it) is removed."""
    saved = [(m, dict(m)) for m in registries()]
    yield
    for mapping, contents in saved:
        mapping.clear()
        mapping.update(contents)


def _register_custom(calls: list, mask: bool) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def my_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[1], attention_mask is not None))  # heads seen, mask given
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("my_attention", my_attention)
    if mask:
        AttentionMaskInterface.register("my_attention", sdpa_mask)


def custom_attention_equivalence(spec: dict, mask: bool) -> dict:
    """Rank task: the model's attention is "my_attention" (SDPA under another name, with or without a mask function
    of its own): sharded == unsharded (rank_tasks.equivalence), and the custom function ran in both, with the
    mask HF gives it unsharded. The registries are restored on the way out."""
    saved, calls = [(m, dict(m)) for m in registries()], []
    try:
        _register_custom(calls, mask)
        compared = rank_tasks.equivalence({**spec, "reference_attention": "my_attention"})
        heads = {h for h, _ in calls}
        assert len(heads) == 2, f"the custom function saw head counts {heads}: not both the full and local ones"
        assert mask or not any(m for _, m in calls), "HF gives no mask to a function without a mask function"
        return compared
    finally:
        for mapping, contents in saved:
            mapping.clear()
            mapping.update(contents)


CUSTOM = {"cls": "BertForMaskedLM", "seq": 7, "batch": 2, "padding": True, "seed": 11, "dtype": "float32",
          "config": {"heads": 4, "head_dim": 4, "layers": 2, "intermediate": 16, "vocab": 31}}
LAYOUTS = {"tp2-mask": ({"tp": 2}, True), "tp2-megatron-sp": ({"tp": 2, "sp": True}, False),
           "tp2-all-to-all": ({"tp": 2, "sp": "all_to_all", "sp_size": 2}, True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_custom_registered_attention_equals_unsharded(pool, layout):
    extra, mask = LAYOUTS[layout]
    results = pool.run(custom_attention_equivalence, {**CUSTOM, **extra}, mask)
    assert all(r["grads"] > 10 for r in results)


OTHERS = [spec for _, spec in SPECS if spec["cls"] != "BertForMaskedLM"]  # family modules: by the spec's "family"


@ci_only("T5, ViT and a BERT decoder with a custom attention function: ~6 s; BERT covers it in the dev profile")
@pytest.mark.parametrize("spec", OTHERS, ids=[spec["cls"] for spec in OTHERS])
def test_custom_attention_other_families(pool, spec):
    results = pool.run(custom_attention_equivalence, {**spec, "dtype": "float32", "tp": 2}, True)
    assert all(r["grads"] > 10 for r in results)


def test_custom_attention_shards_where_it_used_to_fail_half_way(registries_restored):
    """The issue's reproduction: a BERT on a custom registered function raised KeyError from local_rng_name after
    21 parameters were rewritten. Now it shards, the wrapper dispatches to it, and the registries gain only
    shardlib's own names (removed again by a failed shard())."""
    calls = []
    _register_custom(calls, mask=False)
    spec = {**CUSTOM, "tp": 2}
    model = rank_tasks.cases(spec).make_model(spec)
    model.set_attn_implementation("my_attention")
    twin = copy.deepcopy(model)
    names = set(registries()[0])
    with fake_world(2, 0):
        with mock.patch.object(passes_module.ReplicatedInputCheck, "install", side_effect=Injected):
            with pytest.raises(Injected):
                shardlib.shard(twin, shardlib.init_mesh(tp=2), check_replicated_inputs=True)
        assert set(registries()[0]) == names  # the failed call's wrapper names are gone again
        shardlib.shard(model, shardlib.init_mesh(tp=2))
    assert model.config._attn_implementation == "shardlib_local_rng_my_attention"
    assert set(registries()[0]) - names == {"shardlib_local_rng_my_attention"}


def test_unregistered_attention_is_refused_before_any_change():
    spec = {**CUSTOM, "tp": 2}
    model = rank_tasks.cases(spec).make_model(spec)
    model.config._attn_implementation_internal = "nowhere_attention"
    before = fingerprint(model)
    with fake_world(2, 0):
        with pytest.raises(shardlib.PlanError, match="'nowhere_attention' is not registered in transformers'"):
            shardlib.shard(model, shardlib.init_mesh(tp=2))
    assert_same(before, fingerprint(model), "after the refusal")


def test_an_install_writing_tensor_data_in_place_is_named():
    """The one change a snapshot cannot undo: the restore says which tensor, instead of claiming success."""
    spec = {**CUSTOM, "tp": 2}
    model = rank_tasks.cases(spec).make_model(spec)

    def scribble(self, r):
        with torch.no_grad():
            r.model.bert.embeddings.LayerNorm.weight.add_(1)
        raise Injected("after scribbling")

    with fake_world(2, 0):
        with mock.patch.object(passes_module.VocabParallelLoss, "install", scribble), \
                pytest.raises(RuntimeError, match="bert.embeddings.LayerNorm.weight .* was written in place"):
            shardlib.shard(model, shardlib.init_mesh(tp=2))


def test_snapshot_restores_what_an_install_may_change(registries_restored):
    """Beyond what today's installs do (the property covers those): every kind of change the snapshot claims to
    undo, done by hand to a small model, is undone, and a hook the caller registered before still removes."""
    from transformers import AttentionInterface

    from shardlib.sharding.transaction import ModelSnapshot

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    model[0].weight.grad = torch.ones(4, 3)
    handle = model.register_forward_hook(lambda *a: None)
    before = fingerprint(model)
    snapshot = ModelSnapshot(model)
    lin, norm = model[0], model[1]
    lin.weight.data = torch.zeros(4, 3)  # data swapped
    lin.weight.grad, lin.bias.requires_grad = None, False
    norm.weight.register_hook(lambda g: g)  # autograd hooks on a kept parameter
    norm.weight.register_post_accumulate_grad_hook(lambda p: None)
    norm.weight.tag = "x"
    norm.bias = torch.nn.Parameter(torch.zeros(4))  # replaced parameter
    model[1] = torch.nn.Identity()  # replaced child
    lin.__class__ = type("Swapped", (torch.nn.Linear,), {})  # class swap
    lin.forward = lambda x: x  # instance attribute
    model.register_forward_pre_hook(lambda *a: None)
    model.register_buffer("extra", torch.zeros(1))
    AttentionInterface.register("shardlib_test_name", lambda *a: None)
    assert snapshot.restore() == []
    assert_same(before, fingerprint(model), "after restore")
    handle.remove()
    assert not model._forward_hooks
