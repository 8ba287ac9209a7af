"""``ShardingSpec``: how one tensor is laid out over a ``LogicalMesh`` (OneFlow's S/B/P, JAX's PartitionSpec).

For each tensor dimension, ``dims[i]`` lists the mesh axes that dimension is split over, major to minor
(exactly like ``jax.sharding.PartitionSpec``: ``dims[i] == ("x", "y")`` means the dimension is cut into
``|x|·|y|`` blocks and device ``(x=a, y=b)`` holds block ``a·|y| + b``). Mesh axes used by no dimension
replicate the tensor. ``partial`` is the set of mesh axes over which the value is a pending partial sum: the
true tensor is the sum over those axes of what the devices hold (the output of a matmul whose contraction
dimension was split, before its all-reduce or reduce-scatter).

Printed form (``str(spec)``), one token per dimension joined by ``·``, then the partial axes::

    S(data)·R·S(model)          dims (("data",), (), ("model",))
    S(x,y)·R +P(model)          dims (("x", "y"), ()) partial {"model"}
    ()                          a scalar (no dimensions)

``ShardingSpec.parse`` reads that form back (``.`` is accepted for ``·``).

Non-divisible dimensions are priced as XLA pads them: each device holds ``ceil(dim / shards)`` elements of the
dimension (``shard_shape``). ``validate(shape, mesh, require_divisible=True)`` rejects them instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cost_models.errors import CostModelError
from cost_models.mesh import LogicalMesh


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """Per-dimension mesh axes plus pending-partial-sum axes; see the module docstring."""

    dims: tuple[tuple[str, ...], ...]
    partial: frozenset[str] = field(default_factory=frozenset)
    # derived once: a problem builder hashes and queries the same few hundred specs millions of times
    _hash: int = field(init=False, repr=False, compare=False)
    _sharded: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _used: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dims = tuple((d,) if isinstance(d, str) else tuple(str(a) for a in d) for d in self.dims)
        object.__setattr__(self, "dims", dims)
        partial = frozenset(str(a) for a in self.partial)
        object.__setattr__(self, "partial", partial)
        sharded = tuple(a for d in dims for a in d)
        used = [*sharded, *sorted(partial)]
        if len(set(used)) != len(used):
            dup = sorted({a for a in used if used.count(a) > 1})
            raise CostModelError(
                f"sharding spec {self._fmt()} uses mesh axis {', '.join(map(repr, dup))} more than once; "
                "a mesh axis may split one dimension or mark a partial sum, not both or twice"
            )
        object.__setattr__(self, "_hash", hash((dims, partial)))
        object.__setattr__(self, "_sharded", sharded)
        object.__setattr__(self, "_used", frozenset(used))

    def __hash__(self) -> int:
        return self._hash

    # ----------------------------------------------------------------------------------------- builders
    @classmethod
    def replicated(cls, ndim: int) -> ShardingSpec:
        """Fully replicated: every device holds the whole tensor."""
        return cls(dims=((),) * ndim)

    @classmethod
    def parse(cls, text: str) -> ShardingSpec:
        """Read the printed form back: ``"S(data)·R +P(model)"`` (``.`` may replace ``·``)."""
        s = text.strip()
        partial: frozenset[str] = frozenset()
        if "+P(" in s:
            s, _, p = s.partition("+P(")
            partial = frozenset(a.strip() for a in p.rstrip(")").split(",") if a.strip())
            s = s.strip()
        if s == "()":
            return cls(dims=(), partial=partial)
        dims = []
        for tok in re.split(r"[·.]", s):
            tok = tok.strip()
            if tok == "R":
                dims.append(())
            elif tok.startswith("S(") and tok.endswith(")"):
                dims.append(tuple(a.strip() for a in tok[2:-1].split(",") if a.strip()))
            else:
                raise CostModelError(
                    f"cannot parse {tok!r} in sharding spec {text!r}; write each dimension as R or "
                    "S(axis,...), joined by '·' or '.', then optionally ' +P(axis,...)'"
                )
        return cls(dims=tuple(dims), partial=partial)

    # ---------------------------------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """Mesh axes that split some dimension, in dimension order then major-to-minor."""
        return self._sharded

    @property
    def axes_used(self) -> frozenset[str]:
        """Every mesh axis the spec mentions: splitting axes and partial axes."""
        return self._used

    def is_replicated(self) -> bool:
        return not self._used

    def dim_of(self, axis: str) -> int | None:
        """The dimension ``axis`` splits, or ``None``."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def num_shards(self, mesh: LogicalMesh, dim: int | None = None) -> int:
        """Blocks along ``dim`` (or in total, when ``dim`` is ``None``)."""
        axes = self.sharded_axes if dim is None else self.dims[dim]
        return math.prod(mesh.axis_size(a) for a in axes)

    def replicated_axes(self, mesh: LogicalMesh) -> tuple[str, ...]:
        """Mesh axes over which every device holds the same data (neither splitting nor partial)."""
        return tuple(a for a in mesh.axis_names if a not in self.axes_used)

    def validate(self, shape: Sequence[int], mesh: LogicalMesh, *, require_divisible: bool = False) -> None:
        """Raise ``CostModelError`` unless the spec fits ``shape`` on ``mesh``."""
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise CostModelError(
                f"sharding spec {self} has {self.ndim} dimensions but the tensor has shape {shape}; "
                "give one entry per dimension (R for unsplit)"
            )
        for a in sorted(self.axes_used):
            if a not in mesh.axis_names:
                raise CostModelError(
                    f"sharding spec {self} uses mesh axis {a!r}, which is not in the mesh; "
                    f"mesh axes are {mesh.axis_names}"
                )
        if require_divisible:
            for i, (n, d) in enumerate(zip(shape, self.dims, strict=True)):
                k = self.num_shards(mesh, i)
                if n % k:
                    raise CostModelError(
                        f"dimension {i} of size {n} is not divisible by the {k} shards of {d} in spec "
                        f"{self}; pick axes whose product divides {n}, or pad the tensor"
                    )

    def shard_shape(self, shape: Sequence[int], mesh: LogicalMesh) -> tuple[int, ...]:
        """Per-device block shape: ``ceil(shape[i] / shards_i)`` (XLA pads non-divisible dimensions)."""
        self.validate(shape, mesh)
        return tuple(-(-int(n) // self.num_shards(mesh, i)) for i, n in enumerate(shape))

    # ------------------------------------------------------------------------------------- rendering
    def _fmt(self) -> str:
        body = "()" if not self.dims else "·".join(f"S({','.join(d)})" if d else "R" for d in self.dims)
        if self.partial:
            body += f" +P({','.join(sorted(self.partial))})"
        return body

    def __str__(self) -> str:
        return self._fmt()

    def to_dict(self) -> dict[str, Any]:
        return {"dims": [list(d) for d in self.dims], "partial": sorted(self.partial)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardingSpec:
        return cls(dims=tuple(tuple(x) for x in d["dims"]), partial=frozenset(d.get("partial", ())))

    def with_dims(self, dims: Iterable[Iterable[str]]) -> ShardingSpec:
        return ShardingSpec(dims=tuple(tuple(d) for d in dims), partial=self.partial)
