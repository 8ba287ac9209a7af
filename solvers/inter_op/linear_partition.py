"""The min-max linear partition: ``L`` layers cut into ``V`` contiguous groups so that the slowest group is
as fast as possible, the stage cut of the interleaved schedule (``V = v·S`` virtual stages, each one model
chunk on a submesh) where every virtual stage runs at the pace of the slowest one.

Given ``t[i, j]``, the time of a group of layers ``i..j`` (``inf`` where it has no plan), with

    best[0, 0] = 0,   best[k, j] = min_{k-1 <= i < j} max(best[k-1, i], t[i, j-1])

(``best[k, j]``: layers ``0..j-1`` in ``k`` groups, the slowest group's time), the answer is
``best[V, L]`` and the cuts are read back from the argmins. ``O(V·L²)`` comparisons; the group times may be
any numbers (a group's time is not assumed to grow with its layers: a layer priced under its stage's share
of memory may be cheaper in a larger group).
"""

from __future__ import annotations

import numpy as np


class PartitionInfeasibleError(ValueError):
    """No cut of the layers into the groups has every group's time finite."""


def linear_partition(group_time: np.ndarray, groups: int) -> tuple[list[tuple[int, int]], float]:
    """``group_time[i, j]`` (``[L, L]``; only ``i <= j`` read): the ``groups`` contiguous groups of layers
    ``(first, last)`` minimising the largest ``group_time`` among them, and that largest time. Ties go to the
    earliest cut. Raises ``PartitionInfeasibleError`` when every cut has a group of infinite time, and
    ``ValueError`` when ``groups`` is not between 1 and ``L``."""
    layers = group_time.shape[0]
    if group_time.ndim != 2 or group_time.shape[1] != layers:
        raise ValueError(f"group_time must be [L, L], got {group_time.shape}")
    if not 1 <= groups <= layers:
        raise ValueError(f"{layers} layers cannot make {groups} non-empty groups")
    best = np.full((groups + 1, layers + 1), np.inf)
    cut = np.zeros((groups + 1, layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, groups + 1):
        for j in range(k, layers + 1):
            # the last group is layers i..j-1 for every i leaving k-1 layers at least before it
            i = np.arange(k - 1, j)
            val = np.maximum(best[k - 1, i], group_time[i, j - 1])
            a = int(np.argmin(val))
            best[k, j], cut[k, j] = val[a], i[a]
    if not np.isfinite(best[groups, layers]):
        raise PartitionInfeasibleError(f"no cut of {layers} layers into {groups} groups has every group's time finite")
    bounds, j = [], layers
    for k in range(groups, 0, -1):
        bounds.append((int(cut[k, j]), j - 1))
        j = int(cut[k, j])
    return bounds[::-1], float(best[groups, layers])
