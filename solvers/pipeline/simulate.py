"""One price for a pipeline: ``simulate(program, costs, mode)``, its step time and its memory per stage.

Pure (numpy, no JAX). Every place that needs a pipeline's time or the microbatches a stage holds asks here:
the stage planner (``autoshard.pipeline.stages``), the SPMD program's price (``autoshard.pipeline.ticks``),
the microbatch choice and ``PipelineProgram.simulate``. Alpa's closed form ``Σ_s t_s + (B − 1)·max_s t_s``
stays the stage DP's objective (``solvers.inter_op.pipeline_cost``), tied to this by a test where both apply.

Costs (``Costs``), per virtual stage ``u``: ``f_u``, ``b_u`` (the input gradient where the program has a
weight pass), ``w_u``; ``Costs.of_micro`` makes them from a microbatch's time ``t_u`` as the planner does:
``f = t/3``, ``b = 2t/3``, or ``b = w = t/3`` with a weight pass.

Modes
-----
``async``: each stage runs its order (``PipelineProgram.orders``) at its own pace, as the MPMD runtime
does: an action starts when its stage is free and its inputs have arrived, ``comm`` seconds after the
action that made them ends when that ran on another stage:

    start(a) = max(end(previous action of a's stage), max_{d ≺ a} end(d) + comm·[stage(d) ≠ stage(a)])
    loop     = max_a end(a)

``lockstep``: the program's slots are ticks that every stage runs together, as the SPMD program does: a
tick lasts as long as its slowest stage's work ``a(t, s)`` (the ``f``, ``b``, ``w`` it runs, plus
``tail / G`` at a spread tail's tick on each of the ``G`` stages that run its slices, ``Ticks.tail_stages``),
and every tick sends the stream up and its cotangent down (``x = Costs.exchange``, one message one way), a
tail tick also its ``G − 1`` slices out and back (``x_G = Costs.tail_exchange``):

    loop     = Σ_t max_s a(t, s) + T·2·x + (tail ticks)·2·(G − 1)·x_G

Both: the MPMD runtime's host issues the passes from Python, a serial resource beside the stages of
``Costs.host`` seconds a step (``autoshard.pipeline.host`` counts them); the devices cannot run ahead of it,
so the passes take ``max(loop, host)``; then the once-a-step work (reduce and update) of the slowest stage
and one program dispatch:

    step     = max(loop, host) + max_s update_s + dispatch

Lockstep is never faster than async on the same program and costs (each tick waits for its slowest stage;
the async timeline of the same orders can only start each action earlier), which the tests check.

Memory: ``Timing.inflight[s]``, the most microbatches (chunk-microbatches when interleaved) whose forward
ran on stage ``s`` and whose last pass (``B``, or ``W`` with a weight pass) has not; the activations a stage
holds are that many times a microbatch's (per chunk: ``inflight_by_chunk``). The order fixes them, so both
modes give the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from solvers.pipeline.lowering import Ticks, action_tables
from solvers.pipeline.program import Action, PipelineProgram

__all__ = ["MODES", "Costs", "Timing", "memory", "simulate"]

Mode = Literal["async", "lockstep"]
MODES: tuple[str, ...] = ("async", "lockstep")


@dataclass(frozen=True, slots=True, kw_only=True)
class Costs:
    """Seconds of a program's actions and resources (module doc). Times per virtual stage ``u = c·S + s``;
    ``update`` per physical stage (its chunks' once-a-step work summed)."""

    forward: Sequence[float]
    backward: Sequence[float]
    weight: Sequence[float] = ()
    comm: float = 0.0  # async: added to every dependency that crosses from one stage to another
    exchange: float = 0.0  # lockstep: one message one way, α + X/(n·β); a tick sends two
    tail: float = 0.0  # a spread tail's forward and backward for a whole microbatch
    tail_exchange: float = 0.0  # lockstep: one slice of a spread tail one way, α + X/(G·n·β)
    update: Sequence[float] = ()
    host: float = 0.0  # the MPMD runtime's host, issuing the step's passes (a serial resource)
    dispatch: float = 0.0

    @classmethod
    def of_micro(cls, micro_times: Sequence[float], *, weight_pass: bool, **rest: float | Sequence[float]) -> Costs:
        """Costs from each virtual stage's time a microbatch (forward and backward): ``f = t/3``, ``b = 2f``,
        or, with a weight pass, ``b = w = f`` (a backward costs two forwards; ZB-H1 splits it in halves)."""
        f = np.asarray(micro_times, np.float64) / 3.0
        b = f if weight_pass else 2.0 * f
        return cls(forward=tuple(f.tolist()), backward=tuple(b.tolist()),
                   weight=tuple(f.tolist()) if weight_pass else (), **rest)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Timing:
    """What ``simulate`` found: ``ticks`` (the program's slots), ``loop`` the stages' passes (module doc),
    of which ``exchange`` the lockstep exchanges, ``update``, ``host``, ``dispatch``, ``busy`` seconds per
    stage, the microbatches in flight per stage and per (stage, chunk), and, asked for, every action's
    start and end (async)."""

    mode: str
    ticks: int
    loop: float
    exchange: float
    update: float
    host: float
    dispatch: float
    busy: tuple[float, ...]
    inflight: tuple[int, ...]
    inflight_by_chunk: tuple[tuple[int, ...], ...]
    start: Mapping[Action, float] | None = field(default=None, repr=False)
    end: Mapping[Action, float] | None = field(default=None, repr=False)

    @property
    def passes(self) -> float:
        """The forward and backward passes with the host issuing them: ``max(loop, host)``."""
        return max(self.loop, self.host)

    @property
    def step(self) -> float:
        """A step's seconds: the passes, then the slowest stage's reduce and update, and a dispatch."""
        return self.passes + self.update + self.dispatch

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stages' time over the passes: ``1 − Σ busy / (S · loop)``, at least 0."""
        if self.loop <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy) / (len(self.busy) * self.loop))


def simulate(program: PipelineProgram | Ticks, costs: Costs, mode: Mode = "async", *, tail_split: int = 1,
             timeline: bool = False) -> Timing:
    """Price ``program`` on ``costs`` (module doc). ``lockstep`` takes the program or its lowered tick
    tables (``lowering.ticks``/``action_tables``, which carry the tail spread); a program is lowered here
    with the tail spread over ``tail_split`` stages. ``async`` takes the program (its orders); ``timeline``
    keeps every action's start and end."""
    if mode not in MODES:
        raise ValueError(f"simulate: mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "lockstep":
        tables = action_tables(program, tail_split) if isinstance(program, PipelineProgram) else program
        return _lockstep(tables, costs)
    if not isinstance(program, PipelineProgram):
        raise TypeError("simulate(..., 'async') runs each stage's order: pass the PipelineProgram, not its ticks")
    if tail_split > 1:
        raise ValueError("simulate(..., 'async'): the MPMD runtime keeps the tail on the last stage; a spread "
                         f"tail (tail_split={tail_split}) is the SPMD program's, price it 'lockstep'")
    return _async(program, costs, timeline)


def memory(program: PipelineProgram) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The microbatches ``program`` holds in flight at most, per stage and per (stage, chunk) (module doc,
    "Memory"): what ``simulate`` reports beside the time, without pricing it."""
    return _inflight_of_tables(action_tables(program), program.num_chunks)


def _check_lengths(name: str, V: int, S: int, weight_pass: bool, costs: Costs) -> None:
    for label, times in (("forward", costs.forward), ("backward", costs.backward),
                         *((("weight", costs.weight),) if weight_pass else ())):
        if len(times) != V:
            raise ValueError(
                f"program {name!r}: costs.{label} has {len(times)} entries, expected one per virtual stage "
                f"({V} = {S} stages x {V // S} chunks)" + ("; a weight pass needs costs.weight too"
                                                           if label == "weight" and not times else ""))


def _async(program: PipelineProgram, costs: Costs, timeline: bool) -> Timing:
    S, V, M = program.num_stages, program.num_virtual_stages, program.num_microbatches
    _check_lengths(program.name, V, S, program.weight_pass, costs)
    program.verify()
    t = action_tables(program)
    # A valid program puts every dependency, and every earlier action of the same stage, in an earlier slot
    # (fused: the stage's own forward first in the same one), so one pass over the ticks, a tick's forwards
    # before its backwards before its weight passes, sees each action's predecessors timed: vectorised over
    # the stages of a tick (GPT-1T's 128 stages x 1024 microbatches in a fraction of a second).
    # ``comm`` where a dependency crosses stages: the virtual stage before (after) runs on another stage,
    # but for chunks of one stage (S = 1) or a V's turn at the bottom
    place = np.array([program.place(x)[0] for x in range(V)])
    cross_in = np.zeros(V)
    cross_in[1:] = np.where(place[1:] != place[:-1], costs.comm, 0.0)  # F(u-1) → F(u)
    cross_out = np.zeros(V)
    cross_out[:-1] = np.where(place[:-1] != place[1:], costs.comm, 0.0)  # B(u+1) → B(u)
    f, b = np.asarray(costs.forward, np.float64), np.asarray(costs.backward, np.float64)
    w = np.asarray(costs.weight, np.float64) if program.weight_pass else b
    end = {k: np.zeros((V, M)) for k in ("forward", "backward", "weight")}
    begin = {k: np.zeros((V, M)) for k in end} if timeline else None
    free = np.zeros(S)
    busy = np.zeros(S)
    passes = [("forward", t.f_micro, t.f_chunk, f), ("backward", t.b_micro, t.b_chunk, b)]
    if program.weight_pass:
        passes.append(("weight", t.w_micro, t.w_chunk, w))
    for k in range(t.num_ticks):
        for kind, micro, chunk, dur in passes:
            s = np.flatnonzero(micro[k] >= 0)
            if not s.size:
                continue
            m = micro[k, s]
            u = t.virtual(chunk[k, s], s)
            ready = free[s]
            if kind == "forward":
                has = u > 0
                ready = np.where(has, np.maximum(ready, end["forward"][np.maximum(u - 1, 0), m] + cross_in[u]), ready)
            elif kind == "backward":
                ready = np.maximum(ready, end["forward"][u, m])
                has = u < V - 1
                ready = np.where(has, np.maximum(ready, end["backward"][np.minimum(u + 1, V - 1), m] + cross_out[u]),
                                 ready)
            else:
                ready = np.maximum(ready, end["backward"][u, m])
            stop = ready + dur[u]
            end[kind][u, m] = stop
            if begin is not None:
                begin[kind][u, m] = ready
            free[s] = stop
            np.add.at(busy, s, dur[u])
    loop = float(free.max()) if S else 0.0
    inflight, by_chunk = _inflight_of_tables(t, program.num_chunks)
    start = finish = None
    if begin is not None:
        start, finish = {}, {}
        for slot in program.slots:
            for a in slot:
                at = (a.virtual_stage(S, program.v_shape), a.microbatch)
                start[a], finish[a] = float(begin[a.kind][at]), float(end[a.kind][at])
    return Timing(mode="async", ticks=t.num_ticks, loop=loop, exchange=0.0,
                  update=float(max(costs.update, default=0.0)), host=costs.host, dispatch=costs.dispatch,
                  busy=tuple(busy.tolist()), inflight=inflight, inflight_by_chunk=by_chunk, start=start, end=finish)


def _lockstep(t: Ticks, costs: Costs) -> Timing:
    T, S = t.f_micro.shape
    V = len(costs.forward)
    _check_lengths("lockstep ticks", V, S, t.weight_pass, costs)
    f = np.asarray(costs.forward, np.float64)  # per virtual stage u = chunk·S + s
    b = np.asarray(costs.backward, np.float64)
    stage = np.arange(S)[None, :]
    per = (np.where(t.f_micro >= 0, f[t.virtual(t.f_chunk, stage)], 0.0)
           + np.where(t.b_micro >= 0, b[t.virtual(t.b_chunk, stage)], 0.0))
    if t.weight_pass:
        w = np.asarray(costs.weight, np.float64)
        per = per + np.where(t.w_micro >= 0, w[t.virtual(t.w_chunk, stage)], 0.0)
    exchange = T * 2.0 * costs.exchange
    if t.spread:
        G = t.tail_split
        on = (t.tail_micro >= 0)[:, None] & np.isin(np.arange(S), t.tail_stages())[None, :]
        per = per + np.where(on, costs.tail / G, 0.0)
        exchange += int((t.tail_micro >= 0).sum()) * 2.0 * (G - 1) * costs.tail_exchange
    loop = float(per.max(axis=1).sum()) + exchange
    inflight, by_chunk = _inflight_of_tables(t, V // S)
    return Timing(mode="lockstep", ticks=T, loop=loop, exchange=exchange,
                  update=float(max(costs.update, default=0.0)), host=costs.host, dispatch=costs.dispatch,
                  busy=tuple(per.sum(axis=0).tolist()), inflight=inflight, inflight_by_chunk=by_chunk)


def _inflight_of_tables(t: Ticks, chunks: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Peak microbatches in flight per stage and per (stage, chunk) from tick tables: after the forward of
    tick ``k`` a stage holds the forwards of ticks ``<= k`` less the last passes of ticks ``< k`` (a tick runs
    its forward before its backward, module doc of ``program``)."""
    last_micro, last_chunk = (t.w_micro, t.w_chunk) if t.weight_pass else (t.b_micro, t.b_chunk)

    def peak(f_on: np.ndarray, l_on: np.ndarray) -> np.ndarray:
        held = np.cumsum(f_on, axis=0) - np.cumsum(l_on, axis=0) + l_on  # less the last passes before tick k
        return np.where(f_on, held, 0).max(axis=0) if len(f_on) else np.zeros(f_on.shape[1], np.int64)

    f_on, l_on = t.f_micro >= 0, last_micro >= 0
    total = peak(f_on.astype(np.int64), l_on.astype(np.int64))
    per_chunk = np.stack([peak((f_on & (t.f_chunk == c)).astype(np.int64), (l_on & (last_chunk == c)).astype(np.int64))
                          for c in range(chunks)], axis=1)
    return tuple(int(x) for x in total), tuple(tuple(int(x) for x in row) for row in per_chunk)
