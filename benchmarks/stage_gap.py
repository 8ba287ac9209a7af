"""Why a pipeline's stages, planned whole, come out slower than the stage DP's sum of their layers.

Plans a model file's preset with no option but the mesh, captures every whole-stage solve the pipeline
planner makes (``pipeline.stages.plan_part``), then solves each again with more time, and with the memory
limit lifted: the difference between the last two is what the stage's memory budget costs it, the rest of the
gap to the DP's sum (in the planner's log, "the DP's sum of its layers") is what joining the layers costs.

    AUTOSHARD_CACHE_DIR=off python benchmarks/stage_gap.py examples/llama.py 70b 16x8

llama-70b on 16x8 H100, 2026-11-29 (middle stage, 5 blocks on 1x8, DP sum 57.89 ms a microbatch): 1 s 64.97 ms,
10 s 63.04, 40 s 61.58, 10 s without the memory limit 55.76 ms at 69.7 GiB (budget 67.1).
"""

from __future__ import annotations

import logging
import sys
import time

import autoshard
import autoshard.pipeline.stages as stages
from autoshard._examples import load_example
from autoshard.target import parse_mesh


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    model, preset, mesh, *sets = sys.argv[1:]
    calls = []
    plan_part = stages.plan_part

    def captured(*a, **k):
        part = plan_part(*a, **k)
        calls.append((a, k, part))
        return part

    stages.plan_part = captured
    ex = load_example(model, preset, sets)
    t0 = time.perf_counter()
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=parse_mesh(mesh)[0], hardware="h100")
    print(f"planned in {time.perf_counter() - t0:.1f} s: {plan.predicted_step_time:.3f} s a step")
    for a, k, part in calls:
        graph, mops, uops, cost, hardware, budget, seconds, held = a[:8]
        print(f"stage of {len(mops)} microbatch ops on {cost.mesh}, {seconds:.1f} s: {part.micro.time * 1e3:.2f} ms "
              f"a microbatch, {part.memory / 2**30:.1f} GiB of {(budget or 0) / 2**30:.1f}")
        for more, limit in ((10.0, budget), (40.0, budget), (10.0, None)):
            t0 = time.perf_counter()
            again = plan_part(graph, mops, uops, cost, hardware, limit, more, held, **k)
            print(f"  {more:.0f} s, {'no memory limit' if limit is None else 'the same budget'}: "
                  f"{again.micro.time * 1e3:.2f} ms at {again.memory / 2**30:.1f} GiB ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
