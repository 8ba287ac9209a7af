"""Load the public IOPDDL contest instances (google/iopddl) as :class:`solvers.IntraOpProblem`.

The instance files are not in this repository. Fetch them once, e.g.::

    git clone --depth 1 https://github.com/google/iopddl /tmp/iopddl
    mkdir -p /tmp/iopddl15 && for x in A C D K L M N Q; do
        cp /tmp/iopddl/benchmarks/asplos-2025-iopddl-$x.json.gz /tmp/iopddl15/$x.json.gz; done

and point ``IOPDDL_DIR`` (default ``/tmp/iopddl15``) at the folder. ``dev_set.json`` (timeouts, best known
costs) lives in ``/work/shared/iopddl/`` or beside the files (``IOPDDL_DEV_SET``).

Semantics (the contest's reference evaluator, ``iopddl.cc``): intervals are half-open ``[start, end)``;
usage equal to the limit is allowed; an edge's flat cost list is the row-major ``k_u × k_v`` matrix;
duplicate edges add up; a cost of exactly ``1e18`` marks a forbidden choice (here ``+inf``).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np

from solvers import IntraOpProblem

FORBIDDEN = 1e18
IOPDDL_DIR = Path(os.environ.get("IOPDDL_DIR", "/tmp/iopddl15"))
DEV_SET = Path(os.environ.get("IOPDDL_DEV_SET", "/work/shared/iopddl/dev_set.json"))


def _costs(values: list) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    a[a >= FORBIDDEN] = np.inf
    return a


def load_iopddl(path: str | Path) -> IntraOpProblem:
    """One contest instance (``.json`` or ``.json.gz``); self-loop edges are folded into node costs."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)["problem"]
    nodes = data["nodes"]
    costs = [_costs(c) for c in nodes["costs"]]
    memory = [np.asarray(u, dtype=np.float64) for u in nodes["usages"]]
    k = [c.shape[0] for c in costs]
    edges, mats = [], []
    for (u, v), flat in zip(data["edges"]["nodes"], data["edges"]["costs"], strict=True):
        m = _costs(flat).reshape(k[u], k[v])
        if u == v:
            costs[u] = costs[u] + np.diagonal(m)
            continue
        edges.append((u, v))
        mats.append(m)
    return IntraOpProblem(
        node_costs=costs,
        node_memory=memory,
        intervals=np.asarray(nodes["intervals"], dtype=np.int64),
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        edge_costs=mats,
        memory_limit=data.get("usage_limit"),
    )


def dev_set() -> dict[str, dict]:
    """``{"A": {"best_known": ..., "timeout_s": ..., "xla": ...}, ...}``."""
    return json.loads(DEV_SET.read_text())


def instance_path(name: str) -> Path:
    return IOPDDL_DIR / f"{name}.json.gz"
