"""Lowering passes: a ``PipelineProgram`` made into what a runtime indexes. Pure (numpy, no JAX).

- **Packing into lockstep ticks**: ``solvers.pipeline.schedules.pack`` (list scheduling of the stages' orders
  into unit slots); a program's slots are the SPMD program's ticks.
- **Buffer slots** (``ticks``): every value that waits on a stage (the stream of ``F(u−1, m)`` for
  ``F(u, m)``, the cotangent of ``B(u+1, m)`` for ``B(u, m)``, the residuals from ``F`` to ``B`` or ``W``,
  what ``B`` leaves ``W``) is an interval of ticks; an interval colouring (``_colour``: greedy by start, the
  slot that frees earliest) gives each one a buffer slot, and the count of colours is the buffer's size.
- **The tail spread** (``tail_split > 1``): the layers after the last block run, a slice of the
  microbatch's rows each, on ``G`` stages (the last ``G``; in a V, whose last virtual stage is stage 0, the
  first ``G``: ``Ticks.tail_stages``) in the tick after the last virtual stage's forward
  (``Ticks.tail_micro``), which the program's tail gap leaves free.
- **Exchanges** (``exchanges``): every value a stage makes for another (the stream of ``F(u−1, m)``, the
  cotangent of ``B(u+1, m)``) as a send after the slot that makes it and a receive before the slot that
  reads it; the SPMD program exchanges on every tick (zeros when idle), a tail tick also its slices out
  and back (``G − 1`` each way), and ``solvers.pipeline.simulate`` prices that per tick (lockstep) or per
  crossing dependency (async).

A program in a V (ZB-V) lays out too: each value is received from the side it comes from (chunk 0's stream
from below, chunk 1's from above, the cotangents the other way), the turn's stay on stage ``S − 1``, and
a stage sends at most one value each way a tick (``Ticks.act_recv_down``).

``ticks(program)`` gives the tables the SPMD program (``autoshard.pipeline.spmd_program``) indexes by
``[tick, stage]``: the action, its microbatch, and the buffer slots it reads and writes; ``action_tables``
the same without the buffer slots (what pricing reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from solvers.pipeline.program import PipelineProgram

__all__ = ["Exchange", "Ticks", "action_tables", "exchanges", "spread_times", "ticks"]


@dataclasses.dataclass(frozen=True, slots=True)
class Ticks:
    """A schedule as static tables indexed ``[tick, stage]``. Each tick a stage runs at most one forward
    (``f_micro >= 0``: its microbatch, ``f_chunk`` its model chunk), then at most one backward (``b_micro``,
    ``b_chunk``), then exchanges. The slots: ``act_read`` the stream slot the forward reads, ``res_write``
    the residual slot it fills, ``cot_self`` the cotangent slot the last virtual stage's forward fills (the
    tail's); ``res_read`` / ``cot_read`` what the backward reads; ``*_recv``: where the value arriving at
    the end of the tick is stored (-1: nothing arrives)."""

    f_micro: np.ndarray
    f_chunk: np.ndarray
    b_micro: np.ndarray
    b_chunk: np.ndarray
    act_read: np.ndarray
    act_recv: np.ndarray
    cot_read: np.ndarray
    cot_recv: np.ndarray
    cot_self: np.ndarray
    res_write: np.ndarray
    res_read: np.ndarray
    act_slots: int
    cot_slots: int
    res_slots: int
    fused: bool = False  # a forward and a backward in the same tick (``schedules.fused_1f1b``)
    # a weight pass (ZB-H1): ``w_micro``/``w_chunk`` the weight-gradient action ``W`` a stage runs after its
    # backward ``B`` (then only the input gradient); ``W`` reads its residuals (``w_res``), its cotangent
    # (``w_cot``) and what ``B`` left it (``g_write`` at ``B``, ``g_read`` at ``W``, ``g_slots`` of them)
    w_micro: np.ndarray | None = None
    w_chunk: np.ndarray | None = None
    w_res: np.ndarray | None = None
    w_cot: np.ndarray | None = None
    g_write: np.ndarray | None = None
    g_read: np.ndarray | None = None
    g_slots: int = 1
    # a spread tail (``tail_split`` stages run the layers after the blocks, a slice of the microbatch's rows
    # each): ``tail_micro[t]`` the microbatch whose tail runs at tick ``t`` (the tick after the last virtual
    # stage's forward, whose stream leaves at the end of it), ``tail_cot[t]`` the cotangent slot of the last
    # stage where the slices' cotangents, back at the end of tick ``t``, are stored; indexed by tick alone
    # (the same on every stage, so the exchanges around it run on every stage or none)
    tail_micro: np.ndarray | None = None
    tail_cot: np.ndarray | None = None
    tail_split: int = 1
    v_shape: bool = False  # chunk 1 of stage s is virtual stage 2S-1-s (``PipelineProgram.v_shape``)
    # in a V a stage hears from both neighbours: ``act_recv`` / ``cot_recv`` stay what arrives from the stage
    # below (sent up) and from the one above (sent down), and chunk 1's values come the other way:
    # ``act_recv_down`` its stream from above, ``cot_recv_up`` its cotangent from below; at the turn (stage
    # S-1) chunk 0's stream and chunk 1's cotangent stay on the stage, kept at the end of the tick that makes
    # them in ``act_turn`` / ``cot_turn``. A stage sends at most one value each way a tick (``ticks`` checks),
    # so one message each way carries either
    act_recv_down: np.ndarray | None = None
    cot_recv_up: np.ndarray | None = None
    act_turn: np.ndarray | None = None
    cot_turn: np.ndarray | None = None

    def virtual(self, chunk: np.ndarray, stage: np.ndarray) -> np.ndarray:
        """The virtual stage of each ``(chunk, stage)``: ``chunk·S + stage``, or in a V ``2S − 1 − stage`` for
        chunk 1."""
        S = self.f_micro.shape[1]
        if self.v_shape:
            return np.where(chunk == 1, 2 * S - 1 - stage, chunk * S + stage)
        return chunk * S + stage

    @property
    def weight_pass(self) -> bool:
        return self.w_micro is not None

    @property
    def spread(self) -> bool:
        return self.tail_micro is not None

    @property
    def num_ticks(self) -> int:
        return int(self.f_micro.shape[0])

    def tail_stages(self) -> range:
        """The stages a spread tail's slices run on, slice ``g`` on the ``g``-th: the ``G`` (``tail_split``)
        stages ending with the last virtual stage's, ``S − G .. S − 1``, or in a V, where that is stage 0,
        ``0 .. G − 1``."""
        S, G = self.f_micro.shape[1], self.tail_split
        return range(0, G) if self.v_shape else range(S - G, S)

    def res_slots_at(self, stage: int) -> int:
        """Residual slots stage ``stage`` uses: the microbatches it holds in flight at most."""
        used = set(self.res_write[:, stage][self.res_write[:, stage] >= 0].tolist())
        return len(used)


def _colour(intervals: list[tuple[int, int, Any]], strict: bool) -> tuple[dict[Any, int], int]:
    """Slots for values alive from tick ``w`` to tick ``r`` (read at ``r``): a value may take the slot of one
    read at tick ``r'`` when ``w >= r'`` (written at the end of its tick, after the read), or ``w > r'`` with
    ``strict`` (written during its tick by a forward, which runs before that tick's backward reads)."""
    free: list[tuple[int, int]] = []  # (tick the slot frees up, slot)
    slots: dict[Any, int] = {}
    n = 0
    for w, r, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        free.sort()
        if free and (free[0][0] < w if strict else free[0][0] <= w):
            _, k = free.pop(0)
        else:
            k, n = n, n + 1
        slots[key] = k
        free.append((r, k))
    return slots, max(n, 1)


def _tables(S: int, T: int, V: int, M: int, fwd: dict[tuple[int, int], tuple[int, int]],
            bwd: dict[tuple[int, int], tuple[int, int]], fused: bool,
            wgt: dict[tuple[int, int], tuple[int, int]] | None = None, tail_split: int = 1,
            v_shape: bool = False) -> Ticks:
    """Tables from when each action runs: ``fwd[(u, m)] = (tick, stage)``, ``bwd`` and ``wgt`` (a weight
    pass) likewise. With a weight pass the residuals and the received cotangent live until ``W``. With
    ``tail_split > 1`` the tail of microbatch ``m`` runs at tick ``fwd[(V-1, m)] + 1`` on other stages and
    its cotangent reaches the last stage at the end of that tick (the schedule leaves the gap). ``v_shape``:
    virtual stage ``u``'s place is the V's (``PipelineProgram.place``) and each value is received from the
    side it comes from (``Ticks.act_recv_down`` and the rest)."""
    def place(u: int) -> tuple[int, int]:  # (stage, chunk), as PipelineProgram.place
        return (2 * S - 1 - u, 1) if v_shape and u >= S else (u % S, u // S)

    def way(u_from: int, u_to: int) -> str:
        """How a value of ``u_from`` reaches ``u_to``'s stage: on the ring (not a V: ``up`` for the stream,
        ``down`` for the cotangent, as always), or in a V from below (``up``), above (``down``) or itself."""
        a, b = place(u_from)[0], place(u_to)[0]
        if not v_shape:
            return "up" if u_to > u_from else "down"
        return "turn" if a == b else "up" if b == a + 1 else "down"

    last = wgt if wgt else bwd  # the action that reads a microbatch's residuals and cotangent last
    f_micro, f_chunk, b_micro, b_chunk = (np.full((T, S), -1, np.int32), np.zeros((T, S), np.int32),
                                          np.full((T, S), -1, np.int32), np.zeros((T, S), np.int32))
    for (u, m), (t, s) in fwd.items():
        f_micro[t, s], f_chunk[t, s] = m, place(u)[1]
    for (u, m), (t, s) in bwd.items():
        b_micro[t, s], b_chunk[t, s] = m, place(u)[1]
    st = lambda u: place(u)[0]  # noqa: E731
    act_iv = [(fwd[(u - 1, m)][0], fwd[(u, m)][0], (st(u), u, m)) for u in range(1, V) for m in range(M)]
    cot_iv = [(bwd[(u + 1, m)][0], last[(u, m)][0], (st(u), u, m)) for u in range(V - 1) for m in range(M)]
    spread = tail_split > 1
    self_iv = [(fwd[(V - 1, m)][0] + spread, last[(V - 1, m)][0], (st(V - 1), V - 1, m)) for m in range(M)]
    res_iv = [(fwd[(u, m)][0], last[(u, m)][0], (st(u), u, m)) for u in range(V) for m in range(M)]
    act_slot, n_act = _colour_per_stage(act_iv, strict=False)
    cot_slot, n_cot = _colour_per_stage(cot_iv + self_iv, strict=fused)  # the last stage's: made and read in F, B
    res_slot, n_res = _colour_per_stage(res_iv, strict=True)
    neg = lambda: np.full((T, S), -1, np.int32)  # noqa: E731
    act_read, cot_read, cot_self, res_w, res_r = neg(), neg(), neg(), neg(), neg()
    recv = {(kind, w): neg() for kind in ("act", "cot") for w in ("up", "down", "turn")}

    def receive(kind: str, w: str, t: int, s: int, k: int, what: str) -> None:
        table = recv[(kind, w)]
        if table[t, s] >= 0:  # a builder bug: two values for one slot table at once
            raise AssertionError(f"two {kind} values reach stage {s} {w} at the end of tick {t} ({what})")
        table[t, s] = k

    for (s, u, m), k in act_slot.items():
        act_read[fwd[(u, m)][0], s] = k
        receive("act", way(u - 1, u), fwd[(u - 1, m)][0], s, k, f"the stream into F({u}, {m})")
    tail_micro, tail_cot = (np.full(T, -1, np.int32), np.full(T, -1, np.int32)) if spread else (None, None)
    for (s, u, m), k in cot_slot.items():
        cot_read[bwd[(u, m)][0], s] = k
        if u == V - 1 and spread:
            t_tail = fwd[(u, m)][0] + 1
            if not t_tail < bwd[(u, m)][0]:
                raise ValueError(f"a spread tail needs a tick between the last stage's forward and backward of "
                                 f"microbatch {m}; build the schedule with tail_gap=1")
            tail_micro[t_tail], tail_cot[t_tail] = m, k
        elif u == V - 1:
            cot_self[fwd[(u, m)][0], s] = k
        else:
            receive("cot", way(u + 1, u), bwd[(u + 1, m)][0], s, k, f"the cotangent into B({u}, {m})")
    for (s, u, m), k in res_slot.items():
        res_w[fwd[(u, m)][0], s] = k
        res_r[bwd[(u, m)][0], s] = k
    sides: dict[str, Any] = {}
    if v_shape:
        # one message each way a tick: what arrives from below is a stream or a cotangent, never both
        for a, b in (("up", "up"), ("down", "down")):
            both = (recv[("act", a)] >= 0) & (recv[("cot", b)] >= 0)
            if both.any():
                t, s = (int(i) for i in np.argwhere(both)[0])
                raise ValueError(f"in a V, stage {s} would receive a stream and a cotangent from one neighbour at "
                                 f"the end of tick {t}; the SPMD program sends one value each way a tick")
        sides = dict(act_recv_down=recv[("act", "down")], cot_recv_up=recv[("cot", "up")],
                     act_turn=recv[("act", "turn")], cot_turn=recv[("cot", "turn")])
    weight: dict[str, Any] = {}
    if wgt:
        w_micro, w_chunk, w_res, w_cot, g_w, g_r = (neg(), np.zeros((T, S), np.int32), neg(), neg(), neg(), neg())
        g_slot, n_g = _colour_per_stage([(bwd[(u, m)][0], wgt[(u, m)][0], (st(u), u, m))
                                         for u in range(V) for m in range(M)], strict=True)
        for (u, m), (t, s) in wgt.items():
            w_micro[t, s], w_chunk[t, s] = m, place(u)[1]
            w_res[t, s] = res_slot[(s, u, m)]
            w_cot[t, s] = cot_slot[(s, u, m)]
            g_w[bwd[(u, m)][0], s] = g_r[t, s] = g_slot[(s, u, m)]
        weight = dict(w_micro=w_micro, w_chunk=w_chunk, w_res=w_res, w_cot=w_cot, g_write=g_w, g_read=g_r,
                      g_slots=n_g)
    return Ticks(f_micro=f_micro, f_chunk=f_chunk, b_micro=b_micro, b_chunk=b_chunk, act_read=act_read,
                 act_recv=recv[("act", "up")], cot_read=cot_read, cot_recv=recv[("cot", "down")], cot_self=cot_self,
                 res_write=res_w, res_read=res_r, act_slots=n_act, cot_slots=n_cot, res_slots=n_res, fused=fused,
                 tail_micro=tail_micro, tail_cot=tail_cot, tail_split=tail_split, v_shape=v_shape, **sides, **weight)


def ticks(sched: PipelineProgram, tail_split: int = 1) -> Ticks:
    """The tables of ``sched`` (any chunk count, with or without a weight pass), one action per stage per
    tick (its unit slots). Values are keyed by virtual stage ``u = chunk·S + s`` (``schedules``): the stream
    of ``F(u−1, m)`` arrives at stage ``u mod S`` (from the stage before it, round the ring from ``S−1`` to 0
    between chunks) and waits there for ``F(u, m)``; the cotangent of ``B(u+1, m)`` waits for ``B(u, m)``;
    the last virtual stage makes its own (the tail's) during ``F``; residuals live from ``F(u, m)`` to
    ``B(u, m)``, or to ``W(u, m)`` with a weight pass (ZB-H1), which also keeps the cotangent and what ``B``
    computed for ``W`` (the gradients of the block's inner values) until then. ``tail_split > 1``: the tail
    is spread over that many stages (``_tables``; ``sched`` needs ``tail_gap >= 1``).

    In a V (``sched.v_shape``, ZB-V) chunk 0's stream comes from the stage below and chunk 1's from the stage
    above, the cotangents the other way, and the turn's (``F(S−1) → F(S)``, ``B(S) → B(S−1)``, both on stage
    ``S − 1``) stay on the stage: each has its own receive table (``Ticks.act_recv_down`` and the rest),
    and a stage sends at most one value each way a tick, which ``_tables`` checks. A spread tail runs in a V
    too: the last virtual stage sits on stage 0, beside the head, and its tail's slices on stages ``0..G−1``
    (``Ticks.tail_stages``)."""
    S, M, V = sched.num_stages, sched.num_microbatches, sched.num_virtual_stages
    _check_gap(sched, tail_split)
    acts: dict[str, dict[tuple[int, int], tuple[int, int]]] = {"forward": {}, "backward": {}, "weight": {}}
    for t, slot in enumerate(sched.slots):
        for a in slot:
            acts[a.kind][(a.virtual_stage(S, sched.v_shape), a.microbatch)] = (t, a.stage)
    return _tables(S, len(sched.slots), V, M, acts["forward"], acts["backward"], fused=sched.fused,
                   wgt=acts["weight"] or None, tail_split=tail_split, v_shape=sched.v_shape)


def _check_gap(sched: PipelineProgram, tail_split: int) -> None:
    if tail_split > 1 and sched.tail_gap < 1:
        raise ValueError(f"a tail spread over {tail_split} stages needs a schedule built with tail_gap=1")


def _actions_only(f_micro: np.ndarray, f_chunk: np.ndarray, b_micro: np.ndarray, b_chunk: np.ndarray,
                  tail_micro: np.ndarray | None, tail_split: int, fused: bool = False,
                  w_micro: np.ndarray | None = None, w_chunk: np.ndarray | None = None, v_shape: bool = False) -> Ticks:
    """``Ticks`` of the given actions with every buffer slot left at -1 (one slot each): what ``simulate``
    reads, for ``action_tables``."""
    T = f_micro.shape[0]
    neg = np.full(f_micro.shape, -1, np.int32)
    weight: dict[str, Any] = {}
    if w_micro is not None:
        weight = dict(w_micro=w_micro, w_chunk=w_chunk, w_res=neg, w_cot=neg, g_write=neg, g_read=neg)
    return Ticks(f_micro=f_micro, f_chunk=f_chunk, b_micro=b_micro, b_chunk=b_chunk, act_read=neg, act_recv=neg,
                 cot_read=neg, cot_recv=neg, cot_self=neg, res_write=neg, res_read=neg, act_slots=1, cot_slots=1,
                 res_slots=1, fused=fused, tail_micro=tail_micro,
                 tail_cot=None if tail_micro is None else np.full(T, -1, np.int32), tail_split=tail_split, v_shape=v_shape,
                 **weight)


def action_tables(sched: PipelineProgram, tail_split: int = 1) -> Ticks:
    """What ``simulate`` reads of ``ticks(sched, tail_split)`` (each tick's actions, the spread tail's ticks),
    without the buffer slots (left at -1, one slot each): a fifth of the time for GPT-1T's 128 stages x
    1024 microbatches, which the planner prices in several forms."""
    S, T, V = sched.num_stages, len(sched.slots), sched.num_virtual_stages
    _check_gap(sched, tail_split)
    tables = {k: np.full((T, S), -1, np.int32) for k in ("forward", "backward", "weight")}
    chunk = {k: np.zeros((T, S), np.int32) for k in tables}
    tail_micro = np.full(T, -1, np.int32) if tail_split > 1 else None
    last = sched.place(V - 1)[::-1]  # (chunk, stage)
    for t, slot in enumerate(sched.slots):
        for a in slot:
            tables[a.kind][t, a.stage] = a.microbatch
            chunk[a.kind][t, a.stage] = a.chunk
            if tail_micro is not None and a.kind == "forward" and (a.chunk, a.stage) == last:
                tail_micro[t + 1] = a.microbatch
    weight = sched.weight_pass
    return _actions_only(tables["forward"], chunk["forward"], tables["backward"], chunk["backward"], tail_micro,
                         tail_split, fused=sched.fused, v_shape=sched.v_shape, w_micro=tables["weight"] if weight else None,
                         w_chunk=chunk["weight"] if weight else None)


def spread_times(times: Sequence[float], tail: float, tail_split: int) -> list[float]:
    """The (virtual) stages' times as the tick loop runs them: with the tail spread (``tail_split > 1``) the
    last one's less the tail's ``tail`` seconds, which ``simulate`` puts in the tail's ticks."""
    return [*times[:-1], max(times[-1] - tail, 0.0)] if tail_split > 1 else list(times)


def _colour_per_stage(intervals: list[tuple[int, int, tuple[int, int, int]]], strict: bool
                      ) -> tuple[dict[tuple[int, int, int], int], int]:
    by_stage: dict[int, list[tuple[int, int, tuple[int, int, int]]]] = {}
    for iv in intervals:
        by_stage.setdefault(iv[2][0], []).append(iv)
    slots: dict[tuple[int, int, int], int] = {}
    n = 1
    for ivs in by_stage.values():
        got, k = _colour(ivs, strict)
        slots.update(got)
        n = max(n, k)
    return slots, n


@dataclasses.dataclass(frozen=True, slots=True)
class Exchange:
    """One value sent between stages: the ``stream`` into ``F(virtual_stage, microbatch)`` or the
    ``cotangent`` into ``B(virtual_stage, microbatch)``, sent by stage ``src`` at the end of slot ``sent``
    and received by stage ``dst`` before slot ``needed``."""

    value: str
    virtual_stage: int
    microbatch: int
    src: int
    dst: int
    sent: int
    needed: int


def exchanges(program: PipelineProgram) -> tuple[Exchange, ...]:
    """The sends and receives ``program`` needs: every dependency between virtual stages that run on two
    different stages (the V's turn and one stage's chunks on ``S = 1`` stay put), in slot order."""
    S, V = program.num_stages, program.num_virtual_stages
    slot_of = {}
    for t, slot in enumerate(program.slots):
        for a in slot:
            slot_of[(a.virtual_stage(S, program.v_shape), a.microbatch, a.kind)] = t
    out = []
    for m in range(program.num_microbatches):
        for u in range(V):
            here = program.place(u)[0]
            if u > 0 and (there := program.place(u - 1)[0]) != here:
                out.append(Exchange("stream", u, m, there, here, slot_of[(u - 1, m, "forward")],
                                    slot_of[(u, m, "forward")]))
            if u < V - 1 and (there := program.place(u + 1)[0]) != here:
                out.append(Exchange("cotangent", u, m, there, here, slot_of[(u + 1, m, "backward")],
                                    slot_of[(u, m, "backward")]))
    return tuple(sorted(out, key=lambda e: (e.sent, e.src, e.value)))
