"""The SPMD pipeline's schedule as static tables, and what the program costs: pure (numpy, no JAX).

``ticks(schedule)`` turns a schedule (``schedules.Schedule``: at most one action per stage per unit slot)
into the tables the SPMD program (``spmd_program``) indexes by ``[tick, stage]``: the action, its
microbatch, and the buffer slots it reads and writes. ``price`` gives the seconds the program takes on
given stage times: its ticks run in lockstep, each as long as its slowest stage's action.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from autoshard.pipeline.partition import PipelineError
from autoshard.pipeline.schedules import Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # what the SPMD program runs as such


def _fail(msg: str) -> PipelineError:
    return PipelineError(f"the SPMD pipeline cannot run this step: {msg}")


# ---- the tick tables --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Ticks:
    """A schedule as static tables indexed ``[tick, stage]``: the action (0 idle, 1 forward, 2 backward),
    its microbatch, and the buffer slots it reads and writes. ``*_recv``: the slot where the value that
    arrives at the end of the tick is stored (-1: nothing arrives)."""

    kind: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray  # the model chunk the action works on (interleaved schedules; else 0)
    act_read: np.ndarray
    act_recv: np.ndarray
    cot_read: np.ndarray
    cot_recv: np.ndarray
    cot_self: np.ndarray  # the last stage: slot for the tail's cotangent made during F
    res_slot: np.ndarray  # F: the slot written; B: the slot read
    act_slots: int
    cot_slots: int
    res_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.kind.shape[0])


def _colour(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for values alive from the end of tick ``w`` to tick ``r`` (read at ``r``): two values share
    a slot when one is read no later than the other is written."""
    free: list[tuple[int, int]] = []  # (tick the slot frees up, slot)
    slots: dict[Any, int] = {}
    n = 0
    for w, r, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        free.sort()
        if free and free[0][0] <= w:
            _, k = free.pop(0)
        else:
            k, n = n, n + 1
        slots[key] = k
        free.append((r, k))
    return slots, max(n, 1)


def ticks(sched: Schedule) -> Ticks:
    """The tables of ``sched`` (any chunk count; no weight pass): see ``Ticks``. Values are keyed by virtual
    stage ``u = chunk·S + s`` (``schedules``): the stream of ``F(u−1, m)`` arrives at stage ``u mod S`` (from
    the stage before it, round the ring from ``S−1`` to 0 between chunks) and waits there for ``F(u, m)``;
    the cotangent of ``B(u+1, m)`` waits for ``B(u, m)``; the last virtual stage makes its own (the tail's)
    during ``F``; residuals live from ``F(u, m)`` to ``B(u, m)``."""
    if sched.weight_pass:
        raise _fail(f"the {sched.name!r} schedule is not supported by the SPMD pipeline yet; use "
                    f"{' or '.join(SCHEDULES)}")
    S, T, M, V = sched.num_stages, len(sched.slots), sched.num_microbatches, sched.num_virtual_stages
    when: dict[tuple[str, int, int], int] = {}
    kind = np.zeros((T, S), np.int32)
    micro = np.zeros((T, S), np.int32)
    chunk = np.zeros((T, S), np.int32)
    for t, slot in enumerate(sched.slots):
        for a in slot:
            when[(a.kind, a.virtual_stage(S), a.microbatch)] = t
            kind[t, a.stage] = 1 if a.kind == "forward" else 2
            micro[t, a.stage], chunk[t, a.stage] = a.microbatch, a.chunk
    act_iv = [(when[("forward", u - 1, m)], when[("forward", u, m)], (u % S, u, m)) for u in range(1, V)
              for m in range(M)]
    cot_iv = [(when[("backward", u + 1, m)], when[("backward", u, m)], (u % S, u, m)) for u in range(V - 1)
              for m in range(M)]
    cot_iv += [(when[("forward", V - 1, m)], when[("backward", V - 1, m)], ((V - 1) % S, V - 1, m)) for m in range(M)]
    res_iv = [(when[("forward", u, m)], when[("backward", u, m)], (u % S, u, m)) for u in range(V) for m in range(M)]
    act_slot, n_act, cot_slot, n_cot, res_slot, n_res = (*_colour_per_stage(act_iv), *_colour_per_stage(cot_iv),
                                                         *_colour_per_stage(res_iv))
    neg = lambda: np.full((T, S), -1, np.int32)  # noqa: E731
    act_read, act_recv, cot_read, cot_recv, cot_self, res = neg(), neg(), neg(), neg(), neg(), neg()
    for (s, u, m), k in act_slot.items():
        act_read[when[("forward", u, m)], s] = k
        act_recv[when[("forward", u - 1, m)], s] = k
    for (s, u, m), k in cot_slot.items():
        cot_read[when[("backward", u, m)], s] = k
        if u == V - 1:
            cot_self[when[("forward", u, m)], s] = k
        else:
            cot_recv[when[("backward", u + 1, m)], s] = k
    for (s, u, m), k in res_slot.items():
        res[when[("forward", u, m)], s] = k
        res[when[("backward", u, m)], s] = k
    return Ticks(kind=kind, micro=micro, chunk=chunk, act_read=act_read, act_recv=act_recv, cot_read=cot_read,
                 cot_recv=cot_recv, cot_self=cot_self, res_slot=res, act_slots=n_act, cot_slots=n_cot,
                 res_slots=n_res)


def _colour_per_stage(intervals: list[tuple[int, int, tuple[int, int, int]]]
                      ) -> tuple[dict[tuple[int, int, int], int], int]:
    by_stage: dict[int, list[tuple[int, int, tuple[int, int, int]]]] = {}
    for iv in intervals:
        by_stage.setdefault(iv[2][0], []).append(iv)
    slots: dict[tuple[int, int, int], int] = {}
    n = 1
    for ivs in by_stage.values():
        got, k = _colour(ivs)
        slots.update(got)
        n = max(n, k)
    return slots, n


# ---- what the program costs (pure) ----------------------------------------------------------------------

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
          link: Any, inner: int, dispatch: float = DISPATCH_S) -> SpmdTime:
    """The program as it runs: ticks in lockstep, each as long as its slowest stage's action.

    With ``f_u = micro_time_u / 3`` and ``b_u = 2·micro_time_u / 3`` (per virtual stage ``u``) (a backward costs two forwards, the
    convention of ``schedules.Schedule.simulate``; ``micro_time`` already holds receiving the stage's
    inputs) and ``a(t, s)`` the action of stage ``s`` at tick ``t`` (``f_u``, ``b_u`` of the chunk it runs, or 0):

        loop     = Σ_t max_s a(t, s) + T · 2·(α + X / (n·β))     (every tick sends the stream up and its
                                                                   cotangent down, zeros when idle)
        step     = loop + max_s update_s + dispatch

    ``X`` = ``stream_bytes`` of one microbatch, split over the stage's ``n = inner`` devices, on ``link``
    (α latency, β bandwidth). Against the MPMD runtime's asynchronous 1F1B, where each stage runs at its
    own pace, a stage doing a forward while another does a backward waits for it: the lockstep costs up to
    ``4/3`` of ``f + b`` per microbatch in the steady state, and idle ticks still exchange."""
    T, S = t.kind.shape
    f = np.asarray(micro_times, np.float64) / 3.0  # per virtual stage u = chunk·S + s
    b = 2.0 * f
    u = t.chunk * S + np.arange(S)[None, :]
    per = np.where(t.kind == 1, f[u], np.where(t.kind == 2, b[u], 0.0))
    exchange = T * 2.0 * (link.latency + stream_bytes / max(inner, 1) / link.bandwidth)
    loop = float(per.max(axis=1).sum()) + exchange
    return SpmdTime(ticks=T, loop=loop, exchange=exchange, update=float(max(update_times, default=0.0)),
                    dispatch=dispatch)
