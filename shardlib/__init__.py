"""shardlib: policy-driven sharding of unmodified HuggingFace models over a dp x pp x sp x tp mesh.

    mesh = shardlib.init_mesh(tp=2)          # under `shardlib run` / torchrun
    model = shardlib.shard(model, mesh)      # policy found from the model class
    print(shardlib.plan("bert-large/", tp=8, pp=4))   # dry run of a layout, no ranks needed
"""

from .layout import Layout, layout_of, named_layouts
from .mesh import Mesh, MeshError, init_mesh
from .plan import LossSpec, Plan, PlanError, Stack
from .random import RNGStatesTracker, manual_seed
from .sharded import ShardState, shard_state
from .sharder import ShardReport, report, shard
from .state import full_state_dict, load_full_state_dict, materialize
from .styles import ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel, VocabParallel
from .kernels import Kernels
from .compiling import compile_model
from .checkpoint import from_pretrained, save_pretrained
from . import checkpoint, compiling, export, runtime, train  # noqa: E402  (shardlib.checkpoint.*, shardlib.train.* after `import shardlib`)
from .train import Trainer, TrainingArguments, dp_shard
# the function shadows the submodule's attribute on the package; `from shardlib.plan import Plan` still finds the
# module (sys.modules["shardlib.plan"])
from .dryrun import PlanReport, plan  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "init_mesh", "Mesh", "MeshError", "shard", "report", "ShardReport", "Plan", "LossSpec", "Stack", "PlanError",
    "ColwiseParallel", "RowwiseParallel", "VocabParallel", "CopyInputs", "LocalRNG", "Layout", "layout_of",
    "named_layouts", "full_state_dict", "load_full_state_dict", "materialize", "manual_seed", "RNGStatesTracker",
    "Trainer", "TrainingArguments", "dp_shard", "checkpoint", "runtime", "train", "Kernels", "shard_state",
    "ShardState", "plan", "PlanReport", "compile_model", "export", "from_pretrained", "save_pretrained",
]
