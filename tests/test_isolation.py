"""``shard()`` changes nothing outside the model it was given: a twin built from the same config object still runs
and computes what it computed before, and the shared config is as it was. (Sharding one model used to switch the
attention implementation on the shared config, and the unsharded twin then failed with KeyError.)"""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration, ViTConfig, ViTModel

import shardlib
from shardlib.parallel.mesh import fake_world

MODES = {
    "tp": dict(tp=2, options={}),
    "megatron-sp": dict(tp=2, options={"sequence_parallel": True}),
    "all-to-all": dict(tp=1, sp=2, options={"sequence_parallel": "all_to_all"}),
    "ring": dict(tp=1, sp=2, options={"sequence_parallel": "ring"}),
    "eager-attention": dict(tp=2, options={"kernels": shardlib.Kernels(attention="eager")}),
    "all-kernels": dict(tp=2, options={"kernels": shardlib.Kernels(attention="sdpa", fused_qkv=True,
                                                                   bias_gelu=True, dropout_add=True)}),
}


def _bert():
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    ids = torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    return cfg, BertForMaskedLM, {"input_ids": ids}


def _vit():
    cfg = ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=32)
    return cfg, ViTModel, {"pixel_values": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))}


def _t5():
    cfg = T5Config(vocab_size=60, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, decoder_start_token_id=0)
    ids = torch.randint(2, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    return cfg, T5ForConditionalGeneration, {"input_ids": ids, "decoder_input_ids": ids}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", [_bert, _vit, _t5], ids=["bert", "vit", "t5"])
def test_twin_from_the_same_config_is_untouched(family, mode):
    config, cls, batch = family()
    options = dict(MODES[mode]["options"])
    if family is _t5 and "kernels" in options and options["kernels"].bias_gelu:
        options["kernels"] = shardlib.Kernels(fused_qkv=True, dropout_add=True)  # T5's MLP has no GELU epilogue
    torch.manual_seed(0)
    twin, model = cls(config).eval(), cls(config)
    before_config = config.to_dict()
    with torch.no_grad():
        expected = twin(**batch)[0]
    world = MODES[mode]["tp"] * MODES[mode].get("sp", 1)
    with fake_world(world, 0):
        shardlib.shard(model, shardlib.init_mesh(tp=MODES[mode]["tp"], sp=MODES[mode].get("sp", 1)), **options)
    assert model.config is not config
    assert config.to_dict() == before_config and config._attn_implementation == twin.config._attn_implementation
    with torch.no_grad():
        assert torch.equal(twin(**batch)[0], expected)
    torch.manual_seed(0)
    with torch.no_grad():  # a model built from the config now is what it would have been
        assert torch.equal(cls(config).eval()(**batch)[0], expected)


def test_unknown_loss_kind_is_refused_before_any_change():
    """An unknown LossSpec.kind is one of the problems found before the rewrite: the model is left untouched (it
    used to be caught after the rewrite, and a retry then said "already sharded")."""
    import dataclasses

    from shardlib.policies import Policy, policy_for

    config, cls, batch = _bert()
    model = cls(config)
    base = policy_for(model)

    def bogus_plan(m, tp):
        plan = base.plan(m, tp)
        return dataclasses.replace(plan, loss=dataclasses.replace(plan.loss, kind="bogus"))

    policy = Policy(name="bogus-loss", model_classes=base.model_classes, make_plan=bogus_plan)
    before = {name: type(m) for name, m in model.named_modules()}
    with fake_world(2, 0):
        with pytest.raises(shardlib.PlanError, match="loss kind 'bogus' is not one of"):
            shardlib.shard(model, shardlib.init_mesh(tp=2), policy)
        assert {name: type(m) for name, m in model.named_modules()} == before
        shardlib.shard(model, shardlib.init_mesh(tp=2))  # untouched: it shards now


def test_fake_world_refuses_an_initialized_process_and_bad_sizes():
    import torch.distributed as dist

    from shardlib.parallel.mesh import MeshError

    for world, rank in ((0, 0), (2, 2)):
        with pytest.raises(MeshError, match="fake_world needs world_size >= 1"):
            with fake_world(world, rank):
                pass
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(MeshError, match="already initialized"):
            with fake_world(2, 0):
                pass
        assert dist.get_backend() == "gloo"  # the real group is still there
    finally:
        dist.destroy_process_group()
