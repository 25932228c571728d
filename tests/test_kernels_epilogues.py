"""Fused epilogues (shardlib.kernels.epilogues) against their references, op by op and in whole HF models.

Tolerances and their reasons:

* ``dropout_add``: exact (``torch.equal``) in every dtype, forward and backward, and the default generator is left
  in the same state. The mask is drawn by the same ``bernoulli_`` call F.dropout makes on CPU, the scale is the
  same rounded ``1 / (1 - p)``, and inductor emulates eager's per-op bf16 rounding (``emulate_precision_casts``).
* ``bias_gelu``: not bit-exact. Inductor's erf / tanh differ from ATen's GELU kernel by a few ulp, and the bias
  gradient (a sum over rows) is accumulated in another order. float32: rtol 1e-5 (~100 ulp) and, because
  ``1 + erf(z/sqrt 2)`` cancels for negative z, atol ``32 eps max|z|``; bf16: one bf16 ulp (rtol 2^-7) where the
  fp32 results straddle a rounding boundary. The bias gradient allows ``rows`` times the per-element error.
* whole models with bias_gelu (BERT, ViT; float32): those few-ulp differences pass through LayerNorm, softmax and
  two layers: outputs and gradients to rtol 1e-4 / atol 1e-5. After one AdamW step the update
  ``lr * g / (sqrt(g^2) + eps)`` is ~``lr * sign(g)``, so a gradient that is ~0 in both models can flip sign:
  weights are compared to atol ``lr`` (1e-3 of the update size, tight relative to weights ~0.02-1).
* T5 (no biases, so only dropout_add): exact.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from shardlib.kernels import epilogues as E
from shardlib.parallel.layers import ColumnParallelLinear
from shardlib.parallel.random import RNGStatesTracker
from shardlib.parallel.styles import LocalRNG, ShardContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def calls():
    return dict(E.CALLS)


def delta(before: dict, key: str) -> int:
    return E.CALLS[key] - before.get(key, 0)


# ------------------------------------------------------------------------------------------------- op level
@given(shape=st.lists(st.integers(1, 17), min_size=1, max_size=3), dtype=st.sampled_from(list(DTYPES)),
       p=st.sampled_from([0.0, 0.1, 0.5]), training=st.booleans(), transposed=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_dropout_add_equals_reference_bitwise(shape, dtype, p, training, transposed, seed):
    dtype = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    x0 = (torch.randn(shape, generator=g) * 3).to(dtype)
    r0 = torch.randn(shape, generator=g).to(dtype)
    if transposed and len(shape) >= 2:  # a non-contiguous x: the mask follows x's memory layout in both
        x0 = x0.transpose(0, -1).contiguous().transpose(0, -1)
    outs, grads, states = [], [], []
    for fn in (E.dropout_add_reference, E.dropout_add):
        x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
        torch.manual_seed(seed)
        out = fn(x, r, p, training)
        states.append(torch.get_rng_state())
        out.backward(torch.ones_like(out) * 0.5 + torch.arange(out.numel()).view(out.shape).to(dtype) % 3)
        outs.append(out.detach())
        grads.append((x.grad, r.grad))
    assert outs[0].dtype == outs[1].dtype and outs[0].shape == outs[1].shape
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert torch.equal(states[0], states[1]), "the fused dropout consumed the default generator differently"


def test_dropout_add_edge_cases():
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    for p, training in ((1.0, True), (0.3, False), (0.0, True)):
        torch.manual_seed(0)
        ref = E.dropout_add_reference(x, r, p, training)
        torch.manual_seed(0)
        assert torch.equal(E.dropout_add(x, r, p, training), ref)
    with pytest.raises(ValueError, match="between 0 and 1"):
        E.dropout_add(x, r, 1.5, True)
    x[0, 0] = float("nan")  # NaNs survive (or not) exactly as in x * noise
    torch.manual_seed(1)
    ref = E.dropout_add_reference(x, r, 0.5, True)
    torch.manual_seed(1)
    assert torch.equal(E.dropout_add(x, r, 0.5, True).isnan(), ref.isnan())
    # DropoutAdd with one argument is nn.Dropout
    d = E.DropoutAdd(0.2)
    torch.manual_seed(2)
    a = d(x)
    torch.manual_seed(2)
    assert torch.equal(a.nan_to_num(), F.dropout(x, 0.2, True).nan_to_num())


def _bias_gelu_tol(dtype, rows, zmax, gmax):
    """(output, input-gradient, bias-gradient) tolerances; see the module docstring. For negative z,
    GELU(z) = z/2 (1 + erf(z/sqrt 2)) cancels: erf's few-ulp difference near -1 becomes ~ulp(1) * |z| absolute."""
    if dtype == torch.float32:
        atol = 32 * torch.finfo(torch.float32).eps * max(1.0, zmax)
        out, grad = dict(rtol=1e-5, atol=atol), dict(rtol=1e-5, atol=atol * gmax)
    else:  # one bf16 ulp of the output where the fp32 results straddle a rounding boundary
        out, grad = dict(rtol=2**-7, atol=1e-3), dict(rtol=2**-7, atol=1e-3 * gmax)
    return out, grad, dict(rtol=grad["rtol"] * 2, atol=grad["atol"] * rows)


@given(lead=st.lists(st.integers(1, 12), min_size=0, max_size=2), h=st.integers(1, 40),
       dtype=st.sampled_from(list(DTYPES)), approximate=st.sampled_from(["none", "tanh"]),
       scale=st.sampled_from([0.1, 1.0, 4.0]), seed=st.integers(0, 2**31 - 1))
def test_bias_gelu_matches_reference(lead, h, dtype, approximate, scale, seed):
    dtype = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    y0 = (torch.randn(*lead, h, generator=g) * scale).to(dtype)
    b0 = torch.randn(h, generator=g).to(dtype)
    gout = torch.randn(*lead, h, generator=g).to(dtype)
    res = []
    for fn in (E.bias_gelu_reference, E.bias_gelu):
        y, b = y0.clone().requires_grad_(), b0.clone().requires_grad_()
        out = fn(y, b, approximate)
        out.backward(gout)
        res.append((out.detach(), y.grad, b.grad))
    rows = max(1, y0.numel() // h)
    zmax = (y0.float() + b0.float()).abs().max().item()
    out_tol, grad_tol, bias_tol = _bias_gelu_tol(dtype, rows, zmax, gout.float().abs().max().item())
    (o0, gy0, gb0), (o1, gy1, gb1) = res
    assert o1.dtype == dtype and o1.shape == o0.shape
    torch.testing.assert_close(o1, o0, **out_tol)
    torch.testing.assert_close(gy1, gy0, **grad_tol)
    torch.testing.assert_close(gb1, gb0, **bias_tol)


def test_bias_gelu_eager_fallback_is_the_reference():
    """With compilation off the fused ops run the same math in eager mode: bit-identical to the references."""
    y, b = torch.randn(6, 5, 32), torch.randn(32)
    before = calls()
    E.set_compile(False)
    try:
        assert E.implementation().startswith("eager")
        for approximate in ("none", "tanh"):
            assert torch.equal(E.bias_gelu(y, b, approximate), E.bias_gelu_reference(y, b, approximate))
        torch.manual_seed(3)
        out = E.dropout_add(y, y * 2, 0.1, True)
        torch.manual_seed(3)
        assert torch.equal(out, E.dropout_add_reference(y, y * 2, 0.1, True))
    finally:
        E.set_compile(True)
    assert delta(before, "bias_gelu:eager") == 2 and delta(before, "dropout_add:eager") == 1


def test_ops_run_compiled():
    """On this machine (gcc present) the fused ops really run through inductor, not the eager fallback."""
    y, b = torch.randn(8, 16, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    before = calls()
    E.bias_gelu(y, b).sum().backward()
    E.dropout_add(y, y, 0.1, True).sum().backward()
    assert E.implementation() == "inductor", E.implementation()
    assert delta(before, "bias_gelu") == 1 and delta(before, "bias_gelu:eager") == 0
    assert delta(before, "dropout_add") == 1 and delta(before, "dropout_add:eager") == 0


# ----------------------------------------------------------------------------------- ColumnParallelLinear
def test_column_parallel_linear_epilogue():
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    x = torch.randn(3, 5, 16)
    plain = ColumnParallelLinear(lin, None)
    assert plain.epilogue is None and torch.equal(plain(x), F.linear(x, lin.weight, lin.bias))
    fused = ColumnParallelLinear(lin, None)
    fused.epilogue = E.BiasGELU()
    before = calls()
    torch.testing.assert_close(fused(x), F.gelu(lin(x)), rtol=1e-5, atol=1e-6)  # few-ulp erf difference
    assert delta(before, "bias_gelu") == 1
    # an epilogue set on the nn.Linear (install before sharding) is carried over by the sharded layer
    carrier = E.EpilogueLinear(16, 24)
    carrier.epilogue = E.BiasGELU("tanh")
    assert ColumnParallelLinear(carrier, None, tp_size=1, tp_rank=0).epilogue is carrier.epilogue


def _bert_intermediate(hidden=16, inter=24, act="gelu"):
    from transformers.models.bert.modeling_bert import BertIntermediate
    return BertIntermediate(transformers.BertConfig(hidden_size=hidden, intermediate_size=inter, hidden_act=act))


def test_bias_gelu_survives_sharding_after_install():
    """Installed on the HF module, then its dense replaced by a ColumnParallelLinear (what ColwiseParallel does):
    the epilogue moves along and the kernel still runs."""
    torch.manual_seed(0)
    m = _bert_intermediate()
    x = torch.randn(2, 7, 16)
    stock = m.intermediate_act_fn(m.dense(x))
    E.install_bias_gelu("layer.intermediate", m)
    m.dense = ColumnParallelLinear(m.dense, None, tp_size=1, tp_rank=0)
    before = calls()
    torch.testing.assert_close(m(x), stock, rtol=1e-5, atol=1e-6)
    assert delta(before, "bias_gelu") == 1
    # a replacement without the epilogue: correct stock math, but loudly unfused
    m.dense = nn.Linear(16, 24)
    with pytest.warns(RuntimeWarning, match="lost the bias_gelu epilogue"):
        torch.testing.assert_close(m(x), F.gelu(m.dense(x)))


# ------------------------------------------------------------------------------------------- problems
def test_epilogue_problems_name_the_path():
    assert E.epilogue_problems("bias_gelu", "a.b", _bert_intermediate()) == []
    p = E.epilogue_problems("bias_gelu", "enc.0.intermediate", _bert_intermediate(act="relu"))
    assert len(p) == 1 and p[0].startswith("enc.0.intermediate.intermediate_act_fn") and "not GELU" in p[0]
    assert "not GELU" in E.epilogue_problems("bias_gelu", "x", _bert_intermediate(act="gelu_new"))[0]
    assert E.epilogue_problems("bias_gelu", "x", _bert_intermediate(act="gelu_pytorch_tanh")) == []
    p = E.epilogue_problems("dropout_add", "enc.0", nn.Linear(2, 2))
    assert p[0].startswith("enc.0: dropout_add applies to BertSelfOutput") and "found Linear" in p[0]
    assert "unknown epilogue kind" in E.epilogue_problems("softmax", "x", nn.Linear(2, 2))[0]
    m = _bert_intermediate()
    m.dense = nn.Conv1d(1, 1, 1)
    assert "needs an nn.Linear or ColumnParallelLinear" in E.epilogue_problems("bias_gelu", "q", m)[0]
    with pytest.raises(ValueError, match=r"cannot install bias_gelu:\n  enc.1.intermediate.intermediate_act_fn"):
        E.install_bias_gelu("enc.1.intermediate", _bert_intermediate(act="relu"))
    with pytest.raises(ValueError, match="dropout_add applies to"):
        E.install_dropout_add("pooler", nn.Linear(2, 2))


# -------------------------------------------------------------------------------------------- models
def bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                  max_position_embeddings=16)
    model = transformers.BertForMaskedLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 9), generator=g)
    labels = ids.masked_fill(torch.rand(3, 9, generator=g) < 0.5, -100)
    # (installed modules, fused calls per forward) per kind
    return model, {"input_ids": ids, "labels": labels}, {"bias_gelu": (2, 2), "dropout_add": (4, 4)}, "logits"


def vit():
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.1,
                                 attention_probs_dropout_prob=0.1, num_labels=3)
    model = transformers.ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(3, 3, 8, 8, generator=g), "labels": torch.randint(0, 3, (3,), generator=g)}
    # ViTLayer: one dropout module for both residuals -> two fused calls per layer and forward
    return model, batch, {"bias_gelu": (2, 2), "dropout_add": (2, 4)}, "logits"


def t5(ffn="relu"):
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                dropout_rate=0.1, feed_forward_proj=ffn, pad_token_id=0, eos_token_id=1,
                                decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(2, 64, (3, 7), generator=g),
             "labels": torch.randint(2, 64, (3, 5), generator=g)}
    # encoder: 2 x (self-attn, FF); decoder: 2 x (self-attn, cross-attn, FF)
    return model, batch, {"bias_gelu": (0, 0), "dropout_add": (10, 10)}, "logits"


CASES = {"bert": bert, "vit": vit, "t5": t5, "t5_gated": lambda: t5("gated-gelu")}
EXACT = {"t5", "t5_gated"}  # no bias_gelu: everything bit-identical


def _step(model, batch, seed):
    torch.manual_seed(seed)
    out = model(**batch)
    rng = torch.get_rng_state()
    out.loss.backward()
    return out, rng


@pytest.mark.parametrize("case", list(CASES))
def test_fused_model_equals_stock(case):
    torch.manual_seed(0)
    stock, batch, expected, logits = CASES[case]()
    fused = copy.deepcopy(stock)
    params_before = [(n, id(p)) for n, p in fused.named_parameters()]
    keys_before = list(fused.state_dict())
    installed = E.install_epilogues(fused)
    assert {k: len(v) for k, v in installed.items()} == {k: n for k, (n, _calls) in expected.items()}
    assert [(n, id(p)) for n, p in fused.named_parameters()] == params_before
    assert list(fused.state_dict()) == keys_before == list(stock.state_dict())
    stock.train(), fused.train()

    before = calls()
    out_s, rng_s = _step(stock, batch, seed=123)
    out_f, rng_f = _step(fused, batch, seed=123)
    # the kernels ran, once per installed site and forward, compiled (not silently bypassed)
    assert delta(before, "dropout_add") == expected["dropout_add"][1] and delta(before, "dropout_add:reference") == 0
    assert delta(before, "bias_gelu") == expected["bias_gelu"][1]
    if E.implementation() == "inductor":
        assert all(delta(before, f"{k}{suffix}:eager") == 0 for k in E.KINDS for suffix in ("", ".backward"))
    assert torch.equal(rng_s, rng_f), "dropout consumed the RNG differently"

    exact = case in EXACT
    close = (lambda a, b: torch.equal(a, b)) if exact else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    assert close(out_f.loss, out_s.loss), (out_f.loss, out_s.loss)
    assert close(out_f[logits], out_s[logits])
    for (name, ps), pf in zip(stock.named_parameters(), fused.parameters()):
        assert (ps.grad is None) == (pf.grad is None), name
        if ps.grad is not None:
            assert close(pf.grad, ps.grad), f"{name}: max diff {(pf.grad - ps.grad).abs().max()}"

    lr = 1e-3
    for model in (stock, fused):
        torch.optim.AdamW(model.parameters(), lr=lr).step()
    for (name, ps), pf in zip(stock.named_parameters(), fused.parameters()):
        if exact:
            assert torch.equal(pf, ps), name
        else:
            torch.testing.assert_close(pf, ps, rtol=0, atol=lr, msg=name)

    # a second forward with dropout active must draw new masks in both models alike
    stock.zero_grad(), fused.zero_grad()
    out_s2, _ = _step(stock, batch, seed=7)
    out_f2, _ = _step(fused, batch, seed=7)
    assert not torch.equal(out_s2[logits], out_s[logits])
    assert exact is False or torch.equal(out_s2[logits], out_f2[logits])


@pytest.mark.parametrize("case", ["t5", "vit"])
def test_eval_mode_and_hidden_states(case):
    """Eval: dropout_add is r + x exactly. HF's output recorders (isinstance on ViTLayer) still see the fused layers."""
    torch.manual_seed(0)
    stock, batch, _, logits = CASES[case]()
    fused = copy.deepcopy(stock)
    E.install_epilogues(fused)
    stock.eval(), fused.eval()
    with torch.no_grad():
        out_s = stock(**batch, output_hidden_states=True)
        out_f = fused(**batch, output_hidden_states=True)
    hidden = "encoder_hidden_states" if case == "t5" else "hidden_states"
    assert len(out_f[hidden]) == len(out_s[hidden]) == 3
    for a, b in zip((out_f[logits], *out_f[hidden]), (out_s[logits], *out_s[hidden])):
        assert torch.equal(a, b) if case == "t5" else torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_local_rng_hooks_switch_streams_around_the_fused_dropout():
    """styles.LocalRNG hooks on the dropout modules (registered before install on one model, after on another)
    still fire, and the fused dropout draws its mask inside them, from the per-rank stream."""
    torch.manual_seed(0)
    stock, batch, _, logits = t5()
    early, late = copy.deepcopy(stock), copy.deepcopy(stock)
    trackers = []

    def hook_dropouts(model):
        tracker = RNGStatesTracker()
        tracker.add("tensor-parallel", 99, index=0, count=2)  # rank 0 of 2: a stream of its own (at 1 rank, none)
        ctx = ShardContext(group=None, tp=1, rng_tracker=tracker)
        for path, mod in model.named_modules():
            if path.endswith("layer.0.dropout") or path.endswith("layer.1.dropout") or path.endswith(
                    "layer.2.dropout"):
                LocalRNG().apply(path, mod, ctx)
        trackers.append(tracker)

    hook_dropouts(stock)
    hook_dropouts(early)
    E.install_epilogues(early)
    E.install_epilogues(late)
    hook_dropouts(late)
    outs = []
    for model in (stock, early, late):
        model.train()
        torch.manual_seed(5)
        outs.append((model(**batch)[logits], torch.get_rng_state()))
    for out, rng in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(rng, outs[0][1])
    states = [t.get_states()["tensor-parallel"][0] for t in trackers]
    assert not torch.equal(states[0], torch.manual_seed(99).get_state())  # the forked stream advanced
    assert torch.equal(states[0], states[1]) and torch.equal(states[0], states[2])


def test_install_is_idempotent_and_models_copy_and_pickle():
    torch.manual_seed(0)
    model, batch, _, logits = bert()
    first = E.install_epilogues(model)
    again = E.install_epilogues(model)
    assert first == again
    layer = model.bert.encoder.layer[0]
    assert E.install_bias_gelu("l0.intermediate", layer.intermediate) is layer.intermediate
    assert type(layer.intermediate.dense) is E.EpilogueLinear
    model.eval()
    ref = model(**batch)[logits]
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone.bert.encoder.layer[1].output) is E.FusedBertOutput
        assert isinstance(clone.bert.encoder.layer[1].output, transformers.models.bert.modeling_bert.BertOutput)
        before = calls()
        assert torch.equal(clone(**batch)[logits], ref)
        assert delta(before, "bias_gelu") == 2


def test_unsupported_activation_is_left_alone_by_install_epilogues():
    cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, hidden_act="relu")
    model = transformers.BertModel(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        installed = E.install_epilogues(model)
    assert installed["bias_gelu"] == [] and len(installed["dropout_add"]) == 2
    assert type(model.encoder.layer[0].intermediate).__name__ == "BertIntermediate"
