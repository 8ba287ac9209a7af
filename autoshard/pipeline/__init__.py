"""Pipeline parallelism: schedules (pure data), partitioning the step, the stage planner, the runtime.

``schedules`` imports nothing but the standard library; the rest needs JAX.
"""

from autoshard.pipeline.partition import PipelineError
from autoshard.pipeline.planner import PipelinePlan, StagePlan, plan_pipeline
from autoshard.pipeline.runtime import PipelinedStep, build_pipelined_step
from autoshard.pipeline.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    SimResult,
    gpipe,
    inflight_rule,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
)
from autoshard.pipeline.spmd import spmd_pipeline

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "PipelineError",
    "PipelinePlan",
    "PipelinedStep",
    "Schedule",
    "SimResult",
    "StagePlan",
    "build_pipelined_step",
    "gpipe",
    "inflight_rule",
    "interleaved_1f1b",
    "one_f_one_b",
    "plan_pipeline",
    "schedule",
    "spmd_pipeline",
]
