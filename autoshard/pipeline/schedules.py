"""Pipeline schedules as pure data: which stage runs which microbatch's forward or backward, and when.

No JAX here (stdlib only), so every schedule is built, checked and timed in microseconds.

Model
-----
``S`` physical stages ``s = 0..S-1``, ``B`` microbatches ``m = 0..B-1``, ``v`` model chunks per stage
(``v = 1`` except for the interleaved schedule). Chunk ``c`` of stage ``s`` is the *virtual stage*

    u = c·S + s,        u = 0..V-1,   V = v·S,

so a microbatch goes forward through stages 0..S-1 holding chunk 0, then again holding chunk 1, and so on
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §2.2, fig. 4).

An action is ``F(u, m)`` or ``B(u, m)``. A schedule is valid when every microbatch has exactly one ``F`` and
one ``B`` at every virtual stage, no stage runs two actions at once, and

    F(u, m)   ≺  F(u+1, m)        activations flow forward
    B(u+1, m) ≺  B(u, m)          gradients flow backward
    F(u, m)   ≺  B(u, m)          a backward needs its own forward (at u = V-1 this turns the microbatch round)

where ``≺`` is "ends before the other starts". A schedule with a *tail gap* ``g`` (``tail_gap``) spreads the
layers after the last block over several stages (``spmd_program``): the stream leaves the last stage after
``F(V-1, m)``, the tail runs elsewhere during the next ``g`` slots, and its cotangent returns, so
``B(V-1, m)`` comes at least ``g + 1`` slots after ``F(V-1, m)``. ``Schedule.verify`` checks exactly these rules. A
schedule with a *weight pass* (``weight_pass``, ZB-H1) splits each backward into ``B(u, m)``, the input
gradient the rules above speak of, and ``W(u, m)``, the weight gradient, with ``B(u, m) ≺ W(u, m)`` and
nothing waiting on a ``W``.

Slots
-----
``Schedule.slots`` is the schedule drawn with unit times: every action, forward or backward, takes one
slot; ``slots[t]`` holds the actions that run during slot ``t``, at most one per physical stage, and ``≺``
is "in a strictly earlier slot". Real durations differ (a backward costs about twice a forward):
``Schedule.simulate`` replays the same per-stage order with any per-virtual-stage times. So the table fixes
the *order* each stage follows, and its slots are one valid timeline of that order.

The builders give each stage's order; the slots then come from list scheduling with unit times: at each
slot, every stage starts its next action if that action's dependencies ran in earlier slots.

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

Bubble
------
With a forward time ``f`` and a backward time ``b`` per action, GPipe and 1F1B take
``(B + S - 1)(f + b)``, so the idle fraction ``1 - Σ_s busy_s / (S · makespan)`` is ``(S-1)/(B+S-1)``.
The interleaved schedule, whose actions each cost ``1/v`` of a full stage, idles ``(S-1)/(v·B + S-1)``
(the paper's ``t_pb/t_id = (S-1)/(v·B)``, written as a fraction of the whole step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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
    "zb_h1",
]

Kind = Literal["forward", "backward", "weight"]
_KINDS = ("forward", "backward")
_WEIGHT_KINDS = ("forward", "backward", "weight")
_Key = tuple[int, int, str]  # (virtual stage, microbatch, kind)


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work: the forward or backward of ``microbatch`` on ``chunk`` of physical ``stage`` (or,
    in a schedule with a weight pass, the backward's input-gradient part ``backward`` and its
    weight-gradient part ``weight``)."""

    stage: int
    microbatch: int
    kind: Kind
    chunk: int = 0

    def virtual_stage(self, num_stages: int) -> int:
        return self.chunk * num_stages + self.stage

    def label(self, with_chunk: bool = False) -> str:
        """``F3`` / ``B3``; with ``with_chunk``, ``F3.1`` for chunk 1."""
        text = f"{self.kind[0].upper()}{self.microbatch}"
        return f"{text}.{self.chunk}" if with_chunk else text


@dataclass(frozen=True, slots=True)
class SimResult:
    """Timing of a schedule: when each action starts and ends, the step's makespan, busy time per stage."""

    makespan: float
    start: Mapping[Action, float]
    end: Mapping[Action, float]
    busy: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time over the step: ``1 - Σ busy / (S · makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A pipeline schedule: ``slots[t]`` = actions run during unit-time slot ``t`` (see the module doc)."""

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int = 1
    weight_pass: bool = False  # backwards split into input-gradient "backward" and weight-gradient "weight"
    slots: tuple[tuple[Action, ...], ...]
    tail_gap: int = 0  # slots between F(V-1, m) and B(V-1, m) where the tail runs on other stages

    @property
    def kinds(self) -> tuple[str, ...]:
        return _WEIGHT_KINDS if self.weight_pass else _KINDS

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def actions(self, stage: int) -> tuple[Action, ...]:
        """The actions of physical ``stage`` in execution order."""
        return tuple(a for slot in self.slots for a in slot if a.stage == stage)

    def _key(self, a: Action) -> _Key:
        return (a.virtual_stage(self.num_stages), a.microbatch, a.kind)

    # ------------------------------------------------------------------ checking

    def verify(self) -> None:
        """Raise ValueError naming every broken rule (module doc, "Model"); return None when valid."""
        S, B, v = self.num_stages, self.num_microbatches, self.num_chunks
        head = f"schedule {self.name!r} (stages={S}, microbatches={B}, chunks={v})"
        for field, value in (("num_stages", S), ("num_microbatches", B), ("num_chunks", v)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{head}: {field} must be a positive int, got {value!r}")
        problems: list[str] = []
        slot_of: dict[_Key, int] = {}
        for t, slot in enumerate(self.slots):
            busy: dict[int, Action] = {}
            for a in slot:
                if not isinstance(a, Action):
                    problems.append(f"slot {t} holds {a!r}, not an Action")
                    continue
                if a.kind not in self.kinds:
                    problems.append(f"slot {t}: {a} has kind {a.kind!r}; expected one of {self.kinds}")
                    continue
                ranges = (("stage", a.stage, S), ("microbatch", a.microbatch, B), ("chunk", a.chunk, v))
                out = [f"{n}={x} not in [0, {hi})" for n, x, hi in ranges if not 0 <= x < hi]
                if out:
                    problems.append(f"slot {t}: {a} is out of range ({', '.join(out)})")
                    continue
                if a.stage in busy:
                    problems.append(
                        f"slot {t}: stage {a.stage} runs two actions at once, "
                        f"{_describe(self._key(busy[a.stage]))} and {_describe(self._key(a))}; "
                        "move one to a later slot"
                    )
                busy[a.stage] = a
                key = self._key(a)
                if key in slot_of:
                    problems.append(
                        f"{_describe(key)} appears twice (slots {slot_of[key]} and {t}); each microbatch "
                        "passes every virtual stage exactly once each way"
                    )
                else:
                    slot_of[key] = t
        missing = [k for k in _all_keys(S * v, B, self.kinds) if k not in slot_of]
        if missing:
            shown = ", ".join(_describe(k) for k in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problems.append(
                f"missing {shown}{more}; each microbatch needs a forward and a backward (and a weight "
                "pass, where the schedule has one) on every virtual stage"
            )
        for key, t in slot_of.items():
            for dep in _deps(key, S * v):
                gap = _gap(key, dep, S * v, self.tail_gap)
                if dep in slot_of and slot_of[dep] + gap >= t:
                    after = f" and {gap} slot(s) for the tail" if gap else ""
                    problems.append(
                        f"{_describe(key)} in slot {t} must come after {_describe(dep)}{after}, which is in slot "
                        f"{slot_of[dep]}"
                    )
        if problems:
            shown = "\n  ".join(problems[:10])
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise ValueError(f"{head} is not a valid schedule:\n  {shown}{more}")

    # ------------------------------------------------------------------ measures

    def peak_inflight(self, stage: int) -> int:
        """Most microbatches (chunk-microbatches when interleaved) whose forward ran on ``stage`` and whose
        backward has not: the number of activation sets the stage holds at its worst moment."""
        return self.peak_inflight_all()[stage]

    def peak_inflight_all(self) -> tuple[int, ...]:
        """``peak_inflight`` of every stage, in one pass over the slots (a pass per stage took 24 s for
        GPT-1T's 128 stages x 1024 microbatches)."""
        live: list[set[tuple[int, int]]] = [set() for _ in range(self.num_stages)]
        peak = [0] * self.num_stages
        last = "weight" if self.weight_pass else "backward"  # the pass that frees the activations
        for slot in self.slots:
            for a in slot:
                if a.kind == "forward":
                    live[a.stage].add((a.chunk, a.microbatch))
                    peak[a.stage] = max(peak[a.stage], len(live[a.stage]))
                elif a.kind == last:
                    live[a.stage].discard((a.chunk, a.microbatch))
        return tuple(peak)

    def peak_inflight_by_chunk(self, stage: int) -> tuple[int, ...]:
        """Per model chunk of ``stage``, the most of its microbatches in flight at once. Their sum bounds
        ``peak_inflight`` from above (tightly for interleaved 1F1B: the last stage's second chunk holds
        one or two while its first holds ``S``), so a chunk's plan counts its own activations that many
        times, not the stage's total."""
        live = [0] * self.num_chunks
        peak = [0] * self.num_chunks
        last = "weight" if self.weight_pass else "backward"
        for a in self.actions(stage):
            if a.kind == "forward":
                live[a.chunk] += 1
                peak[a.chunk] = max(peak[a.chunk], live[a.chunk])
            elif a.kind == last:
                live[a.chunk] -= 1
        return tuple(peak)

    def simulate(
        self,
        forward_times: Sequence[float],
        backward_times: Sequence[float],
        comm_time: float = 0.0,
        weight_times: Sequence[float] | None = None,
    ) -> SimResult:
        """Event-simulate the schedule: each stage runs ``actions(stage)`` in order, each action starts once
        its stage is free and its inputs have arrived. Times are indexed by virtual stage; ``comm_time`` is
        added to every dependency that crosses from one physical stage to another; with a weight pass,
        ``backward_times`` are the input-gradient parts and ``weight_times`` the weight-gradient parts.
        Verifies first."""
        V = self.num_virtual_stages
        if self.weight_pass and weight_times is None:
            raise ValueError(f"schedule {self.name!r} splits each backward: pass weight_times too")
        durations = {"forward": forward_times, "backward": backward_times, "weight": weight_times or ()}
        for label, times in (("forward_times", forward_times), ("backward_times", backward_times),
                             *((("weight_times", weight_times or ()),) if self.weight_pass else ())):
            if len(times) != V:
                raise ValueError(
                    f"schedule {self.name!r}: {label} has {len(times)} entries, expected one per virtual "
                    f"stage ({V} = {self.num_stages} stages x {self.num_chunks} chunks)"
                )
        self.verify()
        # Valid slots put every dependency and every earlier action of the same stage in an earlier slot,
        # so one pass in slot order sees each action's predecessors already timed.
        start: dict[Action, float] = {}
        end: dict[Action, float] = {}
        done: dict[_Key, tuple[float, int]] = {}  # key -> (end time, physical stage)
        free = [0.0] * self.num_stages
        busy = [0.0] * self.num_stages
        for slot in self.slots:
            for a in slot:
                key = self._key(a)
                ready = free[a.stage]
                for dep in _deps(key, V):
                    dep_end, dep_stage = done[dep]
                    ready = max(ready, dep_end + (comm_time if dep_stage != a.stage else 0.0))
                duration = durations[a.kind][key[0]]
                start[a], end[a] = ready, ready + duration
                free[a.stage] = ready + duration
                done[key] = (ready + duration, a.stage)
                busy[a.stage] += duration
        makespan = max(end.values(), default=0.0)
        return SimResult(makespan=makespan, start=start, end=end, busy=tuple(busy))

    def bubble_fraction(self, fwd_time: float = 1.0, bwd_time: float = 2.0) -> float:
        """Idle share of the step with the same ``fwd_time``/``bwd_time`` for every action (with a weight
        pass, half of ``bwd_time`` is the input gradient and half the weight gradient)."""
        V = self.num_virtual_stages
        if self.weight_pass:
            half = [bwd_time / 2] * V
            return self.simulate([fwd_time] * V, half, weight_times=half).bubble_fraction
        return self.simulate([fwd_time] * V, [bwd_time] * V).bubble_fraction

    # ------------------------------------------------------------------ data

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "num_chunks": self.num_chunks,
            "weight_pass": self.weight_pass,
            "tail_gap": self.tail_gap,
            "slots": [
                [
                    {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind, "chunk": a.chunk}
                    for a in slot
                ]
                for slot in self.slots
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Inverse of ``to_dict`` (does not verify: call ``verify()``)."""
        return cls(
            name=str(data["name"]),
            num_stages=int(data["num_stages"]),
            num_microbatches=int(data["num_microbatches"]),
            num_chunks=int(data.get("num_chunks", 1)),
            weight_pass=bool(data.get("weight_pass", False)),
            tail_gap=int(data.get("tail_gap", 0)),
            slots=tuple(
                tuple(
                    Action(int(a["stage"]), int(a["microbatch"]), a["kind"], int(a.get("chunk", 0)))
                    for a in slot
                )
                for slot in data["slots"]
            ),
        )

    def __str__(self) -> str:
        with_chunk = self.num_chunks > 1
        grid = [["."] * len(self.slots) for _ in range(self.num_stages)]
        for t, slot in enumerate(self.slots):
            for a in slot:
                if 0 <= a.stage < self.num_stages:
                    grid[a.stage][t] = a.label(with_chunk)
        width = max((len(cell) for row in grid for cell in row), default=1)
        head = (
            f"{self.name}: {self.num_stages} stages, {self.num_microbatches} microbatches"
            + (f", {self.num_chunks} chunks" if with_chunk else "")
            + f", {len(self.slots)} slots"
        )
        rows = [f"stage {s}: " + " ".join(c.ljust(width) for c in row).rstrip() for s, row in enumerate(grid)]
        return "\n".join([head, *rows])


# ---------------------------------------------------------------------- dependencies


def _all_keys(num_virtual: int, num_microbatches: int, kinds: Sequence[str] = _KINDS) -> Iterable[_Key]:
    for m in range(num_microbatches):
        for kind in kinds:
            for u in range(num_virtual):
                yield (u, m, kind)


def _deps(key: _Key, num_virtual: int) -> tuple[_Key, ...]:
    """The actions that must end before ``key`` starts (module doc, "Model")."""
    u, m, kind = key
    if kind == "forward":
        return ((u - 1, m, "forward"),) if u > 0 else ()
    if kind == "weight":
        return ((u, m, "backward"),)
    if u == num_virtual - 1:
        return ((u, m, "forward"),)
    return ((u + 1, m, "backward"), (u, m, "forward"))


def _gap(key: _Key, dep: _Key, num_virtual: int, tail_gap: int) -> int:
    """Slots that must pass between ``dep`` and ``key`` besides ``≺``: ``tail_gap`` between the last virtual
    stage's forward and its backward (the tail runs on other stages meanwhile), else none."""
    if tail_gap and key[2] == "backward" and dep[2] == "forward" and key[0] == num_virtual - 1:
        return tail_gap
    return 0


def _describe(key: _Key) -> str:
    u, m, kind = key
    return f"{kind} of microbatch {m} at virtual stage {u}"


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


def _list_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int, orders: Sequence[Sequence[Action]],
    weight_pass: bool = False, tail_gap: int = 0,
) -> Schedule:
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
    return Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        weight_pass=weight_pass,
        slots=tuple(slots),
        tail_gap=tail_gap,
    )


def gpipe(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards (peak in flight ``B`` on every stage)."""
    _check_sizes("gpipe", num_stages, num_microbatches)
    orders = [
        [Action(s, m, "forward") for m in range(num_microbatches)]
        + [Action(s, m, "backward") for m in range(num_microbatches)]
        for s in range(num_stages)
    ]
    return _list_schedule("gpipe", num_stages, num_microbatches, 1, orders, tail_gap=tail_gap)


def one_f_one_b(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> Schedule:
    """1F1B (PipeDream-Flush): ``min(S-1-s, B)`` warm-up forwards, then one forward one backward, then the
    cool-down backwards; stage ``s`` holds at most ``min(S-s, B)`` microbatches. A tail gap ``g`` delays
    every backward by ``g`` slots: ``g`` more warm-up forwards (and microbatches in flight) fill them."""
    _check_sizes("1f1b", num_stages, num_microbatches)
    orders = []
    for s in range(num_stages):
        fwd = [Action(s, m, "forward") for m in range(num_microbatches)]
        bwd = [Action(s, m, "backward") for m in range(num_microbatches)]
        orders.append(_warmup_steady_cooldown(fwd, bwd, min(num_stages - 1 - s + tail_gap, num_microbatches)))
    return _list_schedule("1f1b", num_stages, num_microbatches, 1, orders, tail_gap=tail_gap)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int, tail_gap: int = 0) -> Schedule:
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
    return _list_schedule(name, S, B, v, orders, tail_gap=tail_gap)


def zb_h1(num_stages: int, num_microbatches: int, tail_gap: int = 0) -> Schedule:
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
    return _list_schedule("zb-h1", num_stages, num_microbatches, 1, orders, weight_pass=True, tail_gap=tail_gap)


_BUILDERS: Mapping[str, Callable[[int, int, int, int], Schedule]] = {
    "gpipe": lambda S, B, v, g: gpipe(S, B, g),
    "1f1b": lambda S, B, v, g: one_f_one_b(S, B, g),
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": lambda S, B, v, g: zb_h1(S, B, g),
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BUILDERS)
WEIGHT_PASS_SCHEDULES = ("zb-h1",)  # the schedules whose backwards split into input- and weight-gradient passes


@functools.lru_cache(maxsize=16)
def schedule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1, tail_gap: int = 0) -> Schedule:
    """Build the schedule called ``name`` (one of ``SCHEDULE_NAMES``); built once for the same arguments (a
    frozen value: the planner asks for GPT-1T's 128 stages x 1024 microbatches several times, 1.6 s each).
    ``tail_gap``: slots between the last virtual stage's forward and backward (module doc)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULE_NAMES)}")
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


def chunk_inflight_rule(name: str, num_stages: int, num_microbatches: int, chunks: int = 1,
                        ) -> tuple[tuple[int, ...], ...]:
    """``inflight_rule`` per model chunk: entry ``[r][c]`` is chunk ``c`` of the stage with ``r`` stages
    after it (``Schedule.peak_inflight_by_chunk``)."""
    sched = schedule(name, num_stages, num_microbatches, chunks)
    return tuple(sched.peak_inflight_by_chunk(num_stages - 1 - r) for r in range(num_stages))
