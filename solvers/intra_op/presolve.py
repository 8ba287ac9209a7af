"""Exact reductions that shrink an intra-operator problem to its hard core before any ILP.

Every reduction keeps the optimum (and the set of optimal assignments' costs) unchanged:

* **forbidden strategies**: a strategy with ``+inf`` node cost, with no finite partner on some edge, or
  whose extra memory alone overflows some step of its live interval is disabled (its cost set to +inf).
* **dominance**: strategy ``b`` of node ``u`` is dropped when another strategy ``a`` is no worse in node
  cost, in the memory of every member value, and in every incident edge row (ties keep the lower index).
* **fixing**: a node with one strategy left is folded into its neighbours' node costs.
* **following** (XLA's "follow" aliasing): when an edge allows exactly one strategy of ``u`` per strategy
  of ``v`` (an ``+inf`` off-diagonal pattern: "``u`` must agree with ``v``"), ``u`` is merged into ``v``:
  ``v`` keeps its strategies, ``u``'s cost, memory and other edges are re-indexed through the map.
* **reparametrisation**: an edge's row minima move into ``u``'s costs and column minima into ``v``'s; an
  edge left all zero is dropped.
* **variable elimination** (the DP over trees and chains): a node whose memory does not depend on its
  strategy and that has degree 0, 1 or 2 is eliminated exactly — degree 1 adds
  ``min_{s_u} c_u(s_u) + E(s_u, s_v)`` to ``v``'s costs, degree 2 adds ``min_{s_u} c_u + E_uv + E_uw`` as a
  new ``(v, w)`` edge — and its argmin tables are replayed backwards once the rest is solved. Repeated to
  a fixed point this solves any tree or chain exactly and contracts series chains inside a graph.

Memory. Let ``B_t = Σ_{i live at t} min_s mem_i(s)`` (the least usage at ``t``) and ``slack_t = M − B_t``;
the rows become ``Σ_i exc_i(s_i) <= slack_t`` with ``exc_i = mem_i − min mem_i >= 0``. A row whose live
nodes' largest excesses sum to at most its slack never binds and is dropped; a node live only at dropped
rows is *memory-free*. Only memory-free nodes may be eliminated; merges and fixes carry memory along.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from solvers.intra_op.problem import InfeasibleError, IntraOpProblem

__all__ = ["Core", "Reduced", "presolve"]

_TOL = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Core:
    """The hard core: what presolve could not remove, with only its enabled strategies.

    Node ``a`` (working node ``nodes[a]``) has strategies ``strategies[a]`` (indices into its original
    node's strategies) costing ``costs[a]``. ``edge_nodes[e] = (a, b)`` with matrix ``edge_costs[e]``
    (``k_a × k_b``, may hold +inf). Memory term ``j`` adds ``mem_usage[j][s]`` to rows
    ``mem_lo[j] <= r < mem_hi[j]`` when node ``mem_node[j]`` takes strategy ``s``; row ``r`` must stay within
    ``slack[r]``. ``constant`` is the cost already committed by presolve.
    """

    nodes: np.ndarray
    strategies: tuple[np.ndarray, ...]
    costs: tuple[np.ndarray, ...]
    edge_nodes: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    mem_node: np.ndarray
    mem_lo: np.ndarray
    mem_hi: np.ndarray
    mem_usage: tuple[np.ndarray, ...]
    slack: np.ndarray
    constant: float

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    def objective(self, choice: np.ndarray) -> float:
        """Core cost of ``choice`` (compressed strategy indices), without ``constant``."""
        total = float(sum(c[s] for c, s in zip(self.costs, choice.tolist(), strict=True)))
        for (a, b), m in zip(self.edge_nodes.tolist(), self.edge_costs, strict=True):
            total += float(m[choice[a], choice[b]])
        return total

    def usage(self, choice: np.ndarray) -> np.ndarray:
        diff = np.zeros(self.slack.shape[0] + 1)
        if self.mem_node.size:
            vals = np.array([u[choice[a]] for a, u in zip(self.mem_node.tolist(), self.mem_usage, strict=True)])
            np.add.at(diff, self.mem_lo, vals)
            np.add.at(diff, self.mem_hi, -vals)
        return np.cumsum(diff)[:-1]

    def violation(self, choice: np.ndarray) -> float:
        if self.slack.size == 0:
            return 0.0
        return float(np.maximum(self.usage(choice) - self.slack, 0.0).sum())


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Reduced:
    """A presolved problem: the core, plus what is needed to expand a core answer to every node."""

    core: Core
    members: tuple[tuple[tuple[int, np.ndarray], ...], ...]
    log: tuple[tuple, ...]
    counts: dict[str, int]

    def expand(self, core_choice: np.ndarray, num_nodes: int) -> np.ndarray:
        """The original assignment for a core assignment (compressed indices)."""
        out = np.full(num_nodes, -1, dtype=np.int64)

        def assign(w: int, s: int) -> None:
            for o, m in self.members[w]:
                out[o] = m[s]

        for a, w in enumerate(self.core.nodes.tolist()):
            assign(w, int(self.core.strategies[a][core_choice[a]]))
        for rec in reversed(self.log):
            if rec[0] == "fix":
                assign(rec[1], rec[2])
            elif rec[0] == "leaf":
                assign(rec[1], int(rec[3][out[rec[2]]]))
            else:  # series
                assign(rec[1], int(rec[4][out[rec[2]], out[rec[3]]]))
        return out


class _Graph:
    """Mutable working graph, private to one presolve call."""

    def __init__(self, problem: IntraOpProblem, ties: np.ndarray | None = None) -> None:
        n = problem.num_nodes
        self.cost = [np.array(c, dtype=np.float64) for c in problem.node_costs]
        self.members: list[list[tuple[int, np.ndarray]]] = [
            [(i, np.arange(c.shape[0], dtype=np.int64))] for i, c in enumerate(self.cost)
        ]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.inf_edges: set[tuple[int, int]] = set()
        self.fresh: set[tuple[int, int]] = set()
        self.dom_done = np.zeros(n, dtype=bool)
        self.alive = np.ones(n, dtype=bool)
        self.log: list[tuple] = []
        self.constant = 0.0
        self.counts = dict(dominated=0, fixed=0, merged=0, eliminated=0, dropped_edges=0)
        self.problem = problem
        self._setup_memory(problem)
        if ties is None:
            for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs, strict=True):
                self._add_edge(u, v, np.asarray(m, dtype=np.float64))
        else:
            self._tie(np.asarray(ties, dtype=np.int64))
        self.en = [np.isfinite(c) for c in self.cost]

    def _tie(self, classes: np.ndarray) -> None:
        """Merge every node into the first node of its class, strategy for strategy (a restriction, see
        ``presolve``): the root's cost is the members' sum, an edge inside a class adds its diagonal, the
        edges between two classes add up into one. Each member keeps its own memory rows."""
        p = self.problem
        _, first, inverse = np.unique(classes, return_index=True, return_inverse=True)
        root = first[inverse].tolist()
        k = p.num_strategies
        bad = np.flatnonzero(k != k[root])
        if bad.size:
            u, v = int(bad[0]), root[int(bad[0])]
            raise ValueError(f"ties: {p.node_label(v)} and {p.node_label(u)} are in one class but have {k[v]} and "
                             f"{k[u]} strategies; only nodes with the same strategies can share a choice")
        for u, v in enumerate(root):
            if u != v:
                self.cost[v] = self.cost[v] + self.cost[u]  # (the memory setup may have set some to +inf)
                self.members[v].extend(self.members[u])
                self.alive[u] = False
                self.counts["merged"] += 1
        between: dict[tuple[int, int], np.ndarray] = {}
        for (u, v), m in zip(p.edges.tolist(), p.edge_costs, strict=True):
            a, b = root[u], root[v]
            if a == b:
                self.cost[a] = self.cost[a] + np.diagonal(m)  # both ends take one strategy
            elif a < b:
                between[a, b] = between[a, b] + m if (a, b) in between else np.asarray(m, dtype=np.float64)
            else:
                between[b, a] = between[b, a] + m.T if (b, a) in between else np.asarray(m.T, dtype=np.float64)
        for (a, b), m in between.items():
            self._add_edge(a, b, m)

    # ------------------------------------------------------------ memory bookkeeping
    def _setup_memory(self, p: IntraOpProblem) -> None:
        n = p.num_nodes
        self.relevant = np.zeros(n, dtype=bool)
        self.exc: list[np.ndarray] = [np.zeros_like(c) for c in self.cost]
        self.row_lo = np.zeros(n, dtype=np.int64)
        self.row_hi = np.zeros(n, dtype=np.int64)
        self.slack = np.zeros(0)
        self.fixed_usage = np.zeros(1)
        if p.memory_limit is None or n == 0:
            return
        p.check_memory_lower_bound()
        mins = p.min_memory()
        points = p.time_points()
        lo, hi = p.live_ranges(points)
        _, base = p.usage_at_points(mins)
        slack = p.memory_limit - base
        k = p.num_strategies
        offsets = np.concatenate([[0], np.cumsum(k)[:-1]])
        exc = np.concatenate(p.node_memory) - np.repeat(mins, k)
        self.exc = np.split(exc, offsets[1:])
        # a strategy whose extra memory alone overflows its tightest live step can never be chosen
        rmin = _range_min(slack, lo, hi)
        bad = (exc > np.repeat(rmin, k) + _TOL * max(1.0, abs(p.memory_limit))) & np.repeat(hi > lo, k)
        for i in np.unique(np.repeat(np.arange(n), k)[bad]).tolist():
            self.cost[i][bad[offsets[i] : offsets[i] + k[i]]] = np.inf
        finite = np.isfinite(np.concatenate(self.cost))
        maxexc = np.maximum.reduceat(np.where(finite, exc, 0.0), offsets)
        _, potential = p.usage_at_points(maxexc)
        binding = potential > slack + _TOL * max(1.0, abs(p.memory_limit))
        bcount = np.concatenate([[0], np.cumsum(binding)])
        self.row_lo, self.row_hi = bcount[lo], bcount[hi]
        self.relevant = (self.row_hi > self.row_lo) & (maxexc > 0)
        self.slack = slack[binding]
        self.fixed_usage = np.zeros(self.slack.shape[0] + 1)

    def reparametrise_all(self) -> None:
        """``_reparametrise`` on every edge at once (edges grouped by shape), before the main loop."""
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for a, b in self.fresh:
            groups.setdefault(self.adj[a][b].shape, []).append((a, b))
        for pairs in groups.values():
            m = np.stack([self.adj[a][b] for a, b in pairs])
            en_a = np.stack([self.en[a] for a, _ in pairs])
            en_b = np.stack([self.en[b] for _, b in pairs])
            mask = en_a[:, :, None] & en_b[:, None, :]
            r = np.where(mask, m, np.inf).min(2)
            r[~np.isfinite(r)] = 0.0
            m = m - r[:, :, None]
            c = np.where(mask, m, np.inf).min(1)
            c[~np.isfinite(c)] = 0.0
            m -= c[:, None, :]
            zero = np.where(mask, m == 0, True).all((1, 2))
            for g, (a, b) in enumerate(pairs):
                self.cost[a] += r[g]
                self.cost[b] += c[g]
                if zero[g]:
                    self._drop_edge(a, b)
                    self.counts["dropped_edges"] += 1
                else:
                    self.adj[a][b] = m[g]
                    self.adj[b][a] = m[g].T
        self.fresh.clear()

    def _mem_members(self, u: int) -> list[tuple[int, np.ndarray]]:
        return [(o, m) for o, m in self.members[u] if self.relevant[o]]

    def _commit_memory(self, u: int, s: int) -> None:
        for o, m in self._mem_members(u):
            val = self.exc[o][m[s]]
            self.fixed_usage[self.row_lo[o]] += val
            self.fixed_usage[self.row_hi[o]] -= val

    def _memory_free(self, u: int, en: np.ndarray) -> bool:
        for o, m in self._mem_members(u):
            vals = self.exc[o][m[en]]
            if vals.max() - vals.min() > 0:
                return False
        return True

    # ------------------------------------------------------------ edges and costs
    def _add_edge(self, u: int, v: int, m: np.ndarray) -> None:
        if v in self.adj[u]:
            m = self.adj[u][v] + m
        self.adj[u][v] = m
        self.adj[v][u] = m.T
        key = (u, v) if u < v else (v, u)
        if np.isfinite(m).all():
            self.inf_edges.discard(key)
        else:
            self.inf_edges.add(key)
        self.fresh.add(key)
        self.dom_done[u] = self.dom_done[v] = False

    def _drop_edge(self, u: int, v: int) -> None:
        del self.adj[u][v]
        del self.adj[v][u]
        key = (u, v) if u < v else (v, u)
        self.inf_edges.discard(key)
        self.fresh.discard(key)

    def _set_cost(self, u: int, cost: np.ndarray) -> None:
        self.cost[u] = cost
        self.en[u] = np.isfinite(cost)
        self.dom_done[u] = False

    def _kill(self, u: int) -> None:
        for v in list(self.adj[u]):
            self._drop_edge(u, v)
        self.alive[u] = False

    def _infeasible(self, u: int) -> InfeasibleError:
        p = self.problem
        names = ", ".join(p.node_label(o) for o, _ in self.members[u][:5])
        return InfeasibleError(
            f"no finite-cost assignment exists: {p.node_label(u)} (merged with {len(self.members[u]) - 1} "
            f"others: {names}) has no strategy left that is finite and compatible with its neighbours"
            + (" within the memory limit" if p.memory_limit is not None else "")
            + ". Look for +inf node costs or edge matrices with no finite entry in a row/column."
        )

    # ------------------------------------------------------------ the reductions
    def run(self, queue: deque[int], deadline: float = np.inf) -> bool:
        """Apply the reductions until none applies (True) or ``deadline`` (perf_counter) passes (False)."""
        queued = np.zeros(self.alive.shape[0], dtype=bool)
        queued[list(queue)] = True
        pops = 0
        while queue:
            pops += 1
            if (pops & 127) == 0 and time.perf_counter() > deadline:
                return False
            u = queue.popleft()
            queued[u] = False
            if not self.alive[u]:
                continue
            touched = self._examine(u)
            for w in touched:
                if self.alive[w] and not queued[w]:
                    queued[w] = True
                    queue.append(w)
        return True

    def _examine(self, u: int) -> list[int]:
        touched: list[int] = []
        # 1. strategies without a finite partner on some edge (only edges holding +inf can cause this)
        while True:
            en = self.en[u]
            patterns = []
            pruned = False
            for v, m in self.adj[u].items():
                if ((u, v) if u < v else (v, u)) not in self.inf_edges:
                    continue
                env = self.en[v]
                fin = np.isfinite(m)
                fin &= en[:, None]
                fin &= env[None, :]
                per_row, per_col = fin.sum(1), fin.sum(0)
                bad_v = env & (per_col == 0)
                if bad_v.any():
                    self._set_cost(v, np.where(bad_v, np.inf, self.cost[v]))
                    touched.append(v)
                bad_u = en & (per_row == 0)
                if bad_u.any():
                    self._set_cost(u, np.where(bad_u, np.inf, self.cost[u]))
                    pruned = True
                    break
                patterns.append((v, fin, per_row, per_col))
            if not pruned:
                break
            touched.append(u)
        en = self.en[u]
        n_en = int(en.sum())
        if n_en == 0:
            raise self._infeasible(u)
        # 2. one strategy left: fold into the neighbours
        if n_en == 1:
            return touched + self._fix(u, int(np.flatnonzero(en)[0]))
        # 3. follow: u or v determined by the other through an +inf pattern
        for v, fin, per_row, per_col in patterns:
            env = self.en[v]
            u_follows, v_follows = bool((per_col[env] == 1).all()), bool((per_row[en] == 1).all())
            if u_follows and v_follows and len(self.adj[u]) > len(self.adj[v]):
                u_follows = False  # a one-to-one pattern: move the fewer edges (hubs would be copied over and over)
            if u_follows:
                return touched + self._merge(u, v, fin.argmax(0))
            if v_follows:
                return touched + self._merge(v, u, fin.argmax(1))
        # 4. exact elimination of memory-free nodes of degree <= 2
        if len(self.adj[u]) <= 2 and self._memory_free(u, en):
            return touched + self._eliminate(u)
        # 5. reparametrise new edges; drop the ones that become zero
        for v in list(self.adj[u]):
            if ((u, v) if u < v else (v, u)) in self.fresh and self._reparametrise(u, v):
                touched.append(v)
        # 6. dominance
        if not self.dom_done[u]:
            self.dom_done[u] = True
            if self._dominance(u, en):
                touched.append(u)
                for v in self.adj[u]:  # fewer columns to compare: neighbours may now dominate more
                    self.dom_done[v] = False
                    touched.append(v)
        return touched

    def _fix(self, u: int, s: int) -> list[int]:
        self.constant += float(self.cost[u][s])
        nbrs = list(self.adj[u])
        for v in nbrs:
            self._set_cost(v, self.cost[v] + self.adj[u][v][s, :])
        self._commit_memory(u, s)
        self._kill(u)
        self.log.append(("fix", u, s))
        self.counts["fixed"] += 1
        return nbrs

    def _merge(self, u: int, v: int, f: np.ndarray) -> list[int]:
        """Merge ``u`` into ``v``; ``f[s_v]`` is ``u``'s strategy when ``v`` takes ``s_v``."""
        m = self.adj[u][v]
        idx = np.arange(f.shape[0])
        self._set_cost(v, self.cost[v] + self.cost[u][f] + m[f, idx])
        self.members[v].extend((o, mo[f]) for o, mo in self.members[u])
        self._drop_edge(u, v)
        nbrs = list(self.adj[u])
        for w in nbrs:
            self._add_edge(v, w, self.adj[u][w][f, :])
        self._kill(u)
        self.counts["merged"] += 1
        return [v, *nbrs]

    def _eliminate(self, u: int) -> list[int]:
        cost = self.cost[u]
        s_any = int(np.flatnonzero(self.en[u])[0])
        self._commit_memory(u, s_any)  # memory-free: every enabled strategy has this usage
        nbrs = list(self.adj[u])
        if len(nbrs) == 0:
            s = int(np.argmin(cost))
            self.constant += float(cost[s])
            self.log.append(("fix", u, s))
        elif len(nbrs) == 1:
            (v,) = nbrs
            t = cost[:, None] + self.adj[u][v]
            arg = t.argmin(0)
            self._set_cost(v, self.cost[v] + t[arg, np.arange(t.shape[1])])
            self.log.append(("leaf", u, v, arg))
        else:
            v, w = nbrs
            t = cost[:, None, None] + self.adj[u][v][:, :, None] + self.adj[u][w][:, None, :]
            arg = t.argmin(0)
            best = np.take_along_axis(t, arg[None], 0)[0]
            self._add_edge(v, w, best)
            self.log.append(("series", u, v, w, arg))
        self._kill(u)
        self.counts["eliminated"] += 1
        return nbrs

    def _reparametrise(self, u: int, v: int) -> bool:
        """Move row and column minima of edge (u, v) into the node costs; True if costs changed."""
        self.fresh.discard((u, v) if u < v else (v, u))
        m = self.adj[u][v]
        en_u, en_v = self.en[u], self.en[v]
        sub = m[en_u][:, en_v]
        if sub.size == 0:
            return False  # an endpoint has no strategy left; examining it raises InfeasibleError
        r = sub.min(1)
        sub = sub - r[:, None]
        c = sub.min(0)
        sub -= c[None, :]
        zero = bool((sub == 0).all())
        if zero:
            self._drop_edge(u, v)
            self.counts["dropped_edges"] += 1
        elif not (r.any() or c.any()):
            return False
        else:
            new = m.copy()
            new[np.ix_(en_u, en_v)] = sub
            self.adj[u][v] = new
            self.adj[v][u] = new.T
        if r.any():
            cu = self.cost[u].copy()
            cu[en_u] += r
            self._set_cost(u, cu)
        if c.any():
            cv = self.cost[v].copy()
            cv[en_v] += c
            self._set_cost(v, cv)
        return True

    def _dominance(self, u: int, en: np.ndarray) -> bool:
        """Drop strategies no better than another in cost, every member's memory and every edge row."""
        idx = np.flatnonzero(en)
        cost = self.cost[u][idx]
        dom = cost[:, None] <= cost[None, :]
        np.fill_diagonal(dom, False)
        mem = self._mem_members(u)
        if mem and dom.any():
            x = np.stack([self.exc[o][mo[idx]] for o, mo in mem], axis=1)
            dom &= (x[:, None, :] <= x[None, :, :]).all(-1)
        pa, pb = np.nonzero(dom)  # candidate pairs: pa[i] may dominate pb[i]
        for v, m in self.adj[u].items():
            if pa.size == 0:
                return False
            rows = m[idx][:, self.en[v]]
            ok = (rows[pa] <= rows[pb]).all(1)
            pa, pb = pa[ok], pb[ok]
        if pa.size == 0:
            return False
        dom = np.zeros((idx.shape[0], idx.shape[0]), dtype=bool)
        dom[pa, pb] = True
        removed = np.zeros(idx.shape[0], dtype=bool)
        for b in range(idx.shape[0]):
            for a in np.flatnonzero(dom[:, b]):
                if not removed[a] and (a < b or not dom[b, a]):
                    removed[b] = True
                    break
        cost = self.cost[u].copy()
        cost[idx[removed]] = np.inf
        self._set_cost(u, cost)
        self.dom_done[u] = True
        self.counts["dominated"] += int(removed.sum())
        return bool(removed.any())

    # ------------------------------------------------------------ the core
    def core(self) -> Core:
        nodes = np.flatnonzero(self.alive)
        pos = np.full(self.alive.shape[0], -1, dtype=np.int64)
        pos[nodes] = np.arange(nodes.shape[0])
        strategies = tuple(np.flatnonzero(np.isfinite(self.cost[w])) for w in nodes)
        costs = tuple(self.cost[w][s] for w, s in zip(nodes, strategies, strict=True))
        edge_nodes, edge_costs = [], []
        for a, w in enumerate(nodes.tolist()):
            for x, m in self.adj[w].items():
                b = int(pos[x])
                if b > a:
                    edge_nodes.append((a, b))
                    edge_costs.append(m[np.ix_(strategies[a], strategies[b])])
        mem_node, mem_lo, mem_hi, mem_usage = [], [], [], []
        for a, w in enumerate(nodes.tolist()):
            for o, mo in self._mem_members(w):
                usage = self.exc[o][mo[strategies[a]]]
                if usage.any():
                    mem_node.append(a)
                    mem_lo.append(self.row_lo[o])
                    mem_hi.append(self.row_hi[o])
                    mem_usage.append(usage)
        slack = self.slack - np.cumsum(self.fixed_usage)[:-1]
        lo, hi, slack = _compress_rows(np.array(mem_lo, dtype=np.int64), np.array(mem_hi, dtype=np.int64),
                                       mem_usage, slack)
        kept = np.flatnonzero(hi > lo)  # terms whose rows were all dropped
        mem_node = np.array(mem_node, dtype=np.int64)[kept]
        mem_usage = [mem_usage[j] for j in kept.tolist()]
        lo, hi = lo[kept], hi[kept]
        return Core(
            nodes=nodes,
            strategies=strategies,
            costs=costs,
            edge_nodes=np.array(edge_nodes, dtype=np.int64).reshape(-1, 2),
            edge_costs=tuple(edge_costs),
            mem_node=mem_node,
            mem_lo=lo,
            mem_hi=hi,
            mem_usage=tuple(mem_usage),
            slack=slack,
            constant=self.constant,
        )


def _compress_rows(
    lo: np.ndarray, hi: np.ndarray, usage: list[np.ndarray], slack: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge the memory rows of the core that no term starts or ends between (one live set: only the
    least slack among them binds) and drop the merged rows that cannot bind (largest excesses of their
    terms within the slack). A row no term touches is dropped unless its slack is negative (kept so that
    an overflow already committed by presolve stays visible). Returns new ``lo``, ``hi``, ``slack``."""
    n_r = slack.shape[0]
    if n_r == 0:
        return lo, hi, slack
    bounds = np.unique(np.concatenate([[0], lo, hi]))
    bounds = bounds[bounds < n_r]
    seg_slack = np.minimum.reduceat(slack, bounds)
    s_lo, s_hi = np.searchsorted(bounds, lo), np.searchsorted(bounds, hi)
    potential = np.zeros(bounds.shape[0] + 1)
    if lo.size:
        top = np.array([u.max() for u in usage])
        np.add.at(potential, s_lo, top)
        np.add.at(potential, s_hi, -top)
    potential = np.cumsum(potential)[:-1]
    keep = (potential > seg_slack + _TOL * max(1.0, float(np.abs(seg_slack).max()))) | (seg_slack < 0)
    count = np.concatenate([[0], np.cumsum(keep)])
    return count[s_lo], count[s_hi], seg_slack[keep]


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(values[lo[i]:hi[i]])`` for every i (+inf for empty ranges), by a sparse table."""
    out = np.full(lo.shape[0], np.inf)
    if values.size == 0:
        return out
    table = [values]
    while (1 << len(table)) <= values.shape[0]:
        prev, half = table[-1], 1 << (len(table) - 1)
        table.append(np.minimum(prev[:-half], prev[half:]))
    ok = hi > lo
    length = hi[ok] - lo[ok]
    level = np.floor(np.log2(length)).astype(np.int64)
    for lev in np.unique(level):
        sel = np.flatnonzero(ok)[level == lev]
        t = table[lev]
        out[sel] = np.minimum(t[lo[sel]], t[hi[sel] - (1 << lev)])
    return out


def presolve(problem: IntraOpProblem, ties: np.ndarray | None = None, *, deadline: float = np.inf) -> Reduced:
    """Apply the exact reductions above until none applies; raise InfeasibleError if they prove it.

    ``ties``: a class id per node (``symmetry.equivalence_classes``); the nodes of one class are merged
    first into one node whose choice they all take (their strategy counts must agree). That is a
    restriction of the problem, not a reduction: the core's optimum is then the best tied assignment.

    ``deadline`` (``time.perf_counter()``): past it the reductions stop where they are and the graph left
    is the core (still exact, only less reduced); ``counts["stopped"]`` is then 1."""
    g = _Graph(problem, ties)
    g.reparametrise_all()
    g.counts["stopped"] = int(not g.run(deque(range(problem.num_nodes)), deadline))
    return Reduced(
        core=g.core(),
        members=tuple(tuple(ms) for ms in g.members),
        log=tuple(g.log),
        counts=dict(g.counts),
    )
