"""Fused QKV (``shardlib.kernels.fused_qkv``): one GEMM per q/k/v group, same results as the separate linears.

Single process, no process group. Models are small HF configs with random weights and dropout 0; the fused copy is
a ``deepcopy`` of the reference taken before installation, so both start from identical weights.

Tolerances (measured on BERT / ViT / T5 here: forward bitwise equal; about half of the parameter gradients not
bitwise equal, max |difference| 4e-9 .. 1.5e-8). The forward GEMM is ``x [W_q; W_k; W_v]^T``: every output element is
the same length-``in`` dot product as in the separate GEMM, and with MKL float32 it comes out bitwise equal
(``test_forward_bitwise_equal_on_this_machine`` pins that); the other tests still allow float32 rounding (``FP32``)
because another BLAS may block the wider matrix differently and change the summation order. Gradients w.r.t. the
attention input are NOT bitwise equal by construction: the fused backward computes ``dx = [g_q, g_k, g_v] [W_q; W_k;
W_v]`` as one GEMM summing over all 3n output features, while autograd adds three GEMMs of n features each. That
rounding difference propagates to every parameter below the attention, so gradients are compared with ``FP32``. The
first AdamW step moves a weight by ``lr * (g / (|g| + eps) + wd * w)``, whose derivative in g is at most ``lr / eps``
= 1e5 here: for gradient entries near zero (T5's embedding rows, 1e-8-sized entries) a 1e-8 rounding difference
legitimately moves the weight by up to 1e-3 (observed 3e-4). So weights after the step are checked elementwise
against exactly that bound, ``|w - w_ref| <= 1e-6 + lr / eps * |g - g_ref|``. bf16 autocast results are compared
with bf16 rounding (``BF16``: 8 bits of mantissa, rel 2^-8 per op, a handful of ops deep; gradients scaled by their
max first).
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import BertConfig, BertModel, T5Config, T5Model, ViTConfig, ViTModel

from shardlib.kernels.fused_qkv import fuse_linears, fused_group, fused_qkv_problems, unfuse_linears
from shardlib.parallel.layers import ColumnParallelLinear, RowParallelLinear

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=3e-2, atol=3e-2)
LR, EPS = 1e-3, 1e-8  # AdamW's default eps
GEMMS = ("aten::mm", "aten::addmm")


# ---------------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------------

def bert(bias=True, hidden=32, heads=4, layers=2):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertModel(cfg)
    if not bias:
        for layer in model.encoder.layer:
            for lin in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value):
                lin.bias = None
    return model


def vit(bias=True):
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, qkv_bias=bias)
    return ViTModel(cfg)


def t5():
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2,
                   relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False)
    return T5Model(cfg)


def qkv_groups(model) -> list[list[str]]:
    """Module paths of every fusable group: BERT / ViT self-attention q, k, v; T5 self-attention q, k, v and T5
    cross-attention k, v (q reads the decoder states, k and v the encoder output)."""
    groups = []
    for path, module in model.named_modules():
        if hasattr(module, "query") and hasattr(module, "key") and hasattr(module, "value"):
            groups.append([f"{path}.{n}" for n in ("query", "key", "value")])
        elif hasattr(module, "q_proj") and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            groups.append([f"{path}.{n}_proj" for n in "qkv"])
        elif type(module).__name__ == "T5Attention":
            names = "kv" if path.endswith("EncDecAttention") else "qkv"
            groups.append([f"{path}.{n}" for n in names])
    return groups


def install(model):
    groups = []
    for names in qkv_groups(model):
        linears = [model.get_submodule(n) for n in names]
        fuse_linears(linears, names=names)
        groups.append(fused_group(linears[0]))
    assert groups
    return groups


def batch(kind, b=2, s=7):
    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        return {"pixel_values": torch.randn(b, 3, 16, 16, generator=g)}
    ids = torch.randint(0, 100, (b, s), generator=g)
    if kind == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(0, 100, (b, s - 2), generator=g)}
    return {"input_ids": ids}


def loss_of(kind, out):
    if kind == "t5":
        return out.last_hidden_state.float().pow(2).mean() + out.encoder_last_hidden_state.float().pow(2).mean()
    return out.last_hidden_state.float().pow(2).mean() + out.pooler_output.float().pow(2).mean()


MODELS = {"bert": bert, "bert-nobias": lambda: bert(bias=False), "vit": vit, "vit-nobias": lambda: vit(False),
          "t5": t5}


def pair(name):
    ref = MODELS[name]()
    fused = copy.deepcopy(ref)
    return ref, fused, install(fused), name.split("-")[0]


def gemm_count(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in GEMMS)


def group_sizes(groups):
    return [len(g.modules) for g in groups]


# ---------------------------------------------------------------------------------------------------------------
# model equivalence
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_model_outputs_grads_and_adamw_step_match(name):
    ref, fused, groups, kind = pair(name)
    keys = list(fused.state_dict())
    params = dict(fused.named_parameters())
    assert keys == list(ref.state_dict())
    inputs = batch(kind)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=LR, eps=EPS)

    out_ref, out_fused = ref(**inputs), fused(**inputs)
    assert all(g.fused_gemms == 1 and g.handed_out == len(g.modules) - 1 and g.own_calls == 0 for g in groups)
    for key in ("last_hidden_state", "encoder_last_hidden_state", "pooler_output"):
        if getattr(out_ref, key, None) is not None:
            torch.testing.assert_close(getattr(out_fused, key), getattr(out_ref, key), **FP32)
    loss_of(kind, out_ref).backward()
    loss_of(kind, out_fused).backward()
    named_ref = dict(ref.named_parameters())
    for n, p in fused.named_parameters():
        r = named_ref[n]
        assert (p.grad is None) == (r.grad is None), n
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, **FP32, msg=lambda m: f"grad of {n}: {m}")
    opt_ref.step()
    opt_fused.step()
    for n, p in fused.named_parameters():
        r = named_ref[n]
        # first AdamW step: w -= lr * (g / (|g| + eps) + wd * w); d/dg of g / (|g| + eps) is at most 1 / eps
        bound = 1e-6 + (0 if r.grad is None else LR / EPS * (p.grad - r.grad).abs())
        assert ((p - r).abs() <= bound).all(), f"{n} after AdamW: {(p - r).abs().max()}"
    # parameters and keys untouched by installation, training and the optimizer
    assert list(fused.state_dict()) == keys
    assert all(params[n] is p for n, p in fused.named_parameters())
    # the fused state dict loads into a stock model, and back
    stock = MODELS[name]()
    stock.load_state_dict(fused.state_dict())
    fused.load_state_dict(ref.state_dict())


def test_forward_bitwise_equal_on_this_machine():
    """Documents the observation behind the tolerance: same dot products, same result (MKL, float32)."""
    ref, fused, _, kind = pair("bert")
    inputs = batch(kind)
    assert torch.equal(fused(**inputs).last_hidden_state, ref(**inputs).last_hidden_state)


def test_parameter_identity_and_state_dict_keys_after_install():
    model = bert()
    before = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    install(model)
    assert list(model.state_dict()) == keys
    assert {n: p for n, p in model.named_parameters()} == before
    assert all(before[n] is p for n, p in model.named_parameters())
    s = model.encoder.layer[0].attention.self
    assert type(s.query) is nn.Linear  # the class is untouched, only the instance's forward
    assert "query.weight" in s.state_dict() and "value.bias" in s.state_dict()


@pytest.mark.parametrize("name", ["bert", "vit", "t5"])
def test_one_gemm_per_group_per_forward_and_two_per_backward(name):
    """Fails if fusion silently does not happen: counts aten::mm / aten::addmm with torch.profiler."""
    ref, fused, groups, kind = pair(name)
    inputs = batch(kind)
    saved = sum(k - 1 for k in group_sizes(groups))  # GEMMs a group of k linears saves per forward
    fwd_ref = gemm_count(lambda: ref(**inputs))
    fwd_fused = gemm_count(lambda: fused(**inputs))
    assert fwd_ref - fwd_fused == saved, (fwd_ref, fwd_fused, saved)
    with torch.no_grad():
        assert gemm_count(lambda: ref(**inputs)) - gemm_count(lambda: fused(**inputs)) == saved
    loss_ref, loss_fused = loss_of(kind, ref(**inputs)), loss_of(kind, fused(**inputs))
    for g in groups:
        g.reset_counters()
    bwd_ref = gemm_count(loss_ref.backward)
    bwd_fused = gemm_count(loss_fused.backward)
    assert bwd_ref - bwd_fused == 2 * saved, (bwd_ref, bwd_fused, saved)  # dx and dW: one GEMM each per group
    for g in groups:
        assert (g.fused_gemms, g.own_calls) == (0, 0)


def test_counter_one_fused_gemm_per_group_per_forward():
    _, fused, groups, kind = pair("t5")
    assert sorted(set(group_sizes(groups))) == [2, 3]  # cross-attention k/v and self-attention q/k/v
    for step in range(1, 4):
        fused(**batch(kind))
        for g in groups:
            assert (g.fused_gemms, g.handed_out, g.own_calls) == (step, step * (len(g.modules) - 1), 0), g


@pytest.mark.parametrize("name", ["bert", "vit", "t5"])
def test_no_grad_and_inference_mode(name):
    ref, fused, groups, kind = pair(name)
    inputs = batch(kind)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            a, b = ref(**inputs).last_hidden_state, fused(**inputs).last_hidden_state
        assert not b.requires_grad
        torch.testing.assert_close(b, a, **FP32)
    assert all(g.fused_gemms == 2 and g.own_calls == 0 for g in groups), groups


@pytest.mark.parametrize("name", ["bert", "vit", "t5"])
def test_bf16_autocast(name):
    ref, fused, groups, kind = pair(name)
    inputs = batch(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out_fused = ref(**inputs), fused(**inputs)
        loss_ref, loss_fused = loss_of(kind, out_ref), loss_of(kind, out_fused)
    assert all(g.fused_gemms == 1 and g.own_calls == 0 for g in groups)
    torch.testing.assert_close(out_fused.last_hidden_state.float(), out_ref.last_hidden_state.float(), **BF16)
    loss_ref.backward()
    loss_fused.backward()
    named_ref = dict(ref.named_parameters())
    for n, p in fused.named_parameters():
        if named_ref[n].grad is not None:
            assert p.grad.dtype == p.dtype == torch.float32, n
            scale = named_ref[n].grad.abs().max().item() + 1e-6
            torch.testing.assert_close(p.grad / scale, named_ref[n].grad / scale, **BF16, msg=lambda m: f"{n}: {m}")


def test_bf16_autocast_group_matches_f_linear_exactly():
    """Inside autocast the fused GEMM multiplies the same bf16-rounded operands as F.linear does."""
    torch.manual_seed(0)
    lins = [nn.Linear(32, 16) for _ in range(3)]
    refs = copy.deepcopy(lins)
    fuse_linears(lins, names=["q", "k", "v"])
    x = torch.randn(4, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [lin(x) for lin in lins]
        expected = [lin(x) for lin in refs]
    for o, e in zip(outs, expected):
        assert o.dtype == torch.bfloat16
        torch.testing.assert_close(o, e, rtol=1e-2, atol=1e-2)
    assert fused_group(lins[0]).fused_gemms == 1


@pytest.mark.parametrize("name", ["bert", "vit", "t5"])
def test_activation_checkpointing(name):
    ref, fused, groups, kind = pair(name)
    inputs = batch(kind)
    fused.gradient_checkpointing_enable()
    fused.train()
    ref.train()
    loss_of(kind, ref(**inputs)).backward()
    loss_of(kind, fused(**inputs)).backward()
    named_ref = dict(ref.named_parameters())
    for n, p in fused.named_parameters():
        if named_ref[n].grad is not None:
            torch.testing.assert_close(p.grad, named_ref[n].grad, **FP32, msg=lambda m: f"{n}: {m}")
    # forward + recompute: the members are called again and fuse again
    assert all(g.fused_gemms == 2 and g.own_calls == 0 for g in groups), groups


# ---------------------------------------------------------------------------------------------------------------
# group behaviour (plain linears of per-rank size stand in for local shards)
# ---------------------------------------------------------------------------------------------------------------

def linears(k=3, in_features=32, out_features=16, bias=True, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(in_features, out_features, bias=bias) for _ in range(k)]


def test_member_called_with_another_input_computes_its_own():
    lins = linears()
    fuse_linears(lins, names=["q", "k", "v"])
    g = fused_group(lins[0])
    x, other = torch.randn(3, 32), torch.randn(3, 32)
    q = lins[0](x)
    k = lins[1](other)  # different tensor object: not the stashed slice
    torch.testing.assert_close(k, F.linear(other, lins[1].weight, lins[1].bias), rtol=0, atol=0)
    same_values = x.clone()
    v = lins[2](same_values)  # equal values but another object: identity, not equality, decides
    torch.testing.assert_close(v, F.linear(same_values, lins[2].weight, lins[2].bias), rtol=0, atol=0)
    torch.testing.assert_close(q, F.linear(x, lins[0].weight, lins[0].bias), **FP32)
    assert (g.fused_gemms, g.handed_out) == (1, 0)
    assert g.own_calls == 2


def test_changed_input_or_weights_between_members_fall_back():
    lins = linears()
    fuse_linears(lins, names=["q", "k", "v"])
    g = fused_group(lins[0])
    x = torch.randn(3, 32)
    q = lins[0](x)
    x.mul_(2)  # in place between members: the stashed slices are stale
    k = lins[1](x)
    torch.testing.assert_close(k, F.linear(x, lins[1].weight, lins[1].bias), rtol=0, atol=0)
    # weight swapped between q and v (e.g. materialized or loaded): v uses the new one
    q = lins[0](x)
    lins[2].weight = nn.Parameter(torch.randn(16, 32))
    v = lins[2](x)
    torch.testing.assert_close(v, F.linear(x, lins[2].weight, lins[2].bias), rtol=0, atol=0)
    # updated in place between q and k (optimizer step)
    q = lins[0](x)  # noqa: F841 (kept alive as a model would)
    with torch.no_grad():
        lins[1].weight.add_(1.0)
    k = lins[1](x)
    torch.testing.assert_close(k, F.linear(x, lins[1].weight, lins[1].bias), rtol=0, atol=0)
    assert g.own_calls == 3


def test_member_order_does_not_matter_and_repeats_are_correct():
    lins = linears()
    refs = copy.deepcopy(lins)
    fuse_linears(lins, names=["q", "k", "v"])
    g = fused_group(lins[0])
    x = torch.randn(2, 3, 32)
    for order in ([2, 0, 1], [1, 1, 0, 2], [0, 2]):
        outs = []
        for i in order:
            outs.append(lins[i](x))
            torch.testing.assert_close(outs[-1], refs[i](x), **FP32)
    assert (g.fused_gemms, g.handed_out, g.own_calls) == (4, 5, 0)


def test_parameters_replaced_later_are_picked_up():
    """Fuse on the meta device, then materialize and load: the next call reads the new parameters."""
    with torch.device("meta"):
        lins = linears()
    fuse_linears(lins, names=["q", "k", "v"])
    assert lins[0](torch.empty(2, 32, device="meta")).shape == (2, 16)
    real = linears(seed=3)
    for lin, src in zip(lins, real):
        lin.to_empty(device="cpu")
        lin.load_state_dict(src.state_dict())
    x = torch.randn(2, 32)
    outs = [lin(x) for lin in lins]
    for out, src in zip(outs, real):
        torch.testing.assert_close(out, src(x), **FP32)
    g = fused_group(lins[0])
    assert (g.fused_gemms, g.handed_out, g.own_calls) == (2, 2, 0)  # meta call (k, v never called) + real call
    # a new Parameter object assigned as a checkpoint loader would
    lins[1].weight = nn.Parameter(torch.ones(16, 32))
    q = lins[0](x)  # noqa: F841
    torch.testing.assert_close(lins[1](x), F.linear(x, torch.ones(16, 32), lins[1].bias), **FP32)


def test_stash_released_when_consumed_or_when_first_output_dies():
    lins = linears()
    fuse_linears(lins, names=["q", "k", "v"])
    g = fused_group(lins[0])
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(4, 32) @ w  # has a graph behind it
    q = lins[0](x)
    assert g._ref() is q and g._held is None
    lins[1](x)
    v = lins[2](x)
    assert g._ref is None and not hasattr(q, "_shardlib_fused_pending")  # released once consumed
    del q, v

    # a member that is never called: its slice lives only as long as the first output
    q = lins[0](x).view(4, 4, 4)  # as HF does: only a view of the first output survives
    pending = g._ref()._shardlib_fused_pending
    stale = [weakref.ref(out) for out, *_ in pending.outputs.values()]
    node = weakref.ref(stale[0]().grad_fn)
    del pending
    assert all(r() is not None for r in stale)
    del q
    gc.collect()
    assert g._ref() is None
    assert all(r() is None for r in stale) and node() is None  # outputs and their graph node are gone

    # without a graph (no_grad / inference mode) the group holds the slices while x lives, and no longer
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            x = torch.randn(4, 32)
            q = lins[0](x).view(4, 4, 4)
            assert g._held is not None and g._ref() is x
            stale = [weakref.ref(out) for out, *_ in g._held.outputs.values()]
            del q
            assert all(r() is not None for r in stale)
            del x
            gc.collect()
            assert g._ref is None and g._held is None and all(r() is None for r in stale)
    assert not g.disabled


def test_no_graph_kept_across_steps_when_a_member_is_skipped():
    """Training loop where v is never called: memory of step N is not held while step N+1 runs."""
    lins = linears()
    fuse_linears(lins, names=["q", "k", "v"])
    refs = []
    for _ in range(3):
        x = torch.randn(4, 32, requires_grad=True)
        q, k = lins[0](x), lins[1](x)
        (q.sum() + k.sum()).backward()
        refs.append(weakref.ref(x))
        del x, q, k
    gc.collect()
    assert all(r() is None for r in refs)
    g = fused_group(lins[0])
    assert (g.fused_gemms, g.handed_out, g.own_calls, g.disabled) == (3, 3, 0, False)


def test_first_output_released_early_disables_fusion(caplog):
    """A model that drops q's output before calling k (``self.q(x) * s``) would recompute the GEMM for every
    member; the group notices at the first such call, warns and computes each projection separately."""
    lins = linears()
    refs = copy.deepcopy(lins)
    fuse_linears(lins, names=["blk.q", "blk.k", "blk.v"])
    g = fused_group(lins[0])
    x = torch.randn(3, 32)
    with caplog.at_level("WARNING", logger="shardlib"):
        for _ in range(2):
            outs = [lin(x) * 1.0 for lin in lins]
            for o, r in zip(outs, refs):
                torch.testing.assert_close(o, r(x), **FP32)
    assert g.disabled and (g.fused_gemms, g.handed_out, g.own_calls) == (1, 0, 5)
    assert "fused QKV disabled for blk.q, blk.k, blk.v" in caplog.text


def test_grad_only_for_consumed_members_and_frozen_weights():
    lins = linears()
    refs = copy.deepcopy(lins)
    fuse_linears(lins, names=["q", "k", "v"])
    lins[1].weight.requires_grad_(False)
    refs[1].weight.requires_grad_(False)
    x = torch.randn(3, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    q, k = lins[0](x), lins[1](x)  # v's slice computed but never used
    (q.sum() + 2 * k.sum()).backward()
    (refs[0](xr).sum() + 2 * refs[1](xr).sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad, **FP32)
    assert lins[1].weight.grad is None
    torch.testing.assert_close(lins[0].weight.grad, refs[0].weight.grad, **FP32)
    torch.testing.assert_close(lins[2].weight.grad, torch.zeros(16, 32), rtol=0, atol=0)
    torch.testing.assert_close(lins[1].bias.grad, refs[1].bias.grad, **FP32)


def close_scaled(actual, expected):
    """FP32 relative to the tensor's largest entry: a float32 dot product is exact to a few ulps of the sum of the
    magnitudes of its terms, not of its (possibly cancelled, near-zero) result."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual / scale, expected / scale, **FP32)


@settings(deadline=None)
@given(
    heads=st.integers(1, 6), head_dim=st.sampled_from([1, 4, 8, 16]), batch=st.integers(1, 4), seq=st.integers(1, 9),
    bias=st.booleans(), tp=st.sampled_from([1, 2, 4]), members=st.sampled_from([2, 3]), seed=st.integers(0, 2**16),
)
def test_property_group_matches_separate_linears(heads, head_dim, batch, seq, bias, tp, members, seed):
    """Any size: local shard shapes (out = hidden / tp, as ColumnParallelLinear holds them) via plain linears."""
    hidden = heads * head_dim * tp  # so that the per-rank size is a whole number of heads
    local = hidden // tp
    lins = linears(members, hidden, local, bias, seed)
    refs = copy.deepcopy(lins)
    fuse_linears(lins, names=[f"m{i}" for i in range(members)])
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    outs = [lin(x) for lin in lins]
    exp = [r(xr) for r in refs]
    g = fused_group(lins[0])
    assert (g.fused_gemms, g.handed_out, g.own_calls) == (1, members - 1, 0)
    weights = torch.randn(members)
    sum(wi * o.pow(2).sum() for wi, o in zip(weights, outs)).backward()
    sum(wi * o.pow(2).sum() for wi, o in zip(weights, exp)).backward()
    for o, e in zip(outs, exp):
        assert o.shape == e.shape == (batch, seq, local)
        close_scaled(o, e)
    close_scaled(x.grad, xr.grad)
    for lin, r in zip(lins, refs):
        for p, pr in zip(lin.parameters(), r.parameters()):
            close_scaled(p.grad, pr.grad)


@settings(deadline=None, max_examples=8)
@given(heads=st.integers(1, 4), head_dim=st.sampled_from([4, 8]), batch=st.integers(1, 3), seq=st.integers(1, 8),
       bias=st.booleans())
def test_property_bert_sizes(heads, head_dim, batch, seq, bias):
    ref = bert(bias=bias, hidden=heads * head_dim, heads=heads, layers=1)
    fused = copy.deepcopy(ref)
    groups = install(fused)
    inputs = {"input_ids": torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(seq))}
    out_ref, out_fused = ref(**inputs), fused(**inputs)
    torch.testing.assert_close(out_fused.last_hidden_state, out_ref.last_hidden_state, **FP32)
    loss_of("bert", out_ref).backward()
    loss_of("bert", out_fused).backward()
    named_ref = dict(ref.named_parameters())
    for n, p in fused.named_parameters():
        if named_ref[n].grad is not None:
            torch.testing.assert_close(p.grad, named_ref[n].grad, **FP32)
    assert all(g.fused_gemms == 1 and g.own_calls == 0 for g in groups)


# ---------------------------------------------------------------------------------------------------------------
# ColumnParallelLinear members, refusals, copies
# ---------------------------------------------------------------------------------------------------------------

def test_column_parallel_members_tp1():
    lins = linears()
    cpl = [ColumnParallelLinear(lin, None, copy_input=False) for lin in lins]
    fuse_linears(cpl, names=["a.q", "a.k", "a.v"])
    x = torch.randn(2, 5, 32)
    outs = [c(x) for c in cpl]
    for out, lin in zip(outs, lins):
        torch.testing.assert_close(out, lin(x), **FP32)
    g = fused_group(cpl[0])
    assert (g.fused_gemms, g.handed_out, g.own_calls) == (1, 2, 0)
    # flags changed after installation: no fusion, every member computes its own output (always correct)
    cpl[2].copy_input = True
    outs = [c(x) for c in cpl[:2]]
    assert (g.fused_gemms, g.own_calls) == (1, 2)


def test_offline_sharded_column_parallel_refuses_to_run_like_stock():
    lins = linears(in_features=32, out_features=32)
    cpl = [ColumnParallelLinear(lin, None, copy_input=False, tp_size=2, tp_rank=1) for lin in lins]
    assert fused_qkv_problems("blk", {"q": cpl[0], "k": cpl[1], "v": cpl[2]}) == []
    fuse_linears(cpl, names=["blk.q", "blk.k", "blk.v"])
    assert cpl[0].weight.shape == (16, 32)  # local shard shape
    with pytest.raises(RuntimeError, match="without a process group"):
        cpl[0](torch.randn(2, 32))


def test_refusals_name_the_module():
    a, b, c = linears()
    cases = {
        "in_features 16 != 32": [a, nn.Linear(16, 16)],
        "dtype torch.float64": [a, nn.Linear(32, 16).double()],
        "device meta": [a, nn.Linear(32, 16, device="meta")],
        "copy_input=True": [a, ColumnParallelLinear(b, None, copy_input=True)],
        "gather_output=True": [a, ColumnParallelLinear(b, None, copy_input=False, gather_output=True)],
        "found Conv1d": [a, nn.Conv1d(32, 16, 1)],
        "has its own forward": [a, RowParallelLinear(nn.Linear(32, 32), None)],
        "also member blk.m0": [a, a],
        "at least 2 linears": [a],
    }
    for expected, mods in cases.items():
        names = [f"blk.m{i}" for i in range(len(mods))]
        problems = fused_qkv_problems("", list(zip(names, mods)))
        assert any(expected in p for p in problems), (expected, problems)
        if len(mods) > 1:
            assert any(p.startswith("blk.m1:") for p in problems) or expected.startswith("also"), problems
        with pytest.raises(ValueError, match="cannot fuse"):
            fuse_linears(mods, names=names)
        assert "forward" not in a.__dict__  # nothing installed on refusal
    # path + mapping form
    problems = fused_qkv_problems("encoder.layer.0.attention.self", {"query": a, "key": nn.Linear(8, 16)})
    assert problems == ["encoder.layer.0.attention.self.key: in_features 8 != 32 of "
                        "encoder.layer.0.attention.self.query"]
    fuse_linears([a, b], names=["x.q", "x.k"])
    with pytest.raises(ValueError, match=r"x\.q: already fused in group \(x\.q, x\.k\)"):
        fuse_linears([a, c], names=["x.q", "x.v"])
    with pytest.raises(ValueError, match="2 linears but 1 names"):
        fuse_linears([b, c], names=["only"])


def test_unfuse_restores_stock_forward():
    lins = linears()
    fuse_linears(lins, names=["q", "k", "v"])
    unfuse_linears(lins[:1])
    assert all("forward" not in lin.__dict__ and fused_group(lin) is None for lin in lins)
    fuse_linears(lins, names=["q", "k", "v"])  # can be fused again


def test_deepcopy_and_pickle_bind_to_the_copy():
    _, fused, groups, kind = pair("bert")
    inputs = batch(kind)
    fused(**inputs)
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        clone_groups = [fused_group(clone.get_submodule(names[0])) for names in qkv_groups(clone)]
        for cg, g in zip(clone_groups, groups):
            assert cg is not g and all(m is clone.get_submodule(n) for m, n in zip(cg.modules, cg.names))
            cg.reset_counters()
        torch.testing.assert_close(clone(**inputs).last_hidden_state, fused(**inputs).last_hidden_state,
                                   rtol=0, atol=0)
        assert all(cg.fused_gemms == 1 and cg.own_calls == 0 for cg in clone_groups)
