"""Large-neighbourhood search: re-solve windows of the core exactly with the rest held fixed.

A window ``W`` of core nodes (a breadth-first ball, or a run of consecutive nodes) becomes a small core
of its own: each node's cost gains ``R^e(·, s_b)`` for every edge to a fixed neighbour ``b``; edges inside
``W`` stay; memory rows keep only the window's terms, with slack ``S_r − (usage of the fixed nodes at r)``
taken as its minimum over each stretch of rows where the window's live set does not change. The window
ILP (see ``ilp.py``) is solved to optimality, warm-started at the current assignment, so a window never
makes the answer worse; windows whose optimum is cheaper are applied. A window whose ILP HiGHS could not
set up in time (``ilp.ilp_fits``: with 64 strategies a node, 120 nodes can make 50k columns) halves the
window size instead.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from solvers.intra_op.ilp import ilp_columns, ilp_fits, solve_ilp
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core

__all__ = ["improve_by_windows"]

MIN_WINDOW = 8


def _sub_core(core: Core, ls: LocalSearch, window: np.ndarray, incident: list[list[int]]) -> Core:
    n = core.num_nodes
    pos = np.full(n, -1, dtype=np.int64)
    pos[window] = np.arange(window.shape[0])
    choice = ls.choice
    costs = [core.costs[a].copy() for a in window.tolist()]
    edge_nodes, edge_costs = [], []
    seen = set()
    for la, a in enumerate(window.tolist()):
        for e in incident[a]:
            x, y = core.edge_nodes[e]
            m = core.edge_costs[e]
            if pos[x] >= 0 and pos[y] >= 0:
                if e not in seen:
                    seen.add(e)
                    edge_nodes.append((pos[x], pos[y]))
                    edge_costs.append(m)
            elif x == a:
                costs[la] += m[:, choice[y]]
            else:
                costs[la] += m[choice[x], :]
    terms = [j for a in window.tolist() for j in ls.terms[a]]
    if terms:
        lo = core.mem_lo[terms]
        hi = core.mem_hi[terms]
        own = np.zeros(core.slack.shape[0] + 1)
        vals = np.array([core.mem_usage[j][choice[core.mem_node[j]]] for j in terms])
        np.add.at(own, lo, vals)
        np.add.at(own, hi, -vals)
        local_slack = ls.head + np.cumsum(own)[:-1]
        bounds = np.unique(np.concatenate([lo, hi]))
        bounds = bounds[bounds < core.slack.shape[0]]
        seg_slack = np.minimum.reduceat(local_slack, bounds)
        mem_lo = np.searchsorted(bounds, lo)
        mem_hi = np.searchsorted(bounds, hi)
        mem_node = pos[core.mem_node[terms]]
        usage = tuple(core.mem_usage[j] for j in terms)
    else:
        seg_slack = np.zeros(0)
        mem_lo = mem_hi = mem_node = np.zeros(0, dtype=np.int64)
        usage = ()
    return Core(
        nodes=window,
        strategies=tuple(np.arange(c.shape[0]) for c in costs),
        costs=tuple(costs),
        edge_nodes=np.array(edge_nodes, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(edge_costs),
        mem_node=mem_node,
        mem_lo=mem_lo,
        mem_hi=mem_hi,
        mem_usage=usage,
        slack=seg_slack,
        constant=0.0,
    )


def _bfs_window(start: int, size: int, nbrs: list[list[tuple[int, np.ndarray]]]) -> np.ndarray:
    seen = {start}
    queue = deque([start])
    while queue and len(seen) < size:
        a = queue.popleft()
        for b, _ in nbrs[a]:
            if b not in seen:
                seen.add(b)
                queue.append(b)
                if len(seen) >= size:
                    break
    return np.array(sorted(seen), dtype=np.int64)


def improve_by_windows(core: Core, ls: LocalSearch, deadline: float, *, window: int = 120, seed: int = 0) -> int:
    """Re-solve windows until ``deadline``; returns the number of improving windows.

    Sweeps first (runs of consecutive nodes, then breadth-first balls from evenly spaced nodes, growing the
    window by half after each pair); once a pair of sweeps finds nothing, balls around random nodes,
    with the size drawn between half and twice the current one, until the deadline."""
    n = core.num_nodes
    incident: list[list[int]] = [[] for _ in range(n)]
    for e, (a, b) in enumerate(core.edge_nodes.tolist()):
        incident[a].append(e)
        incident[b].append(e)
    rng = np.random.default_rng(seed)
    state = {"size": min(window, n), "improved": 0}

    def attempt(w: np.ndarray) -> bool | None:
        """True if the window improved, False if not, None if it was too big to set up in time."""
        left = deadline - time.perf_counter()
        sub = _sub_core(core, ls, w, incident)
        if not ilp_fits(ilp_columns(sub), min(left, 5.0)):
            state["size"] = max(MIN_WINDOW, state["size"] // 2)  # HiGHS would overrun setting it up
            return None
        cur = ls.choice[w]
        before = sub.objective(cur)
        res = solve_ilp(sub, time_limit_s=min(left, 5.0), warm_start=cur)
        if res.choice is None or res.objective is None or res.objective >= before - 1e-9 * max(1, abs(before)):
            return False
        for la, a in enumerate(w.tolist()):
            ls.choice[a] = res.choice[la]
        ls.head = core.slack - core.usage(ls.choice) if core.slack.size else ls.head
        state["improved"] += 1
        return True

    sweep = 0
    while time.perf_counter() < deadline - 0.05:
        size = state["size"]
        changed_in_sweep = 0
        starts = range(0, n, max(1, size // 2)) if sweep % 2 == 0 else range(sweep % max(1, size), n, size)
        for s in starts:
            if deadline - time.perf_counter() < 0.05:
                break
            w = np.arange(s, min(n, s + state["size"])) if sweep % 2 == 0 else _bfs_window(s, state["size"], ls.nbrs)
            changed_in_sweep += bool(attempt(w))
        sweep += 1
        if changed_in_sweep == 0 and sweep >= 2:
            break
        if sweep % 2 == 0:
            state["size"] = min(n, int(state["size"] * 1.5))
    base = state["size"]
    while time.perf_counter() < deadline - 0.05 and n > 1:
        size = int(np.clip(base * 2.0 ** rng.uniform(-1, 1), MIN_WINDOW, n))
        if attempt(_bfs_window(int(rng.integers(n)), size, ls.nbrs)) is None:
            base = state["size"]
    return state["improved"]
