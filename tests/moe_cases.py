"""Mixture-of-experts models for the tests (issue 52): Switch Transformers (the hand policy), Mixtral, Qwen2-MoE and Qwen3-MoE
(inferred plans), at small configs built from their config classes, and a batch of each one's task.

``router_dtype``: Switch routes in float32 whatever the model's dtype (as HF computes it); the float64 proofs set
it to float64 where they compare at float64 tolerances (a float32 router's rounding, the same op on both sides,
would otherwise turn a 1e-16 difference of its input into a 1e-7 one). Causal LMs compute their loss and
load-balancing loss in float32 (transformers' own upcasts): their float64 proofs compare a weighted sum of the
logits, and their router losses are compared at float32 tolerances."""

from __future__ import annotations

import torch
import transformers

DECODER = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=32, use_cache=False, pad_token_id=0)

#: family -> (model class, config class, config kwargs, the config field counting experts, its MoE sizes)
FAMILIES = {
    "switch": ("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", dict(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=4, num_decoder_layers=4, num_heads=4,
        encoder_sparse_step=2, decoder_sparse_step=2, dropout_rate=0.0, router_jitter_noise=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1), "num_experts"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", DECODER, "num_local_experts"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(DECODER, moe_intermediate_size=8,
                                                               shared_expert_intermediate_size=12), "num_experts"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(DECODER, moe_intermediate_size=8, head_dim=4),
                 "num_experts"),
}


def build_model(family: str, *, experts: int = 4, top_k: int = 2, capacity: int = 3, dtype=torch.float64,
               implementation: str = "eager", router_losses: bool = False, router_dtype: str = "float64",
               seed: int = 0, starve: bool = False, **overrides) -> torch.nn.Module:
    """``family``'s model with ``experts`` experts; Switch routes top-1 with ``capacity`` tokens per expert and
    sequence, the decoders top-``top_k``, dropless; ``router_losses``: the decoders' ``output_router_logits``."""
    cls, config_cls, kwargs, count = FAMILIES[family]
    kwargs = {**kwargs, count: experts, **overrides}
    if family == "switch":
        kwargs |= dict(expert_capacity=capacity)
    else:
        kwargs |= dict(num_experts_per_tok=top_k, output_router_logits=router_losses)
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**kwargs)).to(dtype)
    for router in (m for m in model.modules() if type(m).__name__ == "SwitchTransformersTop1Router"):
        router.dtype = getattr(torch, router_dtype)  # the config admits 16/32-bit routers only: set on the modules
        if starve:  # logits x.w0 and -x.w0 for experts 0 and 1, 0 for the rest: no token reaches experts 2, 3, ...
            with torch.no_grad():
                router.classifier.weight[1] = -router.classifier.weight[0]
                router.classifier.weight[2:] = 0
    if model.config._experts_implementation != implementation:
        model.set_experts_implementation(implementation)
    return model


def build_batch(family: str, *, batch: int = 2, seq: int = 9, labels: bool = True, seed: int = 1) -> dict:
    """Random token ids; Switch gets decoder labels (its loss), the decoders their ids as labels when ``labels``
    (then the loss is float32, transformers' upcast), else none (a weighted sum of the float64 logits is the
    objective)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (batch, seq), generator=g)
    if family == "switch":
        return {"input_ids": ids, "labels": torch.randint(2, 50, (batch, max(2, seq // 2)), generator=g)}
    return {"input_ids": ids, **({"labels": ids.clone()} if labels else {})}


def routed_tokens(model: torch.nn.Module, batch: dict) -> tuple[int, int]:
    """(tokens kept, tokens routed) by Switch's routers on ``batch``: fewer kept than routed means the capacity
    dropped some."""
    kept, total = [], []

    def count(mod, args, out):
        kept.append(int(out[0].sum()))
        total.append(args[0].shape[0] * args[0].shape[1])

    routers = [m for m in model.modules() if type(m).__name__ == "SwitchTransformersTop1Router"]
    handles = [r.register_forward_hook(count) for r in routers]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return sum(kept), sum(total)


# ------------------------------------------------------- the rank tasks' case interface (rank_tasks.cases(spec))
def make_model(spec: dict) -> torch.nn.Module:
    """``spec["model"]``'s model with ``spec["options"]`` (:func:`build_model`), in ``spec["dtype"]``."""
    return build_model(spec["model"], dtype=getattr(torch, spec["dtype"]), **spec.get("options", {}))


def make_batch(spec: dict, config) -> dict:
    return build_batch(spec["model"], batch=spec.get("batch", 4), seq=spec.get("seq", 9),
                       labels=spec.get("labels", True))
