"""One dataclass of training arguments, parsed with ``transformers.HfArgumentParser``, and the launch.

    @dataclass
    class MyArgs:
        hidden: int = 64

    args, mine = shardlib.train.parse_args(MyArgs)     # --help lists both; `--nproc 4` starts 4 local ranks
    mesh = shardlib.train.mesh_from_args(args)

The same script runs as ``python train.py`` (a world of one), ``python train.py --nproc 4 --tp 2`` (it starts its
own 4 ranks through torch's elastic launcher, as FlagAI's Trainer does), ``shardlib run --nproc 4 train.py --tp 2``
or torchrun, on one node or several. Mesh sizes default to the environment (``SHARDLIB_TP``, ``SHARDLIB_PP``,
``SHARDLIB_SP``, ``SHARDLIB_DP``); dp is inferred from the world size when not given.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

from ..parallel.mesh import MeshError, init_mesh, launched


def _env_int(name: str, default: int | None):
    def read():
        value = os.environ.get(name)
        return int(value) if value else default

    return read


@dataclass
class TrainingArguments:
    """Mesh, launch, schedule, optimization, data, evaluation, logging and checkpoint options of ``fit``."""

    tp: int = field(default_factory=_env_int("SHARDLIB_TP", 1), metadata={"help": "tensor-parallel ranks"})
    pp: int = field(default_factory=_env_int("SHARDLIB_PP", 1), metadata={"help": "pipeline stages"})
    sp: int = field(default_factory=_env_int("SHARDLIB_SP", 1),
                    metadata={"help": "sequence-parallel ranks per sequence (all-to-all or ring)"})
    dp: Optional[int] = field(default_factory=_env_int("SHARDLIB_DP", None),
                              metadata={"help": "data-parallel replicas (default: inferred from the world size)"})
    ep: int = field(default=1, metadata={
        "help": "expert-parallel ranks: each mixture-of-experts layer's experts split over that many data-parallel "
                "ranks (it must divide dp; docs/moe.md)"})
    expert_capacity: Optional[float] = field(default=None, metadata={
        "help": "with --ep: the static-capacity exchange with this capacity factor (default: dropless)"})
    sequence_parallel: Optional[Literal["megatron", "all_to_all", "ring"]] = field(
        default=None, metadata={"help": "Megatron SP on the tp group; all-to-all (Ulysses) or ring attention over "
                                        "--sp ranks (default with --sp > 1: all_to_all)"})
    transport: Optional[Literal["auto", "c10d", "shm"]] = field(default=None, metadata={
        "help": "how tp/sp ranks exchange tensors: c10d (the backend), shm (shared memory, CPU ranks on one host) or "
                "auto (shm where a CPU group can use it, else c10d; default: SHARDLIB_TRANSPORT, else auto)"})
    nproc: Optional[int] = field(default=None, metadata={
        "help": "start this many local ranks when the script was not started by a launcher"})
    max_restarts: int = field(default=0, metadata={
        "help": "with --nproc: restart every rank this many times after a failure; fit resumes from the newest "
                "complete checkpoint in --save-dir"})
    microbatches: int = field(default=1, metadata={"help": "microbatches per step (pipeline / accumulation)"})
    microbatch_size: Optional[int] = field(default=None, metadata={
        "help": "samples per microbatch on each rank: sets --microbatches to batch-size / (dp x this) from the "
                "world size, so a job that shrinks to fewer ranks accumulates more microbatches of the same size"})
    schedule: str = field(default="1f1b", metadata={"help": "pipeline schedule: gpipe, 1f1b, interleaved_1f1b, "
                                                            "looped_bfs"})
    batch_size: int = field(default=32, metadata={"help": "global batch size"})
    eval_batch_size: Optional[int] = field(default=None, metadata={"help": "global eval batch (default: "
                                                                             "--batch-size)"})
    packing: Optional[int] = field(default=None, metadata={
        "help": "train padding-free: pack each global batch's samples into rows of this many tokens"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = 0.0
    warmup_ratio: float = field(default=0.0, metadata={"help": "linear warmup share of the steps, then cosine"})
    max_grad_norm: Optional[float] = field(default=1.0, metadata={"help": "clip the global gradient norm"})
    skip_nonfinite: bool = field(default=False, metadata={
        "help": "skip and count a step whose gradients hold inf/nan on any rank (any precision)"})
    max_consecutive_skips: Optional[int] = field(default=None, metadata={
        "help": "--skip-nonfinite: stop after this many skipped steps in a row, naming the parameters (default 20)"})
    epochs: Optional[int] = None
    max_steps: Optional[int] = None
    eval_interval: Optional[str] = field(default=None, metadata={"help": "evaluate every N steps, or 'epoch'"})
    log_interval: int = 10
    save_dir: Optional[str] = field(default=None, metadata={"help": "logs and checkpoints go here"})
    save_interval: Optional[int] = field(default=None, metadata={"help": "checkpoint every N steps"})
    keep_last: int = 2
    async_save: bool = field(default=True, metadata={"help": "write checkpoints in a background thread"})
    resume: Optional[str] = field(default=None, metadata={"help": "'auto' or a checkpoint directory"})
    seed: int = 0
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank"})
    precision: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata={
        "help": "bf16: autocast; fp16: autocast and a dynamic loss scaler"})
    initial_scale: float = field(default=2.0 ** 16, metadata={"help": "fp16 loss scaler: the first scale"})
    min_scale: float = 1.0
    max_scale: float = 2.0 ** 32
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = field(default=1000, metadata={"help": "fp16: grow the scale after this many clean steps"})
    hysteresis: int = field(default=2, metadata={"help": "fp16: back off after this many overflowing steps"})
    master_weights: bool = field(default=False, metadata={"help": "fp32 copies of fp16/bf16 weights for the "
                                                                  "optimizer"})
    zero: int = field(default=0, metadata={"help": "ZeRO over dp: 1 optimizer state, 2 + gradients, 3 + parameters "
                                                   "(FSDP2)"})
    offload: bool = field(default=False, metadata={"help": "zero=3: parameters and optimizer state in CPU memory"})
    bucket_mb: float = field(default=25.0, metadata={"help": "zero=1/2: MiB per flat gradient bucket"})
    overlap_param_gather: bool = field(default=False, metadata={
        "help": "zero=1/2: the parameter all-gathers after a step run on into the next forward"})
    activation_checkpointing: bool = False
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (pipeline stages: their layers)"})
    layout: Optional[Literal["auto"]] = field(default=None, metadata={
        "help": "auto: search every layout of the world size and use the fastest that fits --memory (sets the "
                "mesh, --ep for a mixture of experts, --zero, --microbatches, --schedule, --activation-checkpointing)"})
    memory: Optional[str] = field(default=None, metadata={"help": "--layout auto: memory per rank, e.g. 16GiB"})
    profile: Optional[str] = field(default=None, metadata={
        "help": "--layout auto: machine profile JSON (shardlib calibrate); default: a nominal built-in one"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar on rank 0"})

    def __post_init__(self):
        if not self.bucket_mb > 0:
            raise ValueError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        for name in ("tp", "pp", "sp", "ep", "microbatches", "batch_size", "log_interval", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("dp", "nproc", "eval_batch_size", "epochs", "max_steps", "save_interval", "microbatch_size",
                     "packing"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1 when given, got {getattr(self, name)}")
        for name in ("lr", "weight_decay"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{_flag(name)} must be a finite number >= 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"--max-grad-norm must be a positive finite number (or None: no clipping), got "
                             f"{self.max_grad_norm}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        from .autolayout import check_auto

        check_auto(self)
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be one of 0, 1, 2, 3, got {self.zero}")
        self._check_experts()
        if self.sp > 1 and self.sequence_parallel is None:
            self.sequence_parallel = "all_to_all"
        if self.eval_interval is not None and self.eval_interval != "epoch":
            if not self.eval_interval.isdigit() or int(self.eval_interval) < 1:
                raise ValueError(f"--eval-interval must be a positive integer or 'epoch', got {self.eval_interval!r}")

    def _check_experts(self) -> None:
        if self.expert_capacity is not None and not (math.isfinite(self.expert_capacity) and self.expert_capacity > 0):
            raise ValueError(f"--expert-capacity must be a positive capacity factor, got {self.expert_capacity}")
        if self.ep == 1 and self.expert_capacity is not None:
            raise ValueError("--expert-capacity sets expert parallelism's static capacity: give --ep N too")

    def mesh_sizes(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "sp": self.sp}

    def trainer_options(self) -> dict:
        """Keyword arguments of :class:`shardlib.train.Trainer` (after the model and the optimizer)."""
        return {"microbatches": self.microbatches_per_step(), "schedule": self.schedule, "max_grad_norm": self.max_grad_norm,
                "precision": self.precision, "zero": self.zero, "offload": self.offload, "bucket_mb": self.bucket_mb,
                "overlap_param_gather": self.overlap_param_gather,
                "master_weights": self.master_weights, "loss_scaler": self.loss_scaler(),
                "activation_checkpointing": self.activation_checkpointing, "compile": self.compile,
                "skip_nonfinite": self.skip_nonfinite, "max_consecutive_skips": self.max_consecutive_skips}

    def microbatches_per_step(self) -> int:
        """``--microbatches``, or with ``--microbatch-size``: the global batch over dp x that size (dp from the world
        size when not given)."""
        if self.microbatch_size is None:
            return self.microbatches
        model = self.pp * self.sp * self.tp
        dp = self.dp or max(int(os.environ.get("WORLD_SIZE", "1")) // model, 1)
        per_rank, rest = divmod(self.batch_size, dp)
        if rest or per_rank % self.microbatch_size:
            raise ValueError(f"--batch-size {self.batch_size} is not a multiple of dp({dp}) x --microbatch-size "
                             f"{self.microbatch_size}")
        return per_rank // self.microbatch_size

    def loss_scaler(self) -> dict | None:
        """The fp16 loss scaler's settings (:class:`shardlib.train.DynamicLossScaler`), None for other precisions."""
        if self.precision != "fp16":
            return None
        return {k: getattr(self, k) for k in ("initial_scale", "min_scale", "max_scale", "growth_factor",
                                              "backoff_factor", "growth_interval", "hysteresis")}

    def fit_options(self) -> dict:
        """Keyword arguments of :meth:`Trainer.fit` (after the training data)."""
        from .loop import warmup_cosine

        interval = self.eval_interval
        return {"batch_size": self.batch_size, "eval_batch_size": self.eval_batch_size, "epochs": self.epochs,
                "max_steps": self.max_steps, "eval_interval": int(interval) if interval and interval.isdigit()
                else interval, "log_interval": self.log_interval, "save_dir": self.save_dir,
                "save_interval": self.save_interval, "keep_last": self.keep_last, "resume": self.resume,
                "seed": self.seed, "num_workers": self.num_workers, "progress": self.progress,
                "async_save": self.async_save, "packing": self.packing,
                "lr_scheduler": warmup_cosine(self.warmup_ratio) if self.warmup_ratio else None}

    def shard_options(self) -> dict:
        options = {"sequence_parallel": self.sequence_parallel} if self.sequence_parallel else {}
        return options | ({"expert_capacity": self.expert_capacity} if self.expert_capacity is not None else {})

    def to_dict(self) -> dict:
        return asdict(self)


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def check_nproc(nproc: int, args: TrainingArguments) -> None:
    """``nproc`` ranks must fill the mesh: a multiple of pp x sp x tp, and exactly dp x pp x sp x tp when dp is
    given."""
    if nproc < 1:
        raise MeshError(f"--nproc must be >= 1, got {nproc}")
    model = args.pp * args.sp * args.tp
    named = f"pp({args.pp}) x sp({args.sp}) x tp({args.tp}) = {model}"
    if nproc % model:
        raise MeshError(f"--nproc {nproc} is not a multiple of {named}")
    if args.dp is not None and nproc != args.dp * model:
        word = "more" if nproc > args.dp * model else "fewer"
        raise MeshError(f"--nproc {nproc} is {word} ranks than the mesh needs: dp({args.dp}) x {named} = "
                        f"{args.dp * model}")


def launch_if_requested(args: TrainingArguments, argv: list[str] | None = None) -> None:
    """With ``--nproc N`` in a process no launcher started: start N local ranks of this script (same arguments)
    through torch's elastic launcher (:func:`shardlib.train.launch.run`), wait for them and exit with their status.
    Under a launcher, or without ``--nproc``, return at once."""
    if launched():
        from .restarts import launcher_max_restarts

        given = launcher_max_restarts()
        if args.max_restarts and args.max_restarts != given:  # `shardlib run --nproc 4 train.py --max-restarts 3`
            raise ValueError(f"--max-restarts {args.max_restarts} reached the script, but the launcher that started "
                             f"it restarts {given} times: give it to the launcher, before the script "
                             f"(shardlib run --max-restarts {args.max_restarts} ... train.py), or with --nproc")
        return
    if args.nproc is None:
        return
    check_nproc(args.nproc, args)
    from .launch import run

    argv = list(sys.argv if argv is None else argv)
    sys.exit(run(args.nproc, argv[0], _without_nproc(argv[1:]), max_restarts=args.max_restarts))


def _without_nproc(argv: list[str]) -> list[str]:
    """The ranks' arguments: the parent's without ``--nproc N`` (they are launched; torchrun's parser would also
    read ``--nproc`` as an abbreviation of its own ``--nproc-per-node``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def parse_args(*extra, args: list[str] | None = None, defaults: dict | None = None, launch: bool = True,
               model=None, seq: int = 128):
    """Parse the command line into a :class:`TrainingArguments` and the script's own dataclasses ``extra`` (with
    ``transformers.HfArgumentParser``; ``--help`` lists every field). ``defaults``: the script's own defaults for
    any field (``{"tp": 2, "epochs": 12}``; shown by ``--help``, overridden by the command line). With ``launch``
    and ``--nproc``, start the ranks first (:func:`launch_if_requested`): the call returns only in the ranks.

    ``--layout auto --memory 16GiB``: the layout search picks the mesh (with ep for a mixture of experts), ZeRO
    stage, microbatches, schedule and activation checkpointing for ``model`` (a model, config or model directory;
    sequences of ``seq`` tokens) and the global ``--batch-size`` (:mod:`shardlib.train.autolayout`), and says what
    it chose and why."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser((TrainingArguments, *extra))
    if defaults:
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"parse_args(defaults=...) names no argument: {', '.join(unknown)}")
        parser.set_defaults(**defaults)  # --help shows them (HfArgumentParser prints defaults)
    parsed = _or_exit(lambda: parser.parse_args_into_dataclasses(args=args))
    argv = None
    if parsed[0].layout == "auto":
        if model is None:  # the script's mistake, not its user's: a traceback shows where
            raise ValueError("--layout auto needs the model to search layouts for: "
                             "parse_args(..., model=config_or_path)")
        argv = _or_exit(lambda: _choose_layout(parsed[0], model, seq, list(sys.argv[1:] if args is None else args)))
    if launch:
        launch_if_requested(parsed[0], argv)
    return parsed[0] if not extra else tuple(parsed)


def _or_exit(parse):
    """``parse()``; a ValueError (a bad value on the command line, or no layout for ``--layout auto``) ends the
    program as argparse ends it for a bad flag: one line on stderr, exit status 2, no traceback."""
    try:
        return parse()
    except ValueError as exc:
        print(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _choose_layout(args: TrainingArguments, model, seq: int, argv: list[str]) -> list[str]:
    """Run the layout search (:func:`shardlib.train.autolayout.choose_layout`), print the choice (once), and return
    the command line the launched ranks get: the same, the choice given explicitly instead of ``--layout auto``."""
    from .autolayout import choose_layout, explain, explicit_flags, without_auto, world_size

    best, result = choose_layout(args, model, world_size(args), seq)
    if int(os.environ.get("RANK", "0")) == 0:
        print(explain(best, result), flush=True)
    args.layout = args.memory = args.profile = None
    return [sys.argv[0], *without_auto(argv), *explicit_flags(best.layout)]


def mesh_from_args(args: TrainingArguments, **options):
    """:func:`shardlib.init_mesh` with the argument's sizes (a world of one without a launcher)."""
    return init_mesh(args.dp, args.pp, args.tp, sp=args.sp, ep=args.ep, transport=args.transport, **options)
