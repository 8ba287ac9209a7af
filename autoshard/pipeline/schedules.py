"""Pipeline schedules: they live in ``solvers.pipeline`` (the program, its generators, its price), JAX-free; this
module keeps the names the runtime and older callers import."""

from solvers.pipeline.program import Action, PipelineProgram, Schedule, SimResult
from solvers.pipeline.schedules import (
    SCHEDULE_NAMES,
    V_SCHEDULES,
    WEIGHT_PASS_SCHEDULES,
    chunk_inflight_rule,
    gpipe,
    inflight_rule,
    interleaved_1f1b,
    one_f_one_b,
    schedule,
    zb_h1,
)

__all__ = [
    "SCHEDULE_NAMES",
    "V_SCHEDULES",
    "WEIGHT_PASS_SCHEDULES",
    "Action",
    "PipelineProgram",
    "Schedule",
    "SimResult",
    "chunk_inflight_rule",
    "gpipe",
    "inflight_rule",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule",
    "zb_h1",
]
