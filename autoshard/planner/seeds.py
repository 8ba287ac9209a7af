"""Starting points for the final intra-op solve: the seed portfolio.

Windowed search cannot move a large plan from one global structure to another (say, from data parallel
over one axis to data x tensor parallel over two), so ``plan_graph`` starts its final solve from the best
of these. How the seed budget is split is in ``planner.shares``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.planner.build import BuiltProblem
from autoshard.planner.layouts import fallbacks, grid
from autoshard.planner.pins import fixed_ids, pin
from autoshard.planner.plan import Plan, PlanError, decode_choice
from autoshard.planner.readback import peak_memory_of
from autoshard.planner.shares import SHARES
from autoshard.planner.summary import human_time
from autoshard.trace.graph import Graph, Scope
from cost_models import CostModel, ShardingSpec
from solvers import InfeasibleError, IntraOpProblem, equivalence_classes, solve_intra_op

log = logging.getLogger("autoshard")


@dataclasses.dataclass(frozen=True, slots=True)
class Seed:
    name: str
    choice: np.ndarray
    objective: float
    given: bool  # one of the user's starts (recorded as ``SolverReport.starts``), else automatic


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """A start given as the layouts of the graph's tensors, keyed ``(scope, tensor id)`` as the built
    problem's nodes produce them, e.g. the plans of the layers a pipeline stage is made of: every node
    takes the strategy that produces most of these layouts (the cheapest among equals), so the start is
    those plans joined, and the solve begins no worse than their sum plus the resharding between them."""

    name: str
    layouts: Mapping[tuple[Scope, int], ShardingSpec]

    def __len__(self) -> int:
        return len(self.layouts)


def assignment_choice(built: BuiltProblem, layouts: Mapping[tuple[Scope, int], ShardingSpec]) -> np.ndarray:
    """Per node of ``built``, the strategy producing the most of ``layouts`` (ties: the cheapest)."""
    choice = np.zeros(len(built.nodes), dtype=np.int64)
    for i, node in enumerate(built.nodes):
        score = np.array([sum(layouts.get(key) == spec for key, spec in prod) for prod in node.produces])
        best = np.flatnonzero(score == score.max()) if score.size else np.zeros(1, dtype=np.int64)
        choice[i] = best[int(np.argmin(node.cost[best]))]
    return choice


def seeds(graph: Graph, cost: CostModel, built: BuiltProblem, problem: IntraOpProblem,
          pins: Mapping[int, ShardingSpec], starts: Sequence[Any], budget_s: float,
          starts_only: bool = False) -> list[Seed]:
    """Starting points for the final solve, each a memory-feasible assignment of ``problem``. Every seed is solved *tied*: the copies of a repeated block (``solvers.equivalence_classes``)
    take one choice, which makes a transformer's problem 20-50 times smaller (``solve_intra_op(ties=)``).

    First round, ``SHARES.first_round`` of ``budget_s`` shared equally, in this order (what is left of the
    round is shared by the jobs left, so a job that overruns costs those after it):

    * with no inputs pinned, one per textbook layout of ``layouts.grid`` (data, ZeRO and tensor parallel
      per mesh axis): the tied problem with the layout's inputs pinned;
    * the user's ``starts``: a Plan of this graph (its recorded choice) as is, an ``Assignment`` (every
      tensor's layout) as its ``assignment_choice``, a hand layout (a ``layouts.HandLayout`` or a
      mapping input name -> layout) like the grid's. A Plan or Assignment that overflows the memory
      budget is the initial point of a tied solve instead (which repairs it). Each of these solves gets
      at least ``SHARES.min_start_seconds`` however little is left of the round: a start the caller made
      (a pipeline stage's layers' plans joined) is the plan's floor; with the round spent it was skipped, and
      a stage whose repair is skipped or cut short is solved from the replicated seed (llama-70b's first
      stage once planned 105.5 ms a microbatch, 65.3 ms where its repair had 0.4 s);
    * ``tied``: the tied problem on its own, last: unpinned, it is the slowest to solve, and on GPT-39B over
      8x8 its short solve gave a 381 s plan where the layouts' gave 10-11 s; first, it overran its share
      and left the layouts nothing when building had eaten most of the budget (a loaded machine).

    Before both rounds, and on graphs of any size, the *replicated* seed (``replicated_choice``): every
    node at its cheapest strategy that reads and writes every tensor whole, no solve at all. It is the
    plain single-device program on every device, which no plan should lose to: no collective, no
    resharding. Small steps on large meshes are best that way or close (the examples' tiny GPT on 8x8
    H100: 11 us, where a 4 s solve that left the grid out for time returned 4.35 ms, and compare priced
    data parallel at 229 us).

    The layouts of the grid and ``tied`` are left out when each would get under
    ``SHARES.min_grid_seed_seconds`` of the first round, all but the textbook fallbacks first
    (``layouts.fallbacks``: data parallel and ZeRO-3 over every axis), which are kept when they get
    that time between them: GPT with 4 blocks on 2x4 (1,480 nodes, a 366-node
    tied core), 4 s: eleven tied seeds of 0.10-0.12 s priced 4,955-6,886 us (their least-memory starts,
    barely moved), the second round 900-978 us, and the final solve, left 1.7 s, ended at 122.9-135.2 us;
    given the whole 4 s it reaches 73.0 us.

    Second round, the rest of ``budget_s``: the tied problem again, with no inputs pinned beyond ``pins``,
    started from each of the ``SHARES.second_round`` best of the first round (``tied, from <name>``): a layout's
    global structure, with every tensor free to leave it (a ZeRO-sharded optimizer state here, a
    replicated bias there), uniformly over the blocks. Graphs under ``SHARES.seed_min_nodes`` nodes get only the
    replicated seed and the user's starts, in one round. Measured on GPT-6.7B over 8x8 (30 s budget): the best layout's first-round
    seed costs 231 ms, its second-round seed 225 ms, the final untied solve from it 222 ms.

    ``starts_only``: the replicated seed and the ``starts`` given as a Plan or an ``Assignment`` that fit, as
    they are: no solve at all (``plan_graph(solve=False)``)."""
    start = time.perf_counter()
    fallback = _replicated(built, problem)
    if problem.num_nodes < SHARES.seed_min_nodes and not starts:
        return fallback
    classes = equivalence_classes(problem)
    limit = built.problem.memory_limit
    layouts: list[tuple[str, Mapping[str, ShardingSpec], bool]] = []
    out: list[Seed] = list(fallback)
    repair: list[tuple[str, np.ndarray]] = []
    for n, user in enumerate(starts):
        if isinstance(user, Assignment):
            name, choice = user.name, assignment_choice(built, user.layouts)
        elif isinstance(user, Plan):
            name, choice = f"plan {n}", decode_choice(user.solver.choice)
        else:
            layouts.append((str(getattr(user, "name", f"layout {n}")), getattr(user, "specs", user), True))
            continue
        if len(choice) != problem.num_nodes or not bool(np.all(choice < problem.num_strategies)):
            continue
        objective = problem.cost_of(choice)  # a plan made under other pins or another budget may not do
        fits = limit is None or peak_memory_of(built, choice) <= limit * (1 + 1e-9)
        if math.isfinite(objective) and fits:
            out.append(Seed(name, choice, objective, True))
            log.info("start %r: %s", name, human_time(objective))
        elif math.isfinite(objective):
            repair.append((name, choice))
    if starts_only:
        return out
    automatic = problem.num_nodes >= SHARES.seed_min_nodes and cost.mesh.num_devices > 1
    essential: set[str] = set()
    if automatic and not pins:
        essential = {lay.name for lay in fallbacks(graph, cost.mesh)}
        layouts += sorted(((lay.name, lay.specs, False) for lay in grid(graph, cost.mesh)),
                          key=lambda x: x[0] not in essential)  # the fallbacks first: they are kept longest
    jobs: list[tuple[str, IntraOpProblem | None, bool, np.ndarray | None]] = [
        (f"{name}, repaired", problem, True, choice) for name, choice in repair]
    for name, specs, given in layouts:
        try:
            pinned = pin(graph, built, {**fixed_ids(graph, specs, cost.mesh), **pins}, strict=False)
        except PlanError:
            continue  # a layout that does not fit the tensors (a grid layout over an axis that divides nothing)
        jobs.append((name, pinned, given, None))
    if automatic:  # last: the whole tied problem is the slowest to solve, and a short solve of it the worst
        jobs.append(("tied", problem, False, None))
    second = automatic and len(jobs) > 1
    first_round = (SHARES.first_round if second else 1.0) * budget_s
    if automatic and first_round / len(jobs) < SHARES.min_grid_seed_seconds:
        # too short for the grid's tied solves to leave their start: the final solve gets their time, but
        # for the textbook fallbacks' when they get that much between them (a plan must not lose to them)
        kept = [job for job in jobs if job[2] or job[0] in essential]
        if first_round / max(len(kept), 1) < SHARES.min_grid_seed_seconds:
            kept = [job for job in jobs if job[2]]
        jobs = kept
        second = False
        first_round = budget_s
    deadline = start + first_round
    for n, (name, pinned, given, initial) in enumerate(jobs):
        # what is left of the round, shared by the jobs left: a job that overran costs them all
        seconds = (deadline - time.perf_counter()) / (len(jobs) - n)
        if given:  # a start is tried however late (a stage's layers' plans, repaired: llama-70b's stage 0 on 1x8
            # planned 105.5 ms a microbatch in one run, 65.3 ms in another, where the repair had 0.4 s)
            seconds = max(seconds, SHARES.min_start_seconds)
        if pinned is None or seconds <= SHARES.min_seed_seconds:
            continue
        seed = _tied(name, pinned, classes, seconds, given, initial=initial)
        if seed is not None:
            out.append(seed)
            log.info("seed %r: %s", name, human_time(seed.objective))
    if not second:
        return out
    top = sorted(out, key=lambda x: x.objective)[:SHARES.second_round]
    for n, best in enumerate(top):
        seconds = (start + budget_s - time.perf_counter()) / (len(top) - n)
        if seconds <= SHARES.min_seed_seconds:
            continue
        seed = _tied(f"tied, from {best.name}", problem, classes, seconds, False, initial=best.choice)
        if seed is not None:
            out.append(seed)
            log.info("seed %r: %s", seed.name, human_time(seed.objective))
    return out


def replicated_choice(built: BuiltProblem) -> np.ndarray | None:
    """Per node of ``built``, its cheapest strategy that reads and produces every tensor whole (split over
    no axis, no pending sum): the single-device program run on every device. None when some node has no
    such strategy."""
    choice = np.zeros(len(built.nodes), dtype=np.int64)
    for i, node in enumerate(built.nodes):
        whole = [s for s in range(node.k)
                 if all(_whole(spec) for _, spec in node.produces[s]) and all(_whole(spec) for _, spec in node.reads[s])
                 and math.isfinite(built.problem.node_costs[i][s])]
        if not whole:
            return None
        choice[i] = min(whole, key=lambda s: built.problem.node_costs[i][s])
    return choice


def _whole(spec: ShardingSpec) -> bool:
    return not spec.partial and not any(spec.dims)


def _replicated(built: BuiltProblem, problem: IntraOpProblem) -> list[Seed]:
    """The replicated seed (``seeds``), when every node has a replicated strategy, ``problem`` allows them
    (its pins) and they fit its memory limit."""
    choice = replicated_choice(built)
    if choice is None:
        return []
    objective = problem.cost_of(choice)
    limit = problem.memory_limit
    if not math.isfinite(objective) or (limit is not None and peak_memory_of(built, choice) > limit * (1 + 1e-9)):
        return []
    log.info("seed 'replicated': %s", human_time(objective))
    return [Seed("replicated", choice, objective, False)]


def _tied(name: str, problem: IntraOpProblem, classes: np.ndarray, seconds: float, given: bool,
          initial: np.ndarray | None = None) -> Seed | None:
    """``problem`` solved with ``classes`` tied, as a seed; None if no tied assignment was found. The
    solver's answers are verified within ``problem``'s costs and memory limit: no check needed here."""
    try:
        sol = solve_intra_op(problem, time_budget_s=seconds, ties=_split(classes, problem), initial=initial)
    except InfeasibleError:
        return None  # tied, or with these inputs pinned, nothing fits
    return Seed(name, sol.choice, sol.cost, given) if sol.feasible and math.isfinite(sol.cost) else None


def _split(classes: np.ndarray, problem: IntraOpProblem) -> np.ndarray:
    """``classes`` refined so that the members of a class have the same costs in ``problem`` (pinned
    inputs: copies pinned to different layouts are not tied)."""
    keys = {}
    out = np.empty_like(classes)
    for i, c in enumerate(classes.tolist()):
        out[i] = keys.setdefault((c, problem.node_costs[i].tobytes()), len(keys))
    return out
