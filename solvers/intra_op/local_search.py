"""Feasible incumbents for the core: a memory-aware start and iterated conditional modes (ICM).

ICM visits nodes in turn and moves each to the strategy that minimises its local cost
``c_a(s) + Σ_{e ∋ a} R^e(s, s_b)`` among the strategies that keep every memory row it touches within its
slack. Each move never raises the objective, so the search only improves; it stops at a local optimum
or when its deadline passes. ``+inf`` pairs are replaced by a large penalty here so that a start that
meets one is pushed towards finite choices.
"""

from __future__ import annotations

import time

import numpy as np

from solvers.intra_op.presolve import Core

__all__ = ["LocalSearch"]


class LocalSearch:
    """State of a local search over one core (mutable, private to one solve)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        n = core.num_nodes
        finite = [m[np.isfinite(m)] for m in core.edge_costs] + [c for c in core.costs]
        scale = max((float(np.abs(f).max()) for f in finite if f.size), default=1.0)
        self.penalty = 1e6 * max(scale, 1.0) * max(n, 1)
        self.nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        for (a, b), m in zip(core.edge_nodes.tolist(), core.edge_costs, strict=True):
            pm = np.where(np.isfinite(m), m, self.penalty)
            self.nbrs[a].append((b, pm))
            self.nbrs[b].append((a, pm.T))
        self.terms: list[list[int]] = [[] for _ in range(n)]
        for j, a in enumerate(core.mem_node.tolist()):
            self.terms[a].append(j)
        self.head = core.slack.copy()  # slack minus current usage
        self.choice = np.zeros(n, dtype=np.int64)

    # ------------------------------------------------------------ starts
    def start_min_memory(self) -> None:
        """Each node at the strategy using least memory over its rows, ties broken by cost."""
        c = self.core
        for a in range(c.num_nodes):
            weight = np.zeros(c.costs[a].shape[0])
            for j in self.terms[a]:
                weight += c.mem_usage[j] * (c.mem_hi[j] - c.mem_lo[j])
            order = np.lexsort((c.costs[a], weight))
            self.choice[a] = order[0]
        self._reset_head()

    def start_from(self, choice: np.ndarray) -> None:
        self.choice = np.asarray(choice, dtype=np.int64).copy()
        self._reset_head()

    def _reset_head(self) -> None:
        self.head = self.core.slack - self.core.usage(self.choice)

    def feasible(self) -> bool:
        return bool((self.head >= -1e-9 * max(1.0, float(np.abs(self.core.slack).max(initial=1.0)))).all())

    def objective(self) -> float:
        return self.core.objective(self.choice)

    def local_objective(self, nodes: np.ndarray) -> float:
        """Cost of ``nodes`` plus every edge touching them (each edge once) at the current choice."""
        seen = set(nodes.tolist())
        total = 0.0
        for a in nodes.tolist():
            total += float(self.core.costs[a][self.choice[a]])
            for b, m in self.nbrs[a]:
                if b not in seen or b > a:
                    total += float(m[self.choice[a], self.choice[b]])
        return total

    def refresh_memory(self, nodes: np.ndarray, old: np.ndarray, tol: float) -> bool:
        """After ``nodes`` moved from ``old``: update the headroom; False (nothing updated) if it overflows."""
        c = self.core
        if c.slack.size == 0:
            return True
        terms = [j for a in nodes.tolist() for j in self.terms[a]]
        if not terms:
            return True
        pos = {a: i for i, a in enumerate(nodes.tolist())}
        diff = np.zeros(c.slack.shape[0] + 1)
        for j in terms:
            a = int(c.mem_node[j])
            d = c.mem_usage[j][self.choice[a]] - c.mem_usage[j][old[pos[a]]]
            diff[c.mem_lo[j]] += d
            diff[c.mem_hi[j]] -= d
        delta = np.cumsum(diff)[:-1]
        head = self.head - delta
        if (head < -tol).any():
            return False
        self.head = head
        return True

    # ------------------------------------------------------------ moves
    def _local_cost(self, a: int) -> np.ndarray:
        cost = self.core.costs[a].copy()
        for b, m in self.nbrs[a]:
            cost += m[:, self.choice[b]]
        return cost

    def _allowed(self, a: int) -> tuple[np.ndarray, list[tuple[int, int, np.ndarray]]]:
        """Strategies of ``a`` that keep its rows within slack, and the per-term usage deltas."""
        c = self.core
        k = c.costs[a].shape[0]
        terms = self.terms[a]
        if not terms:
            return np.ones(k, dtype=bool), []
        cur = self.choice[a]
        deltas = [(int(c.mem_lo[j]), int(c.mem_hi[j]), c.mem_usage[j] - c.mem_usage[j][cur]) for j in terms]
        lo0 = min(d[0] for d in deltas)
        hi0 = max(d[1] for d in deltas)
        dd = np.zeros((k, hi0 - lo0))
        for lo, hi, d in deltas:
            dd[:, lo - lo0 : hi - lo0] += d[:, None]
        tol = 1e-9 * max(1.0, float(np.abs(c.slack).max(initial=1.0)))
        worst = (dd - self.head[None, lo0:hi0]).max(1)
        ok = worst <= tol
        ok[cur] = True
        return ok, deltas

    def _move(self, a: int, s: int, deltas: list[tuple[int, int, np.ndarray]]) -> None:
        for lo, hi, d in deltas:
            self.head[lo:hi] -= d[s]
        self.choice[a] = s

    def improve(self, deadline: float, nodes: np.ndarray | None = None) -> int:
        """ICM sweeps until a sweep makes no move or ``deadline`` (perf_counter) passes; returns moves."""
        order = np.arange(self.core.num_nodes) if nodes is None else nodes
        moves = 0
        dirty = np.ones(self.core.num_nodes, dtype=bool)
        while True:
            moved = 0
            for visited, a in enumerate(order.tolist()):
                if (visited & 63) == 0 and time.perf_counter() > deadline:
                    return moves + moved
                if not dirty[a]:
                    continue
                dirty[a] = False
                local = self._local_cost(a)
                cur = self.choice[a]
                best = int(np.argmin(local))
                if local[best] >= local[cur] - 1e-12 * max(1.0, abs(local[cur])):
                    continue
                ok, deltas = self._allowed(a)
                cand = np.where(ok, local, np.inf)
                best = int(np.argmin(cand))
                if cand[best] < local[cur] - 1e-12 * max(1.0, abs(local[cur])):
                    self._move(a, best, deltas)
                    moved += 1
                    for b, _ in self.nbrs[a]:
                        dirty[b] = True
                    dirty[a] = True
            moves += moved
            if moved == 0 or time.perf_counter() > deadline:
                return moves
