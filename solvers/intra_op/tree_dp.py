"""A good start for large cores: exact DP over a spanning forest, with memory priced in (Lagrangian).

The core's edges are ranked by how much they can matter (``max − min`` of their finite entries, +inf
patterns first) and a maximum spanning forest is kept (Kruskal). On a forest the problem without memory
is solved exactly by the two-pass min-sum DP: leaves send ``msg_{c→p}(s_p) = min_{s_c} R(s_p, s_c) +
c_c(s_c) + Σ msg_{→c}(s_c)`` to their parents, roots take their argmin, choices flow back down. Edges off
the forest are ignored by the DP (the local search that follows sees them).

Memory enters as a price: node ``a`` pays ``μ · Σ_{terms j of a} m_{j,s} · w(lo_j, hi_j)`` where
``w`` counts the *priced* rows (those some trial assignment overflowed) the term spans. ``μ`` is found by
doubling then bisection; every trial that fits in memory is a candidate start, the cheapest one wins.
"""

from __future__ import annotations

import time

import numpy as np

from solvers.intra_op.presolve import Core

__all__ = ["ForestDP", "lagrangian_start"]


class ForestDP:
    """A maximum spanning forest of a core and the DP over it."""

    def __init__(self, core: Core) -> None:
        n = core.num_nodes
        self.core = core
        weights = []
        for m in core.edge_costs:
            fin = m[np.isfinite(m)]
            spread = float(fin.max() - fin.min()) if fin.size else 0.0
            weights.append(np.inf if fin.size < m.size else spread)
        order = np.argsort(-np.array(weights), kind="stable") if weights else np.zeros(0, dtype=np.int64)
        parent = list(range(n))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        tree: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for e in order.tolist():
            a, b = core.edge_nodes[e]
            ra, rb = find(int(a)), find(int(b))
            if ra != rb:
                parent[ra] = rb
                tree[a].append((int(b), e))
                tree[b].append((int(a), e))
        # BFS order from one root per component
        self.order: list[int] = []
        self.up: list[tuple[int, int, bool]] = [(-1, -1, False)] * n  # (parent, edge, parent is edge's first)
        seen = np.zeros(n, dtype=bool)
        for r in range(n):
            if seen[r]:
                continue
            seen[r] = True
            head = len(self.order)
            self.order.append(r)
            while head < len(self.order):
                a = self.order[head]
                head += 1
                for b, e in tree[a]:
                    if not seen[b]:
                        seen[b] = True
                        self.up[b] = (a, e, int(core.edge_nodes[e][0]) == a)
                        self.order.append(b)
        big = 1e6 * max(1.0, max((float(np.abs(c).max()) for c in core.costs), default=1.0)) * max(n, 1)
        self.mats = [np.where(np.isfinite(m), m, big) for m in core.edge_costs]

    def solve(self, extra: list[np.ndarray] | None = None) -> np.ndarray:
        core = self.core
        total = [c.copy() for c in core.costs]
        if extra is not None:
            for t, x in zip(total, extra, strict=True):
                t += x
        args: list[np.ndarray | None] = [None] * core.num_nodes
        for c in reversed(self.order):
            p, e, p_first = self.up[c]
            if p < 0:
                continue
            m = self.mats[e] if p_first else self.mats[e].T  # (k_p, k_c)
            t = m + total[c][None, :]
            arg = t.argmin(1)
            args[c] = arg
            total[p] += t[np.arange(t.shape[0]), arg]
        choice = np.zeros(core.num_nodes, dtype=np.int64)
        for a in self.order:
            p = self.up[a][0]
            choice[a] = int(np.argmin(total[a])) if p < 0 else int(args[a][choice[p]])
        return choice


def lagrangian_start(core: Core, deadline: float) -> np.ndarray | None:
    """The cheapest memory-feasible forest-DP assignment found by pricing memory; None if none fits."""
    dp = ForestDP(core)
    choice = dp.solve()
    if core.slack.size == 0:
        return choice
    tol = 1e-9 * max(1.0, float(np.abs(core.slack).max()))

    def over(ch: np.ndarray) -> np.ndarray:
        return core.usage(ch) > core.slack + tol

    priced = over(choice)
    if not priced.any():
        return choice
    scale_cost = float(np.mean([np.ptp(c) for c in core.costs])) + 1e-12
    scale_mem = float(np.mean([np.ptp(u) for u in core.mem_usage])) + 1e-12 if core.mem_usage else 1.0

    def prices(mu: float) -> list[np.ndarray]:
        w = np.concatenate([[0.0], np.cumsum(priced)])
        span = w[core.mem_hi] - w[core.mem_lo]
        extra = [np.zeros_like(c) for c in core.costs]
        for a, u, s in zip(core.mem_node.tolist(), core.mem_usage, span.tolist(), strict=True):
            if s:
                extra[a] += mu * s * u
        return extra

    best, best_obj = None, np.inf
    lo, hi = 0.0, scale_cost / scale_mem / max(1.0, float(priced.sum()))
    for _ in range(40):  # doubling until an assignment fits
        if time.perf_counter() > deadline:
            return best
        ch = dp.solve(prices(hi))
        bad = over(ch)
        if not bad.any():
            best, best_obj = ch, core.objective(ch)
            break
        priced |= bad
        lo, hi = hi, hi * 2
    else:
        return None
    for _ in range(8):  # bisection on the price
        if time.perf_counter() > deadline:
            break
        mid = 0.5 * (lo + hi)
        ch = dp.solve(prices(mid))
        bad = over(ch)
        if bad.any():
            lo = mid
            priced |= bad
        else:
            hi = mid
            obj = core.objective(ch)
            if obj < best_obj:
                best, best_obj = ch, obj
    return best
