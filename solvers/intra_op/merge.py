r"""Solution merging: the best recombination of a few good assignments, solved exactly by one small ILP.

Core symbols as in ``ilp.py``. Given memory-feasible points ``x^1..x^p`` of the core, node ``a`` keeps only
the strategies the points give it, ``K_a = {x^1_a, .., x^p_a}``. Nodes where every point agrees are held
fixed; the others, ``D = {a : |K_a| > 1}``, form a window (``lns._sub_core``: an edge to a fixed neighbour
``b`` adds ``R^e(·, s_b)`` to the node's cost; a memory row keeps only the terms of ``D``, with slack
``S_r`` less the fixed nodes' usage, taken as its minimum over each stretch of rows where ``D``'s live set
does not change) restricted to ``K_a`` (``restrict.restrict``):

.. math::

    \min_{x_a ∈ K_a,\ a ∈ D} \; Σ_{a ∈ D} c'_a(x_a) + Σ_{e=(a,b) ⊆ D} R^e(x_a, x_b)
    \quad \text{s.t. every memory row}

Every ``x^i`` is a point of it, so its optimum is at most ``min_i f(x^i)``; and it may take each node's
strategy from a different point, which no single walk reaches: two annealing walks settle in different
basins, and where they disagree is mostly a few hundred independent pieces (a layer here, a reshard there)
each better in one of them. The columns are ``Σ_{a∈D} |K_a| + Σ_{e ⊆ D} |K_a||K_b|``, at most
``|D| p + |E_D| p²``: a few thousand to tens of thousands where an ILP over all strategies has millions.

This is the "merge & solve" step of Construct, Merge, Solve & Adapt (Blum, Pinacho, López-Ibáñez, Lozano,
"Construct, Merge, Solve & Adapt: a new general algorithm for combinatorial optimization", Computers &
Operations Research 68, 2016), and the "optimal recombination" of genetic algorithms. Measured (IOPDDL K,
two annealed points at 1.036 and 1.074 of the best known, 1373 nodes apart): 9.8k columns, 5.9k rows,
1.020 within 5 s.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from solvers.intra_op.ilp import ILP_COLUMNS_PER_SECOND, ILP_SETUP_SHARE, ilp_columns, ilp_fits, solve_ilp
from solvers.intra_op.lns import _sub_core
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core
from solvers.intra_op.restrict import restrict
from solvers.intra_op.watchdog import IN_PROCESS_COLUMNS

__all__ = ["Merger"]

log = logging.getLogger(__name__)

# a merge ILP big enough to run in a child process (``watchdog``) gives HiGHS this share of the time left
# less this many seconds: starting the child and sending it the model took up to 1 s past the deadline
CHILD_SHARE = 0.8
CHILD_SECONDS = 0.3


class Merger:
    """Merges points of one core (builds the core's adjacency once)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.ls = LocalSearch(core)
        self.incident: list[list[int]] = [[] for _ in range(core.num_nodes)]
        for e, (a, b) in enumerate(core.edge_nodes.tolist()):
            self.incident[a].append(e)
            self.incident[b].append(e)

    def merge(self, points: list[np.ndarray], deadline: float) -> np.ndarray:
        """The best assignment over the union of ``points`` (memory-feasible, never worse than the best of
        them) found by ``deadline`` (perf_counter). The points are taken best first; one whose union would
        not set up in the time left is left out."""
        core = self.core
        objs = [core.objective(p) for p in points]
        order = np.argsort(objs, kind="stable")
        best = np.asarray(points[order[0]], dtype=np.int64).copy()
        best_obj = objs[order[0]]
        used = [best]
        for i in order[1:].tolist():
            cand = [*used, np.asarray(points[i], dtype=np.int64)]
            if self._columns(cand) <= ILP_COLUMNS_PER_SECOND * ILP_SETUP_SHARE * (deadline - time.perf_counter()):
                used = cand
        window = _window(used)
        if window.size == 0 or time.perf_counter() >= deadline:
            return best
        self.ls.start_from(best)
        sub = _sub_core(core, self.ls, window, self.incident)
        keep = [np.unique(np.array([p[a] for p in used])) for a in window.tolist()]
        sub = restrict(sub, keep)
        columns = ilp_columns(sub)
        left = deadline - time.perf_counter()
        # the model HiGHS gets has a column per memory row more (``ilp.build_ilp``): that count decides
        # whether it runs in a child (``watchdog``)
        if columns + sub.slack.shape[0] >= IN_PROCESS_COLUMNS:
            left = CHILD_SHARE * left - CHILD_SECONDS  # a child process to start and the model to send
        if left < 0.1 or not ilp_fits(columns, left):
            return best
        start = np.array([int(np.searchsorted(k, s)) for k, s in zip(keep, best[window].tolist(), strict=True)])
        res = solve_ilp(sub, time_limit_s=left, warm_start=start)
        if res.choice is None:
            return best
        new = best.copy()
        new[window] = [int(k[s]) for k, s in zip(keep, res.choice.tolist(), strict=True)]
        log.debug("merge of %d points: %d nodes, %d columns, %d rows, %s in %.1f s, %.6g -> %.6g", len(used),
                  window.size, columns, sub.slack.shape[0], res.status, res.seconds, best_obj,
                  core.objective(new))
        self.ls.start_from(new)
        return new if self.ls.feasible() and core.objective(new) < best_obj else best

    def _columns(self, points: list[np.ndarray]) -> int:
        """Columns of the merge ILP of ``points`` (strategies per node times those of its neighbours)."""
        stack = np.sort(np.stack(points), axis=0)
        width = 1 + (np.diff(stack, axis=0) != 0).sum(axis=0)
        wide = width > 1
        ea, eb = self.core.edge_nodes[:, 0], self.core.edge_nodes[:, 1]
        inner = wide[ea] & wide[eb]
        return int(width[wide].sum() + (width[ea] * width[eb])[inner].sum())


def _window(points: list[np.ndarray]) -> np.ndarray:
    """Nodes where the points disagree."""
    stack = np.stack(points)
    return np.flatnonzero((stack != stack[0]).any(axis=0))
