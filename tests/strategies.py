"""hypothesis strategies for model specs (plain data the rank tasks turn into models and batches)."""

from hypothesis import strategies as st

import t5_cases
import vit_cases
from bert_cases import CLASSES as BERT_CLASSES


@st.composite
def bert_specs(draw, classes=BERT_CLASSES, tp=(1, 2, 4)):
    tp = draw(st.sampled_from(tp))
    cls = draw(st.sampled_from(classes))
    config = {
        "heads": tp * draw(st.integers(1, 2)),
        "head_dim": draw(st.sampled_from([2, 4, 8])),
        "layers": draw(st.integers(1, 2)),
        "intermediate": tp * draw(st.integers(1, 6)),
        "vocab": draw(st.integers(5, 70)),  # divisible by tp or not: padded
        "act": draw(st.sampled_from(["gelu", "relu"])),
        "tie": draw(st.booleans()),
        "num_labels": draw(st.integers(2, 5)),
        "cross_attention": draw(st.booleans()),
    }
    seq = draw(st.integers(2 if cls == "BertLMHeadModel" else 1, 9))  # causal loss needs 2 tokens
    return {
        "cls": cls, "tp": tp, "config": config, "seq": seq, "batch": draw(st.integers(1, 3)),
        "enc_seq": draw(st.integers(1, 7)), "padding": draw(st.booleans()),
        "dtype": draw(st.sampled_from(["float32", "float64"])), "seed": draw(st.integers(0, 2**20)),
        "meta": draw(st.booleans()),
    }


SPEC_COMMON = dict(padding=st.booleans(), dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**20),
                   meta=st.booleans(), batch=st.integers(1, 3))


@st.composite
def vit_specs(draw, tp=(1, 2, 4)):
    tp = draw(st.sampled_from(tp))
    patch = draw(st.sampled_from([2, 4]))
    config = {
        "image": patch * draw(st.integers(1, 3)), "patch": patch,
        "heads": tp * draw(st.integers(1, 2)), "head_dim": draw(st.sampled_from([2, 4, 8])),
        "layers": draw(st.integers(1, 2)), "intermediate": tp * draw(st.integers(1, 6)),
        "act": draw(st.sampled_from(["gelu", "relu"])), "num_labels": draw(st.integers(2, 7)),  # tp need not divide
        "qkv_bias": draw(st.booleans()),
    }
    return {"family": "vit", "cls": draw(st.sampled_from(vit_cases.CLASSES)), "tp": tp, "config": config,
            "interpolate": draw(st.booleans()), **{k: draw(v) for k, v in SPEC_COMMON.items()}}


@st.composite
def t5_specs(draw, tp=(1, 2, 4), classes=t5_cases.CLASSES):
    tp = draw(st.sampled_from(tp))
    buckets = draw(st.sampled_from([4, 8, 32]))  # HF's bucketing needs >= 4 buckets and max_distance > buckets / 2
    config = {
        "vocab": draw(st.integers(3, 60)),  # divisible by tp or not: padded
        "d_model": draw(st.integers(2, 12)),  # never split: need not divide
        "d_kv": draw(st.sampled_from([1, 2, 4])), "heads": tp * draw(st.integers(1, 2)),
        "d_ff": tp * draw(st.integers(1, 5)), "layers": draw(st.integers(1, 2)),
        "decoder_layers": draw(st.integers(1, 2)), "buckets": buckets,
        "max_distance": buckets * draw(st.sampled_from([2, 4, 16])), "ffn": draw(st.sampled_from(["relu", "gated-gelu"])),
        "tie": draw(st.booleans()), "untie_head": draw(st.booleans()), "num_labels": draw(st.integers(2, 5)),
    }
    return {"family": "t5", "cls": draw(st.sampled_from(classes)), "tp": tp, "config": config,
            "seq": draw(st.integers(1, 9)), "dec_seq": draw(st.integers(1, 7)),
            **{k: draw(v) for k, v in SPEC_COMMON.items()}}
