"""A second launch with the plan cache: the first call of ``@autoshard.parallelize`` in a fresh process that
finds its plan in the cache (``autoshard.cache``), against the first call of ``jax.jit`` of the same step in a
fresh process (the issue's bar: at most 1.3x), against ``jax.jit`` given the cached plan's layouts (the same
8-device program class, nothing of autoshard: ``jit-sharded``), and against the first launch, which plans. With
``--jax-cache`` both run with JAX's persistent compilation cache on (``jax_compilation_cache_dir``), warmed
by one launch of each: what a restarted job that sets it pays.

Each launch is its own Python process (nothing in memory, the JAX compilation cache off), timed from before
the first call to its result on the host; the launches alternate ``hit`` and ``jit`` ``--repeats`` times so
that load from other processes falls on both alike, and the medians are compared.

    nice -n 10 python benchmarks/plan_cache.py --preset tiny
    nice -n 10 python benchmarks/plan_cache.py --preset 125m --set batch=8 --set seq_len=256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(mode: str, preset: str, sets: list[str], mesh: str, budget: float | None) -> None:
    """One launch (this process): build the example, time the first call, print one JSON line."""
    import logging

    import jax
    import numpy as np

    import autoshard
    from autoshard._examples import load_example
    from autoshard.target import parse_mesh

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    if os.environ.get("BENCH_JAX_CACHE"):  # JAX's own persistent compilation cache, for both launches alike
        jax.config.update("jax_compilation_cache_dir", os.environ["BENCH_JAX_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    found = []

    class Found(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "found the plan in the cache" in record.getMessage():
                found.append(True)

    logging.getLogger("autoshard").addHandler(Found())
    logging.getLogger("autoshard").setLevel(logging.INFO)
    ex = load_example(ROOT / "examples" / "gpt.py", preset, sets, abstract=False)
    state, batch = ex.args
    jax.block_until_ready(state)
    if mode == "jit":
        step = jax.jit(ex.train_step)
    elif mode == "jit-sharded":
        step = _jit_as_planned(ex.train_step, (state, batch), mesh)
    else:
        step = autoshard.parallelize(ex.train_step, mesh=parse_mesh(mesh)[0], time_budget_s=budget)
    t0 = time.perf_counter()
    new, metrics = step(state, batch)
    loss = float(np.asarray(metrics["loss"]))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()  # a steady step: what the first call spent beyond it was getting ready
    _, metrics = step(new, batch)
    float(np.asarray(metrics["loss"]))
    print(json.dumps({"mode": mode, "first_call_s": first, "second_call_s": time.perf_counter() - t0,
                      "found": bool(found), "loss": loss}))


def _jit_as_planned(train_step, args, mesh: str):
    """``jax.jit`` of the step given the cached plan's input and output layouts (and donating the state, as
    the decorated step does): the same 8-device SPMD program class XLA compiles for autoshard's plan, with
    nothing of autoshard in the call. A first call's time against it is what autoshard adds, where the
    1-device ``jax.jit`` also leaves out what partitioning a program for 8 devices costs XLA."""
    import jax
    import numpy as np

    from autoshard.cache import entries
    from autoshard.emit.specs import named_sharding
    from autoshard.planner.plan import Plan
    from autoshard.target import parse_mesh

    (entry,) = [e for e in entries() if e.kind == "intra-operator"]
    the_plan = Plan.from_dict(json.loads(entry.path.read_text())["plan"])
    shape = parse_mesh(mesh)[0]
    devices = jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), the_plan.mesh.axis_names)
    ins = [named_sharding(devices, t.spec) for t in the_plan.inputs]
    outs = [named_sharding(devices, t.spec) for t in the_plan.outputs]
    in_tree = jax.tree.structure(args)
    out_tree = jax.tree.structure(jax.eval_shape(train_step, *args))
    jitted = jax.jit(train_step, in_shardings=jax.tree.unflatten(in_tree, ins),
                     out_shardings=jax.tree.unflatten(out_tree, outs), donate_argnums=0)

    def step(*a):  # the state placed in the plan's layouts inside the timed call, as the decorated step does
        return jitted(*jax.device_put(a, jax.tree.unflatten(in_tree, ins)))
    return step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--time-budget", type=float, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--jax-cache", action="store_true",
                   help="both launches with JAX's persistent compilation cache on (warmed by a launch of each first)")
    p.add_argument("--launch", choices=["plan", "hit", "jit", "jit-sharded"], help=argparse.SUPPRESS)
    p.add_argument("--out", help="append the result as one JSON line to this file")
    args = p.parse_args()
    if args.launch:
        launch(args.launch, args.preset, args.sets, args.mesh, args.time_budget)
        return 0
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as jax_cache:
        env = {**os.environ, "AUTOSHARD_CACHE_DIR": cache, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(ROOT)}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if args.jax_cache:
            env["BENCH_JAX_CACHE"] = jax_cache

        def run(mode: str) -> dict:
            cmd = [sys.executable, __file__, "--launch", mode, "--preset", args.preset, "--mesh", args.mesh,
                   *(["--time-budget", str(args.time_budget)] if args.time_budget else []),
                   *(x for s in args.sets for x in ("--set", s))]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(row), file=sys.stderr)
            return row

        first = run("plan")
        if args.jax_cache:
            run("jit")  # its compiled program into JAX's cache, as the first launch put autoshard's there
        hits, jits, sharded = [], [], []
        for _ in range(args.repeats):
            hits.append(run("hit"))
            jits.append(run("jit"))
            sharded.append(run("jit-sharded"))
    hit_s = statistics.median(r["first_call_s"] for r in hits)
    jit_s = statistics.median(r["first_call_s"] for r in jits)
    row = {"preset": args.preset, "sets": args.sets, "mesh": args.mesh, "first_launch_s": round(first["first_call_s"], 2),
           "hit_s": round(hit_s, 2), "jit_s": round(jit_s, 2), "hit_over_jit": round(hit_s / jit_s, 2),
           # jax.jit given the plan's layouts: the same 8-device program class, nothing of autoshard
           "jit_sharded_s": round(statistics.median(r["first_call_s"] for r in sharded), 2),
           "hit_over_jit_sharded": round(hit_s / statistics.median(r["first_call_s"] for r in sharded), 2),
           "jax_compilation_cache": args.jax_cache, "every_hit_found": all(r["found"] for r in hits), "first_found": first["found"],
           "hits": [round(r["first_call_s"], 2) for r in hits], "jits": [round(r["first_call_s"], 2) for r in jits],
           # the first call less a steady step: tracing, (looking up,) emitting, compiling, placing the state
           "hit_setup_s": round(statistics.median(r["first_call_s"] - r["second_call_s"] for r in hits), 2),
           "jit_setup_s": round(statistics.median(r["first_call_s"] - r["second_call_s"] for r in jits), 2),
           "hit_step_s": round(statistics.median(r["second_call_s"] for r in hits), 2),
           "jit_step_s": round(statistics.median(r["second_call_s"] for r in jits), 2),
           "cpus": os.cpu_count()}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
