"""Pipeline parallelism: stages cut from the policy's trunk (:mod:`.stages`, pure), run on this rank by
:mod:`.split`, and scheduled by ``torch.distributed.pipelining`` through :class:`PipelineRunner` (:mod:`.runner`).
"""

from .runner import MULTI_STAGE, SCHEDULES, PipelineRunner, check_schedule
from .split import PipelineSplit, StageExit, StageModule
from .stages import StagePlan, assign_stages, module_cost, stage_plan, tensor_owners

__all__ = ["assign_stages", "module_cost", "stage_plan", "tensor_owners", "StagePlan", "PipelineSplit",
           "StageModule", "StageExit", "PipelineRunner", "SCHEDULES", "MULTI_STAGE", "check_schedule"]
