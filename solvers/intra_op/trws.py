r"""Lagrangian search with message passing: memory priced per row, the priced problem solved by TRW-S.

Core symbols as in ``ilp.py`` and ``lagrange_search.py``. With multipliers ``λ_r >= 0`` on the memory rows,
node ``a`` taking ``s`` costs ``θ_a(s) = c_a(s) + Σ_{j : a_j = a} m_{j,s} Σ_{lo_j <= r < hi_j} λ_r`` and the rows
are dropped: what is left is a pairwise energy ``Σ_a θ_a(x_a) + Σ_(a,b) R^ab(x_a, x_b)`` (a weighted CSP),
which the contest's winners solved with a WCSP solver for each weighting of memory (toulbar2; "Soft
Constraints, Strong Solutions"). Here the priced energy is minimised by sequential tree-reweighted message
passing (TRW-S, Kolmogorov 2006) over the core in its node order: per node a reparametrised unary
``h_a = θ_a + Σ_b M_{b→a}``, and to each neighbour ``b`` later in the pass

    M_{a→b}(u) = min_s  γ_a h_a(s) − M_{b→a}(s) + R^ab(s, u),     γ_a = 1 / max(#earlier, #later neighbours),

normalised to a minimum of 0; a forward and a backward pass make one iteration. A point is decoded in node
order: each node takes the argmin of its unary, the edge costs to the neighbours already decided and the
messages from the others. Messages carry over from one weighting to the next (the weightings move
little), so each costs ``ITERATIONS`` iterations, not a solve from scratch.

One round: decode at the current ``λ``; ``λ_r`` grows by the factor ``1 + γ`` (at least to ``λ_0``) on each
row the point overflows and shrinks by ``1 − γ/2`` on each row with more than 5% of its slack free; when at
most ``REPAIR_ROWS`` of the rows overflow, a copy is repaired (``lagrange_search._repair``: the moves
freeing memory on the worst row at the least cost per byte) and improved by ICM with the rows
(``local_search``). The best feasible point seen is kept.

Why: the annealing's walks (``anneal``) make local moves and end in whichever basin their first round
falls into; messages weigh every node's choice against its whole neighbourhood at once. IOPDDL, 60 s of
this alone from the solve's start, one thread (``benchmarks/iopddl_results.md``): M 1.0036 of the best
known (annealing and the guided ILP: 1.045 at 180 s), N 1.040 (annealing: 1.08-1.14), K 1.039.
"""

from __future__ import annotations

import time

import numpy as np

from solvers.intra_op.anneal import _Flat
from solvers.intra_op.lagrange_search import _repair, _row_index
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core

__all__ = ["improve_by_messages"]

# TRW-S iterations (a forward and a backward pass) per weighting of memory
ITERATIONS = 20
# multiplicative step of the row prices
GAMMA = 0.3
# a decoded point is repaired only when at most this share of the rows overflow (repairing a point that
# overflows everywhere is slow and lands far from the priced optimum; the prices move first)
REPAIR_ROWS = 0.05
# seconds one repair may take
REPAIR_SECONDS = 2.0
# distinct feasible points kept for a merge
POOL = 8


class _Messages:
    """The core in ``_Flat``'s arrays, plus what TRW-S needs: each adjacency entry's reverse, message
    offsets, the node order and the weights ``γ``."""

    def __init__(self, core: Core) -> None:
        f = self.flat = _Flat(core)
        n = core.num_nodes
        m = core.edge_nodes.shape[0]
        # _Flat files entry q < m as edge q seen from its first node, q >= m from its second, sorted by node
        src = np.concatenate([core.edge_nodes[:, 0], core.edge_nodes[:, 1]]).astype(np.int64)
        order_q = np.argsort(src, kind="stable")
        inv = np.empty_like(order_q)
        inv[order_q] = np.arange(2 * m)
        self.rev = inv[(order_q + m) % max(2 * m, 1)]
        node_of = np.repeat(np.arange(n), np.diff(f.adj_off))
        self.moff = np.zeros(2 * m + 1, np.int64)
        np.cumsum(f.k[node_of], out=self.moff[1:])
        self.order = np.arange(n, dtype=np.int64)
        self.pos = np.arange(n, dtype=np.int64)
        later = self.pos[f.adj_nbr] > self.pos[node_of]
        after = np.bincount(node_of, weights=later, minlength=n)
        before = np.bincount(node_of, weights=~later, minlength=n)
        self.gamma = 1.0 / np.maximum(np.maximum(before, after), 1.0)
        self.msg = np.zeros(int(self.moff[-1]))
        self.h = np.zeros(int(f.k.max(initial=1)))

    def solve(self, theta: np.ndarray, iterations: int, x: np.ndarray, deadline: float = np.inf) -> None:
        """``iterations`` TRW-S iterations on unaries ``theta`` (flat, as ``_Flat.cost``; fewer when
        ``deadline`` passes), then decode into ``x``."""
        from solvers.intra_op import _trws_kernel as kern

        f = self.flat
        graph = (self.order, self.pos, f.k, f.koff, theta, f.adj_off, f.adj_nbr, f.adj_omoff, f.omats)
        for i in range(iterations):
            if i and time.perf_counter() > deadline:
                break
            kern.sweep(*graph, self.rev, self.moff, self.msg, self.gamma, self.h, True)
            kern.sweep(*graph, self.rev, self.moff, self.msg, self.gamma, self.h, False)
        kern.decode(*graph, self.moff, self.msg, x, self.h)


def improve_by_messages(core: Core, ls: LocalSearch, deadline: float) -> list[np.ndarray]:
    """Rounds of the module docstring until ``deadline``; ``ls`` ends at the best feasible point found (its
    start when none is cheaper). Returns the distinct feasible points the rounds ended at, cheapest first
    (at most ``POOL``; for a merge)."""
    if core.num_nodes == 0 or not core.edge_nodes.shape[0] or not ls.feasible():
        return []
    msgs = _Messages(core)
    f = msgs.flat
    best, best_obj = ls.choice.copy(), ls.objective()
    rows = core.slack.shape[0]
    lam = np.zeros(rows)
    lam0 = 0.0
    if rows and core.mem_usage:
        span = float((core.mem_hi - core.mem_lo).mean())
        scale_cost = float(np.mean([np.ptp(c) for c in core.costs])) + 1e-12
        scale_mem = float(np.mean([np.ptp(u) for u in core.mem_usage])) + 1e-12
        lam0 = scale_cost / scale_mem / max(1.0, span)
    row_terms = _row_index(core) if rows else []
    priced = np.zeros(f.cost.shape[0])
    x = np.zeros(core.num_nodes, np.int64)
    pool: dict[bytes, tuple[float, np.ndarray]] = {}
    while time.perf_counter() < deadline:
        cum = np.concatenate([[0.0], np.cumsum(lam)])
        f.term_prices(cum[f.term_hi] - cum[f.term_lo], priced)
        msgs.solve(f.cost + priced, ITERATIONS, x, deadline)
        if not rows:
            ls.start_from(x.copy())
            ls.improve(deadline)
            _keep(pool, ls)
            break
        over = core.usage(x) - core.slack
        lam = np.where(over > f.tol, np.maximum(lam * (1 + GAMMA), lam0), lam)
        lam = np.where(over < -0.05 * np.abs(core.slack), lam * (1 - GAMMA / 2), lam)
        if (over > f.tol).sum() > REPAIR_ROWS * rows:
            continue
        y = _repair(core, ls, x.copy(), over, row_terms, f.tol, min(deadline, time.perf_counter() + REPAIR_SECONDS))
        if y is None:
            continue
        ls.start_from(y)
        ls.improve(deadline)
        _keep(pool, ls)
    found = sorted(pool.values(), key=lambda p: p[0])
    if found and found[0][0] < best_obj:
        best = found[0][1]
    ls.start_from(best)
    return [p for _, p in found]



def _keep(pool: dict[bytes, tuple[float, np.ndarray]], ls: LocalSearch) -> None:
    if not ls.feasible():
        return
    obj = ls.objective()
    key = ls.choice.tobytes()
    if key in pool:
        return
    if len(pool) >= POOL:
        worst = max(pool, key=lambda k: pool[k][0])
        if pool[worst][0] <= obj:
            return
        del pool[worst]
    pool[key] = (obj, ls.choice.copy())
