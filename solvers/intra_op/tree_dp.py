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

from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core

__all__ = ["ForestDP", "block_descent", "lagrangian_start"]


class ForestDP:
    """A maximum spanning forest of a core and the DP over it."""

    def __init__(self, core: Core, tree_edges: list[int] | None = None, mats: list[np.ndarray] | None = None) -> None:
        n = core.num_nodes
        self.core = core
        tree: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for e in _max_spanning_forest(core) if tree_edges is None else tree_edges:
            a, b = core.edge_nodes[e]
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
        self.roots = np.array([a for a in self.order if self.up[a][0] < 0], dtype=np.int64)
        if mats is None:
            big = 1e6 * max(1.0, max((float(np.abs(c).max()) for c in core.costs), default=1.0)) * max(n, 1)
            mats = [np.where(np.isfinite(m), m, big) for m in core.edge_costs]
        self.mats = mats

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


def _max_spanning_forest(core: Core) -> list[int]:
    """Kruskal on ``max − min`` of each edge's finite entries (+inf patterns first)."""
    weights = []
    for m in core.edge_costs:
        fin = m[np.isfinite(m)]
        spread = float(fin.max() - fin.min()) if fin.size else 0.0
        weights.append(np.inf if fin.size < m.size else spread)
    order = np.argsort(-np.array(weights), kind="stable") if weights else np.zeros(0, dtype=np.int64)
    parent = list(range(core.num_nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    out = []
    for e in order.tolist():
        ra, rb = find(int(core.edge_nodes[e][0])), find(int(core.edge_nodes[e][1]))
        if ra != rb:
            parent[ra] = rb
            out.append(e)
    return out


def block_descent(core: Core, ls: LocalSearch, deadline: float, *, seed: int = 0) -> int:
    """Exact moves of whole trees: pick a random *induced* forest ``S`` of the core (no edge among ``S``
    is left out), hold every other node fixed, and solve each tree of ``S`` exactly by the forest DP
    (edges to fixed nodes become unary costs). Trees share no edge, so each tree's change is applied on
    its own when it lowers the objective and keeps memory within slack. Returns the trees changed."""
    rng = np.random.default_rng(seed)
    n = core.num_nodes
    big = 1e6 * max(1.0, max((float(np.abs(c).max()) for c in core.costs), default=1.0)) * max(n, 1)
    mats = [np.where(np.isfinite(m), m, big) for m in core.edge_costs]
    incident: list[list[int]] = [[] for _ in range(n)]
    for e, (a, b) in enumerate(core.edge_nodes.tolist()):
        incident[a].append(e)
        incident[b].append(e)
    tol = 1e-9 * max(1.0, float(np.abs(core.slack).max(initial=1.0)))
    changed_total = idle = 0
    while time.perf_counter() < deadline:
        parent = np.arange(n)
        in_s = np.zeros(n, dtype=bool)
        for a in rng.permutation(n).tolist():
            roots = set()
            ok = True
            for b, _ in ls.nbrs[a]:
                if in_s[b]:
                    r = _find(parent, b)
                    if r in roots:
                        ok = False
                        break
                    roots.add(r)
            if ok:
                in_s[a] = True
                for r in roots:
                    parent[r] = a
        tree_edges = [e for e, (a, b) in enumerate(core.edge_nodes.tolist()) if in_s[a] and in_s[b]]
        choice = ls.choice
        unary = [c.copy() for c in core.costs]
        for a in np.flatnonzero(in_s).tolist():
            for e in incident[a]:
                x, y = core.edge_nodes[e]
                if x == a and not in_s[y]:
                    unary[a] += mats[e][:, choice[y]]
                elif y == a and not in_s[x]:
                    unary[a] += mats[e][choice[x], :]
        sub = Core(nodes=core.nodes, strategies=core.strategies, costs=tuple(unary), edge_nodes=core.edge_nodes,
                   edge_costs=core.edge_costs, mem_node=core.mem_node, mem_lo=core.mem_lo, mem_hi=core.mem_hi,
                   mem_usage=core.mem_usage, slack=core.slack, constant=0.0)
        dp = ForestDP(sub, tree_edges, mats)
        new = dp.solve()
        # group S nodes by tree (root of the BFS)
        comp = np.full(n, -1, dtype=np.int64)
        for a in dp.order:
            p = dp.up[a][0]
            comp[a] = a if p < 0 else comp[p]
        changed = 0
        members: dict[int, list[int]] = {}
        for a in np.flatnonzero(in_s & (new != choice)).tolist():
            members.setdefault(int(comp[a]), []).append(a)
        for nodes in members.values():
            if time.perf_counter() > deadline:
                break
            nodes_arr = np.array(nodes)
            old_s, new_s = choice[nodes_arr].copy(), new[nodes_arr]
            before = ls.local_objective(nodes_arr)
            choice[nodes_arr] = new_s
            after = ls.local_objective(nodes_arr)
            if after >= before - 1e-12 * max(1.0, abs(before)) or not ls.refresh_memory(nodes_arr, old_s, tol):
                choice[nodes_arr] = old_s
                continue
            changed += 1
        changed_total += changed
        idle = 0 if changed else idle + 1
        if idle >= 8:
            break
    return changed_total


def _find(parent: np.ndarray, x: int) -> int:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = int(parent[x])
    return x


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
