"""Saving and loading inter-operator problems as JSON.

Format ``autoshard.inter_op_problem``, version 1 (a ``.gz`` suffix gzips the file)::

    {"format": "autoshard.inter_op_problem", "version": 1,
     "num_layers": L, "cluster": [H, D], "submeshes": [[1, 1], [1, 2], ...],
     "num_microbatches": B, "memory_limit": 4e10 | null, "inflight": [1, 2, ...], "max_stages": S | null,
     "stage_time": [[[...M floats or "inf"...] × L] × L], "static_memory": ..., "activation_memory": ...}

The tables are ``[L][L][M]`` nested lists (entries with ``j < i`` are written as 0 and ignored);
``"inf"`` stands for +inf. Readers must reject other formats and newer versions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from solvers._json import check_header, decode, encode, read, write
from solvers.inter_op.problem import InterOpProblem

__all__ = ["FORMAT", "VERSION", "load_problem", "problem_from_dict", "problem_to_dict", "save_problem"]

FORMAT = "autoshard.inter_op_problem"
VERSION = 1
_TABLES = ("stage_time", "static_memory", "activation_memory")


def _enc(a: np.ndarray) -> Any:
    lower = ~np.triu(np.ones(a.shape[:2], dtype=bool))
    return encode(np.where(lower[:, :, None], 0.0, a))  # entries below the diagonal are never read


def problem_to_dict(problem: InterOpProblem) -> dict[str, Any]:
    out: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "num_layers": problem.num_layers, "cluster": list(problem.cluster),
        "submeshes": [list(s) for s in problem.submeshes], "num_microbatches": problem.num_microbatches,
        "memory_limit": problem.memory_limit, "inflight": list(problem.inflight), "max_stages": problem.max_stages,
    }
    out.update({name: _enc(getattr(problem, name)) for name in _TABLES})
    return out


def problem_from_dict(data: dict[str, Any]) -> InterOpProblem:
    check_header(data, FORMAT, VERSION, "an inter-op problem")
    L, M = int(data["num_layers"]), len(data["submeshes"])
    tables = {name: decode(data[name]).reshape(L, L, M) for name in _TABLES}
    problem = InterOpProblem(
        num_layers=L, cluster=tuple(data["cluster"]), submeshes=tuple(tuple(s) for s in data["submeshes"]),
        num_microbatches=data["num_microbatches"], memory_limit=data.get("memory_limit"),
        inflight=tuple(data["inflight"]), max_stages=data.get("max_stages"), **tables,
    )
    problem.verify()
    return problem


def save_problem(problem: InterOpProblem, path: str | Path) -> None:
    """Write ``problem`` to ``path`` as JSON (gzipped when the name ends in ``.gz``)."""
    write(problem_to_dict(problem), path)


def load_problem(path: str | Path) -> InterOpProblem:
    """Read a problem written by ``save_problem``."""
    return problem_from_dict(read(path))
