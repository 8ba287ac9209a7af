"""Benchmark of ``solvers.solve_intra_op`` on synthetic problems (see ``intra_op_problems.py``).

    python benchmarks/intra_op_ilp.py                       # 1k, 10k, 60k nodes; 60 s budget
    python benchmarks/intra_op_ilp.py --sizes 60000 --budget 600 --families transformer

Prints one row per problem: nodes, edges, nodes/edges left after presolve, wall time, cost, lower bound,
gap to the bound, status. The memory limit is ``limit_factor`` (default 1.05) times the tightest feasible
limit, ``max_t Σ_{i live at t} min_s mem_i(s)``. ``--json PATH`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intra_op_problems import FAMILIES

from solvers import solve_intra_op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 60000])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--limit-factor", type=float, default=1.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    head = (f"{'family':<12}{'nodes':>7}{'edges':>8}{'core n':>8}{'core e':>8}{'budget':>8}{'time s':>8}"
            f"{'cost':>13}{'bound':>13}{'gap':>9}  status")
    print(head, flush=True)
    for size in args.sizes:
        for fam in args.families:
            t0 = time.perf_counter()
            problem = FAMILIES[fam](size, seed=args.seed, limit_factor=args.limit_factor)
            gen = time.perf_counter() - t0
            sol = solve_intra_op(problem, time_budget_s=args.budget)
            st = sol.stats
            gap = sol.gap
            row = dict(family=fam, nodes=problem.num_nodes, edges=problem.num_edges, core_nodes=st.nodes_after,
                       core_edges=st.edges_after, memory_rows=st.memory_rows, budget_s=args.budget,
                       time_s=sol.solve_seconds, cost=sol.cost, lower_bound=sol.lower_bound, gap=gap,
                       status=sol.status, method=sol.method, generate_s=gen, memory_limit=problem.memory_limit)
            rows.append(row)
            bound = f"{sol.lower_bound:13.2f}" if sol.lower_bound is not None else f"{'-':>13}"
            gap_s = f"{100 * gap:8.2f}%" if gap is not None else f"{'-':>9}"
            print(f"{fam:<12}{problem.num_nodes:>7}{problem.num_edges:>8}{st.nodes_after:>8}{st.edges_after:>8}"
                  f"{args.budget:>8.0f}{sol.solve_seconds:>8.1f}{sol.cost:>13.2f}{bound}{gap_s}  {sol.status}",
                  flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
