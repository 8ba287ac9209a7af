"""Pipeline parallelism: schedules (pure data, no JAX)."""

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

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "SimResult",
    "gpipe",
    "inflight_rule",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule",
]
