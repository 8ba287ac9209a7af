"""Tiling the cluster with the stages' submeshes (Alpa §5.2).

The cluster is a grid of ``H`` hosts × ``D`` devices. A submesh of shape ``(h, d)`` occupies a rectangle
of hosts ``[a, a + h)`` × devices ``[b, b + d)``. Alpa restricts the shapes to ``(1, 2^k)`` with
``2^k <= D`` and ``(n, D)``; when ``D`` is a power of two, any multiset of such shapes whose device counts
sum to at most ``H·D`` tiles the grid. :func:`place_submeshes` proves it constructively: whole-host
shapes first, then the single-host shapes largest first, each at the first free position in host-major
order. Every single-host block then starts at a multiple of its width (its width divides all widths
placed before it), so a host's free space is always a suffix and nothing fragments.

For other shapes the same first-fit-decreasing greedy is tried and a ValueError names the shape that
did not fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["check_placement", "place_submeshes"]


def place_submeshes(cluster: tuple[int, int], shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Corners ``(host_start, device_start)`` of disjoint rectangles of the given ``(hosts, devices)``
    shapes inside the ``cluster = (H, D)`` grid, in the order of ``shapes``. Raise ValueError if the
    greedy cannot place them (always possible for Alpa's shapes when ``D`` is a power of two)."""
    hosts, per_host = (int(x) for x in cluster)
    shapes = [(int(h), int(d)) for h, d in shapes]
    for h, d in shapes:
        if not (1 <= h <= hosts and 1 <= d <= per_host):
            raise ValueError(f"submesh ({h}, {d}) does not fit the {hosts}x{per_host} cluster")
    total = sum(h * d for h, d in shapes)
    if total > hosts * per_host:
        raise ValueError(f"the submeshes hold {total} devices; the cluster has {hosts * per_host}")
    free = np.ones((hosts, per_host), dtype=bool)
    corners: list[tuple[int, int] | None] = [None] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda s: (-shapes[s][0], -shapes[s][1], s))
    for s in order:
        h, d = shapes[s]
        spot = next(((a, b) for a in range(hosts - h + 1) for b in range(per_host - d + 1)
                     if free[a:a + h, b:b + d].all()), None)
        if spot is None:
            placed = [shapes[t] for t in order[: order.index(s)]]
            raise ValueError(
                f"cannot place submesh {s} of shape ({h}, {d}) on the {hosts}x{per_host} cluster after "
                f"{placed}: no free {h}x{d} rectangle is left. Alpa's shapes (1, 2^k) and (n, D) always "
                f"tile a cluster whose devices per host D is a power of two"
            )
        a, b = spot
        free[a:a + h, b:b + d] = False
        corners[s] = spot
    return [c for c in corners if c is not None]


def check_placement(
    cluster: tuple[int, int], shapes: Sequence[tuple[int, int]], corners: Sequence[tuple[int, int]]
) -> None:
    """Raise ValueError unless each rectangle lies inside the cluster and no two overlap."""
    hosts, per_host = (int(x) for x in cluster)
    if len(shapes) != len(corners):
        raise ValueError(f"{len(shapes)} shapes but {len(corners)} corners")
    owner = np.full((hosts, per_host), -1, dtype=np.int64)
    for s, ((h, d), (a, b)) in enumerate(zip(shapes, corners, strict=True)):
        if a < 0 or b < 0 or a + h > hosts or b + d > per_host:
            raise ValueError(f"submesh {s} ({h}x{d} at host {a}, device {b}) leaves the {hosts}x{per_host} cluster")
        clash = owner[a:a + h, b:b + d]
        if (clash >= 0).any():
            raise ValueError(f"submesh {s} ({h}x{d} at host {a}, device {b}) overlaps submesh {clash.max()}")
        owner[a:a + h, b:b + d] = s
