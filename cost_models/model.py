"""``CostModel``: the prices the planner asks for, from one profile (a preset or a measured file) and a mesh.

Byte conventions, used throughout:

* ``bytes_accessed`` (``compute_time``): total bytes one device reads and writes for the op.
* ``nbytes`` (``collective_time``): the larger per-device buffer (see ``cost_models.collectives``).
* ``shape`` (``reshard``, ``bytes_per_device``): the full logical (global, unsharded) tensor shape.

Compute roofline (Williams, Waterman & Patterson, CACM 2009)::

    compute_time(F, M, dtype) = max(F / (peak(dtype) · matmul_efficiency),  M / (HBM bandwidth · mem_eff))
    conv_time(F, M, dtype)    = max(F / (peak(dtype) · matmul_efficiency · conv_efficiency),  same)

with ``peak(dtype)`` from ``Device.peak_flops``. A measured profile replaces the rate by the measured one
(interpolated by shape) for measured dtypes, and the bandwidth by the measured copy bandwidth (see
``cost_models.profile``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cost_models.collectives import bounded, check_kind, collective_time, combined
from cost_models.dtypes import DtypeLike, dtype_bytes
from cost_models.errors import CostModelError
from cost_models.hardware import Cluster, Device
from cost_models.mesh import Axes, LogicalMesh
from cost_models.profile import Curve, Profile, RateTable, collective_key, load_profile
from cost_models.reshard import CollectiveStep, per_device_bytes, plan_reshard
from cost_models.spec import ShardingSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardCost:
    """Seconds to take a tensor from ``src`` to ``dst`` and the collectives that make it up."""

    time: float
    steps: tuple[CollectiveStep, ...]
    src: ShardingSpec
    dst: ShardingSpec

    def __str__(self) -> str:
        if not self.steps:
            return f"{self.src} -> {self.dst}: free"
        parts = "; ".join(str(s) for s in self.steps)
        return f"{self.src} -> {self.dst}: {self.time * 1e6:.1f} us [{parts}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Prices on ``mesh`` from ``profile``. Build with ``CostModel.load`` (the one loading path)."""

    profile: Profile
    mesh: LogicalMesh
    _matmul: dict[str, RateTable] = field(init=False, repr=False, compare=False)
    _collective: dict[tuple[str, int, frozenset[str]], Curve] = field(init=False, repr=False, compare=False)
    _copy_bandwidth: float | None = field(init=False, repr=False, compare=False)
    # per-instance tables of values derived purely from this model (see ``memo``): a model and its copies
    # on other meshes never share entries
    _memo: dict[str, dict[Any, Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_dtype: dict[str, list[Any]] = {}
        for s in self.profile.matmuls:
            by_dtype.setdefault(s.dtype, []).append(s)
        object.__setattr__(self, "_matmul", {d: RateTable.of(v) for d, v in by_dtype.items()})
        cc: dict[tuple[str, int, frozenset[str]], tuple[list[float], list[float]]] = {}
        for s in self.profile.collectives:
            xs, ys = cc.setdefault(s.key, ([], []))
            xs.append(s.nbytes)
            ys.append(s.seconds)
        object.__setattr__(self, "_collective", {k: Curve.of(x, y) for k, (x, y) in cc.items()})
        bw = None
        if self.profile.copies:
            c = Curve.of(
                [2 * s.nbytes for s in self.profile.copies], [s.seconds for s in self.profile.copies]
            )
            bw = 1.0 / c.b
        object.__setattr__(self, "_copy_bandwidth", bw)
        object.__setattr__(self, "_memo", {})

    # ------------------------------------------------------------------------------------ construction
    @classmethod
    def load(
        cls,
        source: str | Path | Profile | Cluster,
        *,
        mesh: LogicalMesh | None = None,
        mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        **preset_overrides: Any,
    ) -> CostModel:
        """From a preset name (``"h100"``; extra keywords go to ``presets.get``), a profile JSON path or
        shipped file name, a ``Profile`` or a ``Cluster``. The mesh is ``mesh`` if given, else
        ``cluster.logical_mesh(mesh_shape, axis_names)`` when a shape is given, else the mesh the profile was
        measured on, else the cluster's ``(hosts, devices_per_host)`` mesh."""
        profile = load_profile(source, **preset_overrides)
        if mesh is None:
            if mesh_shape is None and axis_names is None and profile.mesh is not None:
                mesh = profile.mesh
            else:
                mesh = profile.cluster.logical_mesh(mesh_shape, axis_names)
        return cls(profile=profile, mesh=mesh)

    def with_mesh(self, shape: Sequence[int], axis_names: Sequence[str] | None = None) -> CostModel:
        """The same prices on another mesh of this cluster."""
        return replace(self, mesh=self.cluster.logical_mesh(shape, axis_names))

    @property
    def cluster(self) -> Cluster:
        return self.profile.cluster

    @property
    def device(self) -> Device:
        return self.profile.cluster.device

    @property
    def memory_capacity(self) -> float:
        """Bytes of device memory (HBM) per device."""
        return self.device.memory_capacity

    @property
    def memory_bandwidth(self) -> float:
        """Achievable bytes/s of device memory traffic (measured copy bandwidth when profiled)."""
        return self._copy_bandwidth or self.device.achievable_memory_bandwidth

    # ----------------------------------------------------------------------------------------- compute
    def compute_time(
        self, flops: float, bytes_accessed: float, dtype: DtypeLike = "float32", *, matmul: bool = True
    ) -> float:
        """Roofline seconds for one device: ``max(flops / rate(dtype), bytes_accessed / bandwidth)``.
        ``matmul=False`` prices the FLOPs at the vector (non-tensor-core) fp32 rate. With a measured
        profile, a matmul's rate is that of a measured cube of the same FLOPs (use ``matmul_time`` when
        the shape is known)."""
        if flops < 0 or bytes_accessed < 0:
            raise CostModelError(f"flops and bytes must be >= 0, got {flops} and {bytes_accessed}")
        side = (flops / 2) ** (1 / 3)
        return self._roofline(flops, bytes_accessed, dtype, matmul, (side, side, side))

    def _roofline(
        self, flops: float, nbytes: float, dtype: DtypeLike, matmul: bool, mnk: tuple[float, float, float]
    ) -> float:
        mem = nbytes / self.memory_bandwidth
        table = self._matmul.get(str(dtype)) if matmul else None
        rate = table.rate(*mnk) if table is not None else self.device.achievable_flops(dtype, matmul=matmul)
        return max(flops / rate, mem)

    def conv_time(self, flops: float, bytes_accessed: float, dtype: DtypeLike = "float32") -> float:
        """Roofline seconds of a convolution: ``compute_time`` with the matmul rate scaled by the device's
        ``conv_efficiency`` (``max(F / (rate(dtype) · conv_efficiency), M / bandwidth)``)."""
        if flops < 0 or bytes_accessed < 0:
            raise CostModelError(f"flops and bytes must be >= 0, got {flops} and {bytes_accessed}")
        side = (flops / 2) ** (1 / 3)
        table = self._matmul.get(str(dtype))
        rate = table.rate(side, side, side) if table is not None else self.device.achievable_flops(dtype)
        return max(flops / (rate * self.device.conv_efficiency), bytes_accessed / self.memory_bandwidth)

    def matmul_time(self, m: int, n: int, k: int, dtype: DtypeLike = "float32", *, batch: int = 1) -> float:
        """Seconds for ``batch`` × ``[m,k] @ [k,n]`` on one device: ``2·b·m·n·k`` FLOPs and
        ``b·(m·k + k·n + m·n)·dtype_bytes`` bytes through the roofline (measured rate of this shape when
        the profile has samples of this dtype; a batched product is looked up as ``[b·m, k] @ [k, n]``, the
        form a profile records it in)."""
        flops = 2.0 * batch * m * n * k
        nbytes = batch * (m * k + k * n + m * n) * dtype_bytes(dtype)
        return self._roofline(flops, nbytes, dtype, True, (batch * m, n, k))

    def memory_time(self, bytes_accessed: float) -> float:
        """Seconds to move ``bytes_accessed`` through device memory (an elementwise op, a copy)."""
        return bytes_accessed / self.memory_bandwidth

    # ------------------------------------------------------------------------------------- collectives
    def collective_time(self, kind: str, nbytes: float, axes: Axes) -> float:
        """Seconds for collective ``kind`` (``all_reduce``, ``all_gather``, ``reduce_scatter``,
        ``all_to_all``, ``send_recv``) over mesh ``axes`` (a name or several; several are priced as a
        hierarchical collective). ``nbytes``: the larger per-device buffer (``cost_models.collectives``).

        The measured curve of this kind, group size and links when the profile has one, else the analytic
        alpha-beta formula; an all-reduce at most its reduce-scatter plus its all-gather on the same buffer
        (``collectives.bounded``: the ring all-reduce is those two halves)."""
        table = self.memo("cost_models.collective_time")  # every reshard step asks it
        key = (kind, nbytes, axes if isinstance(axes, str | tuple) else tuple(axes))
        hit = table.get(key)
        if hit is not None:
            return hit
        check_kind(kind)
        names = self.mesh.normalize_axes(axes)
        p = self.mesh.size(names)
        t = 0.0 if p <= 1 or nbytes <= 0 else bounded(kind, lambda k: self._own_collective_time(k, nbytes, names, p))
        table[key] = t
        return t

    def _own_collective_time(self, kind: str, nbytes: float, names: tuple[str, ...], p: int) -> float:
        """``collective_time`` before ``collectives.bounded``."""
        links = [self.mesh.link(a) for a in names]
        curve = self._collective.get(collective_key(kind, p, [lk.name for lk in links]))
        if curve is not None:
            return curve(nbytes)
        return collective_time(
            kind, nbytes, [(self.mesh.axis_size(a), lk) for a, lk in zip(names, links, strict=True)]
        )

    # ------------------------------------------------------------------------------ sharding and memory
    def bytes_per_device(self, shape: Sequence[int], dtype: DtypeLike, spec: ShardingSpec) -> int:
        """Bytes one device holds of a tensor of global ``shape`` laid out as ``spec`` (ceil-padded blocks;
        a partial-sum tensor takes a full block on every device)."""
        return per_device_bytes(shape, dtype_bytes(dtype), spec, self.mesh)

    def memo(self, name: str) -> dict[Any, Any]:
        """A per-instance table for values callers derive purely from this model's prices (a problem
        builder's priced strategies): they live as long as the model and never leak to a model with other
        prices or another mesh."""
        return self._memo.setdefault(name, {})

    def latency(self, kind: str, axes: Axes) -> float:
        """Seconds of collective ``kind`` over ``axes`` on a one-byte buffer: what it costs whatever it moves
        (the smallest measured sample's time on a measured curve)."""
        return self.collective_time(kind, 1, axes)

    def reshard(
        self, shape: Sequence[int], dtype: DtypeLike, src: ShardingSpec, dst: ShardingSpec, *, combine: int = 1
    ) -> ReshardCost:
        """Collectives and seconds to take a tensor of global ``shape`` from ``src`` to ``dst``
        (rules in ``cost_models.reshard``; each step priced by ``collective_time``). ``combine``: the
        all-reduces of pending sums are one of that many that XLA issues as one instruction, each charged
        ``collectives.combined`` (a gradient reduced as the backward pass ends)."""
        # asked again and again by the problem builder (every edge of every op group)
        table = self.memo("cost_models.reshard")
        key = (tuple(shape), str(dtype), src, dst, combine)
        hit = table.get(key)
        if hit is not None:
            return hit
        steps = tuple(
            CollectiveStep(kind=s.kind, axes=s.axes, nbytes=s.nbytes, time=self.step_time(s.kind, s.nbytes, s.axes, combine))
            for s in plan_reshard(shape, dtype_bytes(dtype), src, dst, self.mesh)
        )
        cost = ReshardCost(time=math.fsum(s.time for s in steps), steps=steps, src=src, dst=dst)
        table[key] = cost
        return cost

    def step_time(self, kind: str, nbytes: float, axes: Axes, combine: int = 1) -> float:
        """``collective_time``; an all-reduce that is one of ``combine`` issued as one instruction priced
        ``collectives.combined`` (its share of the latency they pay once)."""
        t = self.collective_time(kind, nbytes, axes)
        if kind != "all_reduce" or combine <= 1:
            return t
        return combined(t, self.latency(kind, axes), combine)

    def reshard_time(
        self, shape: Sequence[int], dtype: DtypeLike, src: ShardingSpec, dst: ShardingSpec, *, combine: int = 1
    ) -> float:
        return self.reshard(shape, dtype, src, dst, combine=combine).time
