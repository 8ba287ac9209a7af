"""The SPMD pipeline program against the MPMD runtime: host time per step as the microbatch count grows,
and the compiled program's temporary memory under 1F1B and GPipe (XLA's ``memory_analysis``).

    python benchmarks/spmd_pipeline.py [--counts 8 16 32] [--skip-mpmd] [--out FILE.json]

The example GPT with 4 blocks (tiny preset), 4 stages of 2 devices on 8 simulated CPU devices, a fixed
microbatch of 2 rows (the batch grows with the count). Host time: the seconds the step call takes to
return (Python dispatch; the SPMD program is one asynchronous call), and the step's wall time with the
results ready, both the median of 5 steady steps; beside the MPMD runtime's, the step and host work the
planner priced for it (``pipeline.host``, with the shipped CPU profile's host costs). Memory: ``temp_size_in_bytes`` of the compiled SPMD
program for each schedule and count. Prints a table and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard._examples import load_example  # noqa: E402
from autoshard.pipeline.partition import trace_microbatch  # noqa: E402
from autoshard.pipeline.spmd_program import SpmdPipelineStep, stage_mesh  # noqa: E402
from autoshard.trace import trace  # noqa: E402

MICRO_ROWS = 2
STAGES = 4


def _example(count: int, abstract: bool):
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", f"batch={count * MICRO_ROWS}"],
                      abstract=abstract)
    return ex.train_step, ex.args


def _spmd(fn: Any, args: tuple, count: int, name: str) -> SpmdPipelineStep:  # traced, not run
    full = trace(fn, *args)
    micro = trace_microbatch(fn, args, full, count)
    return SpmdPipelineStep(micro, full, stage_mesh(jax.devices(), STAGES), count, name)


def _time(call, state, batch) -> tuple[float, float]:
    host, wall = [], []
    for k in range(7):
        t0 = time.perf_counter()
        state, metrics = call(state, batch)
        t1 = time.perf_counter()
        jax.block_until_ready((state, metrics))
        t2 = time.perf_counter()
        if k >= 2:
            host.append(t1 - t0)
            wall.append(t2 - t0)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--skip-mpmd", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for count in a.counts:
        fn, (state, batch) = _example(count, abstract=False)
        row = {"microbatches": count, "rows": count * MICRO_ROWS}
        for name in ("1f1b", "gpipe"):
            t0 = time.perf_counter()
            step = _spmd(fn, (state, batch), count, name)
            compiled = step.lower(state, batch).compile()
            row[f"spmd_{name}_compile_s"] = time.perf_counter() - t0
            row[f"spmd_{name}_temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
            if name == "1f1b":
                st = jax.tree.map(lambda x: np.asarray(x).copy(), state)
                st, _ = step(*step.place_state(st, batch))
                row["spmd_1f1b_host_s"], row["spmd_1f1b_wall_s"] = _time(step, st, batch)
                row["spmd_res_slots"] = step.ticks.res_slots
        if not a.skip_mpmd:
            mpmd = autoshard.parallelize(fn, mesh=(2, 4), microbatches=count, pipeline=True, schedule="1f1b",
                                         stage_shape=(1, 2), time_budget_s=10, runtime="mpmd")
            st = jax.tree.map(lambda x: np.asarray(x).copy(), state)
            st, _ = mpmd(st, batch)
            row["mpmd_1f1b_host_s"], row["mpmd_1f1b_wall_s"] = _time(mpmd, st, batch)
            # what the planner priced for that runtime (the shipped CPU profile): the host issuing its programs
            # (``pipeline.host``) and the step
            row["mpmd_1f1b_host_priced_s"] = mpmd.plan.host_time
            row["mpmd_1f1b_step_priced_s"] = mpmd.plan.predicted_step_time
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = rows[0]
    print(f"\n{'M':>4} {'spmd host ms':>13} {'spmd wall ms':>13} {'mpmd wall ms':>13} {'mpmd priced ms':>15} "
          f"{'of it host':>11} {'1f1b temp MB':>13} {'gpipe temp MB':>14}")
    nan = float("nan")
    for r in rows:
        print(f"{r['microbatches']:>4} {1e3 * r['spmd_1f1b_host_s']:>13.2f} {1e3 * r['spmd_1f1b_wall_s']:>13.1f} "
              f"{1e3 * r.get('mpmd_1f1b_wall_s', nan):>13.1f} {1e3 * r.get('mpmd_1f1b_step_priced_s', nan):>15.1f} "
              f"{1e3 * r.get('mpmd_1f1b_host_priced_s', nan):>11.1f} {r['spmd_1f1b_temp_bytes'] / 1e6:>13.2f} "
              f"{r['spmd_gpipe_temp_bytes'] / 1e6:>14.2f}")
    last = rows[-1]
    print(f"\nfrom M={base['microbatches']} to M={last['microbatches']}: SPMD host time x"
          f"{last['spmd_1f1b_host_s'] / base['spmd_1f1b_host_s']:.2f}, 1F1B temp x"
          f"{last['spmd_1f1b_temp_bytes'] / base['spmd_1f1b_temp_bytes']:.2f}, GPipe temp x"
          f"{last['spmd_gpipe_temp_bytes'] / base['spmd_gpipe_temp_bytes']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                                           "device": "8 simulated CPU devices", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
