"""GPT-39B at batch 1024 on 8x8 H100, planned for the SPMD pipeline program and lowered as one program.

    python benchmarks/spmd_gpt39b.py [--time-budget S] [--preset 39b] [--mesh 8x8] [--out FILE.json]

The step is planned with ``runtime="spmd"`` and no other option (uniform stages, priced as the program's
lockstep ticks run), then the program is built on 64 simulated CPU devices and lowered with abstract
arguments (``jax.jit(...).lower``: nothing is allocated or compiled). Reported: planning seconds, the plan
(stages, submesh, microbatches, schedule, recompute), predicted step time and MFU, the lowering seconds,
and in the lowered module the stage axis's collective-permutes and the reductions inside the tick loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard._examples import load_example  # noqa: E402
from autoshard.pipeline.partition import trace_microbatch  # noqa: E402
from autoshard.pipeline.spmd_program import spmd_pipeline_step, tail_graph  # noqa: E402
from autoshard.planner.recompute import recomputed  # noqa: E402
from autoshard.trace import trace  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="39b")
    p.add_argument("--mesh", default="8x8")
    p.add_argument("--time-budget", type=float, default=None)
    p.add_argument("--pipeline", action="store_true", help="always return the pipelined plan (pipeline=True)")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--recompute", default="auto")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    ex = load_example(ROOT / "examples" / "gpt.py", a.preset, [], abstract=True)
    shape = tuple(int(x) for x in a.mesh.split("x"))
    t0 = time.perf_counter()
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=shape, hardware="h100", runtime="spmd",
                          time_budget_s=a.time_budget, pipeline=True if a.pipeline else None,
                          microbatches=a.microbatches, recompute=a.recompute)
    planned = time.perf_counter() - t0
    row: dict = {"preset": a.preset, "mesh": a.mesh, "plan_s": round(planned, 1), "kind": type(plan).__name__,
                 "step_s": plan.predicted_step_time, "mfu": plan.mfu}
    print(autoshard.explain(plan))
    if isinstance(plan, autoshard.PipelinePlan):
        S = plan.num_physical_stages
        row.update(stages=S, submesh=list(plan.stages[0].submesh), microbatches=plan.num_microbatches,
                   schedule=plan.schedule, chunks=plan.num_chunks, recompute=dict(plan.recompute),
                   tail_split=plan.tail_split)
        t1 = time.perf_counter()
        full = trace(ex.train_step, *ex.args)
        micro = recomputed(trace_microbatch(ex.train_step, ex.args, full, plan.num_microbatches), plan.recompute)
        step = spmd_pipeline_step(micro, full, plan, jax.devices()[: shape[0] * shape[1]],
                                  tail_graph(ex.train_step, ex.args, full, plan))
        built = time.perf_counter() - t1
        t2 = time.perf_counter()
        text = step.lower(*ex.args).as_text()
        lowered = time.perf_counter() - t2
        # before XLA partitions it, the module's collectives are the program's own: the tick loop's
        # ppermutes and the reductions of the head's and tail's gradients after the loop
        row.update(build_s=round(built, 1), lower_s=round(lowered, 1), ticks=step.ticks.num_ticks,
                   res_slots=step.ticks.res_slots, lowered_mb=round(len(text) / 1e6, 1),
                   collective_permutes=len(re.findall(r"stablehlo\.collective_permute", text)),
                   all_reduces=len(re.findall(r"stablehlo\.all_reduce", text)),
                   whiles=len(re.findall(r"stablehlo\.while", text)),
                   predicted_program_s=None if step.predicted is None else step.predicted.step)
    print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, **row},
                                          indent=1))


if __name__ == "__main__":
    main()
