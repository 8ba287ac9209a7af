"""``solve_intra_op``: presolve, a feasible incumbent by local search, then the ILP on the hard core.

Timeline of one call with budget ``T`` (every phase watches the clock; the answer comes back by
``T`` plus the set-up that no budget can skip: checking the problem, building the working graph and its
core, expanding and checking the answer): verify the problem; run the exact reductions of ``presolve``
(stopped after ``PRESOLVE_SHARE`` of ``T``); if a core is left, build starts (forest DP with memory
priced in, ``tree_dp``; least memory everywhere; ``initial``), each improved by ICM (``local_search``).

* A core small enough for one ILP goes to HiGHS with the incumbent as a warm start: with its memory rows
  by row generation (``rowgen``) when it has more than ``ROWGEN_MIN_ROWS`` of them (production cores:
  a few hundred nodes, tens of thousands of rows), else all at once (``ilp``), until optimal or the
  deadline.
* A larger core with time enough (``annealing.MIN_SECONDS``): first the Lagrangian search with message
  passing (``trws``: memory priced per row, each pricing's unconstrained problem minimised by TRW-S, the
  decoded points repaired and improved by ICM; its chain bound is the core's lower bound), its points merged
  exactly (``merge``); then, from its best point, simulated annealing, one walk with memory as a cost whose
  price per term adapts to where the rows overflow, one that keeps every row (``anneal``, compiled), their
  points merged exactly after each round (``merge``: the ILP over only the strategies they use); when it is
  small enough for the time, the ILP over a guided restriction between the first annealing rounds and the
  last (``restrict.improve_by_guides``: each node keeps its strategy, those of a few whole-core guides and
  the cheapest lighter one); then exact re-solves of windows (``lns``), and the Lagrangian lower bound
  (``bound``) in the last ``BOUND_SHARE`` of the time (the better of the two bounds is reported).
* A larger core otherwise (or without numba): exact moves of whole induced trees
  (``tree_dp.block_descent``), Lagrangian local search with memory priced per row (``lagrange_search``),
  the exact ILP over a few strategies per node (``restrict``), then exact re-solves of windows (``lns``)
  until the deadline, and a Lagrangian lower bound (``bound``) in the last ``BOUND_SHARE`` of the time.

The core answer is expanded to every node by replaying the eliminations. When time runs out the best
feasible answer found so far is returned with ``optimal=False`` and a status that says so.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from solvers.intra_op import anneal as annealing
from solvers.intra_op.bound import lagrangian_bound
from solvers.intra_op.ilp import ILP_COLUMNS_PER_SECOND, highs_available, ilp_columns, ilp_fits, solve_ilp
from solvers.intra_op.lagrange_search import improve_by_prices
from solvers.intra_op.lns import improve_by_windows
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.merge import Merger
from solvers.intra_op.presolve import Core, Reduced, presolve
from solvers.intra_op.problem import InfeasibleError, IntraOpProblem
from solvers.intra_op.restrict import (
    MIN_WIDTH,
    guided_columns,
    guides_fit,
    improve_by_guides,
    improve_by_restriction,
    restriction_width,
)
from solvers.intra_op.rowgen import solve_by_row_generation
from solvers.intra_op.solution import IntraOpSolution, PresolveStats
from solvers.intra_op.tree_dp import ForestDP, block_descent, lagrangian_start
from solvers.intra_op.trws import improve_by_messages

__all__ = ["solve_intra_op"]

# A large core with at least ``annealing.MIN_SECONDS`` left after its starts is annealed (``anneal``) for
# this share of that time, then re-solved by windows; without numba, or with less time, the phases below.
# IOPDDL K / L / M / N (180 s): 1.34 / 1.01 / 1.08 / 1.86 of the best known by the phases below,
# 1.11 / 1.00 / 1.07 / 1.14 annealed (benchmarks/iopddl_results.md).
ANNEAL_SHARE = 0.85
# ... and when the first round of the guided ILP (``restrict.improve_by_guides``) is small enough for the time it
# would get, the first half of the annealing rounds end at ANNEAL_FIRST of that share, the guided ILP rounds
# at GUIDES_UNTIL, the last annealing rounds at the end: IOPDDL M (annealing alone 1.072 of the best known,
# from whatever start): 1.050 after one round of the guided ILP, 1.046 after two
ANNEAL_FIRST = 0.3
GUIDES_UNTIL = 0.85
# Before annealing, the Lagrangian search with message passing (``trws``) gets this share of the annealing
# time, and the merge of its points up to MERGE_UNTIL; the annealing (and the guided ILP) the rest, from its
# best point (shares not tuned). IOPDDL at 180 s (benchmarks/iopddl_results.md, "Message passing"): N
# 0.995-1.004 of the best known in 5 runs (annealing first: 1.08-1.14), M 1.0026 twice (1.045), K 0.953-0.961
# (0.98-1.04)
MESSAGES_SHARE = 0.4
MERGE_UNTIL = 0.45
# Block descent stops by itself once 8 rounds in a row change nothing; up to this share of the time left
# is its. From a good start it is what improves a large core: GPT-6.7B on 8x8 from its best seed (224.7
# ms), 12 s: 222.4 ms with a quarter of the time, 222.2 ms (what 30 s reach) with 0.6; windows after it
# found nothing more. Half of that when the restricted ILP follows.
BLOCK_DESCENT_SHARE = 0.6
# Then Lagrangian local search (``lagrange_search``: memory priced per row, repaired, ICM) gets up to this
# share of what is left (it stops earlier once it stalls): on IOPDDL K, whose memory binds hard, it takes
# the block-descent answer from 2.27 to 1.50 of the best known in 20 s, where windows had reached 2.02.
PRICES_SHARE = 0.5
# ... when at least this many seconds are left: its rounds (0.2-0.5 s on K's 5k-node core) need tens of
# rounds to pay; with less, block descent and windows do better (GPT-1.3B 8x8 at 30 s: 70.6 ms with the
# prices in its 1-10 s solves, 65.0 ms without).
PRICES_MIN_SECONDS = 20.0
# Then the exact ILP over a few strategies per node (``restrict``; only when at least ``MIN_WIDTH`` fit)
# gets up to this share of what is left; windows (``lns``) the rest.
RESTRICTION_SHARE = 0.7
# The Lagrangian lower bound (``bound``) of a large core gets this share of what is left at the end.
BOUND_SHARE = 0.1
# Presolve stops where it is after this share of the budget (the graph left is then the core).
PRESOLVE_SHARE = 0.5
# A core with more memory rows than this gets them by row generation (``rowgen``) instead of all at once.
ROWGEN_MIN_ROWS = 2000
# At most this share of the budget is kept back for expanding and checking the answer.
RESERVE_CAP = 0.1
# A core of at most this many columns goes to one ILP when HiGHS could set it up in all the time left
# (``ilp.ilp_fits`` allows it ``ILP_SETUP_SHARE`` of it, a rule made on cores of 50k-200k columns): such
# cores are proven optimal in a fraction of a second, where the local search + windows path stops at its
# deadline somewhere else each run. GPT-1T's 129 layers on 17 submesh shapes (the planner's 0.15-0.6 s layer
# solves, replayed): the 170-208-node cores (3k-20k columns) proven optimal in 0.1-0.5 s, where the windowed
# path ran its whole 0.47 s to the same cost or above (89.914 against 89.888 ms); the 397-node head cores
# given 0.24 s ended at HiGHS's limit 0.7-1% worse on two shapes and 0.03-2% better on five; the 160 prices
# summed 6,657 ms with the rule and 6,659 without (each recorded solve replayed both ways).
SMALL_ILP_COLUMNS = 25_000


def small_ilp(seconds: float) -> int:
    """The most columns a core may have to go to one ILP by the ``SMALL_ILP_COLUMNS`` rule in ``seconds``."""
    return min(SMALL_ILP_COLUMNS, int(ILP_COLUMNS_PER_SECOND * max(0.0, seconds)))


def solve_intra_op(
    problem: IntraOpProblem,
    *,
    time_budget_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
    backend: str = "highs",
    verify: bool = True,
    max_ilp_columns: int = 250_000,
    initial: np.ndarray | None = None,
    ties: np.ndarray | None = None,
) -> IntraOpSolution:
    """Best assignment found within ``time_budget_s`` seconds (proven optimal when ``optimal``).

    ``backend`` is ``"highs"`` (highspy, the default; CBC through pulp when highspy is missing) or
    ``"cbc"``. A core goes to one ILP when it has at most ``max_ilp_columns`` columns and HiGHS can set
    it up in the time left (``ilp.ilp_fits``; a core of at most ``SMALL_ILP_COLUMNS`` columns by
    ``small_ilp``). A larger core is searched instead (HiGHS would not finish its root LP in time), with
    windows of it re-solved exactly, and ``lower_bound`` is then the trivial bound (every node and edge
    at its own minimum) or a Lagrangian one. ``optimal`` means proven within relative gap
    ``mip_rel_gap``. Raises InfeasibleError when
    no finite, memory-feasible assignment exists and that is proven; never raises because time ran out.

    ``initial``: a known assignment of every node (e.g. the answer on a restricted strategy set) to start
    from; it competes with the solver's own starts, so the answer is never worse than it when it fits.

    ``ties``: a class id per node (``equivalence_classes``); the members of a class take one strategy
    (``presolve`` merges them first). The answer is then the best *tied* assignment found: an assignment
    of ``problem`` (memory counted per member), but ``optimal``, ``lower_bound`` and InfeasibleError speak
    of the tied problem only, whose optimum may be worse than the untied one. Used as a start.
    """
    start = time.perf_counter()
    deadline = start + time_budget_s
    if verify:
        problem.verify()
    # what is left at the end: expanding the core answer and checking it (about 1 s per 20k nodes here,
    # twice that when the machine is busy), at most ``RESERVE_CAP`` of the budget: a short solve of a large
    # problem (a planner seed: 10k nodes, 1 s) would otherwise have no time left at all, and would return
    # its least-memory start; its overrun is then set-up, which no budget can skip
    reserve = min(0.02 * time_budget_s + problem.num_nodes / 10_000, RESERVE_CAP * time_budget_s)
    work_deadline = deadline - reserve
    try:
        reduced = presolve(problem, ties, deadline=start + PRESOLVE_SHARE * time_budget_s)
    except InfeasibleError as err:
        if problem.memory_limit is None or err.time is not None:
            raise
        unlimited = dataclasses.replace(problem, memory_limit=None)
        presolve(unlimited)  # raises again if the +inf costs alone leave no assignment
        raise _proven_infeasible(problem) from err
    core = reduced.core
    k_core = sum(c.shape[0] for c in core.costs)
    counts = reduced.counts
    stats = PresolveStats(
        nodes_before=problem.num_nodes,
        edges_before=problem.num_edges,
        strategies_before=int(problem.num_strategies.sum()),
        nodes_after=core.num_nodes,
        edges_after=int(core.edge_nodes.shape[0]),
        strategies_after=int(k_core),
        memory_rows=int(core.slack.shape[0]),
        dominated_strategies=counts["dominated"],
        fixed_nodes=counts["fixed"],
        merged_nodes=counts["merged"],
        eliminated_nodes=counts["eliminated"],
        dropped_edges=counts["dropped_edges"],
    )
    if core.slack.size and (core.slack < -1e-9 * max(1.0, abs(problem.memory_limit or 0.0))).any():
        raise _proven_infeasible(problem)  # what presolve had to fix already overflows a step
    if core.num_nodes == 0:
        return _finish(problem, reduced.expand(np.zeros(0, np.int64), problem.num_nodes), None, "optimal",
                       "presolve", start, stats, True, verify)

    ls = LocalSearch(core)
    columns = ilp_columns(core)
    left = work_deadline - time.perf_counter()
    one_ilp = columns <= max_ilp_columns and (ilp_fits(columns, left) or columns <= small_ilp(left))
    # starts: 15% of what is left for a large core, 5% when one ILP or annealing will follow
    left = max(0.0, work_deadline - time.perf_counter())
    anneals = not one_ilp and 0.95 * left >= annealing.MIN_SECONDS and annealing.available()
    share = (0.05 if one_ilp or anneals else 0.15) * left
    incumbent = _starts(core, ls, share, left, None if initial is None else _core_choice(reduced, np.asarray(initial)))
    inc_obj = core.objective(incumbent) if incumbent is not None else np.inf
    trivial = core.constant + sum(float(c.min()) for c in core.costs) + sum(
        float(m[np.isfinite(m)].min(initial=np.inf)) for m in core.edge_costs
    )

    if not one_ilp and incumbent is None and (columns > max_ilp_columns or time.perf_counter() > work_deadline):
        return _finish(problem, reduced.expand(ls.choice, problem.num_nodes), trivial,
                       "no feasible assignment found (time budget reached)", "none feasible", start, stats,
                       False, False, feasible=False)
    if not one_ilp and incumbent is not None:
        # too big for one ILP in the budget: annealing when there is time for it, else exact moves of whole
        # trees; then exact re-solves of windows
        if anneals:
            now = time.perf_counter()
            left = work_deadline - now
            phase = ANNEAL_SHARE * left
            incumbent, lower = _by_messages(core, ls, incumbent, now + MESSAGES_SHARE * phase,
                                            now + MERGE_UNTIL * phase)
            inc_obj = core.objective(incumbent)  # what the phases below must beat
            trivial = max(trivial, lower + core.constant)
            t = time.perf_counter()
            now, phase = t, max(0.0, phase - (t - now))
            guided = (backend == "highs" and highs_available()
                      and guides_fit(guided_columns(core, incumbent), (GUIDES_UNTIL - ANNEAL_FIRST) * phase))
            if guided:
                half = annealing.ROUNDS // 2
                ls.start_from(annealing.anneal(core, incumbent, now + ANNEAL_FIRST * phase, rounds=range(half)))
                improve_by_guides(core, ls, now + GUIDES_UNTIL * phase)
                ls.start_from(annealing.anneal(core, ls.choice.copy(), now + phase, seed=1,
                                               rounds=range(half, annealing.ROUNDS)))
                how, method = ("priced by messages, annealed, guided ILP, improved by windows",
                               "messages + annealing + guided ILP + windowed ILP")
            else:
                ls.start_from(annealing.anneal(core, incumbent, now + phase))
                how, method = "priced by messages, annealed, improved by windows", "messages + annealing + windowed ILP"
            ls.improve(time.perf_counter() + 0.02 * left)
        else:
            how, method = "improved by windows", "local search + windowed ILP"
            ls.start_from(incumbent)
            if time.perf_counter() < work_deadline:
                restricted = backend == "highs" and highs_available() and restriction_width(core) >= MIN_WIDTH
                share = BLOCK_DESCENT_SHARE * (0.5 if restricted else 1.0)
                block_descent(core, ls, time.perf_counter() + share * (work_deadline - time.perf_counter()))
                ls.improve(time.perf_counter() + 0.05 * max(0.0, work_deadline - time.perf_counter()))
                if not ls.feasible() or ls.objective() >= inc_obj:
                    ls.start_from(incumbent)
                left = work_deadline - time.perf_counter()
                if left >= PRICES_MIN_SECONDS:
                    improve_by_prices(core, ls, time.perf_counter() + PRICES_SHARE * left)
                if restricted:
                    improve_by_restriction(core, ls, time.perf_counter()
                                           + RESTRICTION_SHARE * max(0.0, work_deadline - time.perf_counter()))
        if time.perf_counter() < work_deadline:
            improve_by_windows(core, ls, work_deadline - BOUND_SHARE * max(0.0, work_deadline - time.perf_counter()))
        choice = ls.choice.copy() if ls.feasible() and ls.objective() < inc_obj else incumbent
        if time.perf_counter() < work_deadline:
            lagrangian = lagrangian_bound(core, work_deadline, upper=core.objective(choice))
            trivial = max(trivial, lagrangian + core.constant)
        return _finish(problem, reduced.expand(choice, problem.num_nodes), trivial,
                       f"feasible (time budget reached; core too large for one ILP, {how})", method, start, stats,
                       False, verify)

    if backend == "highs" and highs_available() and core.slack.shape[0] > ROWGEN_MIN_ROWS:
        rg = solve_by_row_generation(core, work_deadline, incumbent=incumbent, guess=ForestDP(core).solve(),
                                     mip_rel_gap=mip_rel_gap)
        if rg.infeasible:
            raise _proven_infeasible(problem)
        bound = trivial if rg.bound is None else max(trivial, rg.bound + core.constant)
        if rg.choice is None:
            return _finish(problem, reduced.expand(ls.choice, problem.num_nodes), bound,
                           "no feasible assignment found (time budget reached)", "none feasible", start, stats,
                           False, False, feasible=False)
        status = "optimal" if rg.optimal else "feasible (time budget reached)"
        return _finish(problem, reduced.expand(rg.choice, problem.num_nodes), bound, status,
                       "ilp (memory rows by row generation)", start, stats, rg.optimal, verify)

    remaining = work_deadline - time.perf_counter()
    res = solve_ilp(core, time_limit_s=max(0.05, remaining), warm_start=incumbent,
                    mip_rel_gap=mip_rel_gap, backend=backend)
    if res.status == "infeasible":
        raise _proven_infeasible(problem)
    bound = trivial if res.bound is None else max(trivial, res.bound + core.constant)
    if res.choice is not None and res.objective is not None and res.objective <= inc_obj:
        choice, method = res.choice, "ilp"
        if res.status == "optimal":
            return _finish(problem, reduced.expand(choice, problem.num_nodes), bound, "optimal", method,
                           start, stats, True, verify)
    elif incumbent is not None:
        choice, method = incumbent, "local search"
    else:
        choice, method = ls.choice, "none feasible"
        full = reduced.expand(choice, problem.num_nodes)
        return _finish(problem, full, bound, "no feasible assignment found (time budget reached)", method,
                       start, stats, False, False, feasible=False)
    status = "feasible (time budget reached)" if res.status == "time limit" else f"feasible ({res.status})"
    return _finish(problem, reduced.expand(choice, problem.num_nodes), bound, status, method, start, stats,
                   False, verify)


def _by_messages(core: Core, ls: LocalSearch, incumbent: np.ndarray, until: float, merge_until: float
                 ) -> tuple[np.ndarray, float]:
    """``trws.improve_by_messages`` from ``incumbent`` until ``until``, its points merged exactly (``merge``)
    until ``merge_until``: the best feasible point (``incumbent`` when nothing is cheaper) and the search's
    lower bound on the core's objective."""
    ls.start_from(incumbent)
    points, lower = improve_by_messages(core, ls, until)
    best = ls.choice.copy()
    if points and time.perf_counter() < merge_until:
        merged = Merger(core).merge([incumbent, *points], merge_until)
        if core.objective(merged) < core.objective(best):
            best = merged
    return best, lower


def _starts(core: Core, ls: LocalSearch, share: float, left: float,
            initial: np.ndarray | None) -> np.ndarray | None:
    """The cheapest memory-feasible start among: exact DP over a spanning forest with memory priced in
    (``tree_dp``), least memory everywhere, and ``initial``; each improved by ICM. Takes about ``share``
    seconds (the forest DP at least its set-up when ``left``, the time to the work deadline, allows it).
    None when none fits memory."""
    # the forest DP costs about 0.1 ms a node to set up: skip it only when the time left would not even pay
    # for that (a short solve of a small core, a planner seed, gets it: it is often the best start there)
    setup = 2e-4 * core.num_nodes
    start_dp = lagrangian_start(core, time.perf_counter() + max(share, setup)) if left > setup else None
    ls.start_min_memory()
    if ls.feasible():
        ls.improve(time.perf_counter() + 0.5 * share)
    incumbent = ls.choice.copy() if ls.feasible() else None
    inc_obj = core.objective(incumbent) if incumbent is not None else np.inf
    for seed, part in ((start_dp, 0.5), (initial, 0.25)):
        if seed is None:
            continue
        ls.start_from(seed)
        if ls.feasible():
            ls.improve(time.perf_counter() + part * share)
            if ls.objective() < inc_obj:
                incumbent, inc_obj = ls.choice.copy(), ls.objective()
    return incumbent


def _core_choice(reduced: Reduced, initial: np.ndarray) -> np.ndarray:
    """A full assignment restricted to the core (compressed indices); a strategy presolve removed as
    dominated or fixed away becomes the core node's cheapest strategy."""
    core = reduced.core
    out = np.empty(core.num_nodes, dtype=np.int64)
    for a, w in enumerate(core.nodes.tolist()):
        pos = np.flatnonzero(core.strategies[a] == initial[w])
        out[a] = int(pos[0]) if pos.size else int(np.argmin(core.costs[a]))
    return out


def _finish(
    problem: IntraOpProblem,
    choice: np.ndarray,
    bound: float | None,
    status: str,
    method: str,
    start: float,
    stats: PresolveStats,
    optimal: bool,
    verify: bool,
    *,
    feasible: bool = True,
) -> IntraOpSolution:
    cost = problem.cost_of(choice)
    if optimal:
        bound = cost if bound is None else min(bound, cost)
    elif bound is not None:
        bound = min(bound, cost)
    sol = IntraOpSolution(
        choice=choice,
        cost=cost,
        optimal=optimal,
        lower_bound=bound,
        status=status,
        solve_seconds=time.perf_counter() - start,
        stats=stats,
        feasible=feasible,
        method=method,
    )
    if verify and feasible:
        sol.verify(problem)
    return sol


def _proven_infeasible(problem: IntraOpProblem) -> Exception:
    if problem.memory_limit is None:
        return InfeasibleError("no finite-cost assignment exists (the ILP over the presolved core is infeasible)")
    mins = problem.min_memory()
    points, usage = problem.usage_at_points(mins)
    worst = int(np.argmax(usage - problem.memory_limit))
    return problem.memory_error(
        int(points[worst]), float(usage[worst]), mins,
        reason=(
            "; each node's least memory fits on its own, but the +inf edge couplings (or node merges) stop "
            "every node from taking its least-memory strategy at once, and the ILP proves that no assignment "
            "fits"
        ),
    )
