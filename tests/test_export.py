"""``torch.export`` of sharded models (shardlib.export): the functional collectives in the exported fx graph are
exactly the forward collectives the multi-rank tests pin (tests/test_tp_behaviour.py, test_sequence_parallel.py:
same specs, same formulas), by op and by layer; the exported program runs; an untraceable hook is reported with its
module. Exports run in this process as rank 0 (or 1) of a fake world of 2 (shardlib.parallel.mesh.fake_world); one test
compares the exported program with the eager model on real gloo ranks."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx

import shardlib
from shardlib.analysis.export import ExportError, collective_counts, collective_nodes, export
from shardlib.parallel.mesh import fake_world

from rank_tasks import cases, shard_options, spec_mesh
from test_tp_behaviour import T5_SPEC, VIT_SPEC, _spec

AR, AG, RS = "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"
LAYERS, ENC, DEC = 2, 2, 2


@dataclass(frozen=True)
class Case:
    """A model and the collectives of its forward at tp=2, by the formulas of the multi-rank tests.

    ``stacks``: per layer stack of the policy's trunk (``Plan.trunk``, in order): (layers, tensor-parallel regions
    per layer: attention and MLP, plus cross-attention in a T5 decoder block). ``embeddings``: vocab-parallel
    lookups (one all-reduce each, kept under sequence parallelism). ``gathers_logits``: an LM head without labels
    all-gathers its logits (1 all-gather)."""

    spec: dict
    stacks: list
    embeddings: int
    gathers_logits: bool

    @property
    def id(self) -> str:
        return self.spec["cls"]

    def totals(self, sp: bool) -> dict:
        """Forward collectives by op: tensor parallel, one all-reduce per region leaving it (test_collectives_per_
        bert_layer, test_collectives_t5_layers, test_collectives_vit_layers, test_inference_logits_are_gathered);
        sequence parallel, an all-gather entering and a reduce-scatter leaving each region plus one all-gather at
        each stack's exit (test_sp_collectives_*)."""
        regions = sum(n * k for n, k in self.stacks)
        if not sp:
            counts = {AR: self.embeddings + regions}
        else:
            counts = {AR: self.embeddings, AG: regions + len(self.stacks), RS: regions}
        if self.gathers_logits:
            counts[AG] = counts.get(AG, 0) + 1
        return {op: n for op, n in counts.items() if n}

    def per_layer(self, sp: bool, prefixes: list[str]) -> dict:
        """{layer path: {op: count}} for the stacks at ``prefixes``; a sequence-parallel stack's exit all-gather runs
        in its last layer's hook."""
        layers = {}
        for prefix, (n, k) in zip(prefixes, self.stacks, strict=True):
            for i in range(n):
                layers[f"{prefix}.{i}"] = {AG: k + (i == n - 1), RS: k} if sp else {AR: k}
        return layers


BERT = Case(_spec("BertForMaskedLM", 2, LAYERS, labels=False), [(LAYERS, 2)], 1, True)
BERT_CLS = Case(_spec("BertForSequenceClassification", 2, LAYERS, labels=False),
                [(LAYERS, 2)], 1, False)
VIT = Case({**VIT_SPEC, "tp": 2, "labels": False, "config": {**VIT_SPEC["config"], "layers": LAYERS}},
           [(LAYERS, 2)], 0, False)
T5 = Case({**T5_SPEC, "tp": 2, "labels": False, "config": {**T5_SPEC["config"], "layers": ENC, "decoder_layers": DEC}},
          [(ENC, 2), (DEC, 3)], 2, True)
CASES = [BERT, BERT_CLS, VIT, T5]


def _batch(spec: dict, config) -> dict:
    batch = cases(spec).make_batch(spec, config)
    if spec["cls"].endswith("ForConditionalGeneration"):
        # inference forward: decoder inputs given, no KV cache object in the output (not a pytree)
        batch.update(decoder_input_ids=batch["input_ids"][:, : spec["dec_seq"]], use_cache=False)
    return batch


def _sharded(spec: dict, sp: bool = False):
    """Inside a fake world: the spec's model sharded at its tp (eval mode) and its inference batch."""
    options = {**shard_options(spec), "sequence_parallel": sp}
    model = shardlib.shard(cases(spec).make_model(spec), shardlib.init_mesh(tp=spec["tp"]), **options).eval()
    return model, _batch(spec, model.config)


def _layer_of(module: str, prefixes) -> str | None:
    match = next((re.match(rf"{re.escape(p)}\.\d+", module) for p in prefixes if module.startswith(p + ".")), None)
    return match.group(0) if match else None


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_exported_collectives_match_the_pinned_forward_counts(case, sp):
    with fake_world(2, rank=0):
        model, batch = _sharded(case.spec, sp)
        group = shardlib.shard_state(model).mesh.tp_group.group_name
        ep = export(model, kwargs=batch)
    assert collective_counts(ep) == case.totals(sp)
    prefixes = [stack.layers for stack in shardlib.shard_state(model).plan.trunk]
    assert _per_layer(ep, prefixes) == case.per_layer(sp, prefixes)
    outside = [c for c in collective_nodes(ep, waits=False) if _layer_of(c.module, prefixes) is None]
    assert sum(c.op == AR for c in outside) == case.embeddings
    assert all(c.module_type.endswith("VocabParallelEmbedding") for c in outside if c.op == AR)
    assert sum(c.op == AG and c.module == "" for c in outside) == case.gathers_logits  # the root's loss wrapper
    assert len(outside) == case.embeddings + case.gathers_logits
    _check_nodes(ep, group)


def _per_layer(ep, prefixes) -> dict:
    """{layer path: {op: count}} of the collectives inside the layers of the stacks at ``prefixes``."""
    layers: dict = {}
    for c in collective_nodes(ep, waits=False):
        layer = _layer_of(c.module, prefixes)
        if layer is not None:
            layers.setdefault(layer, {}).setdefault(c.op, 0)
            layers[layer][c.op] += 1
    return layers


def test_all_to_all_sequence_parallel_collectives_on_their_groups():
    """Ulysses on the mesh's sp dim with tp=2 (a fake world of 4): per layer the two all-to-alls of
    test_all_to_all_collectives_per_layer on the sp group, the stack exit's all-gather on it too, and the tensor-
    parallel all-reduces (embedding + 2 per layer) on the tp group."""
    spec = {**_spec("BertModel", 2, LAYERS, labels=False), "sp": "all_to_all", "sp_size": 2}
    with fake_world(4, rank=0):
        mesh = shardlib.init_mesh(tp=2, sp=2)
        model = shardlib.shard(cases(spec).make_model(spec), mesh, sequence_parallel="all_to_all").eval()
        ep = export(model, kwargs=_batch(spec, model.config))
        tp_group, sp_group = mesh.tp_group.group_name, mesh.group("sp").group_name
    assert collective_counts(ep) == {AR: 1 + 2 * LAYERS, "all_to_all_single": 2 * LAYERS, AG: 1}
    groups = collective_counts(ep, by=lambda c: f"{c.op} on {'tp' if c.group == tp_group else 'sp'}")
    assert groups == {f"{AR} on tp": 1 + 2 * LAYERS, "all_to_all_single on sp": 2 * LAYERS, f"{AG} on sp": 1}
    assert sp_group != tp_group
    for i in range(LAYERS):
        assert collective_counts(ep, by=lambda c: c.op if c.module.startswith(f"encoder.layer.{i}.attention.self")
                                 else None) == {"all_to_all_single": 2}


def _check_nodes(ep, group: str) -> None:
    """Every collective is functional, on the TP group, waited on, with message sizes from its fake tensors."""
    nodes = collective_nodes(ep, waits=False)
    for c in nodes:
        assert c.functional and c.group == group, c
        assert any(user.target is torch.ops._c10d_functional.wait_tensor.default for user in c.node.users), c
        factor = {AR: 1, AG: 2, RS: 0.5}[c.op]  # result bytes / input bytes at tp=2
        assert c.bytes == factor * c.input_bytes and c.bytes == c.dtype.itemsize * torch.Size(c.shape).numel(), c
    waits = [c for c in collective_nodes(ep) if c.is_wait]
    assert len(waits) >= len(nodes)


def test_exported_program_runs_under_the_fake_group_as_rank_1():
    """The graph runs (the fake collectives move no data, so only shapes are checked) and a graph exported as rank 1
    holds the same collectives."""
    with fake_world(2, rank=1):
        model, batch = _sharded(BERT.spec)
        ep = export(model, kwargs=batch)
        out = ep.module()(**batch)
    assert collective_counts(ep) == BERT.totals(sp=False)
    assert out.logits.shape == (*batch["input_ids"].shape, model.config.vocab_size)


def test_exported_graph_module_is_an_fx_graph_to_walk_and_print():
    with fake_world(2, rank=0):
        model, batch = _sharded({**BERT.spec, "config": {**BERT.spec["config"], "layers": 1}})
        ep = export(model, kwargs=batch)
    gm = ep.graph_module
    assert isinstance(gm, fx.GraphModule)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops._c10d_functional.all_reduce.default in ops and torch.ops.aten.linear.default in ops
    text = gm.print_readable(print_output=False)
    assert "torch.ops._c10d_functional.all_reduce.default" in text and str(gm.graph)
    assert [c.name for c in collective_nodes(gm)] == [c.name for c in collective_nodes(ep)]
    with pytest.raises(TypeError, match="ExportedProgram or a torch.fx.GraphModule"):
        collective_nodes(model)


def test_strict_export_finds_the_collectives_inside_subgraphs():
    """strict=True (dynamo) wraps each autograd Function's body in a ``wrap_with_set_grad_enabled`` subgraph: the walk
    descends into them and names the modules without dynamo's ``_export_root`` prefix."""
    spec = {**BERT.spec, "config": {**BERT.spec["config"], "layers": 1}}
    with fake_world(2, rank=0):
        model, batch = _sharded(spec)
        ep = export(model, kwargs=batch, strict=True)
    assert collective_counts(ep) == {AR: 1 + 2 * 1, AG: 1}
    assert {c.module for c in collective_nodes(ep, waits=False)} == {
        "bert.embeddings.word_embeddings", "bert.encoder.layer.0.attention.output.dense",
        "bert.encoder.layer.0.output.dense", ""}


@pytest.mark.parametrize("case", [BERT_CLS, BERT], ids=lambda c: c.id)
def test_dynamic_batch(case):
    """``dynamic_shapes`` is passed through: one graph for any batch size, the same collectives, message sizes
    symbolic (None), the LM head's logits all-gather included."""
    with fake_world(2, rank=0):
        model, batch = _sharded(case.spec)
        dim = torch.export.Dim("batch", min=1, max=64)
        ep = export(model, kwargs=batch, dynamic_shapes={k: {0: dim} for k in batch})
        three = {k: torch.cat([v, v[:1]]) for k, v in batch.items()}
        assert ep.module()(**three).logits.shape[0] == 3
    assert collective_counts(ep) == case.totals(sp=False)
    assert all(c.bytes is None for c in collective_nodes(ep))


def _branches_on_a_value(module, args, output):
    """A forward hook that cannot be traced: Python control flow on a tensor's value."""
    return (output[0] * 2, *output[1:]) if output[0].sum().item() > 0 else output


def _reads_numpy(module, args):
    """A forward pre-hook that cannot be traced: fake tensors have no data."""
    args[0].detach().numpy()


@pytest.mark.parametrize("path,kind,hook,reason", [
    ("bert.encoder.layer.1.attention", "forward hook", _branches_on_a_value, "data-dependent"),
    ("bert.encoder.layer.0.output.dense", "forward pre-hook", _reads_numpy, "numpy"),
], ids=["item-branch", "numpy"])
def test_untraceable_hook_names_its_module(path, kind, hook, reason):
    with fake_world(2, rank=0):
        model, batch = _sharded(BERT.spec)
        module = model.get_submodule(path)
        handle = (module.register_forward_hook if kind == "forward hook" else module.register_forward_pre_hook)(hook)
        with pytest.raises(ExportError) as info:
            export(model, kwargs=batch)
        handle.remove()
        again = export(model, kwargs=batch)  # a failed export leaves nothing behind
    message = str(info.value)
    assert info.value.module == path and repr(path) in message, message
    assert f"its {kind} {hook.__name__!r}" in message and reason in message and "test_export.py" in message
    assert info.value.__cause__ is not None and reason in info.value.reason
    assert collective_counts(again) == BERT.totals(sp=False)


class _TwoPaths(torch.nn.Module):
    """One linear registered under two paths, ``first.0`` and ``second.0``, called once through each."""

    def __init__(self):
        super().__init__()
        linear = torch.nn.Linear(4, 4)
        self.first, self.second = torch.nn.Sequential(linear), torch.nn.Sequential(linear)

    def forward(self, x):
        return self.second(self.first(x))


def test_a_shared_module_is_named_by_the_parent_that_called_it():
    model, calls = _TwoPaths(), []
    model.first[0].register_forward_hook(
        lambda m, a, out: calls.append(m) if not calls else _branches_on_a_value(m, a, (out,)))  # fails 2nd call
    with pytest.raises(ExportError) as info:
        export(model, (torch.ones(2, 4),))
    assert info.value.module == "second.0", str(info.value)


def test_pipeline_split_model_is_refused():
    with fake_world(2, rank=0):
        spec = BERT.spec
        model = shardlib.shard(cases(spec).make_model(spec), shardlib.init_mesh(pp=2)).eval()
        with pytest.raises(ExportError, match=r"pipeline stages \(pp=2\).*pp=1"):
            export(model, kwargs=_batch(spec, model.config))


# ------------------------------------------------------------------------------------------------- real ranks
def exported_matches_eager(spec: dict) -> dict:
    """Rank task: export the sharded model on this real rank and run the exported program: the same logits as the
    eager sharded model (the same collectives, so the same sums)."""
    model = shardlib.shard(cases(spec).make_model(spec), spec_mesh(spec), **shard_options(spec)).eval()
    batch = _batch(spec, model.config)
    ep = export(model, kwargs=batch)
    with torch.no_grad():
        expected, out = model(**batch), ep.module()(**batch)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-6)
    return collective_counts(ep)


def test_exported_program_matches_eager_on_real_ranks(pool):
    """T5 at tp=2 with sequence parallelism on 2 x 2 gloo ranks: all-reduces, all-gathers and reduce-scatters."""
    counts = pool.run(exported_matches_eager, {**T5.spec, "sp": True})
    assert counts == [T5.totals(sp=True)] * 4
