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

A lower bound comes with it: the messages' reparametrisation (``θ̄_a = θ_a + Σ_b M_{b→a}``, ``θ̄_ab(s, u) =
R^ab(s, u) − M_{a→b}(u) − M_{b→a}(s)``, the same energy at every point) split into TRW-S's monotonic chains
(each edge on one, node ``a``'s unary shared by the ``1 / γ_a`` chains through it), each chain minimised by
a DP: the sum of their minima is below the priced problem's minimum, whatever the messages (``+inf``
entries stand as ``_Flat``'s finite penalty, which can only lower it). Less
``Σ_r λ_r slack_r`` it bounds the memory-constrained problem (Lagrangian duality); the best over the rounds is
returned. IOPDDL, 20 s of the search alone: M 0.9755 of the best known, N 0.876, K 0.768 (the forest
bound of ``bound.py`` the solve reported before: 0.14-0.20, 0.351, 0.05).

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
        self._chains(node_of, later)

    def _chains(self, node_of: np.ndarray, later: np.ndarray) -> None:
        """Monotonic chains covering every edge once (TRW-S's trees): at each node the i-th edge from an
        earlier neighbour continues along the i-th edge to a later one; a node lies on
        ``max(#earlier, #later, 1)`` chains, the ``1 / γ`` its unary is shared by."""
        f = self.flat
        n = f.k.shape[0]
        ins: list[list[int]] = [[] for _ in range(n)]
        outs: list[list[int]] = [[] for _ in range(n)]
        for p, (a, up) in enumerate(zip(node_of.tolist(), later.tolist(), strict=True)):
            (outs if up else ins)[a].append(p)
        nxt: dict[int, int] = {}
        for b in range(n):
            for q_in, q_out in zip(ins[b], outs[b], strict=False):
                nxt[q_in] = q_out
        continued = set(nxt.values())
        nodes: list[int] = []
        entries: list[int] = []
        off = [0]
        nbr, rev = f.adj_nbr.tolist(), self.rev.tolist()
        for a in self.order.tolist():
            starts = [p for p in outs[a] if p not in continued]
            if not ins[a] and not outs[a]:
                nodes.append(a)
                entries.append(-1)
                off.append(len(nodes))
            for p in starts:
                nodes.append(a)
                entries.append(-1)
                q: int | None = p
                while q is not None:
                    nodes.append(nbr[q])
                    entries.append(q)
                    q = nxt.get(rev[q])
                off.append(len(nodes))
        self.chain_off = np.asarray(off, np.int64)
        self.chain_nodes = np.asarray(nodes, np.int64)
        self.chain_entries = np.asarray(entries, np.int64)
        self.share = self.gamma
        self.hbar = np.zeros(f.cost.shape[0])
        self.w = np.zeros_like(self.h)

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

    def lower_bound(self, theta: np.ndarray) -> float:
        """TRW-S's bound on ``min_x Σ_a theta_a(x_a) + Σ_ab R^ab(x_a, x_b)`` at the current messages: the
        messages' reparametrisation split into the monotonic chains, each minimised exactly (valid for any
        messages; the optimum itself once TRW-S has converged on a tree)."""
        from solvers.intra_op import _trws_kernel as kern

        f = self.flat
        return float(kern.chain_bound(f.k, f.koff, theta, f.adj_off, f.adj_omoff, f.omats, self.rev, self.moff,
                                      self.msg, self.share, self.chain_off, self.chain_nodes, self.chain_entries,
                                      self.hbar, self.h, self.w))


def improve_by_messages(core: Core, ls: LocalSearch, deadline: float) -> tuple[list[np.ndarray], float]:
    """Rounds of the module docstring until ``deadline``; ``ls`` ends at the best feasible point found (its
    start when none is cheaper). Returns the distinct feasible points the rounds ended at, cheapest first
    (at most ``POOL``; for a merge), and a lower bound on the core's objective (without ``constant``;
    ``-inf`` when none was computed): the best over the rounds of the Lagrangian dual bound
    ``LB(θ_λ) − Σ_r λ_r slack_r``, ``LB`` the messages' chain bound on the priced problem (a point that fits
    has ``Σ_r λ_r (usage_r − slack_r) <= 0``, so it costs at least its priced energy less ``Σ_r λ_r slack_r``)."""
    if core.num_nodes == 0 or not core.edge_nodes.shape[0] or not ls.feasible():
        return [], -np.inf
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
    bound = -np.inf
    while time.perf_counter() < deadline:
        cum = np.concatenate([[0.0], np.cumsum(lam)])
        f.term_prices(cum[f.term_hi] - cum[f.term_lo], priced)
        theta = f.cost + priced
        msgs.solve(theta, ITERATIONS, x, deadline)
        bound = max(bound, msgs.lower_bound(theta) - float(lam @ core.slack))
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
    return [p for _, p in found], bound



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
