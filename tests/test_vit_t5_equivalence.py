"""Property-based equivalence of sharded ViT and T5-family models with the unsharded ones (4 gloo ranks), and
T5 generation."""

import pytest
from hypothesis import example, given

import rank_tasks
from strategies import t5_specs, vit_specs
import t5_cases
import vit_cases

def _check(results):
    for compared in results:
        assert compared["outputs"] >= 1 and compared["grads"] >= 1 and compared["weights"] >= compared["grads"]


# one token per rank under Megatron SP (2 tokens, tp=2) with batch 2: the all-gather's flatten was a strided view
# there, and the backward re-gather of the saved sequence read it as contiguous (wrong q/k/v weight gradients)
@example(spec={"family": "vit", "cls": "ViTModel", "tp": 2, "interpolate": False, "padding": False, "dtype": "float32",
               "seed": 0, "meta": False, "batch": 2, "sp": True,
               "config": {"image": 2, "patch": 2, "heads": 2, "head_dim": 2, "layers": 1, "intermediate": 2,
                          "act": "gelu", "num_labels": 2, "qkv_bias": False},
               "kernels": {"attention": None, "fused_qkv": True, "bias_gelu": False, "dropout_add": False}})
@given(spec=vit_specs())
def test_sharded_vit_matches_unsharded(pool, spec):
    _check(pool.run(rank_tasks.equivalence, spec))


@given(spec=t5_specs())
def test_sharded_t5_matches_unsharded(pool, spec):
    _check(pool.run(rank_tasks.equivalence, spec))


FIXED_T5 = {"vocab": 53, "d_model": 12, "d_kv": 4, "heads": 4, "d_ff": 16, "layers": 2, "decoder_layers": 2,
            "buckets": 8, "max_distance": 16, "tie": True, "num_labels": 3}


@pytest.mark.parametrize("cls", t5_cases.CLASSES)
@pytest.mark.parametrize("ffn", ["relu", "gated-gelu"])
def test_every_t5_class_both_ffn_kinds(pool, cls, ffn):
    spec = {"family": "t5", "cls": cls, "tp": 4, "seq": 7, "dec_seq": 5, "batch": 2, "padding": True,
            "dtype": "float32", "seed": 1, "config": {**FIXED_T5, "ffn": ffn}}
    _check(pool.run(rank_tasks.equivalence, spec))


@pytest.mark.parametrize("cls", vit_cases.CLASSES)
@pytest.mark.parametrize("interpolate", [False, True])
def test_every_vit_class(pool, cls, interpolate):
    spec = {"family": "vit", "cls": cls, "tp": 2, "batch": 2, "dtype": "float32", "seed": 2,
            "interpolate": interpolate, "config": {"image": 8, "patch": 2, "heads": 4, "head_dim": 4, "layers": 2,
                                                   "intermediate": 32, "num_labels": 5}}
    _check(pool.run(rank_tasks.equivalence, spec))


@pytest.mark.parametrize("cls", ["T5ForConditionalGeneration", "MT5ForConditionalGeneration",
                                 "UMT5ForConditionalGeneration"])
@pytest.mark.parametrize("tp", [2, 4])
def test_generate_matches_unsharded(pool, cls, tp):
    # d_model 64 with a large init: random weights that generate varied tokens rather than one repeated token
    spec = {"family": "t5", "cls": cls, "tp": tp, "seq": 6, "batch": 3, "padding": True, "dtype": "float32",
            "seed": 4, "new_tokens": 8,
            "config": {**FIXED_T5, "vocab": 41, "d_model": 64, "d_kv": 8, "d_ff": 64, "ffn": "gated-gelu", "init": 10.0}}
    distinct = pool.run(rank_tasks.generation_matches, spec)[0]
    assert distinct[1] >= 8 and distinct[3] >= 8, f"degenerate generations, the test would prove little: {distinct}"
