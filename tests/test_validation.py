"""Single-process tests: plan validation errors (the model is left untouched), mesh arithmetic, layouts,
pattern matching, the vocab-parallel cross-entropy at tp=1."""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2Model

import shardlib
from shardlib.parallel.layers import _VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from shardlib.parallel.mesh import MeshError, OfflineMesh, _resolve_sizes
from shardlib.parallel.styles import ColwiseParallel, RowwiseParallel
from shardlib.policies import policy_for
from shardlib.sharding.plan import Plan, PlanError, match_modules


@dataclass
class FakeMesh:
    """Enough of a Mesh for paths that must fail before any communication."""

    tp: int
    tp_group: object = None
    tp_rank: int = 0
    sp: int = 1


def tiny_bert(cls=BertForMaskedLM, **overrides):
    cfg = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=36,
               max_position_embeddings=16)
    torch.manual_seed(0)
    return cls(BertConfig(**{**cfg, **overrides}))


def assert_untouched(before, after):
    assert [type(m) for m in before.modules()] == [type(m) for m in after.modules()]
    sd_b, sd_a = before.state_dict(), after.state_dict()
    assert sd_b.keys() == sd_a.keys() and all(torch.equal(sd_b[k], sd_a[k]) for k in sd_b)
    assert type(after) is type(before) and shardlib.shard_state(after, required=False) is None


@pytest.mark.parametrize(
    "overrides, tp, expected",
    [
        ({}, 4, "num_attention_heads = 6 is not divisible by tp=4"),
        ({"intermediate_size": 30}, 4, "intermediate.dense: out_features 30 is not divisible by tp=4"),
        ({"intermediate_size": 30}, 4, "layer.1.output.dense: in_features 30 is not divisible by tp=4"),
        ({"num_attention_heads": 4, "hidden_size": 24, "intermediate_size": 30}, 4, "bert.encoder.layer.1.intermediate"),
    ],
)
def test_indivisible_sizes_are_refused_and_model_untouched(overrides, tp, expected):
    model = tiny_bert(**overrides)
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError) as err:
        shardlib.shard(model, FakeMesh(tp=tp))
    assert expected in str(err.value)
    assert "BertForMaskedLM" in str(err.value) and "tp=4" in str(err.value)
    assert_untouched(before, model)


def test_unknown_model_class_names_it_and_the_supported_ones():
    from transformers import ConvNextConfig, ConvNextModel

    model = ConvNextModel(ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32))
    # no policy, and inference finds no attention in a convolutional network (docs/inferred-plans.md): both said
    with pytest.raises(shardlib.PlanError, match=r"no shardlib policy for model class ConvNextModel; supported: "
                                                 r".*BertModel.*; and its plan cannot be inferred from its graph: "
                                                 r".*ConvNextModel: no attention block"):
        shardlib.shard(model, FakeMesh(tp=2))


def test_pattern_matching_nothing_is_an_error():
    policy = policy_for(tiny_bert())
    bad = type(policy)(name="bad", model_classes=(), make_plan=lambda m, tp: Plan(
        styles={"bert.encoder.layers.*.attention.self.query": ColwiseParallel()}))
    model = tiny_bert()
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError, match=r"pattern 'bert.encoder.layers.\*.attention.self.query' matches no module"):
        shardlib.shard(model, FakeMesh(tp=2), policy=bad)
    assert_untouched(before, model)


def test_style_on_wrong_module_type_is_an_error():
    policy = policy_for(tiny_bert())
    bad = type(policy)(name="bad", model_classes=(), make_plan=lambda m, tp: Plan(
        styles={"bert.embeddings.LayerNorm": RowwiseParallel()}))
    with pytest.raises(shardlib.PlanError, match="bert.embeddings.LayerNorm: RowwiseParallel applies to "
                                                 "torch.nn.Linear, found torch.nn.LayerNorm"):
        shardlib.shard(tiny_bert(), FakeMesh(tp=2), policy=bad)


class Linear(nn.Module):
    """A wrapper named like the layer it wraps (peft's ``lora.Linear`` is one)."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def test_a_look_alike_class_is_named_by_its_full_path():
    """Not "ColwiseParallel applies to Linear, found Linear" (a peft LoRA layer, before)."""
    model = tiny_bert()
    layer = model.bert.encoder.layer[0].attention.self
    layer.query = Linear(layer.query)
    with pytest.raises(shardlib.PlanError, match=r"attention.self.query: ColwiseParallel applies to torch.nn.Linear, "
                                                 r"found test_validation.Linear"):
        shardlib.shard(model, FakeMesh(tp=2))


def test_all_problems_reported_together():
    with pytest.raises(shardlib.PlanError) as err:
        shardlib.shard(tiny_bert(num_attention_heads=3, hidden_size=24, intermediate_size=30), FakeMesh(tp=4))
    lines = str(err.value).splitlines()[1:]
    assert len(lines) >= 2 * 3  # every layer: heads, all_head_size, intermediate out, output in (and q/k/v)


def test_mesh_arithmetic_errors():
    assert _resolve_sizes(8, None, 2, 2) == (2, 2, 1, 2)
    assert _resolve_sizes(8, None, 1, 2, sp=2) == (2, 1, 2, 2)
    with pytest.raises(MeshError, match=r"dp\(1\) \* pp\(1\) \* sp\(2\) \* tp\(2\) = 4 != WORLD_SIZE 8"):
        _resolve_sizes(8, 1, 1, 2, sp=2)
    with pytest.raises(MeshError, match="sp must be a positive integer"):
        _resolve_sizes(4, None, 1, 1, sp=0)
    with pytest.raises(MeshError, match=r"dp\(2\) \* pp\(2\) \* tp\(2\) = 8 != WORLD_SIZE 4"):
        _resolve_sizes(4, 2, 2, 2)
    with pytest.raises(MeshError, match=r"pp\(1\) \* tp\(3\) = 3 does not divide WORLD_SIZE 4"):
        _resolve_sizes(4, None, 1, 3)
    with pytest.raises(MeshError, match="tp must be a positive integer"):
        _resolve_sizes(4, None, 1, 0)


def test_init_mesh_without_launcher_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MeshError, match="shardlib run --nproc N"):
        shardlib.init_mesh(tp=2)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.data())
def test_layout_shard_unshard_roundtrip(shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    n = data.draw(st.integers(1, 5))
    layout = shardlib.Layout(tuple(shape), shard_dim=dim, num_shards=n)
    full = torch.randn(shape)
    pieces = [layout.shard(full, r) for r in range(n)]
    assert all(tuple(p.shape) == layout.local_shape for p in pieces)
    assert torch.equal(layout.unshard(pieces), full)
    assert sum(layout.valid_range(r)[1] - layout.valid_range(r)[0] for r in range(n)) == shape[dim]
    assert layout.padded_size % n == 0 and 0 <= layout.padding < n


def test_vocab_30522_at_tp4_layout():
    layout = shardlib.Layout((30522, 768), shard_dim=0, num_shards=4)
    assert layout.local_shape == (7631, 768) and layout.padding == 2
    assert layout.valid_range(3) == (22893, 30522)


@given(st.integers(1, 40), st.integers(1, 6), st.integers(0, 3), st.data())
def test_vocab_parallel_cross_entropy_single_rank_matches_torch(vocab, n_tokens, pad, data):
    logits = torch.randn(n_tokens, vocab + pad, dtype=torch.float64, requires_grad=True)
    target = torch.tensor(data.draw(st.lists(st.sampled_from([-100, *range(vocab)]), min_size=n_tokens,
                                            max_size=n_tokens)))
    loss = vocab_parallel_cross_entropy(logits, target, vocab_start=0, valid=vocab, group=None)
    ref = F.cross_entropy(logits[:, :vocab], target, reduction="none")
    torch.testing.assert_close(loss, ref)
    w = torch.randn(n_tokens, dtype=torch.float64)
    (g,) = torch.autograd.grad((loss * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g, g_ref)
    assert torch.all(g[:, vocab:] == 0)
    # only the labelled rows are computed (eager): bitwise what every row gives (the traced path)
    every_row = _VocabParallelCrossEntropy.apply(logits, target, 0, vocab, None, -100, torch.float64)
    assert torch.equal(loss, every_row)
    (g_every,) = torch.autograd.grad((every_row * w).sum(), logits)
    assert torch.equal(g, g_every)


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("a.*.c", ["a.1.c", "a.22.c"]),
        ("a.**", ["a", "a.1", "a.1.c", "a.22", "a.22.c", "a.22.c.d"]),
        ("**.c", ["a.1.c", "a.22.c", "ab.1.c"]),
        ("a.1", ["a.1"]),
        ("a.**.d", ["a.22.c.d"]),
        ("a.**.c", ["a.1.c", "a.22.c"]),
    ],
)
def test_pattern_matching(pattern, expected):
    paths = ["", "a", "a.1", "a.1.c", "a.22", "a.22.c", "a.22.c.d", "ab.1.c"]
    assert match_modules(pattern, paths) == expected


def test_tp1_shard_in_one_process_is_identity_numerically():
    """tp=1 needs no process group at all: every collective returns early."""
    model = tiny_bert().eval()
    ref = copy.deepcopy(model)
    shardlib.shard(model, FakeMesh(tp=1))
    ids = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)
    report = str(shardlib.report(model))
    assert "VocabParallel" in report and "parameter bytes per rank" in report


def test_sharding_twice_is_refused():
    model = tiny_bert(BertModel)
    shardlib.shard(model, FakeMesh(tp=1))
    with pytest.raises(shardlib.PlanError, match="already sharded"):
        shardlib.shard(model, FakeMesh(tp=1))


def test_meta_model_shards_without_allocating():
    with torch.device("meta"):
        model = BertForMaskedLM(BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=2,
                                           num_attention_heads=12, intermediate_size=3072))
    shardlib.shard(model, FakeMesh(tp=4))  # no group is touched: construction only slices meta tensors
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.bert.embeddings.word_embeddings.weight.shape == (7631, 768)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.bert.encoder.layer[0].intermediate.dense.weight.shape == (768, 768)
    r = shardlib.report(model)
    assert r.local_bytes < 0.3 * r.unsharded_bytes


def test_tied_module_left_replicated_is_refused():
    """A plan that shards the word embedding but forgets the tied LM decoder would run the decoder on a shard."""
    policy = policy_for(tiny_bert())
    base_plan = policy.plan(tiny_bert(), 2)
    styles = {k: v for k, v in base_plan.styles.items() if k != "cls.predictions.decoder"}
    bad = type(policy)(name="bad", model_classes=(), make_plan=lambda m, tp: Plan(styles=styles))
    model = tiny_bert()
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError, match="cls.predictions.decoder shares a parameter with a sharded module"):
        shardlib.shard(model, FakeMesh(tp=2), policy=bad)
    assert_untouched(before, model)


def test_untied_embeddings_shard_separately():
    model = tiny_bert(tie_word_embeddings=False)
    shardlib.shard(model, FakeMesh(tp=1))
    assert model.cls.predictions.decoder.weight is not model.bert.embeddings.word_embeddings.weight


def test_vit_heads_not_divisible_is_refused():
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=12, num_hidden_layers=1,
                                                 num_attention_heads=3, intermediate_size=16))
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError, match=r"vit.layers.0.attention.num_attention_heads = 3 is not divisible by tp=2"):
        shardlib.shard(model, FakeMesh(tp=2))
    assert_untouched(before, model)


def test_t5_heads_not_divisible_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=20, d_model=8, d_kv=2, d_ff=16, num_layers=1, num_heads=3))
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError) as err:
        shardlib.shard(model, FakeMesh(tp=2))
    message = str(err.value)
    assert "encoder.block.0.layer.0.SelfAttention.n_heads = 3 is not divisible by tp=2" in message
    assert "relative_attention_bias: embedding_dim 3 is not divisible by tp=2" in message
    assert "decoder.block.0.layer.1.EncDecAttention.n_heads = 3" in message
    assert_untouched(before, model)


@pytest.mark.parametrize("make,sp,expected", [
    (lambda: tiny_bert(num_attention_heads=6), 4,
     r"encoder.layer.0.attention.self.num_attention_heads = 6 is not divisible by tp\(1\) \* sp\(4\) = 4"),
    (lambda: tiny_bert(BertModel), 1, "needs a mesh with sp > 1"),
    # an inferred plan (GPT-2 has no policy) names its attention sites and their head counts
    (lambda: GPT2Model(GPT2Config(n_embd=8, n_layer=1, n_head=2)), 4, r"is not divisible by tp\(1\) \* sp\(4\) = 4"),
])
def test_all_to_all_refusals(make, sp, expected):
    model = make()
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError, match=expected):
        shardlib.shard(model, FakeMesh(tp=1, sp=sp), sequence_parallel="all_to_all")
    assert_untouched(before, model)


@pytest.mark.parametrize("make,sp,options,expected", [
    (tiny_bert, 1, {}, "sequence_parallel='ring' needs a mesh with sp > 1"),
    (tiny_bert, 4, {"ulysses": 3}, r"ulysses=3 does not divide sp=4"),
    (lambda: tiny_bert(num_attention_heads=6), 4, {"ulysses": 4},
     r"num_attention_heads = 6 is not divisible by tp\(1\) \* ulysses\(4\) = 4"),
    (tiny_bert, 2, {"kernels": shardlib.kernels.Kernels(attention="sdpa"), "sequence_parallel": "all_to_all",
                    "ulysses": 2}, r"ulysses=2 applies to sequence_parallel='ring'"),
])
def test_ring_refusals(make, sp, options, expected):
    model = make()
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError, match=expected):
        shardlib.shard(model, FakeMesh(tp=1, sp=sp), **{"sequence_parallel": "ring", **options})
    assert_untouched(before, model)


def test_ring_refuses_an_attention_whose_masks_it_does_not_know():
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register("my_attention", ALL_ATTENTION_FUNCTIONS["sdpa"])
    try:
        model = tiny_bert()
        model.set_attn_implementation("my_attention")
        with pytest.raises(shardlib.PlanError, match="the model runs 'my_attention'"):
            shardlib.shard(model, FakeMesh(tp=1, sp=2), sequence_parallel="ring")
    finally:
        del AttentionInterface._global_mapping["my_attention"]


def test_sp_mesh_without_all_to_all_and_unknown_modes_are_refused():
    with pytest.raises(shardlib.PlanError, match="sp=2 ranks per sequence but sequence_parallel=True"):
        shardlib.shard(tiny_bert(), FakeMesh(tp=1, sp=2), sequence_parallel=True)
    with pytest.raises(shardlib.PlanError, match="sequence_parallel='ulysses': expected False, True"):
        shardlib.shard(tiny_bert(), FakeMesh(tp=1), sequence_parallel="ulysses")
    with pytest.raises(shardlib.PlanError, match="attention implementation 'flash' is not one of sdpa, eager"):
        shardlib.shard(tiny_bert(), FakeMesh(tp=1), kernels=shardlib.kernels.Kernels(attention="flash"))


def test_every_registered_class_has_a_plan_that_matches():
    """Each registered model class, built small, passes validation (every pattern matches something)."""
    import transformers

    from shardlib.policies import registered_classes

    t5_like = dict(vocab_size=30, d_model=8, d_kv=2, d_ff=8, num_layers=1, num_heads=2, decoder_start_token_id=0)
    configs = {
        "Bert": transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=8),
        "ViT": transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=8, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=8, encoder_stride=4),
        "UMT5": transformers.UMT5Config(**t5_like), "MT5": transformers.MT5Config(**t5_like),
        "T5": transformers.T5Config(**t5_like),
        "Switch": transformers.SwitchTransformersConfig(**{**t5_like, "num_layers": 2}, num_decoder_layers=2,
                                                        num_experts=2, encoder_sparse_step=2, decoder_sparse_step=2),
    }
    classes = registered_classes()
    assert len(classes) == 9 + 3 + 18 + 3
    for cls in classes:
        family = next(f for f in configs if cls.__name__.startswith(f))
        model = cls(configs[family])
        shardlib.shard(model, FakeMesh(tp=1))
        assert shardlib.report(model).rows, cls.__name__


@dataclass
class FakePipelineMesh(FakeMesh):
    pp: int = 2


def test_more_pipeline_stages_than_layers_is_refused_before_any_change():
    model = tiny_bert()
    with pytest.raises(PlanError, match="3 pipeline stages but only 2 layers"):
        shardlib.shard(model, FakePipelineMesh(tp=1, pp=3))
    assert shardlib.shard_state(model, required=False) is None


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=100,
                                               decoder_start_token_id=0))


@pytest.mark.parametrize("option, value", [("max_norm", 1.0), ("scale_grad_by_freq", True), ("sparse", True)])
@pytest.mark.parametrize("make, path, style", [
    (tiny_bert, "bert.embeddings.word_embeddings", "VocabParallel"),
    (_tiny_t5, "shared", "VocabParallel"),
    (_tiny_t5, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias", "ColwiseParallel"),
], ids=["bert-word", "t5-shared", "t5-relative-bias"])
def test_embedding_options_are_refused_before_any_change(make, path, style, option, value):
    """An embedding option the sharded embeddings cannot honour is one of the problems found before the rewrite
    (it used to raise half-way through: T5's ``shared`` and the first ``q`` already replaced); the model is left
    untouched, and once the option is unset the same model shards."""
    model = make()
    setattr(model.get_submodule(path), option, value)
    modules = dict(model.named_modules())
    before = copy.deepcopy(model)
    with pytest.raises(shardlib.PlanError) as err:
        shardlib.shard(model, OfflineMesh(tp=2))
    assert f"{path}: {style} cannot shard an embedding with {option}={value!r}" in str(err.value)
    after = dict(model.named_modules())
    assert after.keys() == modules.keys() and all(after[name] is m for name, m in modules.items())
    assert_untouched(before, model)
    setattr(model.get_submodule(path), option, None if option == "max_norm" else False)
    shardlib.shard(model, OfflineMesh(tp=2))
    assert shardlib.shard_state(model, required=False) is not None
