"""The inter-operator (pipeline stage) problem as plain data, after Alpa §5 (arXiv 2201.12023).

A model is a chain of ``L`` layers; the cluster is ``H`` hosts × ``D`` devices per host
(``N = H·D`` devices). A *stage* runs layers ``i..j`` (inclusive) on one submesh ``m`` of shape
``(h_m, d_m)``, holding ``n_m = h_m·d_m`` devices. The tables, for ``0 <= i <= j < L``:

* ``stage_time[i, j, m]`` = ``t_{i,j,m}``: forward + backward time of one microbatch (``+inf`` = impossible);
* ``static_memory[i, j, m]`` = ``σ_{i,j,m}``: bytes per device held whatever the microbatch count
  (parameters, gradients, optimizer state);
* ``activation_memory[i, j, m]`` = ``α_{i,j,m}``: bytes per device per microbatch in flight.

Entries with ``j < i`` are ignored. A stage with ``r`` stages after it (so ``r + 1`` counting itself)
holds ``inflight[r]`` microbatches at once, so it needs ``σ + inflight[r]·α <= memory_limit`` bytes per
device. For 1F1B ``inflight[r] = min(r + 1, B)`` (:func:`inflight_1f1b`, the default); for GPipe
``inflight[r] = B`` (:func:`inflight_gpipe`).

A plan is stages ``(i_1..j_1, m_1), …, (i_S..j_S, m_S)`` covering layers ``0..L-1`` in order, with
``Σ_s n_{m_s} = N`` exactly (Alpa §5.2: every device is used; the shapes of :func:`alpa_submeshes` can
always tile the cluster, see :func:`solvers.inter_op.placement.place_submeshes`) and at most
``max_stages`` stages. With ``B`` microbatches its step time is (Alpa §5)

    T = Σ_s t_s + (B - 1) · max_s t_s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "InterOpInfeasibleError",
    "InterOpProblem",
    "alpa_submeshes",
    "inflight_1f1b",
    "inflight_gpipe",
]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class InterOpInfeasibleError(ValueError):
    """No slicing into stages satisfies the problem; the message says which constraint binds.

    ``layer`` is the layer that fits in no stage when that is the cause (else ``None``); ``limit`` is
    the memory limit; ``closest`` is ``(first_layer, last_layer, submesh, bytes)`` of the stage that came
    closest to fitting, when memory is the cause.
    """

    def __init__(
        self,
        message: str,
        *,
        layer: int | None = None,
        limit: float | None = None,
        closest: tuple[int, int, int, float] | None = None,
    ) -> None:
        super().__init__(message)
        self.layer = layer
        self.limit = limit
        self.closest = closest


def alpa_submeshes(cluster: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shapes (§5.2): ``(1, 2^k)`` for ``2^k <= D``, then ``(n, D)`` for ``n = 2..H``.

    When ``D`` is not a power of two, ``(1, D)`` is added so that a whole host is a choice (tiling is
    then no longer guaranteed: :func:`place_submeshes` raises when it fails).
    """
    hosts, per_host = (int(x) for x in cluster)
    if hosts < 1 or per_host < 1:
        raise ValueError(f"cluster must be (hosts >= 1, devices_per_host >= 1), got {cluster}")
    shapes = [(1, 1 << k) for k in range(per_host.bit_length()) if (1 << k) <= per_host]
    if shapes[-1] != (1, per_host):
        shapes.append((1, per_host))
    shapes += [(n, per_host) for n in range(2, hosts + 1)]
    return tuple(shapes)


def inflight_1f1b(max_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """1F1B: the stage with ``r`` stages after it holds ``min(r + 1, B)`` microbatches at once."""
    return tuple(min(r + 1, int(num_microbatches)) for r in range(int(max_stages)))


def inflight_gpipe(max_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """GPipe: every stage holds all ``B`` microbatches' activations before the backward passes start."""
    return (int(num_microbatches),) * int(max_stages)


def _table(a: np.ndarray | None, shape: tuple[int, int, int], name: str, fill: float) -> np.ndarray:
    if a is None:
        return _frozen(np.full(shape, fill, dtype=np.float64))
    arr = np.array(a, dtype=np.float64)
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}; expected [L, L, M] = {list(shape)}")
    return _frozen(arr)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class InterOpProblem:
    """Layers, cluster, submesh shapes, per-(layer range, submesh) tables, microbatches, memory rule.

    ``submeshes`` defaults to :func:`alpa_submeshes` of ``cluster``; a shape may be listed more than once
    (the same devices laid out as different logical meshes, each with its own tables); ``static_memory`` and
    ``activation_memory`` default to zeros; ``inflight`` defaults to 1F1B
    (``inflight_1f1b(stage_limit, B)``). Tables are copied into read-only float64 arrays.
    """

    num_layers: int
    cluster: tuple[int, int]
    stage_time: np.ndarray
    num_microbatches: int = 1
    submeshes: tuple[tuple[int, int], ...] | None = None
    static_memory: np.ndarray | None = None
    activation_memory: np.ndarray | None = None
    memory_limit: float | None = None
    inflight: tuple[int, ...] | None = None
    max_stages: int | None = None

    def __post_init__(self) -> None:
        cluster = tuple(int(x) for x in self.cluster)
        if len(cluster) != 2:
            raise ValueError(f"cluster must be (num_hosts, devices_per_host), got {self.cluster}")
        subs = alpa_submeshes(cluster) if self.submeshes is None else self.submeshes
        subs = tuple((int(h), int(d)) for h, d in subs)
        shape = (int(self.num_layers), int(self.num_layers), len(subs))
        object.__setattr__(self, "num_layers", int(self.num_layers))
        object.__setattr__(self, "cluster", cluster)
        object.__setattr__(self, "submeshes", subs)
        object.__setattr__(self, "num_microbatches", int(self.num_microbatches))
        object.__setattr__(self, "stage_time", _table(self.stage_time, shape, "stage_time", 0.0))
        object.__setattr__(self, "static_memory", _table(self.static_memory, shape, "static_memory", 0.0))
        object.__setattr__(self, "activation_memory",
                           _table(self.activation_memory, shape, "activation_memory", 0.0))
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", float(self.memory_limit))
        if self.max_stages is not None:
            object.__setattr__(self, "max_stages", int(self.max_stages))
        if self.inflight is None:
            inflight = inflight_1f1b(self.stage_limit, self.num_microbatches)
        else:
            inflight = tuple(int(x) for x in self.inflight)
        object.__setattr__(self, "inflight", inflight)

    # ---------------------------------------------------------------- shape
    @property
    def num_submeshes(self) -> int:
        return len(self.submeshes)

    @property
    def num_devices(self) -> int:
        return self.cluster[0] * self.cluster[1]

    @property
    def submesh_sizes(self) -> np.ndarray:
        """``n_m = h_m · d_m``, the device count of each submesh."""
        return np.array([h * d for h, d in self.submeshes], dtype=np.int64)

    @property
    def stage_limit(self) -> int:
        """The most stages a plan can have: ``min(L, N // min_m n_m, max_stages)``."""
        sizes = [h * d for h, d in self.submeshes if h * d > 0]
        cap = min(self.num_layers, self.num_devices // min(sizes)) if sizes else 0
        return cap if self.max_stages is None else min(cap, self.max_stages)

    def stage_memory(self, first: int, last: int, submesh: int, stages_after: int) -> float:
        """``σ + inflight[r]·α`` of layers ``first..last`` on ``submesh`` with ``r = stages_after``."""
        return float(self.static_memory[first, last, submesh]
                     + self.inflight[stages_after] * self.activation_memory[first, last, submesh])

    def submesh_label(self, m: int) -> str:
        h, d = self.submeshes[m]
        return f"submesh {m} ({h}x{d}, {h * d} devices)"

    def verify(self) -> None:
        """Raise a ValueError naming the first malformed field."""
        hosts, per_host = self.cluster
        if hosts < 1 or per_host < 1:
            raise ValueError(f"cluster must be (hosts >= 1, devices_per_host >= 1), got {self.cluster}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if not self.submeshes:
            raise ValueError("submeshes is empty; try alpa_submeshes(cluster)")
        for m, (h, d) in enumerate(self.submeshes):
            if not (1 <= h <= hosts and 1 <= d <= per_host):
                raise ValueError(f"submesh {m} has shape ({h}, {d}), which does not fit the cluster "
                                 f"{hosts}x{per_host} (hosts x devices per host)")
        upper = np.triu(np.ones((self.num_layers, self.num_layers), dtype=bool))[:, :, None]
        for name in ("stage_time", "static_memory", "activation_memory"):
            a = getattr(self, name)
            bad = np.argwhere(upper & (np.isnan(a) | (a < 0)))
            if bad.size:
                i, j, m = bad[0].tolist()
                raise ValueError(f"{name}[{i}, {j}, {m}] = {float(a[i, j, m])!r}; entries must be >= 0 or +inf "
                                 f"(layers {i}..{j} on {self.submesh_label(m)})")
        if self.memory_limit is not None and not (np.isfinite(self.memory_limit) and self.memory_limit >= 0):
            raise ValueError(f"memory_limit must be finite and >= 0, or None; got {self.memory_limit}")
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages must be >= 1 or None, got {self.max_stages}")
        if len(self.inflight) < self.stage_limit:
            raise ValueError(
                f"inflight has {len(self.inflight)} entries but a plan may have up to {self.stage_limit} stages; "
                f"pass inflight_1f1b({self.stage_limit}, {self.num_microbatches}) or "
                f"inflight_gpipe({self.stage_limit}, {self.num_microbatches}), or set max_stages"
            )
        if any(x < 0 for x in self.inflight):
            raise ValueError(f"inflight counts must be >= 0, got {self.inflight}")

    # ---------------------------------------------------------------- JSON
    def to_json(self, path: str | Path) -> None:
        """Save as JSON (format ``autoshard.inter_op_problem`` v1, see ``solvers.inter_op.io_json``)."""
        from solvers.inter_op.io_json import save_problem

        save_problem(self, path)

    @staticmethod
    def from_json(path: str | Path) -> InterOpProblem:
        from solvers.inter_op.io_json import load_problem

        return load_problem(path)
