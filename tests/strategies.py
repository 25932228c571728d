"""hypothesis strategies for model specs (plain data the rank tasks turn into models and batches)."""

from hypothesis import strategies as st

import t5_cases
import vit_cases
from bert_cases import CLASSES as BERT_CLASSES


def sequence_parallel(draw, tp: int, all_to_all: bool = True) -> dict:
    """Off, Megatron (on the TP group), or all-to-all or ring attention over sp_size ranks (tp * sp_size <= the
    pool's 4 ranks). ``all_to_all=False``: neither mode on the sp dimension."""
    modes = [False, True] + (["all_to_all", "ring"] if all_to_all and tp < 4 else [])
    mode = draw(st.sampled_from(modes))
    if mode not in ("all_to_all", "ring"):
        return {"sp": mode}
    return {"sp": mode, "sp_size": draw(st.sampled_from([2, 4] if tp == 1 else [2]))}


def heads_per_rank_group(sp: dict) -> int:
    """What the head count must be a multiple of beyond tp: sp_size under all-to-all (each rank takes whole heads),
    nothing under the ring."""
    return sp.get("sp_size", 1) if sp.get("sp") == "all_to_all" else 1


def kernel_choice(draw, act: str | None = None) -> dict:
    """The kernels switches (shardlib.kernels.Kernels); bias + GELU only where the MLP activation is GELU."""
    return {"attention": draw(st.sampled_from([None, "sdpa", "eager"])), "fused_qkv": draw(st.booleans()),
            "bias_gelu": act == "gelu" and draw(st.booleans()), "dropout_add": draw(st.booleans())}


@st.composite
def bert_specs(draw, classes=BERT_CLASSES, tp=(1, 2, 4), all_to_all=True):
    tp = draw(st.sampled_from(tp))
    cls = draw(st.sampled_from(classes))
    sp = sequence_parallel(draw, tp, all_to_all)
    config = {
        "heads": tp * heads_per_rank_group(sp) * draw(st.integers(1, 2)),
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
        "meta": draw(st.booleans()), **sp, "kernels": kernel_choice(draw, config["act"]),
    }


SPEC_COMMON = dict(padding=st.booleans(), dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**20),
                   meta=st.booleans(), batch=st.integers(1, 3))


@st.composite
def vit_specs(draw, tp=(1, 2, 4), all_to_all=True):
    tp = draw(st.sampled_from(tp))
    patch = draw(st.sampled_from([2, 4]))
    sp = sequence_parallel(draw, tp, all_to_all)
    config = {
        "image": patch * draw(st.integers(1, 3)), "patch": patch,
        "heads": tp * heads_per_rank_group(sp) * draw(st.integers(1, 2)), "head_dim": draw(st.sampled_from([2, 4, 8])),
        "layers": draw(st.integers(1, 2)), "intermediate": tp * draw(st.integers(1, 6)),
        "act": draw(st.sampled_from(["gelu", "relu"])), "num_labels": draw(st.integers(2, 7)),  # tp need not divide
        "qkv_bias": draw(st.booleans()),
    }
    spec = {"family": "vit", "cls": draw(st.sampled_from(vit_cases.CLASSES)), "tp": tp, "config": config,
            "interpolate": draw(st.booleans()), **{k: draw(v) for k, v in SPEC_COMMON.items()}, **sp,
            "kernels": kernel_choice(draw, config["act"])}
    if sp["sp"] == "ring":  # the ring's softmax runs in the input dtype, ViT's eager one in float32: compare to SDPA
        spec["reference_attention"] = "sdpa"
    return spec


@st.composite
def t5_specs(draw, tp=(1, 2, 4), classes=t5_cases.CLASSES, all_to_all=True):
    tp = draw(st.sampled_from(tp))
    sp = sequence_parallel(draw, tp, all_to_all)
    buckets = draw(st.sampled_from([4, 8, 32]))  # HF's bucketing needs >= 4 buckets and max_distance > buckets / 2
    config = {
        "vocab": draw(st.integers(3, 60)),  # divisible by tp or not: padded
        # never split: need not divide. >= 4: an RMSNorm over 2 features maps onto a circle, and its gradient
        # amplifies float32 summation-order noise past any sane tolerance (float64 passes at 1e-9 there)
        "d_model": draw(st.integers(4, 12)),
        "d_kv": draw(st.sampled_from([1, 2, 4])), "heads": tp * heads_per_rank_group(sp) * draw(st.integers(1, 2)),
        "d_ff": tp * draw(st.integers(1, 5)), "layers": draw(st.integers(1, 2)),
        "decoder_layers": draw(st.integers(1, 2)), "buckets": buckets,
        "max_distance": buckets * draw(st.sampled_from([2, 4, 16])), "ffn": draw(st.sampled_from(["relu", "gated-gelu"])),
        "tie": draw(st.booleans()), "untie_head": draw(st.booleans()), "num_labels": draw(st.integers(2, 5)),
    }
    return {"family": "t5", "cls": draw(st.sampled_from(classes)), "tp": tp, "config": config,
            "seq": draw(st.integers(1, 9)), "dec_seq": draw(st.integers(1, 7)),
            **{k: draw(v) for k, v in SPEC_COMMON.items()}, **sp, "kernels": kernel_choice(draw)}


PIPELINE_MESHES = ((2, 1), (2, 2), (4, 1))  # (pp, tp) on 4 ranks; dp = 4 / (pp * tp)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@st.composite
def pipeline_specs(draw):
    """A model spec of any family and class plus a pipeline layout: pp x tp (x dp), schedule, microbatches, and
    sometimes an explicit layers-per-stage split."""
    pp, tp = draw(st.sampled_from(PIPELINE_MESHES))
    family = draw(st.sampled_from(["bert", "vit", "t5"]))
    spec = draw({"bert": bert_specs(tp=(tp,), all_to_all=False), "vit": vit_specs(tp=(tp,), all_to_all=False),
                 "t5": t5_specs(tp=(tp,), all_to_all=False)}[family])
    spec["family"] = family
    schedule = draw(st.sampled_from(SCHEDULES))
    stages = pp * (2 if schedule == "interleaved_1f1b" else 1)
    config = spec["config"]
    if "head_dim" in config and config["heads"] * config["head_dim"] < 4:
        # a LayerNorm over 2 features outputs +-1 whatever its input: the gradients before it are pure rounding
        # noise, which a different summation order (the dp split) changes by more than any sane tolerance
        config["head_dim"] = 4
    decoder = family == "t5" and not spec["cls"].endswith(("EncoderModel", "TokenClassification"))
    if decoder:
        config["layers"] = draw(st.integers(1, stages))
        config["decoder_layers"] = draw(st.integers(max(1, stages - config["layers"]), stages))
        total = config["layers"] + config["decoder_layers"]
    else:
        config["layers"] = total = draw(st.integers(stages, stages + 2))
    microbatches = draw(st.sampled_from([1, 2, 4, 8]))
    if microbatches < stages:  # torch's 1F1B schedules need at least one microbatch per stage
        schedule = "gpipe" if schedule == "1f1b" else schedule
        microbatches = stages if schedule != "gpipe" else microbatches
    dp = 4 // (pp * tp)
    spec.update(pp=pp, tp=tp, schedule=schedule, microbatches=microbatches, meta=False,
                batch=dp * microbatches * draw(st.integers(1, 2)), all_targets=spec["cls"] == "BertForPreTraining")
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=stages - 1, max_size=stages - 1,
                                    unique=True))) if stages > 1 else []
        bounds = [0, *cuts, total]
        spec["layers_per_stage"] = [b - a for a, b in zip(bounds, bounds[1:])]
    return spec
