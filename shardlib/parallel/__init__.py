"""The primitives a rank runs, the lowest layer (docs/architecture.md): it imports torch and nothing else of
shardlib.

* :mod:`.mesh`: the validated dp x pp x sp x tp device mesh (and ep, drawn from dp) and its process groups;
* :mod:`.collectives`: one autograd Function per collective (Megatron's copy / reduce / scatter / gather);
* :mod:`.layers` and :mod:`.styles`: column / row / vocab-parallel modules and the small style objects plans name;
* :mod:`.norms`: norms on tensor-parallel heads (per head: gradient summed over tp; whole width: split, statistic
  all-reduced);
* :mod:`.experts`, :mod:`.expert_parallel`: a mixture of experts' experts split like MLPs over tp, and over ep with
  their tokens exchanged (dropless or at a static capacity);
* :mod:`.layout`: how a parameter is split (recorded once, read by everything downstream);
* :mod:`.random`: per-rank and replicated dropout streams;
* :mod:`.overlap`, :mod:`.gradsync`: communication overlapped with backward, replicated-gradient buckets;
* :mod:`.flat`, :mod:`.dp_shards`: ZeRO-1/2's flat buckets, and what FSDP2's dp-sharded tensors look like;
* :mod:`.optim_state`: an optimizer's state by model parameter, whoever holds it (what checkpoints read);
* :mod:`.timeouts`: every collective wait bounded, the stalled ranks named.
"""

from .layout import Layout, layout_of, named_layouts
from .mesh import Mesh, MeshError, fake_world, init_mesh
from .norms import ColwiseNorm, PartialGrads
from .random import RNGStatesTracker, manual_seed
from .styles import ColwiseParallel, CopyInputs, LocalRNG, RowwiseParallel, VocabParallel
from .timeouts import CollectiveFailure

__all__ = ["Mesh", "MeshError", "init_mesh", "fake_world", "Layout", "layout_of", "named_layouts",
           "RNGStatesTracker", "manual_seed", "ColwiseParallel", "RowwiseParallel", "VocabParallel", "CopyInputs",
           "LocalRNG", "PartialGrads", "ColwiseNorm", "CollectiveFailure"]
