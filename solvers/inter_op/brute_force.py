"""Exhaustive references for tiny inter-operator and clustering problems (tests cross-check against them)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np

from solvers.inter_op.clustering import (
    Clustering,
    ClusteringProblem,
    _balances,
    _cap,
    _frozen,
    _layer_sums,
    _prefix,
)
from solvers.inter_op.placement import place_submeshes
from solvers.inter_op.problem import InterOpInfeasibleError, InterOpProblem
from solvers.inter_op.solution import InterOpSolution, InterOpStats, Stage, pipeline_cost

__all__ = ["brute_force_clustering", "brute_force_inter_op"]


def _fills(sizes: list[int], stages: int, devices: int) -> Iterator[tuple[int, ...]]:
    """Every choice of one submesh per stage whose device counts add up to exactly ``devices``."""
    if stages == 0:
        if devices == 0:
            yield ()
        return
    for m, n in enumerate(sizes):
        if n <= devices:
            for rest in _fills(sizes, stages - 1, devices - n):
                yield (m, *rest)


def brute_force_inter_op(problem: InterOpProblem, *, max_plans: int = 2_000_000) -> InterOpSolution:
    """Enumerate every slicing of the layers × every submesh per stage; return the cheapest valid plan.

    Valid: finite stage times, device counts summing to the cluster, at most ``stage_limit`` stages,
    every stage within the memory limit under the in-flight rule. Raises InterOpInfeasibleError when no
    plan is valid and ValueError when there are more than ``max_plans`` plans to look at.
    """
    problem.verify()
    start = time.perf_counter()
    L, N = problem.num_layers, problem.num_devices
    cap, sizes, limit = problem.stage_limit, problem.submesh_sizes, problem.memory_limit
    fills = {s: list(_fills(sizes.tolist(), s, N)) for s in range(1, cap + 1)}
    total = sum(len(list(itertools.combinations(range(1, L), s - 1))) * len(fills[s]) for s in fills)
    if total > max_plans:
        raise ValueError(f"{total} plans is too many to enumerate (max_plans={max_plans})")
    best: tuple[float, tuple[Stage, ...]] | None = None
    for s in range(1, cap + 1):
        for cuts in itertools.combinations(range(1, L), s - 1):
            bounds = list(zip((0, *cuts), (*(c - 1 for c in cuts), L - 1), strict=True))
            for ms in fills[s]:
                stages = tuple(
                    Stage(first_layer=a, last_layer=b, submesh=m, time=float(problem.stage_time[a, b, m]),
                          memory=problem.stage_memory(a, b, m, s - 1 - pos))
                    for pos, ((a, b), m) in enumerate(zip(bounds, ms, strict=True))
                )
                if limit is not None and any(st.memory > limit for st in stages):
                    continue
                cost = pipeline_cost([st.time for st in stages], problem.num_microbatches)
                if cost < float("inf") and (best is None or cost < best[0]):
                    best = (cost, stages)
    if best is None:
        raise InterOpInfeasibleError("no plan has finite stage times, fits in memory and uses every device")
    try:
        placement = tuple(place_submeshes(problem.cluster, [problem.submeshes[st.submesh] for st in best[1]]))
    except ValueError:
        placement = None
    stats = InterOpStats(candidates=0, dp_runs=0, settled=0, pruned=0, dp_states=0,
                         seconds=time.perf_counter() - start)
    return InterOpSolution(stages=best[1], cost=best[0], stats=stats, placement=placement)


def brute_force_clustering(problem: ClusteringProblem) -> Clustering:
    """Enumerate every set of ``L - 1`` boundaries (tiny problems only; tests cross-check the DP)."""
    problem.verify()
    prefix, L = _prefix(problem.flops), problem.num_layers
    free = [p for p in np.flatnonzero(problem.candidate_mask()).tolist() if p not in problem.forced]
    for delta in _balances(problem.balance, L):
        cap, best = _cap(prefix[-1], L, delta), None
        for extra in itertools.combinations(free, L - 1 - len(problem.forced)):
            bounds = sorted([*problem.forced, *extra])
            w = _layer_sums(prefix, bounds)
            if (w > cap).any():
                continue
            key = (float(problem.cut_bytes[bounds].sum()), float(w.max()))
            if best is None or key[0] < best[0][0] - 1e-9 * max(1.0, key[0]) or (
                    key[0] <= best[0][0] + 1e-9 * max(1.0, key[0]) and key[1] < best[0][1]):
                best = (key, bounds, w)
        if best is not None:
            return Clustering(boundaries=tuple(best[1]), layer_flops=_frozen(best[2]), cut_cost=best[0][0],
                              balance_used=delta)
    raise ValueError("no clustering satisfies the forced and allowed boundaries")
