"""The pipeline as one program: per physical stage, the ordered actions it runs, as plain data.

The standard library and numpy only (no JAX, no ``autoshard``): a program is built, checked, lowered and
priced in milliseconds.
Everything that knows a schedule's order reads it from here; everything that knows its time or memory asks
``solvers.pipeline.simulate`` (the DESIGN's "one representation, everything derived from it").

Model
-----
``S`` physical stages ``s = 0..S-1``, ``B`` microbatches ``m = 0..B-1``, ``v`` model chunks per stage
(``v = 1`` except for the interleaved schedule). Chunk ``c`` of stage ``s`` is the *virtual stage*

    u = c·S + s,        u = 0..V-1,   V = v·S,

so a microbatch goes forward through stages 0..S-1 holding chunk 0, then again holding chunk 1, and so on
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §2.2, fig. 4).
A program in a *V* (``v_shape``, two chunks; ZB-V, Qi et al. 2024) runs chunk 1 back up instead: chunk 1 of
stage ``s`` is ``u = 2S − 1 − s``, so the first and the last virtual stage share stage 0 and the turn at
the bottom (``S − 1`` to ``S``) stays on stage ``S − 1`` (``PipelineProgram.place``).

An action is ``F(u, m)`` or ``B(u, m)``. A program is valid when every microbatch has exactly one ``F`` and
one ``B`` at every virtual stage, no stage runs two actions at once, and

    F(u, m)   ≺  F(u+1, m)        activations flow forward
    B(u+1, m) ≺  B(u, m)          gradients flow backward
    F(u, m)   ≺  B(u, m)          a backward needs its own forward (at u = V-1 this turns the microbatch round)

where ``≺`` is "ends before the other starts". A program with a *tail gap* ``g`` (``tail_gap``) spreads the
layers after the last block over several stages (``spmd_program``): the stream leaves the last stage after
``F(V-1, m)``, the tail runs elsewhere during the next ``g`` slots, and its cotangent returns, so
``B(V-1, m)`` comes at least ``g + 1`` slots after ``F(V-1, m)``. ``PipelineProgram.verify`` checks exactly
these rules. A program with a *weight pass* (``weight_pass``, ZB-H1) splits each backward into ``B(u, m)``,
the input gradient the rules above speak of, and ``W(u, m)``, the weight gradient, with ``B(u, m) ≺ W(u, m)``
and nothing waiting on a ``W``.

Action kinds
------------
``forward``, ``backward`` (the input gradient where there is a weight pass) and ``weight`` are what
schedules (``solvers.pipeline.schedules``) order. A *fused* forward+backward (1F1B's fused ticks, the SPMD
program's cheapest lockstep form) is not a kind of its own: it is a forward and a backward of one stage in
the same slot of a ``fused`` program, the forward first (so the last stage may turn a microbatch round
inside one slot). The lowering passes (``solvers.pipeline.lowering``) add what a runtime needs beside them: the
spread ``tail``, the exchanges (``send``/``recv``), the buffer slots, and the once-a-step ``reduce`` and
``update`` (``LOWERED_KINDS``).

Slots
-----
``PipelineProgram.slots`` is the program drawn with unit times: every action, forward or backward, takes one
slot; ``slots[t]`` holds the actions that run during slot ``t``, at most one per physical stage (a forward
and a backward when ``fused``), and ``≺`` is "in a strictly earlier slot" (or, fused, the stage's own
forward before its backward in one slot). Real durations differ (a backward costs about twice a forward):
``simulate(..., "async")`` replays the same per-stage order (``orders``) with any per-virtual-stage times;
``simulate(..., "lockstep")`` runs the slots as ticks, each as long as its slowest stage. So the table fixes
the *order* each stage follows, and its slots are one valid timeline of that order and the SPMD program's
ticks.

Bubble
------
With a forward time ``f`` and a backward time ``b`` per action, GPipe and 1F1B take
``(B + S - 1)(f + b)``, so the idle fraction ``1 - Σ_s busy_s / (S · makespan)`` is ``(S-1)/(B+S-1)``.
The interleaved schedule, whose actions each cost ``1/v`` of a full stage, idles ``(S-1)/(v·B + S-1)``
(the paper's ``t_pb/t_id = (S-1)/(v·B)``, written as a fraction of the whole step).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["KINDS", "LOWERED_KINDS", "Action", "PipelineProgram", "Schedule", "SimResult", "place"]

Kind = Literal["forward", "backward", "weight"]
KINDS: tuple[str, ...] = ("forward", "backward", "weight")  # what schedules order (module doc)
# what the lowering passes add beside them (``solvers.pipeline.lowering``; module doc, "Action kinds")
LOWERED_KINDS: tuple[str, ...] = ("tail", "send", "recv", "reduce", "update")
_KINDS = ("forward", "backward")


def place(u: int, num_stages: int, v_shape: bool = False) -> tuple[int, int]:
    """``(stage, chunk)`` of virtual stage ``u`` on ``num_stages`` stages: ``(u mod S, u div S)``, or in a V
    (``PipelineProgram.v_shape``, ZB-V) ``(2S − 1 − u, 1)`` for ``u >= S``; ``Action.virtual_stage`` inverts
    it. The one rule for the program, the plan (``PipelinePlan.place``) and the stage planner."""
    S = num_stages
    return (2 * S - 1 - u, 1) if v_shape and u >= S else (u % S, u // S)

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

    def virtual_stage(self, num_stages: int, v_shape: bool = False) -> int:
        """``u = chunk·S + stage``; in a V (``PipelineProgram.v_shape``) chunk 1 runs back up: ``2S − 1 − stage``."""
        return 2 * num_stages - 1 - self.stage if v_shape and self.chunk == 1 else self.chunk * num_stages + self.stage

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
class PipelineProgram:
    """A pipeline program: ``slots[t]`` = actions run during unit-time slot ``t``, each stage's in its order
    (``orders``); see the module doc. ``fused``: a stage may run a forward then a backward in one slot."""

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int = 1
    weight_pass: bool = False  # backwards split into input-gradient "backward" and weight-gradient "weight"
    slots: tuple[tuple[Action, ...], ...]
    tail_gap: int = 0  # slots between F(V-1, m) and B(V-1, m) where the tail runs on other stages
    fused: bool = False  # a forward and a backward of one stage share a slot (1F1B's fused ticks)
    v_shape: bool = False  # two chunks in a V: chunk 1 of stage s is virtual stage 2S-1-s (ZB-V; module doc)

    @property
    def kinds(self) -> tuple[str, ...]:
        return _WEIGHT_KINDS if self.weight_pass else _KINDS

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def place(self, u: int) -> tuple[int, int]:
        """``(stage, chunk)`` of virtual stage ``u`` (``place``)."""
        return place(u, self.num_stages, self.v_shape)

    def actions(self, stage: int) -> tuple[Action, ...]:
        """The actions of physical ``stage`` in execution order."""
        return tuple(a for slot in self.slots for a in slot if a.stage == stage)

    @property
    def orders(self) -> tuple[tuple[Action, ...], ...]:
        """Every stage's actions in execution order: the program without its slots, what an asynchronous
        runtime follows."""
        out: list[list[Action]] = [[] for _ in range(self.num_stages)]
        for slot in self.slots:
            for a in slot:
                out[a.stage].append(a)
        return tuple(tuple(o) for o in out)

    def _key(self, a: Action) -> _Key:
        return (a.virtual_stage(self.num_stages, self.v_shape), a.microbatch, a.kind)

    # ------------------------------------------------------------------ checking

    def verify(self) -> None:
        """Raise ValueError naming every broken rule (module doc, "Model"); return None when valid. The
        rules are checked on arrays first (GPT-1T's 128 stages x 1024 microbatches: a tenth of the
        per-action walk's seconds), and walked action by action to name what broke only when they fail."""
        if self._valid_by_arrays():
            return
        S, B, v = self.num_stages, self.num_microbatches, self.num_chunks
        head = f"schedule {self.name!r} (stages={S}, microbatches={B}, chunks={v})"
        for field, value in (("num_stages", S), ("num_microbatches", B), ("num_chunks", v)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{head}: {field} must be a positive int, got {value!r}")
        problems: list[str] = []
        if self.v_shape and v != 2:
            problems.append(f"a program in a V holds two chunks a stage, not {v}")
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
                if a.stage in busy and not (self.fused and busy[a.stage].kind == "forward"
                                            and a.kind == "backward"):
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
                # fused: the stage's own forward runs first in the slot, its backward may read it
                same = self.fused and not gap and dep[2] == "forward" and dep[0] == key[0]
                if dep in slot_of and slot_of[dep] + gap >= t + same:
                    after = f" and {gap} slot(s) for the tail" if gap else ""
                    problems.append(
                        f"{_describe(key)} in slot {t} must come after {_describe(dep)}{after}, which is in slot "
                        f"{slot_of[dep]}"
                    )
        if problems:
            shown = "\n  ".join(problems[:10])
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise ValueError(f"{head} is not a valid schedule:\n  {shown}{more}")

    def _valid_by_arrays(self) -> bool:
        """``verify``'s rules on arrays: True when all hold (False says only that one does not)."""
        S, B, v = self.num_stages, self.num_microbatches, self.num_chunks
        sizes = (S, B, v)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in sizes) or (
                self.v_shape and v != 2):
            return False
        code = {k: i for i, k in enumerate(self.kinds)}
        n = sum(len(slot) for slot in self.slots)
        try:  # (slot, place in the slot, stage, chunk, microbatch, kind) of every action
            rows = np.fromiter(itertools.chain.from_iterable(
                (t, i, a.stage, a.chunk, a.microbatch, code[a.kind])
                for t, slot in enumerate(self.slots) for i, a in enumerate(slot)), np.int64, count=6 * n)
        except (AttributeError, KeyError, TypeError, ValueError):
            return False
        V, K = S * v, len(code)
        if n != V * B * K:
            return False
        rows = rows.reshape(-1, 6)
        t, place, s, c, m, k = rows.T
        if not ((s >= 0) & (s < S) & (c >= 0) & (c < v) & (m >= 0) & (m < B)).all():
            return False
        u = np.where((c == 1) & self.v_shape, 2 * S - 1 - s, c * S + s)
        tick = np.full((K, V, B), -1, np.int64)
        where = np.full((K, V, B), -1, np.int64)
        tick[k, u, m], where[k, u, m] = t, place
        if (tick < 0).any():  # the count is right, so a missing action means another appears twice
            return False
        if (t < 0).any() or np.bincount((t * S + s) * K + k).max() > 1:  # (slot, stage, kind): once at most
            return False
        shared = np.bincount(t * S + s).max() > 1  # (slot, stage): once, or a forward then a backward fused
        if shared and not self.fused:
            return False
        if self.fused and K == 3:
            return False  # fused programs split no backward (the walk says so)
        F, Bk = tick[0], tick[1]
        if not (F[1:] > F[:-1]).all() or not (Bk[:-1] > Bk[1:]).all():
            return False
        gap = np.zeros(V, np.int64)
        gap[-1] = self.tail_gap
        after = Bk > F + gap[:, None]
        if self.fused:  # the stage's own forward first in the slot
            after |= (gap[:, None] == 0) & (Bk == F) & (where[1] > where[0])
        if not after.all():
            return False
        if shared:  # two actions of a stage in a slot: a forward, then a backward
            both = np.zeros((len(self.slots), S), np.int64)
            np.add.at(both, (t, s), 1)
            fwd = np.zeros((len(self.slots), S), bool)
            fwd[t[k == 0], s[k == 0]] = True
            if ((both > 1) & ~fwd).any():
                return False
            pos = np.full((2, len(self.slots), S), -1, np.int64)
            pos[k, t, s] = place
            if ((both > 1) & (pos[0] > pos[1])).any():
                return False
        return K < 3 or bool((tick[2] > Bk).all())

    # ------------------------------------------------------------------ measures

    def peak_inflight(self, stage: int) -> int:
        """Most microbatches (chunk-microbatches when interleaved) whose forward ran on ``stage`` and whose
        backward has not: the number of activation sets the stage holds at its worst moment."""
        return self.peak_inflight_all()[stage]

    def peak_inflight_all(self) -> tuple[int, ...]:
        """``peak_inflight`` of every stage: ``solvers.pipeline.simulate.memory``, the one count of it."""
        from solvers.pipeline.simulate import memory  # the simulator reads programs: imported on use

        return memory(self)[0]

    def peak_inflight_by_chunk(self, stage: int) -> tuple[int, ...]:
        """Per model chunk of ``stage``, the most of its microbatches in flight at once. Their sum bounds
        ``peak_inflight`` from above (tightly for interleaved 1F1B: the last stage's second chunk holds
        one or two while its first holds ``S``), so a chunk's plan counts its own activations that many
        times, not the stage's total. ``peak_inflight_by_chunk_all`` gives every stage's in one pass."""
        return self.peak_inflight_by_chunk_all()[stage]

    def peak_inflight_by_chunk_all(self) -> tuple[tuple[int, ...], ...]:
        """``peak_inflight_by_chunk`` of every stage (``solvers.pipeline.simulate.memory``)."""
        from solvers.pipeline.simulate import memory

        return memory(self)[1]

    def simulate(
        self,
        forward_times: Sequence[float],
        backward_times: Sequence[float],
        comm_time: float = 0.0,
        weight_times: Sequence[float] | None = None,
    ) -> SimResult:
        """``simulate(self, costs, "async")`` (``solvers.pipeline.simulate``) with its timeline: each stage runs
        ``actions(stage)`` in order, each action starts once its stage is free and its inputs have arrived.
        Times are indexed by virtual stage; ``comm_time`` is added to every dependency that crosses from one
        physical stage to another; with a weight pass, ``backward_times`` are the input-gradient parts and
        ``weight_times`` the weight-gradient parts. Verifies first."""
        V = self.num_virtual_stages
        if self.weight_pass and weight_times is None:
            raise ValueError(f"schedule {self.name!r} splits each backward: pass weight_times too")
        for label, times in (("forward_times", forward_times), ("backward_times", backward_times),
                             *((("weight_times", weight_times or ()),) if self.weight_pass else ())):
            if len(times) != V:
                raise ValueError(
                    f"schedule {self.name!r}: {label} has {len(times)} entries, expected one per virtual "
                    f"stage ({V} = {self.num_stages} stages x {self.num_chunks} chunks)"
                )
        from solvers.pipeline.simulate import Costs, simulate  # the simulator reads programs: imported on use

        costs = Costs(forward=tuple(forward_times), backward=tuple(backward_times),
                      weight=tuple(weight_times or ()), comm=comm_time)
        got = simulate(self, costs, "async", timeline=True)
        return SimResult(makespan=got.loop, start=got.start or {}, end=got.end or {}, busy=got.busy)

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
            "fused": self.fused,
            "v_shape": self.v_shape,
            "slots": [
                [
                    {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind, "chunk": a.chunk}
                    for a in slot
                ]
                for slot in self.slots
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineProgram:
        """Inverse of ``to_dict`` (does not verify: call ``verify()``)."""
        return cls(
            name=str(data["name"]),
            num_stages=int(data["num_stages"]),
            num_microbatches=int(data["num_microbatches"]),
            num_chunks=int(data.get("num_chunks", 1)),
            weight_pass=bool(data.get("weight_pass", False)),
            tail_gap=int(data.get("tail_gap", 0)),
            fused=bool(data.get("fused", False)),
            v_shape=bool(data.get("v_shape", False)),
            slots=tuple(
                tuple(
                    Action(int(a["stage"]), int(a["microbatch"]), a["kind"], int(a.get("chunk", 0)))
                    for a in slot
                )
                for slot in data["slots"]
            ),
        )

    def __str__(self) -> str:
        return self.draw()

    def draw(self, max_slots: int | None = None, max_stages: int | None = None) -> str:
        """The program as a grid, a row per stage and a column per slot (``F3``, ``B3``, ``W3``; ``F3.1`` on
        chunk 1; fused ``F3+B1``; ``.`` idle), under a line that names it. ``max_slots``: only the first that
        many slots (the warm-up and the start of the steady state), ``…`` marking the rest; ``max_stages``:
        only the first and the last stages, half of them each, ``⋮`` between."""
        with_chunk = self.num_chunks > 1
        T, S = len(self.slots), self.num_stages
        shown = T if max_slots is None else min(T, max_slots)
        rows_of = list(range(S)) if max_stages is None or max_stages >= S else [
            *range((max_stages + 1) // 2), *range(S - max_stages // 2, S)]
        grid = {s: ["."] * shown for s in rows_of}
        for t, slot in enumerate(self.slots[:shown]):
            for a in slot:
                if a.stage in grid:  # fused: "F3+B1"
                    cell = grid[a.stage][t]
                    grid[a.stage][t] = a.label(with_chunk) if cell == "." else f"{cell}+{a.label(with_chunk)}"
        width = max((len(cell) for row in grid.values() for cell in row), default=1)
        head = (
            f"{self.name}: {S} stages, {self.num_microbatches} microbatches"
            + (f", {self.num_chunks} chunks" if with_chunk else "")
            + f", {T} slots" + (f" (the first {shown} drawn)" if shown < T else "")
        )
        label = len(f"stage {S - 1}: ")
        lines = [head]
        for i, s in enumerate(rows_of):
            if i and rows_of[i - 1] != s - 1:
                lines.append("⋮".rjust(label - 2))
            cells = " ".join(c.ljust(width) for c in grid[s]) + (" …" if shown < T else "")
            lines.append(f"stage {s}: ".ljust(label) + cells.rstrip())
        return "\n".join(lines)


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


Schedule = PipelineProgram  # the name the code knew it by; a schedule is a program before lowering
