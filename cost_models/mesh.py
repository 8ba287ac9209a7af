"""Links and the logical device mesh: named axes, their sizes, and the link each axis communicates over.

A ``LogicalMesh`` needs no devices: planning a 16x16 mesh on a laptop only needs this object. It is usually
built by ``Cluster.logical_mesh`` (see ``cost_models.hardware``), which decides which axes stay inside a host
and which cross hosts.

Link convention (used by every formula in ``cost_models.collectives``):

* ``Link.bandwidth`` is bytes/s **per device, per direction, while every device of the mesh communicates at
  once** (SPMD collectives run on all groups of an axis simultaneously). For a host whose devices share one
  network card this is the card's bandwidth divided by the devices per host.
* ``Link.latency`` is seconds per message step (the alpha of the alpha-beta model).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cost_models.errors import CostModelError


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One class of interconnect. ``name`` identifies it (``"nvlink"``, ``"ib"``, ``"ici"``, ``"dcn"``,
    ``"cpu-shm"``); measured collectives in a profile are matched to mesh axes by it."""

    name: str
    bandwidth: float  # bytes/s per device per direction, all devices communicating
    latency: float  # s per message step

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise CostModelError(f"link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not self.latency >= 0:
            raise CostModelError(f"link {self.name!r}: latency must be >= 0 s, got {self.latency}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bandwidth": self.bandwidth, "latency": self.latency}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        return cls(name=str(d["name"]), bandwidth=float(d["bandwidth"]), latency=float(d["latency"]))


Axes = str | Iterable[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class LogicalMesh:
    """Named mesh axes, major to minor (like ``jax.sharding.Mesh``), with one ``Link`` per axis.

    Devices are numbered row-major over ``shape``; the last axis is the innermost (adjacent device ids).
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    links: tuple[Link, ...]
    _size: dict[str, int] = field(init=False, repr=False, compare=False)  # axis -> size, asked per collective

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_names", tuple(str(a) for a in self.axis_names))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "_size", dict(zip(self.axis_names, self.shape, strict=False)))
        n = len(self.axis_names)
        if len(self.shape) != n or len(self.links) != n:
            raise CostModelError(
                f"mesh has {n} axis names {self.axis_names}, {len(self.shape)} sizes {self.shape} and "
                f"{len(self.links)} links; give one size and one link per axis"
            )
        if len(set(self.axis_names)) != n:
            raise CostModelError(f"mesh axis names must be distinct, got {self.axis_names}")
        if any(s < 1 for s in self.shape):
            raise CostModelError(f"mesh axis sizes must be >= 1, got {self.shape}")

    @classmethod
    def uniform(cls, shape: Iterable[int], axis_names: Iterable[str], link: Link) -> LogicalMesh:
        """A mesh whose every axis uses the same link (one host, or a flat network)."""
        shape = tuple(shape)
        return cls(axis_names=tuple(axis_names), shape=shape, links=(link,) * len(shape))

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def normalize_axes(self, axes: Axes) -> tuple[str, ...]:
        """``axes`` as a tuple of known axis names (a single name may be given as a string)."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in names:
            if a not in self.axis_names:
                raise CostModelError(f"unknown mesh axis {a!r}; this mesh has axes {self.axis_names}")
        if len(set(names)) != len(names):
            raise CostModelError(f"mesh axis repeated in {names}; name each axis at most once")
        return names

    def axis_size(self, axis: str) -> int:
        size = self._size.get(axis)
        return size if size is not None else self.shape[self.axis_names.index(self.normalize_axes(axis)[0])]

    def size(self, axes: Axes | None = None) -> int:
        """Number of devices spanned by ``axes`` (all axes when ``None``; 1 for an empty tuple)."""
        if axes is None:
            return self.num_devices
        return math.prod(self.axis_size(a) for a in self.normalize_axes(axes))

    def link(self, axis: str) -> Link:
        return self.links[self.axis_names.index(self.normalize_axes(axis)[0])]

    def __str__(self) -> str:
        return " x ".join(
            f"{a}={s}({lk.name})" for a, s, lk in zip(self.axis_names, self.shape, self.links, strict=True)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "axis_names": list(self.axis_names),
            "shape": list(self.shape),
            "links": [lk.to_dict() for lk in self.links],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LogicalMesh:
        return cls(
            axis_names=tuple(d["axis_names"]),
            shape=tuple(d["shape"]),
            links=tuple(Link.from_dict(x) for x in d["links"]),
        )
