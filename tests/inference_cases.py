"""Families sharded by inferred plans (issue 24): small configs of each, built from the config class (no download),
and a batch of each model's task (``shardlib.sharding.examples.example_batch`` with random values)."""

from __future__ import annotations

import torch
import transformers

from shardlib.sharding.examples import example_batch, task_of

TEXT = dict(vocab_size=50, max_position_embeddings=32)
BERTLIKE = dict(TEXT, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ2SEQ = dict(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2,
               eos_token_id=2, bos_token_id=0)
VISION = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
DECODER = dict(TEXT, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)

#: family -> (config class, config kwargs, the model classes tested: every task head the family has)
FAMILIES = {
    "roberta": ("RobertaConfig", dict(BERTLIKE, pad_token_id=1), (
        "RobertaModel", "RobertaForMaskedLM", "RobertaForCausalLM", "RobertaForSequenceClassification",
        "RobertaForTokenClassification", "RobertaForQuestionAnswering", "RobertaForMultipleChoice")),
    "xlm-roberta": ("XLMRobertaConfig", dict(BERTLIKE, pad_token_id=1), (
        "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification")),
    "camembert": ("CamembertConfig", dict(BERTLIKE, pad_token_id=1), (
        "CamembertForMaskedLM", "CamembertForTokenClassification")),
    "electra": ("ElectraConfig", dict(BERTLIKE, embedding_size=16), (
        "ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM", "ElectraForSequenceClassification",
        "ElectraForQuestionAnswering")),
    "distilbert": ("DistilBertConfig", dict(TEXT, dim=16, n_layers=2, n_heads=4, hidden_dim=32, dropout=0.0,
                                            attention_dropout=0.0, seq_classif_dropout=0.0, qa_dropout=0.0), (
        "DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification",
        "DistilBertForTokenClassification", "DistilBertForQuestionAnswering")),
    "deit": ("DeiTConfig", VISION, ("DeiTModel", "DeiTForImageClassification")),
    "bart": ("BartConfig", SEQ2SEQ, ("BartModel", "BartForConditionalGeneration", "BartForSequenceClassification")),
    "marian": ("MarianConfig", dict(SEQ2SEQ, decoder_vocab_size=50), ("MarianModel", "MarianMTModel")),
    "pegasus": ("PegasusConfig", SEQ2SEQ, ("PegasusModel", "PegasusForConditionalGeneration")),
    "mbart": ("MBartConfig", SEQ2SEQ, ("MBartForConditionalGeneration", "MBartForQuestionAnswering")),
    "opt": ("OPTConfig", dict(TEXT, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, ffn_dim=32,
                              word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, use_cache=False,
                              pad_token_id=1), ("OPTModel", "OPTForCausalLM", "OPTForSequenceClassification")),
    "mistral": ("MistralConfig", dict(DECODER, num_key_value_heads=2, pad_token_id=0, use_cache=False), (
        "MistralForCausalLM", "MistralForSequenceClassification")),
    "qwen2": ("Qwen2Config", dict(DECODER, num_key_value_heads=2, pad_token_id=0, use_cache=False,
                                  classifier_dropout=0.0), (
        "Qwen2ForCausalLM", "Qwen2ForTokenClassification")),
    "albert": ("AlbertConfig", dict(BERTLIKE, embedding_size=8, classifier_dropout_prob=0.0), (
        "AlbertModel", "AlbertForMaskedLM", "AlbertForSequenceClassification")),
    "deberta-v2": ("DebertaV2Config", BERTLIKE, ("DebertaV2ForMaskedLM", "DebertaV2ForSequenceClassification",
                                                 "DebertaV2ForTokenClassification")),
    "data2vec-vision": ("Data2VecVisionConfig", VISION, ("Data2VecVisionForImageClassification",)),
    "beit": ("BeitConfig", VISION, ("BeitModel", "BeitForImageClassification")),
    "megatron-bert": ("MegatronBertConfig", BERTLIKE, ("MegatronBertForMaskedLM", "MegatronBertForCausalLM",
                                                       "MegatronBertForSequenceClassification")),
    "ernie": ("ErnieConfig", BERTLIKE, ("ErnieForMaskedLM", "ErnieForSequenceClassification")),
    "rembert": ("RemBertConfig", dict(BERTLIKE, input_embedding_size=8, output_embedding_size=8,
                                      classifier_dropout_prob=0.0), (
        "RemBertForMaskedLM", "RemBertForSequenceClassification")),
    "blenderbot-small": ("BlenderbotSmallConfig", SEQ2SEQ, ("BlenderbotSmallForConditionalGeneration",)),
    "plbart": ("PLBartConfig", SEQ2SEQ, ("PLBartForConditionalGeneration", "PLBartForSequenceClassification")),
    "gpt2": ("GPT2Config", dict(vocab_size=50, n_embd=16, n_layer=2, n_head=4, n_positions=32, use_cache=False,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                                classifier_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0), (
        "GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification",
        "GPT2ForQuestionAnswering", "GPT2DoubleHeadsModel")),
    "gpt-neo": ("GPTNeoConfig", dict(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, use_cache=False,
                                     attention_types=[[["global", "local"], 1]], max_position_embeddings=32,
                                     embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0, pad_token_id=0), (
        "GPTNeoForCausalLM", "GPTNeoForSequenceClassification")),
    "gemma": ("GemmaConfig", dict(DECODER, num_key_value_heads=2, head_dim=4, use_cache=False, pad_token_id=0), (
        "GemmaForCausalLM", "GemmaForSequenceClassification")),
    "gemma2": ("Gemma2Config", dict(DECODER, num_key_value_heads=2, head_dim=4, use_cache=False, pad_token_id=0), (
        "Gemma2ForCausalLM",)),
    "granite": ("GraniteConfig", dict(DECODER, num_key_value_heads=2, use_cache=False), ("GraniteForCausalLM",)),
    "phi": ("PhiConfig", dict(DECODER, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0), (
        "PhiForCausalLM", "PhiForSequenceClassification")),
    "stablelm": ("StableLmConfig", dict(DECODER, num_key_value_heads=2, use_cache=False), ("StableLmForCausalLM",)),
    "qwen3": ("Qwen3Config", dict(DECODER, num_key_value_heads=2, head_dim=4, pad_token_id=0, use_cache=False), (
        "Qwen3ForCausalLM", "Qwen3ForSequenceClassification")),
    "olmo2": ("Olmo2Config", dict(DECODER, num_key_value_heads=2, pad_token_id=0, eos_token_id=0, use_cache=False), (
        "Olmo2ForCausalLM",)),
    "llama": ("LlamaConfig", dict(DECODER, num_key_value_heads=2, pad_token_id=0, use_cache=False), ("LlamaModel", "LlamaForCausalLM",
                                                                   "LlamaForSequenceClassification")),
}


#: what a class needs of its config beyond its family's
CLASS_CONFIG = {"RobertaForCausalLM": dict(is_decoder=True)}


def make_model(cls: str, family: str, dtype=torch.float64, seed: int = 0, **overrides) -> torch.nn.Module:
    """``cls`` of ``family`` at its small config (changed by ``overrides``), every dropout off."""
    config_cls, kwargs, _ = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**kwargs, **CLASS_CONFIG.get(cls, {}), **overrides})
    # no random drops left on by a family's defaults (BEiT's stochastic depth 0.1, ELECTRA's summary dropout):
    # the models are compared in training mode, one forward after the other, so the two would draw differently
    for name, value in config.to_dict().items():
        if "drop" in name and isinstance(value, float):
            setattr(config, name, 0.0)
    return getattr(transformers, cls)(config).to(dtype)


def make_batch(model: torch.nn.Module, seed: int = 1, batch: int = 2, seq: int = 6) -> dict:
    inputs = example_batch(model, batch, seq, device="cpu", generator=torch.Generator().manual_seed(seed))
    dtype = next(model.parameters()).dtype
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def causal_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a causal LM, whose loss transformers computes in float32 whatever the model's dtype."""
    return task_of(model) == "CAUSAL_LM"


CASES = [(family, cls) for family, (_, _, classes) in FAMILIES.items() for cls in classes]

#: families that compute in float32 inside a float64 model (Gemma's RMSNorm upcasts; OLMo-2's q/k norms sum their
#: float32 squares in another order under tp): compared at float32 tolerances
FLOAT32_INSIDE = {"gemma", "gemma2", "olmo2"}
#: families whose inferred plan the proof refuses under Megatron sequence parallelism (docs/inferred-plans.md)
NO_SEQUENCE_PARALLEL = {"opt", "albert", "gemma2"}


def random_model(family: str, cls: str, sizes: dict, seed: int = 0) -> torch.nn.Module:
    """``cls`` of ``family`` at drawn sizes (heads, kv_heads, head_dim, ffn, vocab, layers), float64: the sizes are
    set by role on the family's config as the inference's twins set them (``inference.twin.twin_config``)."""
    from shardlib.sharding.inference.twin import ROLES, _set_role, twin_config

    config_cls, kwargs, _ = FAMILIES[family]
    base = getattr(transformers, config_cls)(**kwargs, **CLASS_CONFIG.get(cls, {}))
    config, _ = twin_config(base, heads=sizes["heads"], kv_heads=sizes["kv_heads"], head_dim=sizes["head_dim"],
                            ffn=sizes["ffn"], vocab=sizes["vocab"], distinct_hidden=None, dropout_off=True)
    _set_role(config, "layers", sizes["layers"])
    assert "layers" in ROLES
    torch.manual_seed(seed)
    return getattr(transformers, cls)(config).to(torch.float64)
