"""How plans differ: ``diff_plans`` and ``compare``, the automatic plan beside hand-written layouts.

``diff_plans(a, b)`` lists the inputs whose layout changed (folded by parameter class), how many of the
other tensors the solver placed changed layout (when both plans are of the same step), and the time and
memory deltas by category. A plan's diff with itself is empty.

``price_layout(graph, cost, layout)`` prices a hand-written layout (``planner.layouts``): it holds those
inputs at their layouts (every other strategy of their nodes costs +inf) and lets the intra-operator ILP
place everything else. The result is the *best completion* of the hand layout, a ``Plan`` with the same
time and memory breakdown as an automatic plan. That favours the hand layout (a person writing it would
not find a better completion than the solver), so when the automatic plan still wins, the win is the
layouts' and not the completion's. Against a memory budget a
hand layout that does not fit is reported infeasible, naming the moment of the step where memory
overflows and what is live there; its time is then that of the best completion without the budget.

``compare(graph, cost)`` plans the step automatically and prices every layout of ``layouts.grid`` (or the
``layouts`` given) with the same cost model and budget, then tabulates step time, memory per device,
whether it fits, and each layout's time as a multiple of the automatic plan's (``x auto`` > 1: the
automatic plan is faster).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from autoshard.planner.explain import memory_breakdown
from autoshard.planner.layouts import HandLayout, grid
from autoshard.planner.plan import Plan, PlanError, decode_choice
from autoshard.planner.planning import ProblemCache, plan_graph
from autoshard.planner.readback import memory_at_peak
from autoshard.planner.recompute import plan_recomputing
from autoshard.planner.shares import SHARES
from autoshard.planner.summary import fold_layer_indices, human_time, input_class
from autoshard.trace import remat
from autoshard.trace.graph import Graph
from autoshard.trace.summary import human_bytes
from cost_models import CostModel

_RTOL = 1e-9


def _differs(a: float, b: float) -> bool:
    return not math.isclose(a, b, rel_tol=_RTOL, abs_tol=1e-15)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanDiff:
    """What changes from plan ``a`` to plan ``b``; ``empty`` when nothing does."""

    mesh: tuple[str, str] | None  # set when the meshes differ
    layouts: tuple[tuple[str, str, str], ...]  # inputs whose layout changed: (name, in a, in b)
    intermediates_changed: int  # tensors the solver placed (inputs too) whose layout changed; same step only
    intermediates_compared: int
    step_time: tuple[float, float]
    time: tuple[tuple[str, float, float], ...]  # categories whose time changed: (category, a, b)
    peak_memory: tuple[float, float]
    memory: tuple[tuple[str, float, float], ...]  # memory rows that changed
    classes: Mapping[str, str] = dataclasses.field(default_factory=dict)  # input name -> its class (``input_class``)

    @property
    def empty(self) -> bool:
        return (self.mesh is None and not self.layouts and not self.intermediates_changed and not self.time
                and not self.memory and not _differs(*self.step_time) and not _differs(*self.peak_memory))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self, *, max_rows: int = 40) -> str:
        if self.empty:
            return "the plans are the same: same layouts, same predicted time and memory"
        a, b = self.step_time
        lines = [f"step time {human_time(a)} -> {human_time(b)} ({_signed_us(b - a)}, {_ratio(b, a)})",
                 f"peak memory per device {human_bytes(self.peak_memory[0])} -> {human_bytes(self.peak_memory[1])}"]
        if self.mesh:
            lines.append(f"mesh {self.mesh[0]} -> {self.mesh[1]}")
        if self.time:
            lines += ["", "time by category"]
            for k, x, y in self.time:
                label = "(of which resharding)" if k == "resharding" else k
                lines.append(f"  {label:<28} {human_time(x):>11} -> {human_time(y):>11}  {_signed_us(y - x):>12}")
        if self.memory:
            lines += ["", "memory per device"]
            for k, x, y in self.memory:
                lines.append(f"  {k:<28} {human_bytes(x):>11} -> {human_bytes(y):>11}")
        if self.layouts:
            folded: dict[tuple[str, str, str], int] = defaultdict(int)
            for name, x, y in self.layouts:
                folded[(self.classes.get(name) or fold_layer_indices(name), x, y)] += 1
            lines += ["", f"input layouts that changed ({len(self.layouts)} tensors, layer indices folded)"]
            for (name, x, y), n in list(folded.items())[:max_rows]:
                lines.append(f"  {name:<56} {x} -> {y}" + (f"  x{n}" if n > 1 else ""))
            if len(folded) > max_rows:
                lines.append(f"  ... {len(folded) - max_rows} more classes")
        if self.intermediates_compared:
            lines.append(f"\nof the {self.intermediates_compared} tensors the solver placed, "
                         f"{self.intermediates_changed} changed layout")
        return "\n".join(lines)

    __str__ = text


def _signed_us(dt: float) -> str:
    return ("+" if dt >= 0 else "-") + human_time(abs(dt))


def _ratio(b: float, a: float) -> str:
    return f"x{b / a:.3f}" if a > 0 else "-"


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """See the module docstring."""
    mesh = None if a.mesh == b.mesh else (str(a.mesh), str(b.mesh))
    spec_a = {t.name: str(t.spec) for t in a.inputs}
    spec_b = {t.name: str(t.spec) for t in b.inputs}
    layouts = tuple((n, spec_a.get(n, "-"), spec_b.get(n, "-")) for n in dict.fromkeys([*spec_a, *spec_b])
                    if spec_a.get(n) != spec_b.get(n))
    changed = compared = 0
    if list(spec_a) == list(spec_b):  # the same step: tensor ids mean the same tensors
        for scope, table in a.specs.items():
            other = b.specs.get(scope, {})
            for tid, spec in table.items():
                if tid in other:
                    compared += 1
                    changed += spec != other[tid]
    keys = sorted(set(a.time_breakdown) | set(b.time_breakdown))
    time = tuple((k, float(a.time_breakdown.get(k, 0.0)), float(b.time_breakdown.get(k, 0.0))) for k in keys
                 if _differs(a.time_breakdown.get(k, 0.0), b.time_breakdown.get(k, 0.0)))
    ma, mb = memory_breakdown(a), memory_breakdown(b)
    memory = tuple((k, ma[k], mb[k]) for k in ma if _differs(ma[k], mb[k]))
    return PlanDiff(mesh=mesh, layouts=layouts, intermediates_changed=changed, intermediates_compared=compared,
                    classes={t.name: input_class(t) for t in sorted((*a.inputs, *b.inputs), key=lambda t: bool(t.group))},
                    step_time=(a.predicted_step_time, b.predicted_step_time), time=time,
                    peak_memory=(a.peak_memory, b.peak_memory), memory=memory)


# ---- auto versus hand-written ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PricedLayout:
    """A hand layout's best completion. ``plan`` is planned within the budget when ``feasible``, else
    without it (its time is what the layout would cost given the memory); ``reason`` says what overflows."""

    layout: HandLayout
    plan: Plan
    feasible: bool
    reason: str = ""

    @property
    def step_time(self) -> float:
        return self.plan.predicted_step_time

    @property
    def peak_memory(self) -> float:
        return self.plan.peak_memory


def price_layout(graph: Graph, cost: CostModel, layout: HandLayout, *, hardware: str = "",
                 memory_budget: float | None = None, time_budget_s: float = 30.0,
                 problems: ProblemCache | None = None) -> PricedLayout:
    """The best completion of ``layout`` (see the module docstring), checked against ``memory_budget``."""
    problems = problems if problems is not None else ProblemCache(graph)
    kw = dict(hardware=hardware, time_budget_s=time_budget_s, fixed=layout.specs, problems=problems)
    try:
        plan = plan_graph(graph, cost, memory_budget=memory_budget, **kw)  # type: ignore[arg-type]
    except PlanError:
        if memory_budget is None:
            raise
        why = "no completion fits (proven)"
        plan = plan_graph(graph, cost, memory_budget=None, **kw)  # type: ignore[arg-type]
    else:
        if memory_budget is None or plan.peak_memory <= memory_budget * (1 + 1e-9):
            return PricedLayout(layout=layout, plan=plan, feasible=True)
        why = "the solver found no completion within the budget in its time"
    built = problems.get(cost, None)
    peak, at, live = memory_at_peak(built, decode_choice(plan.solver.choice))
    where = graph.ops[at].where() if 0 <= at < len(graph.ops) else f"step {at}"
    largest = "; ".join(f"{n} {human_bytes(b)}" for n, b in live)
    reason = (f"{why}: the best completion needs {human_bytes(peak)} per device, over the "
              f"{human_bytes(memory_budget)} budget, at {where}; largest there: {largest}")
    return PricedLayout(layout=layout, plan=plan, feasible=False, reason=reason)



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CompareRow:
    name: str
    step_time: float
    peak_memory: float
    feasible: bool
    ratio: float  # step time / the automatic plan's
    note: str = ""


SEEDED = "auto + grid starts"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """``auto``: the automatic plan; ``seeded``: the automatic plan again, its solve started from the best
    of ``auto`` and the hand layouts' completions (``plan_graph(starts=...)``); ``priced``: the hand layouts."""

    auto: Plan
    priced: tuple[PricedLayout, ...]
    memory_budget: float | None
    seeded: Plan | None = None

    @property
    def rows(self) -> tuple[CompareRow, ...]:
        t = self.auto.predicted_step_time
        rows = [CompareRow(name="auto", step_time=t, peak_memory=self.auto.peak_memory, feasible=True, ratio=1.0,
                           note=self.auto.solver.status)]
        if self.seeded is not None:
            s = self.seeded
            rows.append(CompareRow(name=SEEDED, step_time=s.predicted_step_time, peak_memory=s.peak_memory,
                                   feasible=True, ratio=s.predicted_step_time / t if t > 0 else math.inf,
                                   note="the automatic plan's solve started from the best of the plans above "
                                        f"and below ({s.solver.status})"))
        for p in self.priced:
            rows.append(CompareRow(name=p.layout.name, step_time=p.step_time, peak_memory=p.peak_memory,
                                   feasible=p.feasible, ratio=p.step_time / t if t > 0 else math.inf,
                                   note=p.reason or p.layout.description))
        return tuple(rows)

    @property
    def best_hand(self) -> PricedLayout | None:
        """The fastest hand layout that fits the budget."""
        fits = [p for p in self.priced if p.feasible]
        return min(fits, key=lambda p: p.step_time) if fits else None

    @property
    def auto_vs_best(self) -> float | None:
        """The automatic plan's time over the best feasible hand layout's (<= 1: auto is at least as fast)."""
        best = self.best_hand
        return None if best is None else self.auto.predicted_step_time / best.step_time

    @property
    def seeded_vs_best(self) -> float | None:
        """As ``auto_vs_best`` for the plan solved from the grid's starts."""
        best = self.best_hand
        if best is None or self.seeded is None:
            return None
        return self.seeded.predicted_step_time / best.step_time

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": str(self.auto.mesh), "memory_budget": self.memory_budget,
                "rows": [dataclasses.asdict(r) for r in self.rows], "auto_vs_best": self.auto_vs_best,
                "seeded_vs_best": self.seeded_vs_best,
                "best_hand": None if self.best_hand is None else self.best_hand.layout.name}

    def text(self, *, notes: bool = True) -> str:
        budget = human_bytes(self.memory_budget) if self.memory_budget else "none"
        lines = [f"mesh {self.auto.mesh}   hardware {self.auto.hardware or '?'}   memory budget {budget}"]
        if self.auto.recompute:
            lines.append(f"recompute: {recompute_note(self.auto)} (every row is priced on the step recomputing so)")
        lines += ["", f"  {'layout':<24}{'step time':>12}{'x auto':>9}{'memory/device':>15}  fits"]
        best = self.best_hand
        for r in self.rows:
            mark = " *" if best is not None and r.name == best.layout.name else ""
            lines.append(f"  {r.name + mark:<24}{human_time(r.step_time):>12}{r.ratio:>9.3f}{human_bytes(r.peak_memory):>15}"
                         f"  {'yes' if r.feasible else 'NO'}")
        if best is None:
            lines.append("\nno hand layout fits the budget")
        else:
            ratio = self.auto_vs_best or 0.0
            verdict = "auto is at least as fast" if ratio <= 1 + 1e-9 else "AUTO LOSES to this layout"
            lines.append(f"\n* best hand layout: {best.layout.name}; auto / best = {ratio:.3f} ({verdict})")
            if self.seeded_vs_best is not None:
                lines.append(f"  {SEEDED} / best = {self.seeded_vs_best:.3f}")
        if notes:
            lines.append("")
            for r in self.rows[1:]:
                lines.append(f"  {r.name}: {r.note}")
        return "\n".join(lines)

    __str__ = text


def compare(graph: Graph, cost: CostModel, *, layouts: Sequence[HandLayout] | None = None, hardware: str = "",
            memory_budget: float | None = None, time_budget_s: float = 30.0, auto: Plan | None = None,
            seeded: bool = True, log: Any = None, recompute: str = "auto",
            total_budget_s: float | None = None) -> Comparison:
    """The automatic plan (``auto``, or planned here) beside each hand layout (``layouts.grid`` by default),
    all on ``cost`` within ``memory_budget``; each solve gets ``time_budget_s``, or, with ``total_budget_s``
    (seconds for the whole comparison, ``compare_budget`` scales one to the step), an equal share of what
    is left of it when it starts. With ``seeded``, one more automatic solve starts from the best of those
    plans (the ``auto + grid starts`` row).

    ``recompute`` is the automatic plan's setting, as ``autoshard.plan`` takes it (``planner.recompute``:
    ``"auto"`` recomputes the step's blocks only when no layout fits without it); when the plan recomputes,
    the hand layouts are priced on the same rewritten step, so that the rows differ only in their layouts.
    A given ``auto`` plan must be of ``graph`` as it is."""
    problems = ProblemCache(graph)
    start = time.perf_counter()
    count = (auto is None) + len(grid(graph, cost.mesh) if layouts is None else layouts) + seeded

    def seconds() -> float:
        """Per solve: ``time_budget_s``, or the share of ``total_budget_s`` left for each plan still to make."""
        nonlocal count
        count -= 1
        if total_budget_s is None:
            return time_budget_s
        return max(MIN_SOLVE_SECONDS, (start + total_budget_s - time.perf_counter()) / (count + 1))

    if auto is None:
        auto, planned = plan_recomputing(graph, cost, recompute=recompute, hardware=hardware,
                                         memory_budget=memory_budget, time_budget_s=seconds(), problems=problems)
        if planned is not graph:
            graph, problems = planned, ProblemCache(planned)
        if log:
            log(f"auto: {human_time(auto.predicted_step_time)}"
                + (f" (recompute: {recompute_note(auto)})" if auto.recompute else ""))
    layouts = grid(graph, cost.mesh) if layouts is None else layouts
    priced = []
    for lay in layouts:
        p = price_layout(graph, cost, lay, hardware=hardware, memory_budget=memory_budget,
                         time_budget_s=seconds(), problems=problems)
        priced.append(dataclasses.replace(p, plan=_recomputing_as(auto, p.plan)))
        if log:
            log(f"{lay.name}: {human_time(p.step_time)}{'' if p.feasible else ' (does not fit)'}")
    again = None
    if seeded:
        starts = [auto, *(p.plan for p in priced if p.feasible)]
        again = _recomputing_as(auto, plan_graph(graph, cost, hardware=hardware, memory_budget=memory_budget,
                                                 time_budget_s=seconds(), problems=problems, starts=starts))
        if log:
            log(f"{SEEDED}: {human_time(again.predicted_step_time)}")
    return Comparison(auto=auto, priced=tuple(priced), memory_budget=memory_budget, seeded=again)


MIN_SOLVE_SECONDS = 0.5  # a plan of the comparison gets at least this, however little of its budget is left


def compare_budget(graph: Graph, cost: CostModel, *, layouts: Sequence[HandLayout] | None = None,
                   seeded: bool = True) -> tuple[float, int]:
    """(seconds, plans): the default budget of a whole comparison, scaled to the step as ``autoshard.plan``
    scales one plan's (``SHARES.auto_seconds``), times the plans it makes (the automatic plan, each hand
    layout, the seeded one). The tiny GPT: 12 plans of 5.8 s, where 30 s each took 5 min 52 s."""
    plans = 1 + len(grid(graph, cost.mesh) if layouts is None else layouts) + seeded
    return plans * SHARES.auto_seconds(len(graph.ops)), plans


def recompute_note(plan: Plan) -> str:
    """What a plan recomputes: ``"selective on 2 blocks"`` (``"none"`` when nothing)."""
    if not plan.recompute:
        return "none"
    return remat.summary(plan.recompute)


def _recomputing_as(auto: Plan, plan: Plan) -> Plan:
    """``plan`` (of the step ``auto`` was planned on) recording ``auto``'s recompute, which its graph has."""
    return dataclasses.replace(plan, recompute=dict(auto.recompute)) if auto.recompute else plan
