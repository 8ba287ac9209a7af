"""Does the emitted program cost anything? ``@autoshard.parallelize``'s step against ``jax.jit`` of the same
step with the same input and output shardings (and donation), on 8 CPU devices, for every example.

For each example (tiny presets, Wide-ResNet also ``small``) the step is planned once on ``--mesh``; then
three programs run on the same arguments, ``emitted`` and then ``parallelize`` interleaved with ``jit``
round by round so that load from other processes falls on both alike:

- ``jit``: ``jax.jit(train_step)`` over the flat leaves, ``in_shardings``/``out_shardings``/``donate_argnums``
  taken from the emitted step (so XLA sees the same boundary and propagates the rest itself);
- ``emitted``: the emitted program itself (``EmittedStep.jitted`` on the same flat leaves);
- ``parallelize``: the decorated step called as a user calls it (pytrees in and out, cache look-up).

Reported: the median seconds of each and the ratios ``emitted / jit`` and ``parallelize / jit`` (target
≤ 1.03), plus the HLO of ``emitted`` and ``jit`` compared: fusions, copies and collectives.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/emit_overhead.py --out \\
        benchmarks/emit_overhead_results.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX_PLATFORMS=cuda measures a GPU

import jax

import autoshard
from autoshard._examples import load_example

ROOT = Path(__file__).resolve().parents[1]
CASES = [("mlp.py", "tiny"), ("gpt.py", "tiny"), ("moe.py", "tiny"), ("wide_resnet.py", "tiny"),
         ("wide_resnet.py", "small")]
_HLO_OPS = ("fusion", "copy", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def hlo_counts(text: str) -> dict[str, int]:
    """Instructions of a compiled module by kind (``-start`` forms of async collectives counted once)."""
    return {k: len(re.findall(rf"=\s*\S+\s+{k}(?:-start)?\(", text)) for k in _HLO_OPS}


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def run_case(path: str, preset: str, mesh: tuple[int, ...], rounds: int, budget_s: float,
             overrides: list[str] | None = None, dump: Path | None = None) -> dict[str, Any]:
    ex = load_example(ROOT / "examples" / path, preset, list(overrides or []), abstract=False)
    par = autoshard.parallelize(ex.train_step, mesh=mesh, time_budget_s=budget_s)
    state, batch = ex.args
    state, _ = par(state, batch)  # plans, compiles, and leaves the state in the program's layouts
    step = par._last.step  # the EmittedStep (internal; this is a benchmark)
    graph = step.graph
    aliases = dict(graph.output_aliases)

    def flat_ref(*xs: Any) -> tuple[Any, ...]:
        return tuple(jax.tree.leaves(ex.train_step(*jax.tree.unflatten(graph.in_tree, list(xs)))))

    ref = jax.jit(flat_ref, in_shardings=step.in_shardings, out_shardings=step.out_shardings,
                  donate_argnums=step.donate_argnums)
    # each program owns its copies of the state: donation deletes what it is given
    feeds = {name: list(step.flatten(*step.place(state, batch))) for name in ("jit", "emitted")}
    par_args = [step.place(state, batch)]
    compiled = {"jit": ref.lower(*feeds["jit"]).compile(), "emitted": step.jitted.lower(*feeds["emitted"]).compile()}
    hlo = {k: c.as_text() for k, c in compiled.items()}

    def runner(name: str, fn: Any) -> Any:
        def once() -> Any:
            out = fn(*feeds[name])
            for o, i in aliases.items():
                feeds[name][i] = out[o]
            return out
        return once

    def run_par() -> Any:
        s, m = par(*par_args[0])
        par_args[0] = (s, par_args[0][1])
        return s, m  # wait for the new state too, as the other two do

    runs = {"jit": runner("jit", ref), "emitted": runner("emitted", step.jitted), "parallelize": run_par}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm up: compile, first-call copies
        for _ in range(2):
            _time(fn)
    # ``emitted`` and ``parallelize`` run one executable on two sets of buffers: interleaved, every call would
    # find the other's buffer addresses in the executable's CUDA graph and update it (~5 ms a step for
    # GPT-350M on an H200, 2026-11-26). So each is interleaved with ``jit`` in rounds of its own.
    for other in ("emitted", "parallelize"):
        _time(runs[other])
        for r in range(rounds):
            for name in ("jit", other) if r % 2 == 0 else (other, "jit"):
                times[name].append(_time(runs[name]))
    med = {k: statistics.median(v) for k, v in times.items()}
    # back to back: ten steps queued with no wait between them (the host's dispatch hidden behind the device)
    b2b = {k: [] for k in ("jit", "emitted")}
    for r in range(3):
        for name in b2b if r % 2 == 0 else reversed(b2b):
            t0 = time.perf_counter()
            for _ in range(10):
                out = runs[name]()  # each step donates the last one's state: wait on the newest only
            jax.block_until_ready(out)
            b2b[name].append((time.perf_counter() - t0) / 10)
    costs = {k: _cost_analysis(c) for k, c in compiled.items()}
    if dump is not None:  # the optimised modules and a profile of a few steps of each, to compare kernel by kernel
        tag = "-".join([path.removesuffix(".py"), preset, *(overrides or [])]).replace("=", "")
        dump.mkdir(parents=True, exist_ok=True)
        for name in ("jit", "emitted"):
            (dump / f"{tag}.{name}.hlo.txt").write_text(hlo[name])
            where = dump / f"{tag}.{name}.trace"
            with jax.profiler.trace(str(where), create_perfetto_trace=True):
                for _ in range(5):
                    _time(runs[name])
            for f in where.rglob("perfetto_trace.json.gz"):  # flat, beside the modules
                f.rename(dump / f"{tag}.{name}.perfetto.json.gz")
            shutil.rmtree(where)
    return {
        "example": path, "preset": preset, "mesh": list(mesh), "rounds": rounds,
        "median_s": med,
        "emitted_over_jit": med["emitted"] / med["jit"],
        "parallelize_over_jit": med["parallelize"] / med["jit"],
        "back_to_back_s": {k: min(v) for k, v in b2b.items()},
        "constraints": sum(step.interpreter.constraints.values()),
        "hlo": {k: hlo_counts(v) for k, v in hlo.items()},
        "cost_analysis": costs,
    }


def _cost_analysis(compiled: Any) -> dict[str, float]:
    """XLA's own flop and byte counts of a compiled module (a list of one dict on some versions)."""
    try:
        c = compiled.cost_analysis()
    except Exception:  # a backend without the analysis
        return {}
    c = c[0] if isinstance(c, list) and c else c
    return {k: float(c[k]) for k in ("flops", "bytes accessed", "transcendentals") if c and k in c}


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(x.split(":", 1)[1].strip() for x in lines if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="8", help="mesh shape, e.g. 8, 2x4 or 1 (default 8)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--time-budget", type=float, default=5.0, help="planner seconds per example")
    ap.add_argument("--only", help="run only examples whose file name contains this")
    ap.add_argument("--out", help="append one JSON line per example to this file")
    ap.add_argument("--dump", help="write both optimised modules and a profile (perfetto trace) of 5 steps of "
                    "each to this folder, per case")
    ap.add_argument("--cases", nargs="*", help="instead of the tiny examples: FILE:PRESET[:KEY=VALUE,...] each, "
                    "e.g. gpt.py:350m:dtype=bfloat16,batch=8 (the GPU fidelity steps)")
    a = ap.parse_args(argv)
    mesh = tuple(int(x) for x in a.mesh.split("x"))
    stamp = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "machine": f"{platform.node()} {_cpu_model()} {os.cpu_count()} cores, {len(jax.devices())} "
                        f"{jax.devices()[0].platform} devices ({jax.devices()[0].device_kind})",
             "jax": jax.__version__, "autoshard": autoshard.__version__}
    print(f"{'example':22s} {'jit ms':>8s} {'emitted':>8s} {'parallel':>8s} {'emit/jit':>8s} {'par/jit':>8s}")
    cases = [[*c.split(":"), ""][:3] for c in a.cases] if a.cases else [(p, q, "") for p, q in CASES]
    for path, preset, sets in cases:
        if a.only and a.only not in path:
            continue
        overrides = [x for x in sets.split(",") if x]
        row = run_case(path, preset, mesh, a.rounds, a.time_budget, overrides, Path(a.dump) if a.dump else None)
        row["overrides"] = overrides
        m = row["median_s"]
        print(f"{':'.join([path, preset, *overrides]):22s} {m['jit'] * 1e3:8.2f} {m['emitted'] * 1e3:8.2f} "
              f"{m['parallelize'] * 1e3:8.2f} {row['emitted_over_jit']:8.3f} {row['parallelize_over_jit']:8.3f}"
              f"  hlo emitted {row['hlo']['emitted']} jit {row['hlo']['jit']}", flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps({**stamp, **row}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
