"""Schedules as pure generators of a ``PipelineProgram`` (``solvers.pipeline.program``): each gives every
stage's order of actions, and ``pack`` lowers the orders into unit-time slots, the lockstep ticks.

The generators give each stage's order; the slots then come from list scheduling with unit times (``pack``):
at each slot, every stage starts its next action if that action's dependencies ran in earlier slots.
Fused 1F1B (``fused_1f1b``) is written as its ticks directly: a forward and a backward a tick.

Per-stage orders (``W_s`` = warm-up forwards of stage ``s``, ``r = S-1-s`` stages after it)
--------------------------------------------------------------------------------------------
- ``gpipe`` (Huang et al. 2019): ``F(s, 0..B-1)`` then ``B(s, 0..B-1)``. Peak in flight: ``B``.
- ``1f1b`` (PipeDream-Flush; Megatron-LM's non-interleaved schedule): ``W_s = min(r, B)`` forwards, then
  ``B - W_s`` pairs (one forward, one backward), then ``W_s`` backwards. Peak in flight: ``min(r+1, B)``.
- ``interleaved-1f1b`` (Narayanan et al. 2021 §2.2, Megatron-LM's interleaved schedule): stage ``s``
  runs ``v·B`` chunk-microbatch units. Its ``k``-th forward is microbatch ``(k // (S·v))·S + k mod S`` on
  chunk ``(k mod S·v) // S``; its ``k``-th backward is the same microbatch on chunk ``v-1-`` that chunk.
  ``W_s = min(2r + (v-1)·S, v·B)``, then the same warm-up / one-forward-one-backward / cool-down shape.
  Requires ``B mod S = 0``. Peak in flight: ``min(W_s + 1, v·B)`` chunk-microbatches, each holding the
  activations of one chunk (``1/v`` of the stage's layers).
- ``zb-h1`` (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3): 1F1B's warm-up, then ``F B W``
  per microbatch, then ``B W`` pairs; the ``W`` of the cool-down fill the slots where 1F1B waits for the
  next backward, and the backward chain between stages carries only ``B``. Peak in flight (until ``W``):
  ``min(r+1, B)``, as 1F1B.

- ``fused-1f1b`` (the SPMD program's fused ticks): stage ``s`` runs ``F(m)`` at tick ``m + s`` and ``B(m)``
  at tick ``m + 2(S-1) - s`` (``+ 2`` with a tail gap), a forward and a backward in one tick, so ``W_s =
  2r + 1`` and in the steady state every stage is busy with ``f + b`` each tick. Peak in flight:
  ``min(2r + 1, B)`` (``+ 2`` with a tail gap).

The bubble each schedule leaves: ``program``'s docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from solvers.pipeline.program import Action, Kind, PipelineProgram, _deps, _gap, _Key

__all__ = [
    "SCHEDULE_NAMES",
    "V_SCHEDULES",
    "WEIGHT_PASS_SCHEDULES",
    "chunk_inflight_rule",
    "fused_1f1b",
    "gpipe",
    "inflight_rule",
    "interleaved_1f1b",
    "one_f_one_b",
    "pack",
    "schedule",
    "zb_h1",
    "zb_v",
]

# ---------------------------------------------------------------------- builders


def _check_sizes(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    for field, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {field} must be a positive int, got {value!r}")


def _warmup_steady_cooldown(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then alternate one forward one backward, then the remaining backwards."""
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup :]


def pack(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int, orders: Sequence[Sequence[Action]],
    weight_pass: bool = False, tail_gap: int = 0,
) -> PipelineProgram:
    """Unit-time slots for the given per-stage orders: at each slot, every stage starts its next action if
    its dependencies ran in earlier slots (and, with ``tail_gap``, the last virtual stage's backward
    ``tail_gap`` slots after its forward; the stage idles meanwhile when its order has nothing else)."""
    V = num_stages * num_chunks
    done: dict[_Key, int] = {}  # key -> its slot
    nxt = [0] * num_stages
    slots: list[tuple[Action, ...]] = []
    remaining = sum(len(o) for o in orders)
    idle = 0  # slots in a row where no stage could start
    while remaining:
        started = []
        now = len(slots)
        for s, order in enumerate(orders):
            if nxt[s] < len(order):
                a = order[nxt[s]]
                key = (a.virtual_stage(num_stages), a.microbatch, a.kind)
                if all(d in done and done[d] + _gap(key, d, V, tail_gap) < now for d in _deps(key, V)):
                    started.append(a)
        idle = 0 if started else idle + 1
        if idle > tail_gap:  # a builder bug, not a user error (waiting out a tail gap is not one)
            raise AssertionError(f"{name}: per-stage orders deadlock at slot {len(slots)}")
        for a in started:
            done[(a.virtual_stage(num_stages), a.microbatch, a.kind)] = now
            nxt[a.stage] += 1
        remaining -= len(started)
        slots.append(tuple(started))
    return PipelineProgram(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        weight_pass=weight_pass,
        slots=tuple(slots),
        tail_gap=tail_gap,
    )


def gpipe(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> PipelineProgram:
    """GPipe: every stage runs all forwards, then all backwards (peak in flight ``B`` on every stage)."""
    _check_sizes("gpipe", num_stages, num_microbatches)
    orders = [
        [Action(s, m, "forward") for m in range(num_microbatches)]
        + [Action(s, m, "backward") for m in range(num_microbatches)]
        for s in range(num_stages)
    ]
    return pack("gpipe", num_stages, num_microbatches, 1, orders, tail_gap=tail_gap)


def one_f_one_b(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> PipelineProgram:
    """1F1B (PipeDream-Flush): ``min(S-1-s, B)`` warm-up forwards, then one forward one backward, then the
    cool-down backwards; stage ``s`` holds at most ``min(S-s, B)`` microbatches. A tail gap ``g`` delays
    every backward by ``g`` slots: ``g`` more warm-up forwards (and microbatches in flight) fill them."""
    _check_sizes("1f1b", num_stages, num_microbatches)
    orders = []
    for s in range(num_stages):
        fwd = [Action(s, m, "forward") for m in range(num_microbatches)]
        bwd = [Action(s, m, "backward") for m in range(num_microbatches)]
        orders.append(_warmup_steady_cooldown(fwd, bwd, min(num_stages - 1 - s + tail_gap, num_microbatches)))
    return pack("1f1b", num_stages, num_microbatches, 1, orders, tail_gap=tail_gap)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int, tail_gap: int = 0) -> PipelineProgram:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021 §2.2): each stage holds ``num_chunks`` model
    chunks and runs microbatches in groups of ``S``, chunk after chunk; see the module doc for the order."""
    name = "interleaved-1f1b"
    _check_sizes(name, num_stages, num_microbatches, num_chunks)
    S, B, v = num_stages, num_microbatches, num_chunks
    if v < 2:
        raise ValueError(f"{name}: num_chunks must be at least 2, got {v}; with one chunk use '1f1b'")
    if B % S:
        raise ValueError(
            f"{name}: num_microbatches ({B}) must be a multiple of num_stages ({S}), since microbatches run "
            f"in groups of {S}; try {B + (-B) % S} or {max(S, B - B % S)} microbatches"
        )
    units = v * B

    def unit(s: int, k: int, kind: Kind) -> Action:
        group, within = divmod(k, S * v)
        chunk = within // S
        if kind == "backward":
            chunk = v - 1 - chunk
        return Action(s, group * S + k % S, kind, chunk)

    orders = []
    for s in range(S):
        fwd = [unit(s, k, "forward") for k in range(units)]
        bwd = [unit(s, k, "backward") for k in range(units)]
        orders.append(_warmup_steady_cooldown(fwd, bwd, min(2 * (S - 1 - s) + (v - 1) * S + tail_gap, units)))
    return pack(name, S, B, v, orders, tail_gap=tail_gap)


def zb_h1(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> PipelineProgram:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3): 1F1B with every backward split
    into its input-gradient part ``B`` (what the stage before waits for) and its weight-gradient part
    ``W`` (needed by no other stage): the warm-up of 1F1B, then ``F B W`` per microbatch, then the
    cool-down ``B W`` pairs, where each ``W`` fills the slot 1F1B leaves idle waiting for the next
    ``B``. Peak in flight (forward run, ``W`` not yet): ``min(S-s, B)``, as 1F1B. With a tail gap the last
    stage runs ``F(m+1) W(m) B(m+1)``: the ``W`` fills the gap, one more slot in all, and only the last
    stage holds one more microbatch."""
    _check_sizes("zb-h1", num_stages, num_microbatches)
    orders = []
    for s in range(num_stages):
        if tail_gap and s == num_stages - 1:  # the tail runs elsewhere in the slot after F(m): W(m-1) fills it
            order = [Action(s, 0, "forward")] + ([Action(s, 0, "backward")] if num_microbatches > 1 else [])
            for m in range(1, num_microbatches):
                order += [Action(s, m, "forward"), Action(s, m - 1, "weight"), Action(s, m, "backward")]
            order += [Action(s, num_microbatches - 1, "backward")] if num_microbatches == 1 else []
            order += [Action(s, num_microbatches - 1, "weight")]
            orders.append(order)
            continue
        warm = min(num_stages - 1 - s, num_microbatches)
        order = [Action(s, m, "forward") for m in range(warm)]
        for i in range(num_microbatches - warm):
            order += [Action(s, warm + i, "forward"), Action(s, i, "backward"), Action(s, i, "weight")]
        for m in range(num_microbatches - warm, num_microbatches):
            order += [Action(s, m, "backward"), Action(s, m, "weight")]
        orders.append(order)
    return pack("zb-h1", num_stages, num_microbatches, 1, orders, weight_pass=True, tail_gap=tail_gap)


@functools.lru_cache(maxsize=16)
def fused_1f1b(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> PipelineProgram:
    """1F1B with a forward and a backward in every tick (``fused``): stage ``s`` runs ``F(m)`` at tick ``m + s``
    and ``B(m)`` at tick ``m + 2(S − 1) − s`` (the last stage both in one tick, the forward first), so
    ``T = M + 2S − 2`` ticks. It holds ``min(2(S − 1 − s) + 1, M)`` microbatches in flight: the price of not
    waiting, in lockstep, for a slower backward elsewhere (unit-slot 1F1B holds ``S − s`` but runs about
    ``2(M + S − 1)`` ticks of ``b``). With a tail gap every backward comes two ticks later (the tail runs in
    the tick between on other stages, and the forward a tick ahead of it waits as well): ``T = M + 2S``, two
    more in flight."""
    _check_sizes("fused-1f1b", num_stages, num_microbatches)
    S, M, d = num_stages, num_microbatches, 2 * int(tail_gap > 0)
    slots: list[tuple[Action, ...]] = []
    for k in range(M + 2 * S - 2 + d):
        slot: list[Action] = []
        for s in range(S):
            if 0 <= k - s < M:
                slot.append(Action(s, k - s, "forward"))
            if 0 <= (m := k - 2 * (S - 1) + s - d) < M:
                slot.append(Action(s, m, "backward"))
        slots.append(tuple(slot))
    return PipelineProgram(name="fused-1f1b", num_stages=S, num_microbatches=M, slots=tuple(slots),
                           tail_gap=int(tail_gap > 0), fused=True)


@functools.lru_cache(maxsize=16)
def zb_v(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> PipelineProgram:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", §4): two chunks a stage in a V
    (``v_shape``: chunk 0 of stage ``s`` is virtual stage ``s``, chunk 1 is ``2S − 1 − s``), every backward
    split into ``B`` and ``W`` (a weight pass), at most ``2S`` chunk-microbatches in flight a stage (until
    ``W``): 1F1B's activation memory, each chunk holding half a stage's layers.

    Built greedily in unit slots (each ``F``, ``B``, ``W`` one slot, about equal when a chunk is half a
    stage): at each slot every stage runs, of what its dependencies allow, its pending ``W`` (one at most
    waits), else a ``B`` (the oldest microbatch: it unblocks the stage before), else a forward while under
    ``2S`` in flight (chunk 1 first, the deeper one, which frees memory sooner), else idles. The V keeps the
    turn at the bottom on one stage, so the step idles about ``2(S − 1)`` slots of ``6B`` (ZB-H1 about
    ``4(S − 1)`` in these half-stage slots, 1F1B ``6(S − 1)``). Deferring ``W`` further, to fill more of the
    warm-up and cool-down, saves ``S − 1`` more slots (under 1% at ``B = 128``) but holds each deferred
    ``W``'s inputs (the block's inner gradients, which ``B`` leaves it, and the cotangent: buffers of their
    own in the SPMD program, ``lowering.ticks``) about ``1.4 S`` times at once, 23% of XLA's temp bytes over
    1F1B's on the tiny GPT, where one at a time keeps ZB-V at 1F1B's activation memory. A tail gap ``g``
    leaves ``g`` slots between the last virtual stage's forward and its backward (``B(2S − 1, m)``, on stage
    0: the layers after the blocks run meanwhile on other stages, ``lowering``), which stage 0 fills with
    whatever else it may run. Priced by ``simulate``; ``lowering.ticks`` lays it out for the SPMD program."""
    _check_sizes("zb-v", num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    V, cap = 2 * S, 2 * S
    done: dict[_Key, int] = {}
    live = [0] * S
    next_f = [[0, 0] for _ in range(S)]  # the next microbatch to run forward, per chunk
    next_b = [[0, 0] for _ in range(S)]  # the next to run backward: microbatches go back in order per chunk
    pending_w: list[list[Action]] = [[] for _ in range(S)]
    slots: list[tuple[Action, ...]] = []
    remaining = 3 * V * M
    idle = 0  # slots in a row where no stage could start
    while remaining:
        now = len(slots)

        def ran(key: _Key, now: int = now, gap: int = 0) -> bool:
            return key in done and done[key] + gap < now

        started: list[tuple[Action, _Key]] = []
        for s in range(S):
            us = (s, V - 1 - s)  # the stage's virtual stages, chunk 0 and chunk 1
            pick: tuple[Action, _Key] | None = None
            backs = [(next_b[s][c], c) for c in (1, 0) if next_b[s][c] < M
                     and ran((us[c], next_b[s][c], "forward"), gap=tail_gap if us[c] == V - 1 else 0)
                     and (us[c] == V - 1 or ran((us[c] + 1, next_b[s][c], "backward")))]
            m = next_f[s][1]
            turn = (tail_gap and s == 0 and pending_w[s] and m < M and live[s] < cap
                    and ran((V - 2, m, "forward"), gap=0))
            if turn:  # the tail's forward first: the pending W then fills its gap (as ZB-H1's last stage does)
                pick = Action(s, m, "forward", 1), (V - 1, m, "forward")
                next_f[s][1] += 1
            elif pending_w[s]:  # W's inputs wait in buffers of their own (``lowering``): one at a time
                a = pending_w[s].pop(0)
                pick = a, (us[a.chunk], a.microbatch, "weight")
            elif backs:
                m, c = min(backs)
                pick = Action(s, m, "backward", c), (us[c], m, "backward")
                next_b[s][c] += 1
            elif live[s] < cap:
                for c in (1, 0):
                    m = next_f[s][c]
                    if m < M and (us[c] == 0 or ran((us[c] - 1, m, "forward"))):
                        pick = Action(s, m, "forward", c), (us[c], m, "forward")
                        next_f[s][c] += 1
                        break
            if pick is not None:
                started.append(pick)
        idle = 0 if started else idle + 1
        if idle > tail_gap:  # a builder bug, not a user error (waiting out a tail gap is not one)
            raise AssertionError(f"zb-v: the greedy order deadlocks at slot {now} (S={S}, M={M})")
        for a, key in started:
            done[key] = now
            if a.kind == "forward":
                live[a.stage] += 1
            elif a.kind == "backward":
                pending_w[a.stage].append(Action(a.stage, a.microbatch, "weight", a.chunk))
            else:
                live[a.stage] -= 1
        remaining -= len(started)
        slots.append(tuple(a for a, _ in started))
    return PipelineProgram(name="zb-v", num_stages=S, num_microbatches=M, num_chunks=2, weight_pass=True,
                           slots=tuple(slots), v_shape=True, tail_gap=tail_gap)


_BUILDERS: Mapping[str, Callable[[int, int, int, int], PipelineProgram]] = {
    "gpipe": lambda S, B, v, g: gpipe(S, B, g),
    "1f1b": lambda S, B, v, g: one_f_one_b(S, B, g),
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": lambda S, B, v, g: zb_h1(S, B, g),
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BUILDERS)
WEIGHT_PASS_SCHEDULES = ("zb-h1",)  # the schedules whose backwards split into input- and weight-gradient passes
# the schedules in a V (two chunks a stage, a weight pass): the SPMD program runs them, the MPMD runtime not yet
V_SCHEDULES = ("zb-v",)


@functools.lru_cache(maxsize=16)
def schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1, tail_gap: int = 0,
             fused: bool = False) -> PipelineProgram:
    """Build the schedule called ``name`` (one of ``SCHEDULE_NAMES``); built once for the same arguments (a
    frozen value: the planner asks for GPT-1T's 128 stages x 1024 microbatches several times, 1.6 s each).
    ``tail_gap``: slots between the last virtual stage's forward and backward (module doc); ``fused``: 1F1B
    as its fused ticks (``fused_1f1b``), the SPMD program's other form of it."""
    if fused:
        if name != "1f1b":
            raise ValueError(f"only '1f1b' runs as fused ticks (a forward and a backward a tick), not {name!r}")
        return fused_1f1b(num_stages, num_microbatches, tail_gap)
    if name in V_SCHEDULES:
        if chunks != 2:
            raise ValueError(f"schedule {name!r} runs two model chunks a stage in a V; got chunks={chunks}")
        return zb_v(num_stages, num_microbatches, tail_gap)
    if name not in _BUILDERS:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of "
                         f"{', '.join((*SCHEDULE_NAMES, *V_SCHEDULES))}")
    if name != "interleaved-1f1b" and chunks != 1:
        raise ValueError(
            f"schedule {name!r} runs one model chunk per stage, got chunks={chunks}; "
            "use 'interleaved-1f1b' for several"
        )
    return _BUILDERS[name](num_stages, num_microbatches, chunks, tail_gap)


def inflight_rule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1,
                  tail_gap: int = 0) -> tuple[int, ...]:
    """Peak in-flight microbatches per stage, indexed from the end: entry ``r`` is the stage with ``r``
    stages after it. Read off the built schedule, so it matches it by construction (1F1B: ``min(r+1, B)``;
    GPipe: ``B``; interleaved: chunk-microbatches, each ``1/chunks`` of the stage's activations)."""
    return schedule(name, num_stages, num_microbatches, chunks, tail_gap).peak_inflight_all()[::-1]


def chunk_inflight_rule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1, tail_gap: int = 0,
                        ) -> tuple[tuple[int, ...], ...]:
    """``inflight_rule`` per model chunk: entry ``[r][c]`` is chunk ``c`` of the stage with ``r`` stages
    after it (``PipelineProgram.peak_inflight_by_chunk``)."""
    return schedule(name, num_stages, num_microbatches, chunks, tail_gap).peak_inflight_by_chunk_all()[::-1]
