"""The workload of ``benchmarks/step_anatomy.py``: one step of a model in one layout (:class:`Step`), kept alive in a
``_rank_pool.RankPool`` per layout. ``mlm``: a ``BertForMaskedLM`` step with AdamW (a hand loop unsharded,
``Trainer.train_step`` sharded); ``encoder``: the bare model's forward + backward of the mean square of its final
hidden states, no optimizer; ``cls`` (``--lengths``): a ``BertForSequenceClassification`` (2 labels) step with AdamW by
``Trainer.train_step`` on global batches of samples whose lengths follow a dataset's histogram (``LENGTHS``), one
batch form per mode (``FORMS``: padded, or packed by ``PackingCollator``), each window one pass over the same batches.
Layouts: ``MODES``; ``_compiled``, ``_loop`` / ``_fit`` (a window timed whole), and ``_docs`` (the encoder workload's
rows packed as ``--documents N`` equal documents: ``document_ids`` in place of the mask)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import _checkout  # noqa: E402,F401  (shardlib from this checkout)
import torch  # noqa: E402
from _anatomy_measure import release  # noqa: E402

MODES = {  # name: (world, threads per rank, shard() options or None for the hand loop)
    "unsharded": (1, 2, None),
    "world1": (1, 2, {}),
    "world1_blocks": (1, 2, {"kernels": {"attention": "blocks"}}),  # kernels: Kernels' fields (built in the rank)
    "tp2": (2, 1, {}),
    "tp2_sp": (2, 1, {"sequence_parallel": True}),
    "tp2_c10d": (2, 1, {}),
    "tp2_sp_c10d": (2, 1, {"sequence_parallel": True}),
    **{f"dp{n}{suffix}": (n, 1, {}) for n in (2, 4) for suffix in ("_zero0", "_zero1", "_zero1_overlap")},
    **{f"sp{n}_{kind}": (n, 1, {"sequence_parallel": option}) for n in (2, 4)
       for kind, option in (("a2a", "all_to_all"), ("ring", "ring"))},
}
SUFFIXES = {"_compiled": ", compiled", "_loop": ", train_step loop", "_fit": ", Trainer.fit",
            "_docs": ", packed documents"}
#: ``--lengths``: token-length histograms of real datasets' samples (docs/data/, each with its ``source``)
LENGTHS = {"sst2": "sst2_train_token_lengths.json"}
#: ``--lengths``: how a global batch of samples becomes the step's batch (a suffix of world1 and tp2)
FORMS = {"_padded": ", padded to --seq", "_longest": ", padded to the batch's longest",
         "_packed": ", packed into rows of --seq", "_packed_fixed": ", packed, fixed_length=True"}
SUFFIXES.update(FORMS)
MODES.update({m + f: MODES[m] for m in ("world1", "tp2") for f in FORMS})
#: what ``step_anatomy.py --lengths`` runs without ``--modes``
LENGTH_MODES = tuple(m + f for m in ("world1", "tp2") for f in ("_padded", "_longest", "_packed"))
MODES.update({m + "_compiled": MODES[m] for m in ("unsharded", "world1", "tp2", "tp2_sp", "sp2_a2a")})
MODES.update({m + s: MODES[m] for m in ("world1", "tp2", "dp2_zero0") for s in ("_loop", "_fit")})
#: ``--documents N``: the encoder workload's rows packed as N equal documents (``document_ids``; sharded layouts only)
MODES.update({m + "_docs": MODES[m] for m in ("world1", "world1_blocks", "sp2_a2a", "sp4_a2a", "sp2_ring", "sp4_ring")})
#: what ``step_anatomy.py`` runs without ``--modes``
DEFAULT_MODES = ("unsharded", "world1", "tp2", "tp2_sp", "tp2_c10d", "tp2_sp_c10d")
#: init_mesh options of a layout (default: tp over its ranks, the default transport)
MESH_OPTIONS = {"tp2_c10d": {"tp": 2, "transport": "c10d"}, "tp2_sp_c10d": {"tp": 2, "transport": "c10d"},
                **{m: {"dp": MODES[m][0]} for m in MODES if m.startswith("dp")},
                **{m: {"tp": 1, "sp": MODES[m][0]} for m in MODES if m.startswith("sp")}}
#: Trainer options of a layout (default: none)
TRAINER_OPTIONS = {**{m: {"zero": 1} for m in MODES if m.endswith("_zero1")},
                   **{m: {"zero": 1, "overlap_param_gather": True} for m in MODES if m.endswith("_overlap")}}
TITLES = {"unsharded": "unsharded (hand loop)", "world1": "shardlib world of one",
          "world1_blocks": 'shardlib world of one, Kernels(attention="blocks")', "tp2": "shardlib tp=2",
          "tp2_sp": "shardlib tp=2 + SP", "tp2_c10d": "shardlib tp=2, gloo transport",
          "tp2_sp_c10d": "shardlib tp=2 + SP, gloo transport",
          **{f"dp{n}_zero{z}": f"shardlib dp={n}, zero={z}" for n in (2, 4) for z in (0, 1)},
          **{f"dp{n}_zero1_overlap": f"shardlib dp={n}, zero=1, overlapped gathers" for n in (2, 4)},
          **{f"sp{n}_{k}": f"shardlib sp={n} {t}" for n in (2, 4)
             for k, t in (("a2a", "all-to-all"), ("ring", "ring"))}}

_BASE = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)
_SMALL = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
_TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256)
#: config fields per size; the family (bert, vit, t5) is the part of the name before the dash
SIZES = {
    "bert-base": _BASE, "bert-small": _SMALL, "bert-tiny": _TINY,
    "bert-256": dict(_SMALL, num_hidden_layers=1),  # one layer of BERT-small's width: the long-sequence masks' model
    #: host-bound: each op's dispatch costs about what its arithmetic does (the Trainer's per-step work shows)
    "bert-host": dict(_TINY, vocab_size=1000),
    "vit-base": dict(_BASE, image_size=224, patch_size=16), "vit-small": dict(_SMALL, image_size=224, patch_size=16),
    "vit-tiny": dict(_TINY, image_size=32, patch_size=8),
    "t5-base": dict(num_layers=12, d_model=768, d_kv=64, num_heads=12, d_ff=3072),
    "t5-small": dict(num_layers=4, d_model=256, d_kv=64, num_heads=4, d_ff=1024),
    "t5-tiny": dict(num_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=256, vocab_size=1000),
}
MODEL_CLASS = {"bert": "BertModel", "vit": "ViTModel", "t5": "T5Model"}


def base_mode(mode: str) -> str:
    """The layout of a mode, its suffix (``_compiled``, ``_loop``, ``_fit``) removed."""
    return next((mode.removesuffix(s) for s in SUFFIXES if mode.endswith(s)), mode)


def title(mode: str) -> str:
    return TITLES[base_mode(mode)] + next((t for s, t in SUFFIXES.items() if mode.endswith(s)), "")


def family(size: str) -> str:
    return size.split("-")[0]


def tokens(size: str, batch: int, seq: int) -> int:
    """Tokens per step: ViT's patches and CLS per image, T5's encoder and decoder sequences."""
    if family(size) == "vit":
        return batch * ((SIZES[size]["image_size"] // SIZES[size]["patch_size"]) ** 2 + 1)
    return batch * seq * (2 if family(size) == "t5" else 1)


def config(size: str, dropout: float, seq: int = 512, layers: int | None = None):
    import transformers

    fields = dict(SIZES[size])
    if family(size) == "t5":  # T5-base's vocabulary and buckets, ReLU feed-forward, as many decoder layers
        fields = {"vocab_size": 32128, **fields, **({"num_layers": layers} if layers else {})}
        return transformers.T5Config(**fields, num_decoder_layers=fields["num_layers"], feed_forward_proj="relu",
                                     dropout_rate=dropout, relative_attention_num_buckets=32,
                                     relative_attention_max_distance=128, pad_token_id=0, eos_token_id=1,
                                     decoder_start_token_id=0)
    fields.update({"num_hidden_layers": layers} if layers else {})
    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if family(size) == "vit":
        return transformers.ViTConfig(**fields, num_channels=3, **drop)
    return transformers.BertConfig(**{"vocab_size": 30522, **fields}, max_position_embeddings=max(512, seq), **drop)


def batches(n: int, batch: int, seq: int, vocab: int = 30522, padding: float = 0.0) -> list[dict]:
    """MLM batches (15% labelled), the same on every rank; the mask hides the last ``padding`` of every row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        mask = torch.ones_like(ids)
        mask[:, seq - int(seq * padding):] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def length_batches(name: str, batches: int, batch: int, seq: int) -> list[list[int]]:
    """``batches`` global batches of ``batch`` sample lengths drawn from ``LENGTHS[name]``'s histogram (seed 1),
    cut to ``seq``."""
    path = Path(__file__).resolve().parent.parent / "docs" / "data" / LENGTHS[name]
    counts = json.loads(path.read_text())["counts"]
    values, weights = torch.tensor([int(k) for k in counts]), torch.tensor([float(v) for v in counts.values()])
    g = torch.Generator().manual_seed(1)
    drawn = values[torch.multinomial(weights, batches * batch, replacement=True, generator=g)]
    return drawn.clamp(max=seq).view(batches, batch).tolist()


def form_batches(form: str, lengths: list[list[int]], seq: int, vocab: int = 30522) -> list[dict]:
    """The same samples (random ids, one of 2 labels; seed 2) in batch form ``form`` (``FORMS``): padded to ``seq`` or
    to the batch's longest (attention_mask), or packed into rows of ``seq`` tokens (``PackingCollator``)."""
    from shardlib.train.packing import PackingCollator

    g, out = torch.Generator().manual_seed(2), []
    for lens in lengths:
        samples = [{"input_ids": torch.randint(1, vocab, (n,), generator=g),
                    "labels": int(torch.randint(0, 2, (), generator=g))} for n in lens]
        if form.startswith("_packed"):
            out.append(PackingCollator(seq, fixed_length=form == "_packed_fixed")(samples))
            continue
        ids = torch.zeros(len(lens), seq if form == "_padded" else max(lens), dtype=torch.long)
        for row, sample in zip(ids, samples):
            row[:len(sample["input_ids"])] = sample["input_ids"]
        out.append({"input_ids": ids, "attention_mask": (ids != 0).long(),
                    "labels": torch.tensor([s["labels"] for s in samples])})
    return out


def slots(mode: str, lengths: list[list[int]], seq: int) -> float:
    """Token positions (padding included) per step of ``mode``'s batches."""
    form = next(f for f in FORMS if mode.endswith(f))
    return sum(b["input_ids"].numel() for b in form_batches(form, lengths, seq)) / len(lengths)


def encoder_batches(size: str, cfg, batch: int, seq: int, padding: float, documents: int = 0) -> list[dict]:
    """The ``encoder`` workload's inputs: ids and mask (T5: the same ids into the decoder), or random images;
    ``documents``: each row's real tokens as that many equal documents (``document_ids``, -1 on padding), no mask."""
    if family(size) == "vit":
        g = torch.Generator().manual_seed(1)
        return [{"pixel_values": torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g)} for _ in range(4)]
    out = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
           for b in batches(4, batch, seq, cfg.vocab_size, padding)]
    for b in out if documents else ():
        b["document_ids"] = document_ids(b.pop("attention_mask"), documents)
    if family(size) == "t5":
        for b in out:
            b.update(decoder_input_ids=b["input_ids"], use_cache=False)
    return out


def document_ids(mask: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, L] ids of ``n`` equal documents over each row's real tokens (``mask``: 1 there, 0 on trailing padding),
    -1 on its padding."""
    ids = torch.arange(mask.shape[-1]) * n // mask.sum(-1, keepdim=True)
    return torch.where(mask.bool(), ids, -1)


class Step:
    """One layout's model, optimizer and batches; ``hand_loop``: a sharded model stepped by a hand loop, no Trainer."""

    def __init__(self, mode: str, size: str, batch: int, seq: int, dropout: float, workload: str = "mlm",
                 hand_loop: bool = False, layers: int | None = None, padding: float = 0.0,
                 lengths: str | None = None, window: int = 3, documents: int = 0):
        import transformers

        import shardlib

        world, threads, options = MODES[mode]
        layout, compiled = base_mode(mode), mode.endswith("_compiled")
        form = next((f for f in FORMS if mode.endswith(f)), None)
        if workload != "mlm" and mode.endswith(("_loop", "_fit")):
            raise ValueError(f"{mode} times the Trainer: --workload mlm")
        if (form is not None) != (workload == "cls") or (workload == "cls") != (lengths is not None):
            raise ValueError(f"{mode}: the batch forms {list(FORMS)} are the modes of --lengths (workload cls)")
        documents = documents if mode.endswith("_docs") else 0
        if mode.endswith("_docs") and (workload != "encoder" or family(size) != "bert" or documents < 1):
            raise ValueError(f"{mode} packs BERT's rows as --documents N (N >= 1) documents: --workload encoder")
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        cls = {"mlm": "BertForMaskedLM", "cls": "BertForSequenceClassification"}.get(workload)
        model = getattr(transformers, cls or MODEL_CLASS[family(size)])(config(size, dropout, seq, layers))
        #: ``cls``: real (non-padding) tokens of each global batch; a window is one pass over them, in order
        self.real_tokens = None
        if workload == "cls":
            assert model.config.num_labels == 2
            lens = length_batches(lengths, window, batch, seq)
            self.data, self.real_tokens = form_batches(form, lens, seq, model.config.vocab_size), list(map(sum, lens))
        elif workload == "mlm":
            self.data = batches(4, batch, seq, model.config.vocab_size, padding)
        else:
            self.data = encoder_batches(size, model.config, batch, seq, padding, documents)
        self.i, self.world, self.workload, self.batch = 0, world, workload, batch
        self.ring = options is not None and options.get("sequence_parallel") == "ring"
        self.fit, self.windowed = mode.endswith("_fit"), mode.endswith(("_loop", "_fit")) or workload == "cls"
        make_optimizer = lambda params: torch.optim.AdamW(params, lr=1e-5)  # noqa: E731
        self.trainer = self.optimizer = self.mesh = None
        if options is None:
            self.model = model
        else:
            self.mesh = shardlib.init_mesh(**MESH_OPTIONS.get(layout, {"tp": world}))
            self.model = shardlib.shard(model, self.mesh, **{k: shardlib.Kernels(**v) if k == "kernels" else v
                                                             for k, v in options.items()})
        if documents:
            from shardlib.sharding.documents import accept_documents

            accept_documents(self.model)
        if workload in ("mlm", "cls") and options is not None and not hand_loop:
            self.trainer = shardlib.Trainer(self.model, make_optimizer, compile=compiled,
                                            **TRAINER_OPTIONS.get(layout, {}))
        else:
            if compiled:
                shardlib.compile_model(self.model)
            if workload == "mlm":
                self.optimizer = make_optimizer(self.model.parameters())

    def run(self, keep_grads: bool = False) -> float:
        batch = self.data[self.i % len(self.data)]
        self.i += 1
        if self.trainer is not None:
            if keep_grads and self.workload == "cls":  # the peak's step: forward + backward, no optimizer
                return self.trainer.forward_backward(batch)
            return self.trainer.train_step(batch)
        if self.workload == "encoder":
            self.model.zero_grad(set_to_none=not keep_grads)
            out = self.model(**batch)
            states = (out.last_hidden_state, getattr(out, "encoder_last_hidden_state", None))
            loss = sum(h.float().pow(2).mean() for h in states if h is not None)
            loss.backward()
            return loss.item()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def window(self, n: int) -> None:
        """``n`` steps, or for a ``_fit`` mode one ``Trainer.fit`` over ``n`` global batches of the same samples."""
        if not self.fit:
            for _ in range(n):
                self.run()
            return
        dp = self.mesh.dp if self.mesh is not None else 1
        rows = [{k: v[i] for k, v in b.items()} for b in self.data for i in range(self.batch)]
        samples = (rows * (n * dp // 4 + 1))[:n * self.batch * dp]
        result = self.trainer.fit(samples, batch_size=self.batch * dp, max_steps=n, log_interval=10, progress=False)
        assert len(result.losses) == n


def setup(rank: int, world: int, mode: str, size: str, batch: int, seq: int, dropout: float, workload: str,
          layers: int | None = None, padding: float = 0.0, lengths: str | None = None, window: int = 3,
          documents: int = 0, warmup: int = 2) -> Step:
    step = Step(mode, size, batch, seq, dropout, workload, layers=layers, padding=padding, lengths=lengths,
                window=window, documents=documents)
    for _ in range(max(warmup, len(step.real_tokens or ()))):  # warm-up: allocator, optimizer state, first calls
        step.run()  # (and compiling); --lengths: each batch of the window, each shape once
    release(step)
    if step.fit:
        step.window(2)  # fit's imports, DataLoader
    return step


IN_PROCESS = {  # name: (shardlib at a world of one?, hand loop?)
    "unsharded": (False, True), "world1_hand": (True, True), "world1": (True, False)}
IN_PROCESS_TITLES = {"unsharded": "unsharded, hand loop", "world1_hand": "shardlib world of one, hand loop",
                     "world1": "shardlib world of one, Trainer.train_step"}


def in_process_steps(size: str, batch: int, seq: int, dropout: float) -> dict[str, Step]:
    """The world-of-one variants in this process, free of the per-process differences (+-20%) between processes."""
    steps = {}
    for name, (sharded, hand) in IN_PROCESS.items():
        steps[name] = Step("world1" if sharded else "unsharded", size, batch, seq, dropout, "mlm", hand_loop=hand)
        for _ in range(2):
            steps[name].run()
    return steps
