"""Which collectives turn one ``ShardingSpec`` into another (pure; ``CostModel.reshard`` prices them).

Rules, applied in this order so that data shrinks before it moves (after Alpa's resharding cost and
OneFlow's S/B/P boxing):

1. **Pending sums.** Axes partial in ``src`` but not in ``dst``: where ``dst`` splits some dimension over
   the axis, one ``reduce_scatter`` over those axes (the reduced result lands already split); the remaining
   ones get one ``all_reduce``. Axes partial in ``dst`` but not in ``src`` cost nothing when they split no
   dimension of ``src`` (a device keeps its value and the others contribute zero). One that does is
   gathered first (step 4): XLA's partitioner never turns a split into a pending sum of zero-padded blocks,
   so a plan that did (a split bias read as a pending sum, then all-reduced) priced a program that is
   never run; the emitted step all-gathers it.
2. **Slice (free).** Axes that ``dst`` splits a dimension over and that the current layout does not use
   are applied by slicing locally.
3. **Move (all-to-all).** An axis that splits dimension ``i`` now and dimension ``j != i`` in ``dst``:
   one ``all_to_all`` over that axis.
4. **Gather.** Axes that split a dimension now but not in ``dst`` (or not at the same position within
   the dimension: only the common major-to-minor prefix is kept): one ``all_gather`` over all of them.
5. Slice again for axes that step 4 gathered but ``dst`` splits elsewhere in the same dimension.

Each step's ``nbytes`` follows ``cost_models.collectives``' convention (larger per-device buffer): the
per-device bytes before a reduce-scatter/all-reduce/all-to-all, after an all-gather. Per-device bytes are
``prod(shard_shape) · element bytes`` (ceil for non-divisible dimensions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.mesh import LogicalMesh
from cost_models.spec import ShardingSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveStep:
    """One collective of a resharding: ``kind`` over mesh ``axes`` on ``nbytes`` (collectives' convention),
    taking ``time`` seconds (0 until priced)."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    time: float = 0.0

    def __str__(self) -> str:
        return f"{self.kind}({','.join(self.axes)}) {_fmt_bytes(self.nbytes)} {self.time * 1e6:.1f} us"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def per_device_bytes(shape: Sequence[int], elem_bytes: float, spec: ShardingSpec, mesh: LogicalMesh) -> int:
    """``prod(spec.shard_shape(shape, mesh)) · elem_bytes``, rounded up to whole bytes."""
    spec.validate(shape, mesh)
    return _block_bytes(shape, elem_bytes, spec.dims, mesh)


def _block_bytes(shape: Sequence[int], elem_bytes: float, dims: Sequence[Sequence[str]], mesh: LogicalMesh) -> int:
    """``per_device_bytes`` of a layout given by its split axes per dimension, unchecked (a pending sum takes a
    whole block, so partial axes do not count)."""
    blocks = (-(-int(n) // math.prod(mesh.axis_size(a) for a in d)) for n, d in zip(shape, dims, strict=True))
    return math.ceil(math.prod(blocks) * elem_bytes)


def plan_reshard(
    shape: Sequence[int], elem_bytes: float, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh
) -> tuple[CollectiveStep, ...]:
    """The collectives (unpriced) that take a tensor of ``shape`` from ``src`` to ``dst``; see module doc."""
    src.validate(shape, mesh)
    dst.validate(shape, mesh)
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    dims = [list(d) for d in src.dims]
    partial = set(src.partial)
    steps: list[CollectiveStep] = []

    def now() -> int:  # the layout so far, already checked as ``src`` and ``dst`` are
        return _block_bytes(shape, elem_bytes, dims, mesh)

    def in_dims(a: str) -> bool:
        return any(a in d for d in dims)

    # 1. pending sums
    reduced = sorted(src.partial - dst.partial, key=order.__getitem__)
    scatter = tuple(a for a in reduced if dst.dim_of(a) is not None)
    allred = tuple(a for a in reduced if a not in scatter)
    if scatter:
        steps.append(CollectiveStep(kind="reduce_scatter", axes=scatter, nbytes=now()))
        for a in scatter:
            dims[dst.dim_of(a)].append(a)  # type: ignore[index]
            partial.discard(a)
    if allred:
        steps.append(CollectiveStep(kind="all_reduce", axes=allred, nbytes=now()))
        partial.difference_update(allred)

    # classify axes currently splitting dimensions
    moves: list[tuple[str, int, int]] = []
    gathers: list[str] = []
    for i, d in enumerate(dims):
        want = dst.dims[i]
        keep = 0
        while keep < min(len(d), len(want)) and d[keep] == want[keep]:
            keep += 1
        for a in d[keep:]:
            j = dst.dim_of(a)
            if j is not None and j != i:
                moves.append((a, i, j))
            else:
                gathers.append(a)

    def slice_free() -> None:
        for j, want in enumerate(dst.dims):
            for a in want:
                if not in_dims(a) and a not in partial:
                    dims[j].append(a)

    # 2. free slices, 3. moves, 4. gathers, 5. slices again
    slice_free()
    for a, i, j in moves:
        steps.append(CollectiveStep(kind="all_to_all", axes=(a,), nbytes=now()))
        dims[i].remove(a)
        dims[j].append(a)
    if gathers:
        for a in gathers:
            for d in dims:
                if a in d:
                    d.remove(a)
        steps.append(
            CollectiveStep(
                kind="all_gather", axes=tuple(sorted(gathers, key=order.__getitem__)), nbytes=now()
            )
        )
    slice_free()
    return tuple(steps)
