"""Attention kernel on CPU: the model's eager attention (reference) vs PyTorch SDPA, through transformers'
attention interface, exactly as the models call it.

What is measured
----------------
Forward + backward time of one attention call (q, k, v -> output; the projections are not included) at the shapes
one rank sees: BERT-base (12 heads of 64, 128 tokens, a padding mask), ViT-base (197 tokens, no mask) and T5-base
(12 heads of 64, 128 tokens, relative position bias + padding mask, no 1/sqrt(d) scaling; ``--seq`` for other
BERT / T5 lengths), with all 12 heads
(tp=1) and with the 6 local heads of tp=2; batch 8, float32. Two regimes: training with attention dropout 0.1
(BERT and T5's defaults; SDPA then runs its math path) and without dropout (ViT's default, and eval: SDPA's fused
CPU kernel). Modes run interleaved round after round; each ratio is the median over rounds of that round's
sdpa / eager time (< 1: SDPA faster). The machine has 2 cores shared with other jobs: trust ratios.

Run: ``.venv/bin/python benchmarks/kernel_attention.py [--rounds 5] [--repeats 5] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, T5Config, ViTConfig
from transformers.models.bert import modeling_bert
from transformers.models.t5 import modeling_t5
from transformers.models.vit import modeling_vit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import interleaved, machine_busy_s, paired_ratio, timed  # noqa: E402

from shardlib.kernels.attention import inner_attention  # noqa: E402


def cases(batch: int, heads: int, seq: int = 128):
    """(name, attention module, q/k/v shape, extra kwargs builder) per model at ``heads`` local heads."""
    g = torch.Generator().manual_seed(0)
    bert = modeling_bert.BertSelfAttention(BertConfig(), is_causal=False, layer_idx=0)
    vit = modeling_vit.ViTAttention(ViTConfig())
    t5 = modeling_t5.T5Attention(T5Config(), has_relative_attention_bias=True)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq) < lengths[:, None]
    float_mask = torch.zeros(batch, 1, 1, seq).masked_fill(~mask[:, None, None, :], torch.finfo(torch.float32).min)
    bias = torch.randn(1, heads, seq, seq, generator=g)
    return [
        ("BERT-base", bert, (batch, heads, seq, 64), dict(attention_mask=mask[:, None, None, :].expand(-1, 1, seq, -1),
                                                         scaling=0.125)),
        ("ViT-base", vit, (batch, heads, 197, 64), dict(attention_mask=None, scaling=0.125)),
        ("T5-base", t5, (batch, heads, seq, 64), dict(attention_mask=float_mask, scaling=1.0, position_bias=bias)),
    ]


def step(fn, module, q, k, v, kwargs, dropout, grad):
    kwargs = dict(kwargs)
    mask = kwargs.pop("attention_mask")
    if mask is not None and mask.dtype == torch.bool and fn.__module__.endswith(("modeling_bert", "modeling_vit")):
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # eager wants additive
    out, _ = fn(module, q, k, v, mask, dropout=dropout, **kwargs)
    out.backward(grad)


def step_seconds(fn, module, shape, kwargs, dropout, repeats) -> float:
    """Median seconds of one forward + backward of ``fn`` after one warm-up."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g)
    return statistics.median(timed(lambda: step(fn, module, q, k, v, kwargs, dropout, grad), repeats, warmup=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128, help="BERT and T5 tokens (ViT-base: 197)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"attention fwd+bwd per call, ms (median over rounds); batch {args.batch}, {args.seq} tokens (ViT 197), "
          f"float32, {args.threads} threads")
    print(f"{'model':<10} {'heads':>5} {'dropout':>7} {'eager':>8} {'sdpa':>8} {'sdpa/eager':>10} {'others':>6}")
    for heads, label in ((12, "12"), (6, "6 (tp=2)")):
        for name, module, shape, kwargs in cases(args.batch, heads, args.seq):
            for dropout in (0.1, 0.0):
                module.train(dropout > 0)
                eager, sdpa = inner_attention(module, "eager"), inner_attention(module, "sdpa")
                busy0, own0, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
                rows = interleaved({mode: (lambda fn=fn: step_seconds(fn, module, shape, kwargs, dropout,
                                                                      args.repeats))
                                    for mode, fn in (("eager", eager), ("sdpa", sdpa))}, args.rounds)
                wall = time.perf_counter() - t0
                # cores busy with other processes (machine-wide busy time minus this process' CPU time)
                others = max(0.0, (machine_busy_s() - busy0 - (time.process_time() - own0)) / wall)
                ratio = paired_ratio(rows["sdpa"], rows["eager"])[0]
                print(f"{name:<10} {label:>5} {dropout:>7.1f} {statistics.median(rows['eager']) * 1e3:>8.2f} "
                      f"{statistics.median(rows['sdpa']) * 1e3:>8.2f} {ratio:>10.2f} {others:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
