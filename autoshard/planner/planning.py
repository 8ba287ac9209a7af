"""``plan_graph``: build the intra-operator problem of a graph, solve it, read the solution back as a Plan.

The problem (``planner.build``) is solved by ``solvers.solve_intra_op``, started from the best of the
seed portfolio (``planner.seeds``) on large graphs; the solution is read back into layouts per tensor, a
step time by category and a peak memory (``planner.readback``). ``fixed=`` pins some inputs' layouts (a
hand-written layout, ``planner.layouts``; ``planner.pins``) and lets the solver complete the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.planner import readback
from autoshard.planner.build import BuiltProblem, build_problem
from autoshard.planner.pins import fixed_ids, pin
from autoshard.planner.plan import DoesNotFit, Plan, SolverReport, encode_choice, versions
from autoshard.planner.seeds import Seed
from autoshard.planner.seeds import seeds as seed_portfolio
from autoshard.planner.shares import SHARES
from autoshard.planner.summary import human_time
from autoshard.trace.graph import Graph
from autoshard.trace.recompute import advice as recompute_advice
from cost_models import CostModel, ShardingSpec
from solvers import InfeasibleError, IntraOpProblem, IntraOpSolution, solve_intra_op

log = logging.getLogger("autoshard")


PROBLEMS = "planner.planning.problems"  # the ``Graph.memo`` table ``ProblemCache.of`` keeps its cache in
FOUND = "planner.planning.found"  # the ``Graph.memo`` table of the plans found for a graph (``_Found``)
KEEP_FOUND = 8  # plans remembered per problem (the fastest)


@dataclasses.dataclass(slots=True)
class ProblemCache:
    """The problems built for one graph, kept across several ``plan_graph`` calls on it (pricing hand-written
    layouts, ``compare``). Building is deterministic: a problem depends on the graph and the cost model's
    mesh and prices only; the memory budget is set per call."""

    graph: Graph
    _built: dict[Any, tuple[Any, BuiltProblem]] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(graph: Graph) -> ProblemCache:
        """The cache that lives with ``graph`` (``Graph.memo(PROBLEMS)``, until its owner clears it): a
        pipeline's layer or stage is planned again under a larger budget when it does not fit its share,
        on the same problem."""
        table = graph.memo(PROBLEMS)
        if "cache" not in table:
            table["cache"] = ProblemCache(graph)
        return table["cache"]

    def get(self, cost: CostModel, memory_budget: float | None, activation_weight: float = 1.0,
            reduction_weight: float = 1.0) -> BuiltProblem:
        key = (id(cost.profile), cost.mesh, activation_weight, reduction_weight)
        hit = self._built.get(key)
        if hit is None or hit[0] is not cost.profile:
            hit = (cost.profile, build_problem(self.graph, cost, None, activation_weight=activation_weight,
                                               reduction_weight=reduction_weight))
            self._built[key] = hit
        built = hit[1]
        return dataclasses.replace(built, problem=dataclasses.replace(built.problem, memory_limit=memory_budget))


def plan_graph(
    graph: Graph,
    cost: CostModel,
    *,
    hardware: str = "",
    memory_budget: float | None = None,
    time_budget_s: float | None = None,
    fixed: Mapping[str, ShardingSpec] | None = None,
    problems: ProblemCache | None = None,
    activation_weight: float = 1.0,
    reduction_weight: float = 1.0,
    starts: Sequence[Any] = (),
    includes_build: bool = False,
    solve: bool = True,
) -> Plan:
    """Plan ``graph`` on ``cost.mesh``: build the problem, solve it, read the layouts back.

    ``fixed``: input tensor name -> layout, held as given while the solver places everything else (the
    best completion of a hand-written layout). ``problems``: reuse problems already built for ``graph``.
    ``activation_weight``: see ``build_problem`` (the peak memory reported counts activations that many
    times; a pipeline stage holds several microbatches' at once). ``reduction_weight``: see
    ``build_problem`` (the price of reducing the pending sums the graph returns is scaled by it).
    ``starts``: other starting points for the solve, each a Plan of this graph (its recorded choice) or a
    hand layout (``layouts.HandLayout`` or a mapping input name -> layout), which is completed first with
    the inputs pinned.

    ``time_budget_s``: seconds for solving, or for building and solving with ``includes_build`` (None:
    scaled to the problem, building included); how they are spent, seeds included, is in
    ``planner.shares``: the plan is never worse than any seed or start.

    ``solve=False``: the best of the replicated seed and the ``starts`` given as a Plan or an ``Assignment``
    that fit, with no seed solved and no solve after (a pipeline stage planned once the call's budget is
    spent: its layers' plans joined, which the stage DP priced); planned as usual when none of them fits.
    """
    t0 = time.perf_counter()
    if problems is None:
        problems = ProblemCache(graph)
    pins = fixed_ids(graph, fixed, cost.mesh)
    built = problems.get(cost, memory_budget, activation_weight, reduction_weight)
    problem = pin(graph, built, pins)
    assert problem is not None
    t_build = time.perf_counter() - t0
    key = (cost.mesh, activation_weight, reduction_weight, problem.num_nodes, tuple(sorted(pins.items())))
    if time_budget_s is None:
        time_budget_s, includes_build = SHARES.auto_seconds(problem.num_nodes), True
    solve_s = time_budget_s
    if includes_build:
        solve_s = max(time_budget_s - t_build, SHARES.min_solve * time_budget_s)
    log.info("built the problem on %s: %d nodes, %d edges in %.1f s; solving for %.1f s",
             cost.mesh, problem.num_nodes, problem.num_edges, t_build, solve_s)
    try:
        problem.check_memory_lower_bound()  # every node at its least memory overflows: no seed can fit
        with _gc_frozen():
            t_start = time.perf_counter()
            found = [] if solve else seed_portfolio(graph, cost, built, problem, pins, starts, 0.0, starts_only=True)
            quick = any(x.given for x in found)
            if not quick:
                found = seed_portfolio(graph, cost, built, problem, pins, starts, SHARES.seeds * solve_s)
            found += _Found.of(graph).fitting(key, cost, problem)
            best = min(found, key=lambda x: x.objective, default=None)
            t_seeds = time.perf_counter() - t_start
            if best is not None:
                log.info("%d seeds in %.1f s, the best (%s) at %s", len(found), t_seeds, best.name,
                         human_time(best.objective))
            if quick:
                assert best is not None
                sol = IntraOpSolution.unsolved(problem, best.choice, best.objective,
                                               f"feasible (not solved: the time budget was spent; {best.name!r})")
            else:
                sol = solve_intra_op(problem, time_budget_s=max(solve_s - t_seeds, (1 - SHARES.seeds) * solve_s),
                                     initial=None if best is None else best.choice)
            if best is not None and (not sol.feasible or best.objective < sol.cost):
                # the incumbent is kept: the final solve never returns worse than its best start
                sol = dataclasses.replace(sol, choice=best.choice, cost=best.objective, optimal=False, feasible=True,
                                          status=f"feasible (time budget reached; seed {best.name!r} kept)")
    except InfeasibleError as e:
        what = ("with the given inputs' layouts held fixed" if pins
                else "with any layout autoshard can express")
        _, least = problem.usage_at_points(problem.min_memory())
        needed = float(least.max()) if least.size else 0.0
        hint = recompute_advice(graph, needed, memory_budget)
        raise DoesNotFit(
            f"{e}\nThe step does not fit in {memory_budget:.3g} bytes per device on mesh {cost.mesh} {what} "
            f"(it needs at least {needed:.3g}). {hint[:1].upper()}{hint[1:]} (recompute='auto', "
            "--recompute auto, the default, tries it). Or use more devices, a smaller batch or microbatches "
            "(microbatches=B, --microbatches B), or plan without a memory limit (memory_budget=None, "
            "--memory-budget none) to see what it would need.", needed=needed,
        ) from None
    specs, inputs, outputs = readback.layouts(graph, built, sol.choice, pins)
    breakdown = readback.breakdown(built, sol.choice, cost)
    report = SolverReport(
        status=sol.status,
        optimal=bool(sol.optimal),
        objective=float(sol.cost),
        lower_bound=None if sol.lower_bound is None else float(sol.lower_bound),
        build_seconds=t_build,
        seed_seconds=t_seeds,
        solve_seconds=float(sol.solve_seconds),
        nodes=built.problem.num_nodes,
        edges=built.problem.num_edges,
        strategies=int(built.problem.num_strategies.sum()),
        choice=encode_choice(sol.choice),
        top_ops=tuple(readback.top_ops(built, sol.choice)),
        seeds={x.name: float(x.objective) for x in found if not x.given},
        starts={x.name: float(x.objective) for x in found if x.given} if starts else None,
        fixed_inputs=len(pins) if pins else None,
    )
    plan = Plan(
        mesh=cost.mesh,
        hardware=hardware,
        memory_budget=memory_budget,
        inputs=inputs,
        outputs=outputs,
        specs=specs,
        time_breakdown=breakdown,
        predicted_step_time=readback.step_time_of_breakdown(breakdown),
        peak_memory=readback.peak_memory_of(built, sol.choice),
        held_memory=readback.held_memory_of(built, sol.choice),
        solver=report,
        versions=versions(),
        collective_counts=readback.collective_counts(built, sol.choice, cost),
    )
    plan.verify(graph)
    _Found.of(graph).add(key, cost, sol.choice, float(sol.cost), plan.peak_memory)
    log.info("planned %s: %s per step predicted, %s (%.1f s in all)", cost.mesh,
             human_time(plan.predicted_step_time), sol.status, time.perf_counter() - t0)
    return plan


@dataclasses.dataclass(slots=True)
class _Found:
    """The plans found for one graph (``Graph.memo(FOUND)``), as solver choices per problem (cost model, mesh,
    activation and reduction weights, pins): each is a start for every later plan of that problem that it
    fits, so a looser memory budget never returns a slower plan than a tighter one found (the plan
    explorer's sweep of GPT-125M on 8x8: 17.4 ms at 1.25 GiB, then 24 ms at 2 and 4 GiB, where the 17.4 ms
    plan fits too)."""

    table: dict[Any, list[tuple[Any, np.ndarray, float, float]]]

    @staticmethod
    def of(graph: Graph) -> _Found:
        memo = graph.memo(FOUND)
        if "found" not in memo:
            memo["found"] = _Found({})
        return memo["found"]

    def add(self, key: Any, cost: CostModel, choice: np.ndarray, objective: float, peak: float) -> None:
        entries = self.table.setdefault(key, [])
        entries.append((cost.profile, np.array(choice, dtype=np.int64), objective, peak))
        entries.sort(key=lambda e: e[2])
        del entries[KEEP_FOUND:]

    def fitting(self, key: Any, cost: CostModel, problem: IntraOpProblem) -> list[Seed]:
        """The plans found before on this problem that fit its memory limit, priced on it, as seeds."""
        limit = problem.memory_limit
        out = []
        for n, (profile, choice, _, peak) in enumerate(self.table.get(key, [])):
            if profile != cost.profile or (limit is not None and peak > limit * (1 + 1e-9)):
                continue
            objective = problem.cost_of(choice)
            if math.isfinite(objective):
                out.append(Seed(f"found before {n}", choice, objective, False))
        return out


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Exempt the objects alive now (the traced graph, the built problem: millions on a large model) from
    the garbage collector's full collections while the solver runs. Each full collection walks all of
    them, about 0.5 s on GPT-6.7B, and the solver allocates enough to set one off every few hundred
    milliseconds; the objects it makes are still collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
