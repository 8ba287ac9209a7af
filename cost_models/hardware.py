"""Frozen hardware descriptions: one accelerator (``Device``) and a cluster of hosts (``Cluster``).

A ``Cluster`` is ``num_hosts`` hosts of ``devices_per_host`` devices. Devices inside a host talk over
``intra_link`` (NVLink; ICI inside a TPU slice; shared memory for CPU devices), hosts over ``inter_link``
(InfiniBand, Ethernet, DCN). For TPUs a "host" here is an ICI domain (a slice), not the CPU host that drives
four chips: what matters to the cost model is which link a collective crosses.

Mapping mesh axes to links (``Cluster.logical_mesh``): devices are numbered host-major (device ``d`` lives on
host ``d // devices_per_host``) and the mesh is laid out row-major over them, so the innermost (last) axes
hold adjacent devices. Walking the axes from innermost outwards with the running product ``P`` of sizes
(this axis included), an axis gets ``intra_link`` while ``P <= devices_per_host`` and ``devices_per_host``
is a multiple of ``P`` (each of its groups lies inside one host), otherwise ``inter_link``. An axis that
only partly crosses hosts (its groups span hosts but also share one) therefore gets the slower link: the
ring is as fast as its slowest hop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cost_models.dtypes import DtypeLike, rate_class
from cost_models.errors import CostModelError
from cost_models.mesh import Link, LogicalMesh


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One accelerator. Rates are dense (no sparsity), in FLOP/s; bandwidths in bytes/s; capacity in bytes.

    * ``flops_fp32`` is the non-tensor-core (vector/SIMT) fp32 rate, also used for non-matmul work.
    * ``flops_tf32`` / ``flops_fp16`` / ``flops_fp8`` / ``flops_int8``: ``None`` when the device has no such
      unit; the dtype then falls back (tf32 → fp32, fp16 → bf16, fp8 → fp16/bf16, int8 → fp8 rate).
    * ``fp32_matmul_as``: the unit an XLA fp32 dot runs on at default precision: ``"fp32"``, ``"tf32"``
      (Ampere and later GPUs) or ``"bf16"`` (TPUs, one bf16 pass).
    * ``matmul_efficiency``: achievable fraction of the peak matmul rate for large dots;
      ``memory_efficiency``: achievable fraction of the HBM bandwidth.
    * ``conv_efficiency``: the rate convolutions (cuDNN's kernels on GPUs) reach as a fraction of the
      matmul rate at equal FLOPs; 1.0 where nothing was measured.
    """

    name: str
    flops_fp32: float
    flops_bf16: float
    flops_tf32: float | None = None
    flops_fp16: float | None = None
    flops_fp8: float | None = None
    flops_int8: float | None = None
    fp32_matmul_as: str = "fp32"
    matmul_efficiency: float = 0.7
    conv_efficiency: float = 1.0
    memory_bandwidth: float
    memory_efficiency: float = 0.8
    memory_capacity: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.fp32_matmul_as not in ("fp32", "tf32", "bf16"):
            raise CostModelError(
                f"device {self.name!r}: fp32_matmul_as must be 'fp32', 'tf32' or 'bf16', "
                f"got {self.fp32_matmul_as!r}"
            )
        for f in ("flops_fp32", "flops_bf16", "memory_bandwidth", "memory_capacity"):
            if not getattr(self, f) > 0:
                raise CostModelError(f"device {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        for f in ("matmul_efficiency", "memory_efficiency", "conv_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise CostModelError(f"device {self.name!r}: {f} must be in (0, 1], got {getattr(self, f)}")

    def peak_flops(self, dtype: DtypeLike, *, matmul: bool = True) -> float:
        """Peak FLOP/s for ``dtype`` (matmul units when ``matmul``; vector fp32 rate otherwise)."""
        if not matmul:
            return self.flops_fp32
        cls = rate_class(dtype)
        if cls == "fp32":
            cls = self.fp32_matmul_as
        fp16 = self.flops_fp16 or self.flops_bf16
        fp8 = self.flops_fp8 or fp16
        table = {
            "fp64": self.flops_fp32 / 2,
            "fp32": self.flops_fp32,
            "tf32": self.flops_tf32 or self.flops_fp32,
            "bf16": self.flops_bf16,
            "fp16": fp16,
            "fp8": fp8,
            "int8": self.flops_int8 or fp8,
            "int": self.flops_fp32,
        }
        return table[cls]

    def achievable_flops(self, dtype: DtypeLike, *, matmul: bool = True) -> float:
        """``peak_flops · matmul_efficiency`` for matmuls, the vector rate for other work."""
        return self.peak_flops(dtype, matmul=matmul) * (self.matmul_efficiency if matmul else 1.0)

    @property
    def achievable_memory_bandwidth(self) -> float:
        return self.memory_bandwidth * self.memory_efficiency

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Device:
        known = set(cls.__slots__)
        extra = set(d) - known
        if extra:
            raise CostModelError(f"unknown device fields {sorted(extra)}; known fields are {sorted(known)}")
        return cls(**dict(d))


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """``num_hosts`` hosts × ``devices_per_host`` identical devices; see the module docstring for links."""

    name: str
    device: Device
    num_hosts: int = 1
    devices_per_host: int
    intra_link: Link
    inter_link: Link
    source: str = ""

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.devices_per_host < 1:
            raise CostModelError(
                f"cluster {self.name!r}: num_hosts and devices_per_host must be >= 1, got "
                f"{self.num_hosts} and {self.devices_per_host}"
            )

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def logical_mesh(
        self, shape: Iterable[int] | None = None, axis_names: Iterable[str] | None = None
    ) -> LogicalMesh:
        """A ``LogicalMesh`` over the first ``prod(shape)`` devices (default: ``(hosts, devices_per_host)``
        named ``("host", "device")``). Axis names default to ``("x", "y", "z", "w")[:ndim]``."""
        shape = (self.num_hosts, self.devices_per_host) if shape is None else tuple(int(s) for s in shape)
        if axis_names is None:
            default_2d = shape == (self.num_hosts, self.devices_per_host)
            axis_names = ("host", "device") if default_2d else ("x", "y", "z", "w", "v", "u")[: len(shape)]
        axis_names = tuple(axis_names)
        if math.prod(shape) > self.num_devices:
            raise CostModelError(
                f"mesh {shape} needs {math.prod(shape)} devices but cluster {self.name!r} has "
                f"{self.num_hosts} hosts x {self.devices_per_host} = {self.num_devices}; use a smaller mesh "
                f"or a larger cluster (e.g. presets.get({self.name!r}, num_hosts=...))"
            )
        links: list[Link] = []
        running = 1
        for size in reversed(shape):
            running *= size
            inside = running <= self.devices_per_host and self.devices_per_host % running == 0
            links.append(self.intra_link if inside or size == 1 else self.inter_link)
        return LogicalMesh(axis_names=axis_names, shape=shape, links=tuple(reversed(links)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device.to_dict(),
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "intra_link": self.intra_link.to_dict(),
            "inter_link": self.inter_link.to_dict(),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        return cls(
            name=str(d["name"]),
            device=Device.from_dict(d["device"]),
            num_hosts=int(d["num_hosts"]),
            devices_per_host=int(d["devices_per_host"]),
            intra_link=Link.from_dict(d["intra_link"]),
            inter_link=Link.from_dict(d["inter_link"]),
            source=str(d.get("source", "")),
        )
