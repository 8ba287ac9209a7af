"""``solve_intra_op`` on the IOPDDL development instances, run as a user would (see ``iopddl_problems.py``
for how to fetch the files).

    python benchmarks/iopddl_bench.py                 # every instance in dev_set.json, one at a time
    python benchmarks/iopddl_bench.py C D --scale 0.5 # some, with half the contest timeout

Each instance runs in its own process (so that its peak RSS is its own): load, then
``solve_intra_op(problem, time_budget_s=timeout)``; the wall time of that call is measured inside the
process. Prints one markdown row per instance: nodes, core left by presolve, time, budget, peak RSS,
cost, cost / best known, lower bound / best known, method, status; ``--json PATH`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from iopddl_problems import dev_set, instance_path, load_iopddl

from solvers import solve_intra_op


def run_one(name: str, scale: float) -> dict:
    info = dev_set()[name]
    problem = load_iopddl(instance_path(name))
    budget = info["timeout_s"] * scale
    t0 = time.perf_counter()
    sol = solve_intra_op(problem, time_budget_s=budget)
    wall = time.perf_counter() - t0
    best = float(info["best_known"])
    # the contest's own check, in exact integers: usage <= limit at every integer time step
    usage = np.zeros(int(problem.intervals[:, 1].max()) + 1, dtype=np.int64)
    per_node = np.array([int(m[s]) for m, s in zip(problem.node_memory, sol.choice.tolist(), strict=True)])
    np.add.at(usage, problem.intervals[:, 0], per_node)
    np.add.at(usage, problem.intervals[:, 1], -per_node)
    exact_fits = bool(np.cumsum(usage).max() <= int(problem.memory_limit))
    return {
        "instance": name, "nodes": problem.num_nodes, "edges": problem.num_edges,
        "core_nodes": sol.stats.nodes_after, "core_edges": sol.stats.edges_after,
        "memory_rows": sol.stats.memory_rows, "budget_s": budget, "wall_s": round(wall, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        "cost": sol.cost, "ratio": sol.cost / best if sol.feasible else None,
        "bound_ratio": None if sol.lower_bound is None else sol.lower_bound / best,
        "feasible": sol.feasible, "fits_exactly": exact_fits, "method": sol.method, "status": sol.status,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="*")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the contest timeout to give")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.scale)))
        return
    names = args.instances or list(dev_set())
    print("| instance | nodes | core nodes | memory rows | time s | budget s | peak RSS GB | cost | / best known "
          "| bound / best known | method | load (1 min) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    rows = []
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--one", name, "--scale", str(args.scale)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1:]} |", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        ratio = "infeasible" if r["ratio"] is None or not r["fits_exactly"] else f"{r['ratio']:.4f}"
        bound = "" if r["bound_ratio"] is None else f"{r['bound_ratio']:.4f}"
        print(f"| {name} | {r['nodes']} | {r['core_nodes']} | {r['memory_rows']} | {r['wall_s']} | {r['budget_s']:g} "
              f"| {r['peak_rss_gb']} | {r['cost']:.6g} | {ratio} | {bound} | {r['method']} | {r['load']:.2f} |",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
