"""The SPMD pipeline's schedule as static tables, and what the program costs.

The tables and their price live in ``solvers.pipeline`` (``lowering.ticks``: a program's slots as tick tables
with buffer slots; ``simulate(..., "lockstep")``: their price); this module keeps the SPMD program's view of
them: which schedules it runs, its errors, and ``price`` as the program's call costs it (``SpmdTime``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autoshard.pipeline.partition import PipelineError
from solvers.pipeline import schedules as _schedules
from solvers.pipeline.lowering import Ticks, action_tables, spread_times, ticks
from solvers.pipeline.schedules import schedule
from solvers.pipeline.simulate import Costs, simulate

__all__ = ["DISPATCH_S", "SCHEDULES", "SpmdTime", "Ticks", "action_tables", "cannot_run", "fused_1f1b",
           "fused_inflight", "lockstep_costs", "lockstep_tables", "price", "spread_times", "ticks"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")  # what the SPMD program runs as such


def cannot_run(msg: str) -> PipelineError:
    """The error for a step the SPMD program cannot run: ``msg`` says why and what to change."""
    return PipelineError(f"the SPMD pipeline cannot run this step: {msg}")


def lockstep_tables(name: str, num_stages: int, num_microbatches: int, chunks: int = 1, *, fused: bool = False,
                    tail_split: int = 1) -> Ticks:
    """What ``price`` reads of the SPMD program's ticks for schedule ``name`` (``fused``: 1F1B's fused
    ticks, ``fused_1f1b``), the tail spread over ``tail_split`` stages (its gap in the schedule)."""
    return action_tables(schedule(name, num_stages, num_microbatches, chunks, tail_gap=int(tail_split > 1),
                                  fused=fused), tail_split)


def fused_1f1b(num_stages: int, num_microbatches: int, tail_split: int = 1) -> Ticks:
    """The tick tables of fused 1F1B (``solvers.pipeline.schedules.fused_1f1b``: a forward and a backward in
    every tick), the tail spread over ``tail_split`` stages (without the buffer slots: ``lockstep_tables``)."""
    return ticks(_schedules.fused_1f1b(num_stages, num_microbatches, tail_gap=int(tail_split > 1)), tail_split)


def fused_inflight(num_stages: int, num_microbatches: int, tail_split: int = 1) -> tuple[int, ...]:
    """Fused 1F1B's microbatches in flight per stage, indexed from the end (entry ``r``: the stage with ``r``
    stages after it, ``min(2r + 1, M)``, two more with a spread tail), read off its program as
    ``schedules.inflight_rule`` reads the others'."""
    program = _schedules.fused_1f1b(num_stages, num_microbatches, tail_gap=int(tail_split > 1))
    return program.peak_inflight_all()[::-1]


# ---- what the program costs ----------------------------------------------------------------------------

DISPATCH_S = 5e-5  # host seconds to launch one program when no profile measured it (``autoshard profile``)


@dataclasses.dataclass(frozen=True, slots=True)
class SpmdTime:
    """The predicted seconds of one call of the SPMD program (``price``)."""

    ticks: int
    loop: float  # the tick loop: Σ_t max_s action(t, s) + the exchange
    exchange: float  # of which: the two ppermutes per tick
    update: float  # once per step after the loop (the slowest stage's reduction and update)
    dispatch: float  # host: one program call

    @property
    def step(self) -> float:
        return self.loop + self.update + self.dispatch


def price(micro_times: Sequence[float], update_times: Sequence[float], t: Ticks, *, stream_bytes: float,
          link: Any, inner: int, dispatch: float = DISPATCH_S, tail: float = 0.0) -> SpmdTime:
    """The program as it runs: ``simulate(t, costs, "lockstep")`` (``solvers.pipeline.simulate``), its ticks in
    lockstep, each as long as its slowest stage's action, with

        f_u = micro_time_u / 3,  b_u = 2·f_u  (with a weight pass b_u = w_u = f_u)   per virtual stage u
        x   = α + X / (n·β)                   a tick's message each way (X = ``stream_bytes`` of one
                                              microbatch over the stage's n = ``inner`` devices, on ``link``)
        x_G = α + X / (G·n·β)                 a spread tail's slice each way (G = ``t.tail_split``)

    ``micro_time`` already holds receiving the stage's inputs; a spread tail's ``tail`` seconds (its forward
    and backward for a whole microbatch) are left out of the last virtual stage's. The step adds the
    slowest stage's ``update_times`` and one ``dispatch``. Against the MPMD runtime's asynchronous 1F1B,
    where each stage runs at its own pace, a stage doing a forward while another does a backward waits for
    it: the lockstep costs up to ``4/3`` of ``f + b`` per microbatch in the steady state, and idle ticks
    still exchange."""
    got = simulate(t, lockstep_costs(micro_times, update_times, t, stream_bytes=stream_bytes, link=link, inner=inner,
                                     dispatch=dispatch, tail=tail), "lockstep")
    return SpmdTime(ticks=got.ticks, loop=got.loop, exchange=got.exchange, update=got.update, dispatch=got.dispatch)


def lockstep_costs(micro_times: Sequence[float], update_times: Sequence[float], t: Ticks, *, stream_bytes: float,
                   link: Any, inner: int, dispatch: float = DISPATCH_S, tail: float = 0.0) -> Costs:
    """``simulate``'s costs of the SPMD program's ticks ``t`` (``price``'s arguments; its docstring)."""
    n = max(inner, 1)
    return Costs.of_micro(micro_times, weight_pass=t.weight_pass, update=tuple(update_times), dispatch=dispatch,
                          exchange=link.latency + stream_bytes / n / link.bandwidth, tail=tail,
                          tail_exchange=link.latency + stream_bytes / t.tail_split / n / link.bandwidth)
