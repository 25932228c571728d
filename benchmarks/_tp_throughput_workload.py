"""The workload of ``benchmarks/tp_throughput.py`` (its models, inputs, ranks and measurements); the script keeps its command line
and its report. Tensor-parallel training throughput on CPU: unsharded vs shardlib tp=2 vs transformers' own DTensor TP."""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# Quiet and offline before transformers is imported (here and in the spawned workers, which import this module).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _harness import machine_busy_s  # noqa: E402

_BERT_SMALL = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
_BERT_BASE = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)
_TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256)
#: Config fields per size; the family is the part of the name before the dash.
SIZES: dict[str, dict] = {
    "bert-tiny": dict(_TINY, vocab_size=1000),
    "bert-small": dict(_BERT_SMALL, vocab_size=30522),
    "bert-base": dict(_BERT_BASE, vocab_size=30522),
    "vit-tiny": dict(_TINY, image_size=32, patch_size=8),
    "vit-small": dict(_BERT_SMALL, image_size=224, patch_size=16),
    "vit-base": dict(_BERT_BASE, image_size=224, patch_size=16),
    "t5-tiny": dict(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=256, vocab_size=1000),
    "t5-small": dict(num_layers=4, num_decoder_layers=4, d_model=256, d_kv=64, num_heads=4, d_ff=1024,
                     vocab_size=32128),
    "t5-base": dict(num_layers=12, num_decoder_layers=12, d_model=768, d_kv=64, num_heads=12, d_ff=3072,
                    vocab_size=32128),
}
ALIASES = {"tiny": "bert-tiny", "small": "bert-small", "base": "bert-base"}  # the names before ViT and T5
DEFAULT_SIZES = ("bert-small", "bert-base", "vit-base", "t5-base")
QUICK_SIZES = ("bert-tiny", "vit-tiny", "t5-tiny")
#: Timed steps per size when --steps is not given. On 2 cores a bert-base step takes ~2-2.5 s, a bert-small one
#: ~0.1-0.2 s; an unsharded vit-base step ~3.2 s and a t5-base one ~5.3 s (fewer steps keep the run ~7 minutes).
DEFAULT_STEPS = {"bert-tiny": 5, "bert-small": 20, "bert-base": 12, "vit-tiny": 5, "vit-small": 20, "vit-base": 8,
                 "t5-tiny": 5, "t5-small": 12, "t5-base": 6}
MODEL_CLASS = {"bert": "BertModel", "vit": "ViTModel", "t5": "T5Model"}
MODES = ("unsharded", "shardlib", "shardlib_sp", "shardlib_a2a", "hf")
MODE_TITLES = {"unsharded": "unsharded", "shardlib": "shardlib tp=2", "shardlib_sp": "shardlib tp=2 + SP",
               "shardlib_a2a": "shardlib sp=2 all-to-all", "hf": "HF DTensor tp=2"}
WORLD = {"unsharded": 1, "shardlib": 2, "shardlib_sp": 2, "shardlib_a2a": 2, "hf": 2}
THREADS = {"unsharded": 2, "shardlib": 1, "shardlib_sp": 1, "shardlib_a2a": 1, "hf": 1}
#: "<mode>_compiled": the same model under torch.compile (Inductor; benchmarks/compile_speed.py runs them)
for _mode in ("unsharded", "shardlib", "shardlib_sp"):
    MODE_TITLES[f"{_mode}_compiled"] = MODE_TITLES[_mode] + " compiled"
    WORLD[f"{_mode}_compiled"], THREADS[f"{_mode}_compiled"] = WORLD[_mode], THREADS[_mode]
SEED = 1234


def family(size: str) -> str:
    return size.split("-")[0]


def model_config(size: str):
    import transformers

    fields = SIZES[size]
    if family(size) == "bert":
        return transformers.BertConfig(**fields, max_position_embeddings=512, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
    if family(size) == "vit":
        return transformers.ViTConfig(**fields, num_channels=3, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
    return transformers.T5Config(**fields, feed_forward_proj="relu", dropout_rate=0.0,
                                 relative_attention_num_buckets=32, relative_attention_max_distance=128,
                                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


# ------------------------------------------------------------------------------------------------------- worker
def _build_model(mode: str, size: str, config, tmpdir: str):
    if mode.endswith("_compiled"):
        import shardlib

        return shardlib.compile_model(_build_model(mode.removesuffix("_compiled"), size, config, tmpdir))
    import transformers

    fam = family(size)
    if mode == "hf":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import _hf_dtensor_tp

        build = {"bert": _hf_dtensor_tp.build_hf_tp_bert, "vit": _hf_dtensor_tp.build_hf_tp_vit,
                 "t5": _hf_dtensor_tp.build_hf_tp_t5}[fam]
        return build(config, os.path.join(tmpdir, size), seed=SEED)
    torch.manual_seed(SEED)
    model = getattr(transformers, MODEL_CLASS[fam])(config)
    if mode in ("shardlib", "shardlib_sp", "shardlib_a2a"):
        import shardlib

        if mode == "shardlib_a2a":
            model = shardlib.shard(model, shardlib.init_mesh(tp=1, sp=2), sequence_parallel="all_to_all")
        else:
            model = shardlib.shard(model, shardlib.init_mesh(tp=2), sequence_parallel=mode == "shardlib_sp")
    return model


def _make_inputs(size: str, config, batch: int, seq: int, dec_seq: int) -> dict:
    """The same batch on every rank and in every mode."""
    g = torch.Generator().manual_seed(0)
    fam = family(size)
    if fam == "vit":
        side = config.image_size
        return dict(pixel_values=torch.randn(batch, 3, side, side, generator=g))
    inputs = dict(input_ids=torch.randint(0, config.vocab_size, (batch, seq), generator=g),
                  attention_mask=torch.ones(batch, seq, dtype=torch.long))
    if fam == "t5":
        inputs.update(decoder_input_ids=torch.randint(0, config.vocab_size, (batch, dec_seq), generator=g),
                      use_cache=False)
    return inputs


def _final_states(size: str, out) -> list[torch.Tensor]:
    """The hidden states the loss reads: T5's decoder and encoder outputs, otherwise ``last_hidden_state``."""
    if family(size) == "t5":
        return [out.last_hidden_state, out.encoder_last_hidden_state]
    return [out.last_hidden_state]


def _run_size(rank: int, world: int, mode: str, size: str, batch: int, seq: int, dec_seq: int, warmup: int,
              steps: int, tmpdir: str) -> None:
    def barrier():
        if world > 1:
            dist.barrier()

    config = model_config(size)
    t_build = time.perf_counter()
    model = _build_model(mode, size, config, tmpdir)
    build_s = time.perf_counter() - t_build
    model.train()
    inputs = _make_inputs(size, config, batch, seq, dec_seq)

    # The loss, mean(h^2) of a final LayerNorm's / RMSNorm's output, is ~1 whatever the weights; a fixed random
    # projection of h (computed on the first step only, outside the timed loop) is the cross-mode check that the
    # math is the same.
    width = config.d_model if family(size) == "t5" else config.hidden_size
    probe = torch.randn(width, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    checksum = None

    def step() -> float:  # one forward + backward; no optimizer
        nonlocal checksum
        model.zero_grad(set_to_none=True)
        hs = _final_states(size, model(**inputs))
        loss = sum(h.float().pow(2).mean() for h in hs)
        loss.backward()
        if checksum is None:
            checksum = [(h.detach().double() @ probe).mean().item() for h in hs]
        return loss.item()

    result = dict(mode=mode, size=size, build_s=build_s, threads=torch.get_num_threads(),
                  attn=getattr(model.config, "_attn_implementation", None))
    first_loss = None
    if mode == "hf" and family(size) == "t5":
        # Expected to fail (see _hf_dtensor_tp): try one step; only that exact failure becomes an "n/a" cell.
        from _hf_dtensor_tp import T5_UNSUPPORTED, is_t5_head_mismatch

        try:
            first_loss = step()
            warmup -= 1  # it ran (a transformers that can do it): the probe step was a warm-up step
        except RuntimeError as e:
            if not is_t5_head_mismatch(e):
                raise
            result.update(error=f"{type(e).__name__}: {e}", reason=T5_UNSUPPORTED)
    if "error" not in result:
        for _ in range(max(0, warmup)):
            loss = step()
            first_loss = loss if first_loss is None else first_loss
        times = []
        barrier()
        # Other load on the machine during the timed window: busy CPU time of the whole machine minus our own.
        busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.perf_counter()
        for _ in range(steps):
            barrier()
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
            first_loss = loss if first_loss is None else first_loss
        barrier()
        busy, own, wall = machine_busy_s() - busy0, time.process_time() - own0, time.perf_counter() - wall0
        if world > 1:
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            times = t.tolist()
            o = torch.tensor([own], dtype=torch.float64)
            dist.all_reduce(o)
            own = o.item()
        # /proc/stat counts in clock ticks (10 ms): windows shorter than 0.5 s are too coarse to judge.
        foreign_cores = max(0.0, (busy - own) / wall) if wall >= 0.5 else None
        result.update(times=times, first_loss=first_loss, checksum=checksum, foreign_cores=foreign_cores,
                      own_cores=own / wall)
    if rank == 0:
        with open(os.path.join(tmpdir, f"result_{size}.json"), "w") as f:
            json.dump(result, f)
    barrier()
    del model
    gc.collect()


def _worker(rank: int, mode: str, sizes: list[str], batch: int, seq: int, dec_seq: int, warmup: int,
            steps: dict[str, int], tmpdir: str) -> None:
    world = WORLD[mode]
    torch.set_num_threads(THREADS[mode])
    if world > 1:
        # The launcher environment some libraries look at (transformers reads LOCAL_RANK); the rendezvous itself
        # is a FileStore, so no TCP store is started.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        import datetime

        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
    for size in sizes:
        _run_size(rank, world, mode, size, batch, seq, dec_seq, warmup, steps[size], tmpdir)
    if world > 1:
        dist.destroy_process_group()


IDLE_CORES = 0.1  # other processes' average CPU use above which a timing is flagged
