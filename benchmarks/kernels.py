"""The CPU kernels of ``shardlib.kernels`` against what they replace, forward + backward, ratios paired per round
(< 1: the kernel is faster; ``others``: cores other processes used). Docs: docs/benchmarks/kernels-and-compile.md.

    .venv/bin/python benchmarks/kernels.py --kernel attention  # eager attention vs SDPA: BERT/ViT/T5-base, 12 / 6 heads
    .venv/bin/python benchmarks/kernels.py --kernel fused_qkv  # q/k/v as 3 linears vs one GEMM
    .venv/bin/python benchmarks/kernels.py --kernel epilogues  # fused bias-GELU / dropout-add vs the stock HF modules
    .venv/bin/python benchmarks/kernels.py --quick             # all three, smoke settings
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import interleaved, machine_busy_s, paired_ratio, timed, wait_idle  # noqa: E402

#: per kernel: defaults of --threads (None: torch's), --rounds, --repeats, --wait-idle
DEFAULTS = {"attention": (2, 5, 5, 0.0), "fused_qkv": (min(2, os.cpu_count() or 1), 15, 3, 60.0),
            "epilogues": (None, 0, 30, 0.0)}


class Others:
    """Cores other processes kept busy during the ``with`` block (the machine's busy time less this process' CPU)."""

    def __enter__(self):
        self.busy, self.cpu, self.wall = machine_busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        own = time.process_time() - self.cpu
        self.cores = max(0.0, (machine_busy_s() - self.busy - own) / (time.perf_counter() - self.wall))


# ------------------------------------------------------------------------------------------------- attention
def attention(args) -> None:
    from transformers import BertConfig, T5Config, ViTConfig
    from transformers.models.bert import modeling_bert
    from transformers.models.t5 import modeling_t5
    from transformers.models.vit import modeling_vit

    from shardlib.kernels.attention import inner_attention

    def cases(heads: int, b: int, seq: int):
        g = torch.Generator().manual_seed(0)
        modules = (modeling_bert.BertSelfAttention(BertConfig(), is_causal=False, layer_idx=0),
                   modeling_vit.ViTAttention(ViTConfig()),
                   modeling_t5.T5Attention(T5Config(), has_relative_attention_bias=True))
        mask = torch.arange(seq) < torch.randint(seq // 2, seq + 1, (b,), generator=g)[:, None]
        additive = torch.zeros(b, 1, 1, seq).masked_fill(~mask[:, None, None, :], torch.finfo(torch.float32).min)
        bias = torch.randn(1, heads, seq, seq, generator=g)
        return [("BERT-base", modules[0], seq, dict(attention_mask=mask[:, None, None, :].expand(-1, 1, seq, -1),
                                                    scaling=0.125)),
                ("ViT-base", modules[1], 197, dict(attention_mask=None, scaling=0.125)),
                ("T5-base", modules[2], seq, dict(attention_mask=additive, scaling=1.0, position_bias=bias))]

    def seconds(fn, module, shape, kwargs, dropout) -> float:
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g)
        kw = dict(kwargs)
        mask = kw.pop("attention_mask")
        if mask is not None and mask.dtype == torch.bool and fn.__module__.endswith(("modeling_bert", "modeling_vit")):
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # eager: additive

        def step():
            fn(module, q, k, v, mask, dropout=dropout, **kw)[0].backward(grad)

        return statistics.median(timed(step, args.repeats, warmup=1))

    print(f"attention fwd+bwd per call, ms (median over rounds); batch {args.batch}, {args.seq} tokens (ViT 197), "
          f"float32, {torch.get_num_threads()} threads")
    print(f"{'model':<10} {'heads':>8} {'dropout':>7} {'eager':>8} {'sdpa':>8} {'sdpa/eager':>10} {'others':>6}")
    for heads, label in ((12, "12"), (6, "6 (tp=2)")):
        for name, module, seq, kwargs in cases(heads, args.batch, args.seq):
            shape = (args.batch, heads, seq, 64)
            for dropout in (0.1, 0.0):
                module.train(dropout > 0)
                fns = {mode: inner_attention(module, mode) for mode in ("eager", "sdpa")}
                with Others() as others:
                    rows = interleaved({m: (lambda fn=fn: seconds(fn, module, shape, kwargs, dropout))
                                        for m, fn in fns.items()}, args.rounds)
                print(f"{name:<10} {label:>8} {dropout:>7.1f} {statistics.median(rows['eager']) * 1e3:>8.2f} "
                      f"{statistics.median(rows['sdpa']) * 1e3:>8.2f} "
                      f"{paired_ratio(rows['sdpa'], rows['eager'])[0]:>10.2f} {others.cores:>6.2f}", flush=True)


# ------------------------------------------------------------------------------------------------- fused q/k/v
QKV_SIZES = [(8, 128, 768, "8x128 tp=1"), (16, 128, 768, "16x128 tp=1"), (8, 128, 384, "8x128 tp=2 local"),
             (16, 128, 384, "16x128 tp=2 local")]  # (batch, seq, out features per projection, label); hidden 768


def fused_qkv(args) -> None:
    from shardlib.kernels.fused_qkv import fuse_linears, fused_group

    print(f"{torch.get_num_threads()} threads, float32, hidden 768, bias on; medians over {args.rounds} rounds x "
          f"{args.repeats} steps (ms); ratio = median over rounds of mode / stock", flush=True)
    header = (f"{'size':<20}{'stock':>9}{'fused':>9}{'ratio':>8}   {'fwd stock':>10}{'fwd fused':>10}{'ratio':>8}"
              f"{'others':>8}")
    print(header + "\n" + "-" * len(header))
    for batch, seq, out, label in QKV_SIZES:
        if args.wait_idle > 0:
            wait_idle(args.wait_idle, threshold_cores=0.3)
        torch.manual_seed(0)
        stock = [torch.nn.Linear(768, out) for _ in range(3)]
        fused = copy.deepcopy(stock)
        fuse_linears(fused, names=["q", "k", "v"])
        x = torch.randn(batch, seq, 768, requires_grad=True)
        grads = [torch.randn(batch, seq, out) for _ in range(3)]
        params = [x] + [p for m in stock + fused for p in m.parameters()]

        def no_grad(mods):
            with torch.no_grad():
                return [m(x) for m in mods]

        modes = {"stock": lambda: torch.autograd.backward([m(x) for m in stock], grads),
                 "fused": lambda: torch.autograd.backward([m(x) for m in fused], grads),
                 "fwd-only stock": lambda: no_grad(stock), "fwd-only fused": lambda: no_grad(fused)}
        for a, b in zip([m(x) for m in stock], [m(x) for m in fused]):  # what is timed computes the same
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        group = fused_group(fused[0])
        group.reset_counters()
        drop = lambda: [setattr(p, "grad", None) for p in params]  # noqa: E731
        with Others() as others:
            res = interleaved({n: (lambda fn=fn: statistics.median(timed(fn, args.repeats, warmup=2, before=drop)))
                               for n, fn in modes.items()}, args.rounds)
        assert group.own_calls == 0 and group.fused_gemms == group.handed_out // 2 > 0, group  # fusion really ran
        m = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        r = {k: paired_ratio(res[a], res[b])[0] for k, a, b in (("fused", "fused", "stock"),
                                                                ("fwd", "fwd-only fused", "fwd-only stock"))}
        print(f"{label:<20}{m['stock']:9.2f}{m['fused']:9.2f}{r['fused']:8.3f}   "
              f"{m['fwd-only stock']:10.2f}{m['fwd-only fused']:10.2f}{r['fwd']:8.3f}{others.cores:8.2f}", flush=True)
    print("stock/fused: forward + backward of q, k, v; fwd: forward under no_grad; others: cores used by other "
          f"processes while the size ran (of {os.cpu_count()})")


# ------------------------------------------------------------------------------------------------- epilogues
def epilogue_cases(batch: int, seq: int, quick: bool):
    """(kind, name, stock module, install(name, module) -> fused module, inputs); dropout 0.1, BERT/ViT-base."""
    import transformers
    from transformers.models.bert.modeling_bert import BertIntermediate, BertOutput, BertSelfOutput
    from transformers.models.vit.modeling_vit import ViTLayer, ViTMLP

    from shardlib.kernels import epilogues as E

    torch.manual_seed(0)
    bert = transformers.BertConfig(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    vit = transformers.ViTConfig(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    vit._attn_implementation = "sdpa"  # what ViT models use by default; a bare ViTLayer has none set
    h, inter, vit_tokens = bert.hidden_size, bert.intermediate_size, (vit.image_size // vit.patch_size) ** 2 + 1
    tok = lambda n, d: torch.randn(batch, n, d)  # noqa: E731
    yield "bias_gelu", "BertIntermediate 768->3072", BertIntermediate(bert), E.install_bias_gelu, (tok(seq, h),)
    yield "bias_gelu", "ViTMLP 768->3072->768", ViTMLP(vit), E.install_bias_gelu, (tok(vit_tokens, h),)
    yield "dropout_add", "BertSelfOutput 768->768", BertSelfOutput(bert), E.install_dropout_add, \
        (tok(seq, h), tok(seq, h))
    yield "dropout_add", "BertOutput 3072->768", BertOutput(bert), E.install_dropout_add, (tok(seq, inter), tok(seq, h))
    if not quick:
        yield "dropout_add", "ViTLayer (whole layer)", ViTLayer(vit), E.install_dropout_add, (tok(vit_tokens, h),)


def epilogue_step(module, inputs, seed: int) -> float:
    torch.manual_seed(seed)
    for p in module.parameters():
        p.grad = None
    x = [t.requires_grad_() if i == 0 else t for i, t in enumerate(inputs)]
    x[0].grad = None
    t0 = time.perf_counter()
    out = module(*x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    return time.perf_counter() - t0


def epilogues(args) -> None:
    from shardlib.kernels import epilogues as E

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused ops: {E.implementation()}; batch "
          f"{args.batch}, seq {args.seq}, {args.repeats} interleaved pairs per case, forward+backward, training, "
          "dropout 0.1, float32", flush=True)
    rows = []
    for kind, name, stock, install, inputs in epilogue_cases(args.batch, args.seq, args.quick):
        stock.train()
        fused = install(name, copy.deepcopy(stock)).train()
        t0 = time.perf_counter()
        epilogue_step(fused, inputs, 0)  # compiles (or loads from the inductor cache)
        warm = time.perf_counter() - t0
        for i in range(args.warmup):
            epilogue_step(stock, inputs, i), epilogue_step(fused, inputs, i)
        ts, tf = [], []
        with Others() as others:
            for i in range(args.repeats):
                for module, out in [(stock, ts), (fused, tf)][:: 1 if i % 2 == 0 else -1]:
                    out.append(epilogue_step(module, inputs, 1000 + i))
        lo, med, hi = statistics.quantiles([f / s for f, s in zip(tf, ts)], n=4, method="inclusive")
        verdict = "faster" if hi < 1 else "slower" if lo > 1 else "same (noise)"
        rows.append((kind, name, statistics.median(ts), statistics.median(tf), lo, med, hi, verdict, others.cores))
        print(f"  {name:34s} stock {1e3 * rows[-1][2]:8.2f} ms  fused {1e3 * rows[-1][3]:8.2f} ms  ratio {med:.3f} "
              f"[{lo:.3f}, {hi:.3f}]  {verdict:12s} others {others.cores:.2f} cores  (first fused call {warm:.1f} s)",
              flush=True)
    print("\n| kernel | case | stock median ms | fused median ms | fused/stock (median of pairs) [IQR] | verdict | "
          "other processes (cores) |\n|---|---|---:|---:|---|---|---:|")
    for kind, name, ms, mf, lo, med, hi, verdict, load in rows:
        print(f"| {kind} | {name} | {1e3 * ms:.2f} | {1e3 * mf:.2f} | {med:.3f} [{lo:.3f}, {hi:.3f}] | {verdict} | "
              f"{load:.2f} |")
    for kind in E.KINDS:  # on by default only if no module measured it slower
        mine = [r for r in rows if r[0] == kind]
        slower = [r[1] for r in mine if r[7] == "slower"]
        verdict = "faster everywhere" if all(r[7] == "faster" for r in mine) else \
            f"slower on {', '.join(slower)}" if slower else "not slower"
        print(f"{kind}: {verdict} -> {'off' if slower else 'on'} by default (this run)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=[*DEFAULTS, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="smoke settings: 2 rounds of 2 repeats (epilogues: 8 pairs, "
                                                        "no whole ViT layer), no waiting for quiet")
    p.add_argument("--threads", type=int, help="torch threads (default: attention 2, fused_qkv 2, epilogues torch's)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default: attention 5, fused_qkv 15)")
    p.add_argument("--repeats", type=int, help="timed calls per mode and round, epilogues pairs (default 5, 3, 30)")
    p.add_argument("--wait-idle", type=float, help="wait for quiet before each fused_qkv size (60 s), epilogues (0)")
    p.add_argument("--batch", type=int, default=8, help="attention, epilogues (default 8)")
    p.add_argument("--seq", type=int, default=128, help="attention (BERT and T5; ViT-base: 197), epilogues")
    p.add_argument("--warmup", type=int, default=3, help="epilogues: untimed pairs after the compile (default 3)")
    args = p.parse_args(argv)
    given, torch_threads = dict(vars(args)), torch.get_num_threads()
    for kernel in DEFAULTS if args.kernel == "all" else [args.kernel]:
        threads, rounds, repeats, wait = DEFAULTS[kernel]
        args.rounds = given["rounds"] or (2 if args.quick else rounds)
        args.repeats = given["repeats"] or ((8 if kernel == "epilogues" else 2) if args.quick else repeats)
        if kernel == "epilogues" and args.repeats < 2:
            p.error("epilogues needs --repeats >= 2 (quartiles of the pairs)")
        args.wait_idle = given["wait_idle"] if given["wait_idle"] is not None else 0.0 if args.quick else wait
        torch.set_num_threads(given["threads"] or threads or torch_threads)
        print(f"\n## kernel: {kernel}")
        if kernel == "epilogues" and args.wait_idle:
            wait_idle(args.wait_idle, 0.5)
        {"attention": attention, "fused_qkv": fused_qkv, "epilogues": epilogues}[kernel](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
