"""What reads a sharded model without training it (docs/architecture.md): the dry run of a layout
(:func:`~.dryrun.plan`, its report in :mod:`.dryrun_report`), the meta run it is built on (:mod:`.metarun`: the
real sharded code on meta tensors under a fake process group), ``torch.export`` of a rank's program
(:mod:`.export`) and ``torch.compile`` of a sharded model (:mod:`.compiling`). Lazy, like the package."""

from .._lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, {
    "dryrun": ["plan"],
    "dryrun_report": ["PlanReport"],
    "compiling": ["compile_model"],
})

__all__ = ["plan", "PlanReport", "compile_model"]
