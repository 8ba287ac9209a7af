"""Pipeline parallelism, in pass order: ``partition`` (the step cut into per-microbatch and per-step parts,
layers), ``schedules`` (the schedules' names, from ``solvers.pipeline``), ``pipeline_plan`` (the plan as data),
``layer_prices`` (layers and stages priced by the intra-op planner), ``stages`` (the stage DP and the
stages planned whole), ``report`` (for a person), ``runtime`` (one program per stage, run in the schedule's
order) and ``spmd`` (the SPMD pipeline for identical stages).

The pipeline program itself, its schedules, lowering and price live in ``solvers.pipeline``, beside the
stage DP, which imports no JAX; everything here needs JAX.
"""

from autoshard.pipeline.partition import PipelineError, microbatch_args, trace_microbatch
from autoshard.pipeline.pipeline_plan import PipelinePlan, PipelineReport, StagePlan
from autoshard.pipeline.report import explain_pipeline, format_pipeline_plan
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
from autoshard.pipeline.stages import plan_pipeline

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "PipelineError",
    "PipelinePlan",
    "PipelineReport",
    "PipelinedStep",
    "Schedule",
    "SimResult",
    "StagePlan",
    "build_pipelined_step",
    "explain_pipeline",
    "format_pipeline_plan",
    "gpipe",
    "inflight_rule",
    "interleaved_1f1b",
    "microbatch_args",
    "one_f_one_b",
    "plan_pipeline",
    "schedule",
    "spmd_pipeline",
    "trace_microbatch",
]
