"""Activation memory per rank per layer: the bytes a training forward saves for backward, exactly.

    .venv/bin/shardlib run --nproc 4 benchmarks/activation_memory.py [--quick] [--seq 128] [--batch 2]

For BERT-base, ViT-base (224 px, 197 tokens) and T5-base (encoder and decoder layers counted separately), at
n = 2 and 4 ranks: no parallelism, tensor parallel only (tp=n), tensor + sequence parallel (tp=n, Megatron), and
all-to-all sequence parallelism alone (sp=n, tp=1, Ulysses). Counting uses
``torch.autograd.graph.saved_tensors_hooks``: every tensor a layer's forward saves for backward is attributed
to that layer (forward pre/post hooks mark the current layer), each storage counted once (q, k and v saving the same input
count once; T5's encoder output, saved by every decoder layer, counts once), parameters excluded (weights are not activations). Dropout masks count (1
byte per element, as in training). The target (issue): with sequence parallelism, per-rank bytes at most
1.05 x (unsharded bytes / n). Only rank 0 prints; n=2 runs as dp=2 x tp=2 (or sp=2) on the 4 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration, ViTConfig, \
    ViTForImageClassification

import shardlib


def models(quick: bool):
    scale = dict(layers=2) if quick else dict(layers=12)
    bert = BertConfig(num_hidden_layers=scale["layers"])
    vit = ViTConfig(num_hidden_layers=scale["layers"])
    t5 = T5Config(num_layers=scale["layers"], num_decoder_layers=scale["layers"], decoder_start_token_id=0)  # base
    return {"BERT-base": (BertForMaskedLM, bert), "ViT-base": (ViTForImageClassification, vit),
            "T5-base": (T5ForConditionalGeneration, t5)}


def batch_for(name: str, config, batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(0)
    if name.startswith("ViT"):
        return {"pixel_values": torch.randn(batch, 3, config.image_size, config.image_size, generator=g),
                "labels": torch.randint(0, 2, (batch,), generator=g)}
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    if name.startswith("T5"):
        return {"input_ids": ids, "labels": torch.randint(0, config.vocab_size, (batch, seq), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise: 4 ranks x 12-layer models ran out of RAM)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class SavedBytes:
    """Bytes saved for backward per (stack, layer) during one forward; a storage is counted once, for the first
    layer that saves it (T5's encoder output, saved by every decoder layer's cross-attention, exists once)."""

    def __init__(self, model, trunk):
        self.current = None
        self.per_layer: dict = {}
        self.seen: set = set()
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"}
        self.handles = []
        for k, stack in enumerate(trunk):
            for key, layer in model.get_submodule(stack.layers)._modules.items():
                self.handles.append(layer.register_forward_pre_hook(lambda m, a, _id=(k, key): self._enter(_id)))
                self.handles.append(layer.register_forward_hook(lambda m, a, o: self._leave()))

    def _enter(self, layer_id):
        self.current = layer_id
        self.per_layer.setdefault(layer_id, 0)

    def _leave(self):
        self.current = None

    def pack(self, t: torch.Tensor):
        if self.current is not None and isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.params and ptr not in self.seen:
                self.seen.add(ptr)
                self.per_layer[self.current] += storage.nbytes()
        return t.detach()  # not t: a saved output would keep its own node alive (graph leak without backward)

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield

    def mean_per_stack(self) -> list[float]:
        stacks = sorted({k for k, _ in self.per_layer})
        return [sum(v for (k, _), v in self.per_layer.items() if k == s) / sum(1 for (k, _) in self.per_layer if k == s)
                for s in stacks]


def measure(cls, config, name, mesh, sequence_parallel, batch, seq):
    torch.manual_seed(0)
    model = cls(config)
    if mesh is not None:
        shardlib.shard(model, mesh, sequence_parallel=sequence_parallel)
        trunk = shardlib.shard_state(model).plan.trunk
    else:
        from shardlib.policies import policy_for

        trunk = policy_for(model).plan(model, 1).trunk
    model.train()
    counter = SavedBytes(model, trunk)
    with counter.counting():
        out = model(**batch_for(name, config, batch, seq))
    del out, model
    gc.collect()  # hooks make reference cycles: free this model before the next one is built (4 ranks share RAM)
    _malloc_trim()
    return counter.mean_per_stack()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 layers instead of 12 (same per-layer numbers)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    meshes = {2: shardlib.init_mesh(tp=2), 4: shardlib.init_mesh(tp=4)}
    sp_meshes = {2: shardlib.init_mesh(tp=1, sp=2), 4: shardlib.init_mesh(tp=1, sp=4)}
    rank = dist.get_rank()
    rows = []
    for name, (cls, config) in models(args.quick).items():
        config.hidden_dropout_prob = getattr(config, "hidden_dropout_prob", 0.1)
        base = measure(cls, config, name, None, False, args.batch, args.seq) if rank == 0 else None
        for tp, mesh in meshes.items():
            tp_only = measure(cls, config, name, mesh, False, args.batch, args.seq)
            tp_sp = measure(cls, config, name, mesh, True, args.batch, args.seq)
            a2a = measure(cls, config, name, sp_meshes[tp], "all_to_all", args.batch, args.seq)
            if rank == 0:
                for s, stack in enumerate(["encoder", "decoder"][: len(base)] if name.startswith("T5") else ["layer"]):
                    rows.append((name, stack, tp, base[s], tp_only[s], tp_sp[s], a2a[s]))
        dist.barrier()
    if rank == 0:
        print(f"activation bytes saved for backward per layer per rank (batch {args.batch}, seq {args.seq}; "
              "ViT: 197 tokens); ratio = per-rank / (unsharded / n); target with SP <= 1.05")
        print(f"{'model':<10} {'layer':<8} {'n':>2} {'unsharded MiB':>14} {'TP MiB':>9} {'ratio':>6} "
              f"{'TP+SP MiB':>10} {'ratio':>6} {'A2A SP MiB':>11} {'ratio':>6}  target")
        for name, stack, n, base, tp_only, tp_sp, a2a in rows:
            ideal = base / n
            met = max(tp_sp, a2a) / ideal <= 1.05
            print(f"{name:<10} {stack:<8} {n:>2} {base / 2**20:>14.2f} {tp_only / 2**20:>9.2f} "
                  f"{tp_only / ideal:>6.2f} {tp_sp / 2**20:>10.2f} {tp_sp / ideal:>6.2f} {a2a / 2**20:>11.2f} "
                  f"{a2a / ideal:>6.2f}  {'met' if met else 'MISSED'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
