"""The intra-operator sharding problem as plain data, and the error raised when it has no answer.

A problem has ``n`` nodes. Node ``i`` has ``k_i`` strategies; strategy ``s`` costs ``node_costs[i][s]``
(compute + collectives, ``+inf`` = forbidden) and holds ``node_memory[i][s]`` bytes per device during the
node's live interval ``[start_i, end_i)``. An edge ``(u, v)`` carries a ``k_u × k_v`` matrix of
resharding costs (``+inf`` = these two choices may not meet). Several edges between one pair of nodes add
up. With a ``memory_limit`` ``M``, every time step ``t`` must satisfy
``Σ_{i : start_i <= t < end_i} node_memory[i][s_i] <= M``.

Only the distinct starts of intervals matter as time steps: between two consecutive starts the set of
live nodes only shrinks. ``time_points`` and ``live_ranges`` give that compressed time axis, which every
other module uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["InfeasibleError", "IntraOpProblem"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _float_array(a: object, ndim: int) -> np.ndarray:
    """``a`` as a read-only float64 array of ``ndim`` dimensions (1: flattened; 2: at least 2-d). An array
    that already is one (another problem's: ``dataclasses.replace`` of a problem) is shared, not copied."""
    if isinstance(a, np.ndarray) and a.dtype == np.float64 and not a.flags.writeable and (
            a.ndim == ndim if ndim == 1 else a.ndim >= ndim):
        return a
    arr = np.array(a, dtype=np.float64, ndmin=ndim)
    return _frozen(arr.reshape(-1) if ndim == 1 else arr)


class InfeasibleError(ValueError):
    """No assignment satisfies the problem: every assignment costs +inf, or no assignment fits in memory.

    Attributes (``None`` when the cause is not memory): ``time`` (the tightest time step), ``min_usage``
    (the least usage any assignment can have there), ``limit`` (the memory limit) and ``nodes`` (indices
    of the nodes live at ``time`` with the largest minimum usage, largest first).
    """

    def __init__(
        self,
        message: str,
        *,
        time: int | None = None,
        min_usage: float | None = None,
        limit: float | None = None,
        nodes: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.time = time
        self.min_usage = min_usage
        self.limit = limit
        self.nodes = nodes


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class IntraOpProblem:
    """Nodes with strategies, edges with resharding matrices, live intervals and a memory limit.

    Sequences are copied into read-only float64 / int64 arrays. ``node_memory`` defaults to zeros and
    ``intervals`` to ``[0, 1)`` for every node. An interval with ``start == end`` is never live.
    """

    node_costs: Sequence[np.ndarray]
    node_memory: Sequence[np.ndarray] | None = None
    intervals: np.ndarray | None = None
    edges: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    edge_costs: Sequence[np.ndarray] = ()
    memory_limit: float | None = None
    node_names: Sequence[str] | None = None

    def __post_init__(self) -> None:
        costs = tuple(_float_array(c, 1) for c in self.node_costs)
        n = len(costs)
        if self.node_memory is None:
            memory = tuple(_frozen(np.zeros_like(c)) for c in costs)
        else:
            memory = tuple(_float_array(m, 1) for m in self.node_memory)
        if self.intervals is None:
            intervals = np.tile(np.array([0, 1], dtype=np.int64), (n, 1))
        else:
            intervals = np.array(self.intervals, dtype=np.int64).reshape(-1, 2) if n else np.zeros((0, 2), np.int64)
        edges = np.array(self.edges, dtype=np.int64)
        edges = edges.reshape(-1, 2) if edges.size else np.zeros((0, 2), dtype=np.int64)
        edge_costs = tuple(_float_array(e, 2) for e in self.edge_costs)
        names = None if self.node_names is None else tuple(str(s) for s in self.node_names)
        limit = None if self.memory_limit is None else float(self.memory_limit)
        object.__setattr__(self, "node_costs", costs)
        object.__setattr__(self, "node_memory", memory)
        object.__setattr__(self, "intervals", _frozen(intervals))
        object.__setattr__(self, "edges", _frozen(edges))
        object.__setattr__(self, "edge_costs", edge_costs)
        object.__setattr__(self, "node_names", names)
        object.__setattr__(self, "memory_limit", limit)

    # ---------------------------------------------------------------- shape
    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])

    @property
    def num_strategies(self) -> np.ndarray:
        return np.array([c.shape[0] for c in self.node_costs], dtype=np.int64)

    def node_label(self, i: int) -> str:
        """``node 7 ('dot_general @ model.py:42')`` or ``node 7``: how errors name a node."""
        if self.node_names is not None and 0 <= i < len(self.node_names) and self.node_names[i]:
            return f"node {i} ({self.node_names[i]!r})"
        return f"node {i}"

    def verify(self) -> None:
        """Raise a ValueError naming the first node or edge that is malformed."""
        n = self.num_nodes
        if len(self.node_memory) != n:
            raise ValueError(f"node_memory has {len(self.node_memory)} entries for {n} nodes")
        if self.intervals.shape != (n, 2):
            raise ValueError(f"intervals has shape {self.intervals.shape}; expected ({n}, 2)")
        if self.node_names is not None and len(self.node_names) != n:
            raise ValueError(f"node_names has {len(self.node_names)} entries for {n} nodes")
        for i, (c, m) in enumerate(zip(self.node_costs, self.node_memory, strict=True)):
            if c.shape[0] == 0:
                raise ValueError(f"{self.node_label(i)} has no strategies")
            if m.shape != c.shape:
                raise ValueError(f"{self.node_label(i)}: {c.shape[0]} costs but {m.shape[0]} memory entries")
        if n:
            owner = np.repeat(np.arange(n), self.num_strategies)
            c, m = np.concatenate(self.node_costs), np.concatenate(self.node_memory)
            bad_c = np.flatnonzero(np.isnan(c) | (c == -np.inf))
            if bad_c.size:
                i = int(owner[bad_c[0]])
                raise ValueError(f"{self.node_label(i)}: costs contain NaN or -inf: {self.node_costs[i]}")
            bad_m = np.flatnonzero(~np.isfinite(m) | (m < 0))
            if bad_m.size:
                i = int(owner[bad_m[0]])
                raise ValueError(f"{self.node_label(i)}: memory must be finite and >= 0: {self.node_memory[i]}")
        bad = np.flatnonzero(self.intervals[:, 0] > self.intervals[:, 1])
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{self.node_label(i)}: interval {self.intervals[i].tolist()} has start > end")
        if len(self.edge_costs) != self.num_edges:
            raise ValueError(f"{self.num_edges} edges but {len(self.edge_costs)} edge cost matrices")
        k = self.num_strategies
        for e, ((u, v), mat) in enumerate(zip(self.edges.tolist(), self.edge_costs, strict=True)):
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"edge {e} ({u}, {v}) names a node outside 0..{n - 1}")
            if u == v:
                raise ValueError(f"edge {e} is a self-loop on {self.node_label(u)}; fold it into its node costs")
            if mat.shape != (k[u], k[v]):
                raise ValueError(
                    f"edge {e} ({self.node_label(u)} -> {self.node_label(v)}): cost matrix has shape "
                    f"{mat.shape}; expected ({k[u]}, {k[v]})"
                )
        if self.num_edges:
            flat = np.concatenate([mat.reshape(-1) for mat in self.edge_costs])
            if (np.isnan(flat) | (flat == -np.inf)).any():
                e = next(e for e, mat in enumerate(self.edge_costs) if (np.isnan(mat) | (mat == -np.inf)).any())
                u, v = self.edges[e].tolist()
                raise ValueError(f"edge {e} ({self.node_label(u)} -> {self.node_label(v)}): cost matrix contains "
                                 "NaN or -inf")
        if self.memory_limit is not None and not np.isfinite(self.memory_limit):
            raise ValueError(f"memory_limit must be finite or None, got {self.memory_limit}")

    def to_json(self, path: str | Path) -> None:
        """Save as JSON (format ``autoshard.intra_op_problem`` v1, see ``solvers.intra_op.io_json``)."""
        from solvers.intra_op.io_json import save_problem

        save_problem(self, path)

    @staticmethod
    def from_json(path: str | Path) -> IntraOpProblem:
        """Load a problem saved by ``to_json`` (or any writer of the same format)."""
        from solvers.intra_op.io_json import load_problem

        return load_problem(path)

    # ---------------------------------------------------------------- evaluation
    def cost_of(self, choice: Sequence[int] | np.ndarray) -> float:
        """Total cost of one strategy per node (``+inf`` when a forbidden entry is chosen)."""
        choice = np.asarray(choice, dtype=np.int64)
        total = float(sum(c[s] for c, s in zip(self.node_costs, choice.tolist(), strict=True)))
        for (u, v), mat in zip(self.edges.tolist(), self.edge_costs, strict=True):
            total += float(mat[choice[u], choice[v]])
        return total

    def time_points(self) -> np.ndarray:
        """Sorted distinct starts of non-empty intervals: the only time steps that need a memory row."""
        live = self.intervals[:, 0] < self.intervals[:, 1]
        return np.unique(self.intervals[live, 0])

    def live_ranges(self, points: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per node, the half-open range ``[lo, hi)`` of indices into ``points`` at which it is live."""
        points = self.time_points() if points is None else points
        lo = np.searchsorted(points, self.intervals[:, 0], side="left")
        hi = np.searchsorted(points, self.intervals[:, 1], side="left")
        return lo, np.maximum(hi, lo)

    def usage_at_points(self, per_node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(points, usage)``: the summed ``per_node[i]`` of the nodes live at each time point."""
        points = self.time_points()
        lo, hi = self.live_ranges(points)
        diff = np.zeros(points.shape[0] + 1)
        np.add.at(diff, lo, per_node)
        np.add.at(diff, hi, -per_node)
        return points, np.cumsum(diff)[:-1]

    def memory_usage(self, choice: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(points, usage)`` of an assignment at each distinct time point."""
        choice = np.asarray(choice, dtype=np.int64)
        per_node = np.array([m[s] for m, s in zip(self.node_memory, choice.tolist(), strict=True)])
        return self.usage_at_points(per_node)

    def min_memory(self) -> np.ndarray:
        """Per node, the least memory among its strategies of finite cost (all of them if none is)."""
        if self.num_nodes == 0:
            return np.zeros(0)
        costs, mem = np.concatenate(self.node_costs), np.concatenate(self.node_memory)
        offsets = np.concatenate([[0], np.cumsum(self.num_strategies)[:-1]])
        finite_min = np.minimum.reduceat(np.where(np.isfinite(costs), mem, np.inf), offsets)
        return np.where(np.isfinite(finite_min), finite_min, np.minimum.reduceat(mem, offsets))

    def check_memory_lower_bound(self) -> None:
        """Raise InfeasibleError if, even with every node at its least memory, some time step overflows."""
        if self.memory_limit is None or self.num_nodes == 0:
            return
        mins = self.min_memory()
        points, usage = self.usage_at_points(mins)
        if usage.size == 0:
            return
        worst = int(np.argmax(usage))
        if usage[worst] > self.memory_limit * (1 + 1e-9) + 1e-9:
            raise self.memory_error(int(points[worst]), float(usage[worst]), mins, reason="")

    def memory_error(self, time: int, usage: float, per_node: np.ndarray, *, reason: str) -> InfeasibleError:
        """The InfeasibleError for time step ``time``, naming its heaviest live nodes."""
        live = np.flatnonzero((self.intervals[:, 0] <= time) & (time < self.intervals[:, 1]))
        top = live[np.argsort(-per_node[live], kind="stable")][:5]
        listing = "; ".join(f"{self.node_label(int(i))} needs >= {per_node[i]:.6g}" for i in top)
        limit = float(self.memory_limit) if self.memory_limit is not None else float("inf")
        msg = (
            f"no assignment fits the memory limit {limit:.6g}: at the tightest time step t={time} the "
            f"least achievable usage is {usage:.6g} ({usage - limit:+.6g} over){reason}. "
            f"{live.size} nodes are live there; the largest: {listing}. Try a larger memory limit, a larger "
            f"mesh, or strategies that shard these values further."
        )
        return InfeasibleError(msg, time=time, min_usage=usage, limit=limit, nodes=tuple(int(i) for i in top))
