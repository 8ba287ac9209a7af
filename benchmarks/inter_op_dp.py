"""Benchmark of ``solvers.inter_op.solve_inter_op`` (Alpa's stage DP) on synthetic stage tables.

    python benchmarks/inter_op_dp.py                           # L in {24, 48, 96} x clusters (1,8) (8,8) (16,16)
    python benchmarks/inter_op_dp.py --layers 96 --clusters 16x16 --microbatches 64

The tables model a transformer: layer ``ℓ`` has work ``w_ℓ`` (uniform ±20 %, plus a heavier embedding
and head), parameters ``π_ℓ`` and activations ``a_ℓ``. A stage of layers ``i..j`` on an ``h x d`` submesh
with ``n = h·d`` devices takes

    t = W_{ij} / n + c_intra·log2(d) + c_inter·(h - 1) + c_0      (per microbatch, forward + backward)

(roofline time plus intra-/inter-host collective overheads) and holds ``16·Π_{ij} / n`` bytes of static
state (weights, gradients, Adam moments) and ``A_{ij} / n`` bytes per microbatch in flight. The memory
limit is ``--memory-factor`` times the bytes per device of the whole model spread evenly over the cluster
with one microbatch in flight (1F1B) or ``B`` (GPipe), so small submeshes cannot hold many layers. Prints one row per (mode, cluster, L): candidates,
DP runs, settled / pruned candidates, stages, wall time.

Then times ``cluster_layers`` (operator clustering) on random op chains of ``n`` ops into ``L`` layers,
with random cut sizes and with equal cut sizes (where the balance tie-break decides everything).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers.inter_op import (
    ClusteringProblem,
    InterOpProblem,
    alpa_submeshes,
    cluster_layers,
    inflight_1f1b,
    inflight_gpipe,
    solve_inter_op,
)


def synthetic_problem(num_layers: int, cluster: tuple[int, int], *, microbatches: int, memory_fraction: float | None,
                      schedule: str = "1f1b", seed: int = 0) -> InterOpProblem:
    rng = np.random.default_rng(seed)
    work = rng.uniform(0.8, 1.2, num_layers)
    work[0] *= 1.5
    work[-1] *= 3.0  # the head
    params, acts = work * 1e8, work * 2e8
    subs = alpa_submeshes(cluster)
    n = np.array([h * d for h, d in subs], dtype=np.float64)
    h = np.array([s[0] for s in subs], dtype=np.float64)
    d = np.array([s[1] for s in subs], dtype=np.float64)
    pw, pp, pa = (np.concatenate([[0.0], np.cumsum(x)]) for x in (work, params, acts))
    i, j = np.meshgrid(np.arange(num_layers), np.arange(num_layers), indexing="ij")
    rng_sum = lambda pref: (pref[j + 1] - pref[i])[:, :, None]  # noqa: E731
    t = rng_sum(pw) / n + 0.02 * np.log2(d) + 0.05 * (h - 1) + 0.01
    static, act = 16 * rng_sum(pp) / n, rng_sum(pa) / n
    stages = min(num_layers, cluster[0] * cluster[1])
    inflight = (inflight_1f1b if schedule == "1f1b" else inflight_gpipe)(stages, microbatches)
    held = microbatches if schedule == "gpipe" else 1
    even = (16 * pp[-1] + held * pa[-1]) / (cluster[0] * cluster[1])  # everything spread evenly
    limit = None if memory_fraction is None else memory_fraction * even
    return InterOpProblem(num_layers=num_layers, cluster=cluster, submeshes=subs, stage_time=t,
                          static_memory=static, activation_memory=act, num_microbatches=microbatches,
                          memory_limit=limit, inflight=inflight)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 48, 96])
    ap.add_argument("--clusters", nargs="+", default=["1x8", "8x8", "16x16"])
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--memory-factor", type=float, default=2.0)
    ap.add_argument("--no-clustering", dest="clustering", action="store_false")
    args = ap.parse_args()
    print(f"{'memory':<14}{'cluster':>8}{'L':>5}{'M':>4}{'cands':>8}{'runs':>6}{'settled':>9}{'pruned':>8}"
          f"{'stages':>8}{'states':>11}{'time s':>9}")
    for mode in ("none", "1f1b", "gpipe"):
        for c in args.clusters:
            cluster = tuple(int(x) for x in c.split("x"))
            for L in args.layers:
                frac = None if mode == "none" else args.memory_factor
                p = synthetic_problem(L, cluster, microbatches=args.microbatches, memory_fraction=frac,
                                      schedule="gpipe" if mode == "gpipe" else "1f1b")
                start = time.perf_counter()
                sol = solve_inter_op(p)
                wall = time.perf_counter() - start
                sol.verify(p)
                s = sol.stats
                print(f"{mode:<14}{c:>8}{L:>5}{p.num_submeshes:>4}{s.candidates:>8}{s.dp_runs:>6}{s.settled:>9}"
                      f"{s.pruned:>8}{sol.num_stages:>8}{s.dp_states:>11}{wall:>9.3f}", flush=True)
    if args.clustering:
        print(f"\n{'clustering':<14}{'ops':>8}{'L':>5}{'cut cost':>12}{'max/mean':>10}{'δ used':>8}{'time s':>9}")
        rng = np.random.default_rng(0)
        for n_ops, L in [(3000, 24), (30000, 24), (30000, 100)]:
            flops = rng.random(n_ops) * 10
            flops[rng.random(n_ops) < 0.5] = 0.0  # cheap elementwise ops between matmuls
            for cuts_kind, cuts in [("random cuts", rng.integers(1, 100, n_ops - 1).astype(float)),
                                    ("equal cuts", np.full(n_ops - 1, 5.0))]:
                p = ClusteringProblem(flops=flops, cut_bytes=cuts, num_layers=L)
                start = time.perf_counter()
                c = cluster_layers(p)
                wall = time.perf_counter() - start
                c.verify(p)
                ratio = c.layer_flops.max() / (flops.sum() / L)
                print(f"{cuts_kind:<14}{n_ops:>8}{L:>5}{c.cut_cost:>12.0f}{ratio:>10.3f}{c.balance_used:>8}"
                      f"{wall:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
