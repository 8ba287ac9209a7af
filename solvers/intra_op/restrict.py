r"""Large cores: the exact ILP over a few promising strategies per node (a restricted master problem).

A core too large for one ILP (IOPDDL K: 5k nodes, up to 73 strategies, 1.3M columns; HiGHS does not
finish its root LP in 150 s) is solved exactly on a *restriction*: node ``a`` keeps only the strategies
``K_a ⊆ {1..k_a}`` with ``|K_a| <= m``, where ``K_a`` holds

* the incumbent's strategy ``s_a`` (so the restriction contains the incumbent and its optimum is never
  worse), and
* the strategies cheapest at the incumbent's neighbours, ``argmin_s c_a(s) + Σ_{e=(a,b)} R^e(s, s_b)``,
  the candidates of a single-node move, up to ``m``.

The columns are then ``Σ_a |K_a| + Σ_e |K_a||K_b| <= n m + |E| m²``; ``m`` is the largest that keeps them
under ``MAX_COLUMNS``. The restricted core (``restrict``) is solved by row generation (``rowgen``) from the
incumbent until its optimum or the deadline; its answer moves many nodes at once, which single-node and
window moves cannot. Rounds repeat from the new incumbent while they improve and time is left.

``improve_by_guides`` widens ``K_a`` with *guide* strategies that need not fit memory nor be good as a whole,
so that the ILP can move many nodes towards them at once:

* the forest DP's optimum without memory (``tree_dp.ForestDP``), each node's cheapest strategy, and its
  least-memory strategy (memory summed over its terms, ties by cost);
* ``lighter``: the cheapest strategy that uses less memory than the incumbent's;
* after the first round, the ``LOCAL`` strategies cheapest at the incumbent's neighbours.

This finds coordinated moves that annealing does not: IOPDDL M, whose annealing ends at 1.072 of the best
known whatever the variant, goes to 1.050 in one round (52k columns, 25 s) and 1.046 in the next (the ILP
without memory rows over the same sets reaches 0.997: memory is what costs the rest; the annealing walks
from 1.045 found nothing more in 40 s). In the 180 s solve: 1.0722 -> 1.0447 (one round, 22 s, then the
last annealing rounds and their merge take 1.051 to 1.045). On K and N the first round (86-105k columns)
is not solved in 60 s, and the rounds that are (guides cut to the cheapest and the lighter) gain < 0.1%.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from solvers.intra_op.ilp import ilp_columns, ilp_fits
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core
from solvers.intra_op.rowgen import solve_by_row_generation
from solvers.intra_op.tree_dp import ForestDP

__all__ = ["MIN_WIDTH", "guided_columns", "guides_fit", "improve_by_guides", "improve_by_restriction", "restrict",
           "restriction_width"]

log = logging.getLogger(__name__)

MAX_COLUMNS = 150_000
# Below this many strategies a node the restriction is little more than the incumbent and its ILP is
# still hard (IOPDDL K and N, m = 2: no improvement in 90 s, at the cost of block descent's time).
MIN_WIDTH = 4
# ``improve_by_guides``: the strategies cheapest at the incumbent's neighbours added from the second round on
# (IOPDDL M from 1.050: 2 of them, 66k columns, 1.046 in 85 s; from 1.073 with them in the first round
# already, 80k columns: 1.047 in 70 s, where the first round without them reaches 1.050 in 25 s)
LOCAL = 2
# a round is started only when its columns are at most this many per second left (IOPDDL M: 52k columns
# solved in 26 s, 66k in 85 s; K and N, 105k and 86k, not in 60 s)
GUIDED_COLUMNS_PER_SECOND = 1_000


def restrict(core: Core, keep: list[np.ndarray]) -> Core:
    """``core`` with node ``a`` limited to its strategies ``keep[a]`` (indices into ``core.costs[a]``)."""
    return dataclasses.replace(
        core,
        strategies=tuple(core.strategies[a][k] for a, k in enumerate(keep)),
        costs=tuple(c[k] for c, k in zip(core.costs, keep, strict=True)),
        edge_costs=tuple(m[np.ix_(keep[a], keep[b])] for (a, b), m in zip(core.edge_nodes.tolist(), core.edge_costs,
                                                                          strict=True)),
        mem_usage=tuple(u[keep[a]] for a, u in zip(core.mem_node.tolist(), core.mem_usage, strict=True)),
    )


def restriction_width(core: Core) -> int:
    """The largest ``m`` with ``n m + |E| m² <= MAX_COLUMNS`` (at least 2)."""
    n, e = core.num_nodes, core.edge_nodes.shape[0]
    m = 2
    while n * (m + 1) + e * (m + 1) ** 2 <= MAX_COLUMNS:
        m += 1
    return m


def improve_by_restriction(core: Core, ls: LocalSearch, deadline: float) -> int:
    """Rounds of the restricted ILP from ``ls.choice`` (memory-feasible) until one finds nothing or the
    deadline passes; ``ls`` holds the best answer after. Returns the rounds that improved."""
    m = restriction_width(core)
    improved = 0
    while time.perf_counter() < deadline - 0.5:
        choice = ls.choice.copy()
        before = core.objective(choice)
        keep = []
        for a in range(core.num_nodes):
            local = ls._local_cost(a)
            order = np.argsort(local, kind="stable")
            k = [int(choice[a])] + [int(s) for s in order[: m] if s != choice[a]]
            keep.append(np.array(sorted(k[:m]), dtype=np.int64))
        sub = restrict(core, keep)
        start = np.array([int(np.searchsorted(k, s)) for k, s in zip(keep, choice.tolist(), strict=True)])
        res = solve_by_row_generation(sub, deadline, incumbent=start)
        if res.choice is None:
            break
        new = np.array([k[s] for k, s in zip(keep, res.choice.tolist(), strict=True)], dtype=np.int64)
        if core.objective(new) >= before - 1e-9 * max(1.0, abs(before)):
            break
        ls.start_from(new)
        if not ls.feasible():
            ls.start_from(choice)
            break
        improved += 1
        if not res.optimal:
            break
    return improved


def _guides(core: Core) -> list[np.ndarray]:
    """Assignments that pull the whole core one way: the forest DP without memory, the cheapest strategy
    everywhere, the least memory everywhere (ties by cost)."""
    memory = _memory(core)
    least = []
    for m, c in zip(memory, core.costs, strict=True):
        tied = np.flatnonzero(m == m.min())
        least.append(int(tied[np.argmin(c[tied])]))
    cheapest = np.array([int(np.argmin(c)) for c in core.costs], dtype=np.int64)
    return [ForestDP(core).solve(), cheapest, np.array(least, dtype=np.int64)]


def _guided_keep(core: Core, ls: LocalSearch, guides: list[np.ndarray], memory: list[np.ndarray],
                 local: int) -> list[np.ndarray]:
    choice = ls.choice
    keep = []
    for a in range(core.num_nodes):
        s = int(choice[a])
        k = {s, *(int(g[a]) for g in guides)}
        lighter = np.flatnonzero(memory[a] < memory[a][s])
        if lighter.size:
            k.add(int(lighter[np.argmin(core.costs[a][lighter])]))
        if local:
            k.update(int(t) for t in np.argsort(ls._local_cost(a), kind="stable")[:local])
        keep.append(np.array(sorted(k), dtype=np.int64))
    return keep


def guided_columns(core: Core, choice: np.ndarray) -> int:
    """Columns of the first round of ``improve_by_guides`` from ``choice``."""
    ls = LocalSearch(core)
    ls.choice = np.asarray(choice, dtype=np.int64).copy()
    return ilp_columns(restrict(core, _guided_keep(core, ls, _guides(core), _memory(core), 0)))


def guides_fit(columns: int, seconds: float) -> bool:
    """Whether a round of ``columns`` columns is worth starting with ``seconds`` left."""
    return columns <= GUIDED_COLUMNS_PER_SECOND * max(0.0, seconds)


def _memory(core: Core) -> list[np.ndarray]:
    """Per node, the memory of each strategy summed over its terms."""
    memory = [np.zeros(c.shape[0]) for c in core.costs]
    for a, u in zip(core.mem_node.tolist(), core.mem_usage, strict=True):
        memory[a] = memory[a] + u
    return memory


def improve_by_guides(core: Core, ls: LocalSearch, deadline: float) -> int:
    """Rounds of the ILP over the guided restriction (module docstring) from ``ls.choice`` (memory-feasible)
    until one finds nothing, is not solved to optimality, or the deadline passes; ``ls`` holds the best
    answer after (never worse than before). Returns the rounds that improved."""
    if core.num_nodes == 0 or time.perf_counter() >= deadline:
        return 0
    guides = _guides(core)
    memory = _memory(core)
    improved, local = 0, 0
    while time.perf_counter() < deadline - 0.5:
        choice = ls.choice.copy()
        before = core.objective(choice)
        keep = _guided_keep(core, ls, guides, memory, local)
        sub = restrict(core, keep)
        columns = ilp_columns(sub)
        if not guides_fit(columns, deadline - time.perf_counter()) or not ilp_fits(columns,
                                                                                   deadline - time.perf_counter()):
            break
        start = np.array([int(np.searchsorted(k, s)) for k, s in zip(keep, choice.tolist(), strict=True)])
        res = solve_by_row_generation(sub, deadline, incumbent=start)
        if res.choice is None:
            break
        new = np.array([k[s] for k, s in zip(keep, res.choice.tolist(), strict=True)], dtype=np.int64)
        log.debug("guided ILP round (%d local): %d columns, %s after %d row rounds, %.6g -> %.6g", local, columns,
                  "optimal" if res.optimal else "stopped", res.rounds, before, core.objective(new))
        if core.objective(new) < before - 1e-9 * max(1.0, abs(before)):
            ls.start_from(new)
            if not ls.feasible():
                ls.start_from(choice)
                break
            improved += 1
        elif local == LOCAL:
            break  # nothing more with every candidate in
        if not res.optimal:
            break
        local = LOCAL
    return improved
