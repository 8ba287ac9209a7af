"""Repeated structure in an intra-operator problem: nodes that look alike, to be tied to one choice.

A transformer's 24 blocks give 24 copies of every node, with identical costs, memory and resharding
matrices. A person shards them all the same way; the windowed search of a large core cannot move all 24
at once, so it cannot go from one global structure (say, data parallel over one axis) to another (data ×
tensor parallel). Tying the copies to one shared choice gives a problem 24 times smaller whose optimum
is the best *uniform* plan, which the ILP solves well; that plan then starts the untied solve.

``equivalence_classes`` finds the copies by colour refinement (1-dimensional Weisfeiler–Lehman), run for
a few rounds only. Round 0 colours a node by its strategy count, cost vector and memory vector; round
``r + 1`` by its colour and the multiset of (neighbour colour, edge matrix, direction) over its edges.
After ``R`` rounds two nodes share a colour exactly when their radius-``R`` neighbourhoods unfold alike,
so the blocks of a stack tie together while the first and last blocks (whose neighbourhoods reach the
embedding or the head) keep classes of their own. Stopping early is the point: refinement run to its
fixed point would tell every block apart by its distance from the ends.

Tying is a restriction, not an exact reduction: every tied assignment is an assignment of the original
problem (memory is counted per original node, so its feasibility is exact), but the tied optimum can be
worse than the untied one. ``solve_intra_op`` uses it only as a start.
"""

from __future__ import annotations

import numpy as np

from solvers.intra_op.problem import IntraOpProblem

__all__ = ["equivalence_classes"]


def _intern(keys: list, table: dict) -> np.ndarray:
    out = np.empty(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        c = table.get(key)
        if c is None:
            c = table[key] = len(table)
        out[i] = c
    return out


def equivalence_classes(problem: IntraOpProblem, rounds: int = 3) -> np.ndarray:
    """Per node, a class id; nodes of one class have the same strategies' costs and memory, and alike
    neighbourhoods out to ``rounds`` edges. Class ids are dense, numbered by first member."""
    n = problem.num_nodes
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    colour = _intern([(c.shape[0], c.tobytes(), m.tobytes())
                      for c, m in zip(problem.node_costs, problem.node_memory, strict=True)], {})
    edge_table: dict = {}
    edge_id = _intern([(m.shape, m.tobytes()) for m in problem.edge_costs], edge_table)
    out_edges: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    in_edges: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for (u, v), e in zip(problem.edges.tolist(), edge_id.tolist(), strict=True):
        out_edges[u].append((v, e))
        in_edges[v].append((u, e))
    for _ in range(rounds):
        keys = [
            (int(colour[i]),
             tuple(sorted((int(colour[v]), e) for v, e in out_edges[i])),
             tuple(sorted((int(colour[u]), e) for u, e in in_edges[i])))
            for i in range(n)
        ]
        new = _intern(keys, {})
        if np.unique(new).shape[0] == np.unique(colour).shape[0]:
            colour = new
            break  # stable: further rounds split nothing
        colour = new
    _, first, dense = np.unique(colour, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # renumber classes by their first member
    return order[dense].astype(np.int64)
