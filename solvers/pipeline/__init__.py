"""The pipeline as one program, plain data and JAX-free (DESIGN, "Emission and running").

In pass order: ``program`` (the IR: per stage, the ordered actions), ``schedules`` (pure generators of it:
GPipe, 1F1B, interleaved 1F1B, ZB-H1, fused 1F1B, ZB-V), ``lowering`` (the tail spread, buffer slots by interval
colouring, the tick tables a runtime indexes) and ``simulate`` (the one price: step time and memory per
stage, asynchronous or lockstep). Imports numpy and the standard library only, never JAX or ``autoshard``
(a test holds it to that), so a schedule is built, lowered and priced in microseconds.
"""

from solvers.pipeline.lowering import Exchange, Ticks, action_tables, exchanges, spread_times, ticks
from solvers.pipeline.program import KINDS, LOWERED_KINDS, Action, PipelineProgram, Schedule, SimResult
from solvers.pipeline.schedules import (
    SCHEDULE_NAMES,
    V_SCHEDULES,
    WEIGHT_PASS_SCHEDULES,
    chunk_inflight_rule,
    fused_1f1b,
    gpipe,
    inflight_rule,
    interleaved_1f1b,
    one_f_one_b,
    pack,
    schedule,
    zb_h1,
    zb_v,
)
from solvers.pipeline.simulate import MODES, Costs, Timing, simulate

__all__ = [
    "KINDS",
    "LOWERED_KINDS",
    "MODES",
    "SCHEDULE_NAMES",
    "V_SCHEDULES",
    "WEIGHT_PASS_SCHEDULES",
    "Action",
    "Costs",
    "Exchange",
    "PipelineProgram",
    "Schedule",
    "SimResult",
    "Ticks",
    "Timing",
    "action_tables",
    "chunk_inflight_rule",
    "exchanges",
    "fused_1f1b",
    "gpipe",
    "inflight_rule",
    "interleaved_1f1b",
    "one_f_one_b",
    "pack",
    "schedule",
    "simulate",
    "spread_times",
    "ticks",
    "zb_h1",
    "zb_v",
]
