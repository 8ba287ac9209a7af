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

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from solvers.inter_op.problem import InterOpProblem

__all__ = ["FORMAT", "VERSION", "load_problem", "problem_from_dict", "problem_to_dict", "save_problem"]

FORMAT = "autoshard.inter_op_problem"
VERSION = 1
_TABLES = ("stage_time", "static_memory", "activation_memory")


def _enc(a: np.ndarray) -> Any:
    lower = ~np.triu(np.ones(a.shape[:2], dtype=bool))
    a = np.where(lower[:, :, None], 0.0, a)
    return [[["inf" if x == np.inf else float(x) for x in row] for row in plane] for plane in a.tolist()]


def _dec(x: Any) -> np.ndarray:
    def one(v: Any) -> float:
        if v == "inf":
            return np.inf
        if isinstance(v, str):
            raise ValueError(f"unexpected string {v!r} in a numeric field (only 'inf' is allowed)")
        return float(v)

    return np.array([[[one(v) for v in row] for row in plane] for plane in x], dtype=np.float64)


def problem_to_dict(problem: InterOpProblem) -> dict[str, Any]:
    out: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "num_layers": problem.num_layers, "cluster": list(problem.cluster),
        "submeshes": [list(s) for s in problem.submeshes], "num_microbatches": problem.num_microbatches,
        "memory_limit": problem.memory_limit, "inflight": list(problem.inflight), "max_stages": problem.max_stages,
    }
    out.update({name: _enc(getattr(problem, name)) for name in _TABLES})
    return out


def problem_from_dict(data: dict[str, Any]) -> InterOpProblem:
    if data.get("format") != FORMAT:
        raise ValueError(f"not an inter-op problem: format is {data.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(data.get("version"), int) or data["version"] > VERSION:
        raise ValueError(f"unsupported version {data.get('version')!r}; this reader knows <= {VERSION}")
    L, M = int(data["num_layers"]), len(data["submeshes"])
    tables = {name: _dec(data[name]).reshape(L, L, M) for name in _TABLES}
    problem = InterOpProblem(
        num_layers=L, cluster=tuple(data["cluster"]), submeshes=tuple(tuple(s) for s in data["submeshes"]),
        num_microbatches=data["num_microbatches"], memory_limit=data.get("memory_limit"),
        inflight=tuple(data["inflight"]), max_stages=data.get("max_stages"), **tables,
    )
    problem.verify()
    return problem


def save_problem(problem: InterOpProblem, path: str | Path) -> None:
    """Write ``problem`` to ``path`` as JSON (gzipped when the name ends in ``.gz``)."""
    text = json.dumps(problem_to_dict(problem), separators=(",", ":"))
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def load_problem(path: str | Path) -> InterOpProblem:
    """Read a problem written by ``save_problem``."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return problem_from_dict(json.load(f))
    return problem_from_dict(json.loads(path.read_text(encoding="utf-8")))
