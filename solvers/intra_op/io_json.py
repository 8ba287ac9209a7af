"""Saving and loading intra-operator problems as JSON, so that any tool can hand the solver a problem.

Format ``autoshard.intra_op_problem``, version 1 (a ``.gz`` suffix gzips the file)::

    {"format": "autoshard.intra_op_problem", "version": 1,
     "memory_limit": 1.5e9 | null,
     "nodes": [{"name": "dot_general @ model.py:42" | null,
                "costs": [1.0, "inf", ...], "memory": [4096, ...], "interval": [start, end]}, ...],
     "edges": [{"u": 0, "v": 1, "costs": [[0.0, "inf"], [2.5, 0.0]]}, ...]}

``"inf"`` stands for +inf (JSON has no infinity). ``costs[a][b]`` is the cost of node ``u`` taking strategy
``a`` while node ``v`` takes ``b``. Readers must reject other formats and newer versions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from solvers._json import check_header, decode, encode, read, write
from solvers.intra_op.problem import IntraOpProblem

__all__ = ["FORMAT", "VERSION", "load_problem", "problem_from_dict", "problem_to_dict", "save_problem"]

FORMAT = "autoshard.intra_op_problem"
VERSION = 1


def problem_to_dict(problem: IntraOpProblem) -> dict[str, Any]:
    names = problem.node_names
    nodes = [
        {
            "name": None if names is None else names[i],
            "costs": encode(problem.node_costs[i]),
            "memory": encode(problem.node_memory[i]),
            "interval": [int(x) for x in problem.intervals[i]],
        }
        for i in range(problem.num_nodes)
    ]
    edges = [
        {"u": int(u), "v": int(v), "costs": encode(m)}
        for (u, v), m in zip(problem.edges.tolist(), problem.edge_costs, strict=True)
    ]
    return {"format": FORMAT, "version": VERSION, "memory_limit": problem.memory_limit, "nodes": nodes,
            "edges": edges}


def problem_from_dict(data: dict[str, Any]) -> IntraOpProblem:
    check_header(data, FORMAT, VERSION, "an intra-op problem")
    nodes = data["nodes"]
    names = [nd.get("name") for nd in nodes]
    problem = IntraOpProblem(
        node_costs=[decode(nd["costs"]) for nd in nodes],
        node_memory=[decode(nd["memory"]) for nd in nodes],
        intervals=np.array([nd["interval"] for nd in nodes], dtype=np.int64).reshape(-1, 2),
        edges=np.array([[e["u"], e["v"]] for e in data["edges"]], dtype=np.int64).reshape(-1, 2),
        edge_costs=[decode(e["costs"]).reshape(len(nodes[e["u"]]["costs"]), -1) for e in data["edges"]],
        memory_limit=data.get("memory_limit"),
        node_names=None if all(x is None for x in names) else [x or "" for x in names],
    )
    problem.verify()
    return problem


def save_problem(problem: IntraOpProblem, path: str | Path) -> None:
    """Write ``problem`` to ``path`` as JSON (gzipped when the name ends in ``.gz``)."""
    write(problem_to_dict(problem), path)


def load_problem(path: str | Path) -> IntraOpProblem:
    """Read a problem written by ``save_problem`` (or any tool following the format above)."""
    return problem_from_dict(read(path))
