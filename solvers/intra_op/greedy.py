"""A greedy completion: nodes in index order, each taking its cheapest strategy given those before it.

For node ``v`` (in order ``0, 1, …``) with the nodes ``u < v`` already decided:

    s_v = argmin_s  c_v[s] + Σ_{(u, v) ∈ E, u decided} R_{uv}[s_u, s] + Σ_{(v, u) ∈ E, u decided} R_{vu}[s, s_u]

then ``sweeps`` rounds of ICM over every node (backward, then forward order), each node moving to
its cheapest strategy given all its neighbours — the backward pass fixes what the forward pass could
not see (a forward op's layout that the backward pass would rather have). Memory is ignored (a local
search repairs it). Problem builders number nodes in schedule order, so this
is the propagation a partitioner does from pinned inputs (GSPMD's): cheap, and a good start for a
local search when the inputs' layouts are fixed by hand (pin them with +inf costs elsewhere). Its value
is the global structure it carries, which windowed search cannot reach from another structure.
"""

from __future__ import annotations

import numpy as np

from solvers.intra_op.problem import IntraOpProblem

__all__ = ["greedy_completion"]


def greedy_completion(problem: IntraOpProblem, sweeps: int = 2) -> np.ndarray | None:
    """One strategy per node (see the module docstring); None when some node has no finite choice."""
    n = problem.num_nodes
    # per node: (other node, matrix, whether the other node indexes the rows)
    adj: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in range(n)]
    for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs, strict=True):
        if u != v:
            adj[v].append((u, m, True))
            adj[u].append((v, m, False))
    choice = np.full(n, -1, dtype=np.int64)

    def best(v: int) -> int:
        total = np.array(problem.node_costs[v], dtype=np.float64, copy=True)
        for u, m, u_is_row in adj[v]:
            if choice[u] >= 0:
                total += m[choice[u], :] if u_is_row else m[:, choice[u]]
        return int(np.argmin(total)) if np.isfinite(total).any() else -1

    for v in range(n):
        choice[v] = best(v)
        if choice[v] < 0:
            return None
    for k in range(2 * sweeps):
        order = range(n - 1, -1, -1) if k % 2 == 0 else range(n)
        moved = False
        for v in order:
            s = best(v)
            if s >= 0 and s != choice[v]:
                choice[v] = s
                moved = True
        if not moved:
            break
    return choice
