"""Ground truth from one GPU: matmul speed per shape, recompute's real memory, more fidelity cases.

Three parts, each appending JSON lines to ``--out`` as it goes (a run stopped at its limit keeps what it
measured):

``matmuls``
    Seconds per ``a @ b`` for the matmul shapes the examples' steps issue (GPT-125M to 2.6B at 8k and 16k
    tokens, forward ``[T, k] x [k, n]`` and weight-gradient ``[k, T] x [T, n]``, the attention's batched
    products, and GPT-39B's per-device shapes under 4- and 8-way tensor parallelism), in bf16 and in f32 at
    the default precision (TF32 on Hopper). Each is the median over bursts of back-to-back calls (dispatch
    hidden behind the queue). Rows: ``{"part": "matmul", "dtype", "b", "m", "n", "k", "s", "tflops"}``.

``recompute``
    The GPT step as traced, rewritten by autoshard's recompute (``trace.remat.rematerialize`` with every
    block set to ``selective`` or ``full``) and re-emitted for the one device (``autoshard.emit``, train state
    donated): XLA's ``memory_analysis()`` of that program and its step time, beside the step as written.
    This is what ``recompute=`` does to a real program; the planner's predictions for the same rewrite are
    computed off the device (``--predict``).

``cases``
    Fidelity cases beyond ``tests/data/h100_fidelity.json`` (larger models and batches): the example's
    ``train_step`` jitted with the state donated, as ``cost_model_fidelity.py --planner --measure`` does.

Run on the GPU machine (no planner, so no LP solver, is needed there)::

    JAX_PLATFORMS=cuda python benchmarks/gpu_truth.py --out rows.jsonl [--parts matmuls recompute cases]

and here, for the predictions of the same rows (``h100`` preset, 1-device mesh), or to write the matmul rows
as a profile of the ``h100`` preset with measured matmul rates (``--hardware <file>`` anywhere)::

    python benchmarks/gpu_truth.py --predict rows.jsonl
    python benchmarks/gpu_truth.py --profile cost_models/profiles/h100-<date>.json rows.jsonl
    python benchmarks/gpu_truth.py --kernels traces/*/trace.json.gz

Two more parts: ``profile`` (a profiler trace of three back-to-back steps of GPT-350M bf16 and GPT-125M fp32,
and the optimized HLO, under ``--trace-dir``; ``--kernels`` summarises a trace) and ``overlap`` (the
fidelity cases' step time synchronised after every step and dispatched back to back).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (model, preset, overrides) of the recompute part and of the extra fidelity cases
RECOMPUTE_CASES = [
    ("gpt", "760m", ["dtype=bfloat16", "batch=8"], ("none", "selective", "full")),
    ("gpt", "1.3b", ["dtype=bfloat16", "batch=8"], ("selective", "full")),
    ("gpt", "350m", ["dtype=float32", "batch=8"], ("none", "selective", "full")),
]
EXTRA_CASES = [
    ("gpt", "2.6b", ["dtype=bfloat16", "batch=2"]),
    ("gpt", "1.3b", ["dtype=bfloat16", "batch=16", "remat=true"]),
    ("gpt", "125m", ["dtype=bfloat16", "batch=32"]),
    ("wide_resnet", "250m", ["dtype=bfloat16", "batch=32"]),
    ("wide_resnet", "250m", ["dtype=float32", "batch=64"]),
    ("moe", "690m", ["dtype=bfloat16", "batch=8"]),
]


REWRITE = os.environ.get("AUTOSHARD_COMMIT", "")  # the commit whose recompute rewrite the rows measured
DEADLINE = float("inf")  # perf_counter() by which every part stops (--deadline)


def _late(row_seconds: float = 60.0) -> bool:
    """Whether a row of about ``row_seconds`` would end past the deadline (then the part stops)."""
    if time.perf_counter() + row_seconds > DEADLINE:
        print("deadline: the rest of this part is skipped", flush=True)
        return True
    return False


def _emit_row(out: Path, row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def matmul_shapes() -> list[tuple[int, int, int, int]]:
    """(batch, m, n, k) of ``[b, m, k] x [b, k, n]``; b = 1 is a plain matmul."""
    shapes: set[tuple[int, int, int, int]] = set()
    for d in (768, 1024, 1536, 2048, 2560):
        for t in (8192, 16384):
            for n, k in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (51200, d)):
                shapes.add((1, t, n, k))  # forward (and the input gradient has the same kind)
            for n, k in ((3 * d, t), (4 * d, t), (d, t)):
                shapes.add((1, d if n != d else 4 * d, n, k))  # weight gradient: contraction over tokens
    for b, s, hd in ((8 * 12, 1024, 64), (8 * 16, 1024, 64), (8 * 16, 1024, 96), (8 * 32, 1024, 64),
                     (4 * 32, 1024, 80)):
        shapes.add((b, s, s, hd))  # q k^T
        shapes.add((b, s, hd, s))  # p v
    for tp in (4, 8):  # GPT-39B (hidden 8192) per device, 8192 tokens a microbatch
        h, t = 8192, 8192
        for n, k in ((3 * h // tp, h), (h, h // tp), (4 * h // tp, h), (h, 4 * h // tp)):
            shapes.add((1, t, n, k))
            shapes.add((1, k, n, t))
    return sorted(shapes)


def part_matmuls(out: Path, seconds: float, done: set[tuple[Any, ...]] | None = None) -> None:
    import jax
    import jax.numpy as jnp

    t_end = time.perf_counter() + seconds
    shapes = matmul_shapes()
    for dtype in ("bfloat16", "float32"):
        for b, m, n, k in shapes:
            if (dtype, b, m, n, k) in (done or set()):
                continue
            if time.perf_counter() > t_end or _late(5.0):
                print(f"matmuls: out of time at {dtype} {(b, m, n, k)}", flush=True)
                return
            dt = jnp.dtype(dtype)
            ka, kb = jax.random.split(jax.random.key(0))
            sa, sb = ((b, m, k), (b, k, n)) if b > 1 else ((m, k), (k, n))
            a = jax.random.normal(ka, sa, dt)
            w = jax.random.normal(kb, sb, dt)
            f = jax.jit(jnp.matmul)
            f(a, w).block_until_ready()
            flops = 2.0 * b * m * n * k
            reps = max(3, min(50, int(0.02 / max(flops / 600e12, 1e-6))))
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    r = f(a, w)
                r.block_until_ready()
                times.append((time.perf_counter() - t0) / reps)
            s = statistics.median(times)
            _emit_row(out, {"part": "matmul", "dtype": dtype, "b": b, "m": m, "n": n, "k": k, "s": s,
                            "tflops": flops / s / 1e12})
            del a, w, r


def synced_steps(fn: Any, state: Any, batch: Any, steps: int) -> tuple[list[float], Any]:
    """Seconds of each of ``steps`` train steps, the host waiting for each, each fed the last one's (donated)
    state; and the state after the last."""
    import jax

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = fn(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return times, state


def time_steps(fn: Any, args: tuple[Any, ...], repeats: int) -> tuple[float, float]:
    """Median and least seconds of ``repeats`` train steps (after 2 untimed), each fed the last one's state."""
    times, _ = synced_steps(fn, *args, repeats + 2)
    return statistics.median(times[2:]), min(times[2:])


def xla_memory(compiled: Any) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program; its peak is temp + arguments + outputs - aliased."""
    mem = compiled.memory_analysis()
    row = {"xla_temp_bytes": mem.temp_size_in_bytes, "xla_arg_bytes": mem.argument_size_in_bytes,
           "xla_out_bytes": mem.output_size_in_bytes, "xla_alias_bytes": mem.alias_size_in_bytes}
    row["xla_peak_bytes"] = (row["xla_temp_bytes"] + row["xla_arg_bytes"] + row["xla_out_bytes"]
                             - row["xla_alias_bytes"])
    return row


def part_recompute(out: Path, repeats: int, modes: tuple[str, ...] = ("none", "selective", "full")) -> None:
    import jax

    from autoshard._examples import load_example
    from autoshard.emit import emit
    from autoshard.trace import trace
    from autoshard.trace.remat import blocks, rematerialize

    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    for model, preset, overrides, case_modes in RECOMPUTE_CASES:
        for mode in [m for m in case_modes if m in modes]:
            if _late():
                return
            t0 = time.perf_counter()
            row: dict[str, Any] = {"part": "recompute", "model": model, "preset": preset,
                                   "overrides": overrides, "mode": mode, "rewrite": REWRITE}
            try:
                ex = load_example(ROOT / "examples" / f"{model}.py", preset, overrides, abstract=False)
                graph = trace(ex.train_step, *ex.args)
                if mode != "none":
                    graph = rematerialize(graph, {b: mode for b in blocks(graph)})
                step = emit(graph, {}, mesh)
                args = step.place(*ex.args)
                row.update(xla_memory(step.compiled(*args)))
                row["emit_median_s"], row["emit_min_s"] = time_steps(step, args, repeats)
                row["device_peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
            except Exception as e:  # an OOM is a measurement too
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["case_wall_s"] = time.perf_counter() - t0
            _emit_row(out, row)
            jax.clear_caches()


PROFILE_CASES = [
    ("gpt", "350m", ["dtype=bfloat16", "batch=8"]),
    ("gpt", "125m", ["dtype=float32", "batch=8"]),
]


def part_profile(out: Path, trace_dir: Path) -> None:
    """A profiler trace of 3 steps of each ``PROFILE_CASES`` step (jitted, state donated) and its optimized HLO.

    Written under ``trace_dir/<case>/``: ``perfetto_trace.json.gz`` and ``trace.json.gz`` (every GPU kernel
    with its duration) and ``hlo.txt``; ``--kernels`` reads a trace here: the GPU's span and busy time per
    step and the kernels that took the most time.
    """
    import shutil

    import jax

    from autoshard._examples import load_example

    for model, preset, overrides in PROFILE_CASES:
        if _late(90.0):
            return
        t0 = time.perf_counter()
        name = f"{model}-{preset}-{'-'.join(overrides)}".replace("=", "")
        row: dict[str, Any] = {"part": "profile", "model": model, "preset": preset, "overrides": overrides}
        try:
            ex = load_example(ROOT / "examples" / f"{model}.py", preset, overrides, abstract=False)
            compiled = jax.jit(ex.train_step, donate_argnums=0).lower(*ex.args).compile()
            dest = trace_dir / name
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "hlo.txt").write_text(compiled.as_text())
            state, batch = ex.args
            times, state = synced_steps(compiled, state, batch, 5)  # warm-up and an untraced time
            row["jit_median_s"] = statistics.median(times[2:])
            raw = dest / "raw"
            with jax.profiler.trace(str(raw), create_perfetto_trace=True):
                for _ in range(3):
                    state, metrics = compiled(state, batch)
                jax.block_until_ready(metrics)
            for f in raw.rglob("*.json.gz"):
                shutil.copy(f, dest / ("perfetto_trace.json.gz" if f.name.startswith("perfetto") else "trace.json.gz"))
            shutil.rmtree(raw, ignore_errors=True)
            row["trace"] = str(dest.name)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["case_wall_s"] = time.perf_counter() - t0
        _emit_row(out, row)
        jax.clear_caches()


# The cases of tests/data/h100_fidelity.json, for the overlap part (the two the H100 run of 2026-11-26 did
# not reach first, and a larger step that fits only a 141 GB card: an error row elsewhere) and the rest
OVERLAP_CASES = [
    ("gpt", "1.3b", ["dtype=bfloat16", "batch=4"]),
    ("gpt", "1.3b", ["dtype=bfloat16", "batch=8", "remat=true"]),
    ("gpt", "6.7b", ["dtype=bfloat16", "batch=2"]),
    ("gpt", "350m", ["dtype=bfloat16", "batch=8"]),
    ("gpt", "125m", ["dtype=float32", "batch=8"]),
    ("gpt", "760m", ["dtype=bfloat16", "batch=8"]),
    ("gpt", "125m", ["dtype=bfloat16", "batch=16"]),
    ("wide_resnet", "250m", ["dtype=float32", "batch=32"]),
    ("moe", "380m", ["dtype=float32", "batch=8"]),
]


def part_overlap(out: Path, repeats: int, back_to_back: int = 10) -> None:
    """Each step timed two ways: synchronised after every step (median, as ``time_steps``), and
    ``back_to_back`` steps dispatched without waiting, then one wait (seconds per step). The difference is
    host time per step that a training loop which does not wait on every step hides behind the GPU. The row
    also holds the compiled step's ``memory_analysis()`` (``xla_*_bytes``)."""
    import jax

    from autoshard._examples import load_example

    for model, preset, overrides in OVERLAP_CASES:
        if _late(50.0):
            return
        t0 = time.perf_counter()
        row: dict[str, Any] = {"part": "overlap", "model": model, "preset": preset, "overrides": overrides}
        try:
            ex = load_example(ROOT / "examples" / f"{model}.py", preset, overrides, abstract=False)
            compiled = jax.jit(ex.train_step, donate_argnums=0).lower(*ex.args).compile()
            row.update(xla_memory(compiled))
            state, batch = ex.args
            synced, state = synced_steps(compiled, state, batch, repeats + 2)
            row["synced_median_s"] = statistics.median(synced[2:])
            runs = []
            for _ in range(2):
                t1 = time.perf_counter()
                for _ in range(back_to_back):
                    state, metrics = compiled(state, batch)
                jax.block_until_ready((state, metrics))
                runs.append((time.perf_counter() - t1) / back_to_back)
            row["back_to_back_s"] = min(runs)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["case_wall_s"] = time.perf_counter() - t0
        _emit_row(out, row)
        jax.clear_caches()


def part_cases(out: Path, repeats: int) -> None:
    import jax

    from autoshard._examples import load_example

    for model, preset, overrides in EXTRA_CASES:
        if _late():
            return
        t0 = time.perf_counter()
        path = ROOT / "examples" / f"{model}.py"
        row: dict[str, Any] = {"part": "case", "model": model, "preset": preset, "overrides": overrides}
        try:
            ex = load_example(path, preset, overrides, abstract=False)
            step = jax.jit(ex.train_step, donate_argnums=0)
            compiled = step.lower(*ex.args).compile()
            row.update(xla_memory(compiled))
            row["jit_median_s"], row["jit_min_s"] = time_steps(compiled, ex.args, repeats)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["case_wall_s"] = time.perf_counter() - t0
        _emit_row(out, row)
        jax.clear_caches()


def predict(rows_path: Path, hardware: str = "h100") -> None:
    """The planner's predictions (``hardware`` preset, 1-device mesh) beside each recompute, case and overlap
    row: peak memory against XLA's, step time against the synchronised median (and, for an overlap row, against
    the steps dispatched back to back)."""
    import autoshard
    from autoshard._examples import load_example

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    print(f"{'row':<44} {'pred GB':>8} {'XLA GB':>8} {'ratio':>6}   {'pred ms':>8} {'meas ms':>8} {'ratio':>6}"
          f"   {'b2b ms':>8} {'ratio':>6}")
    for r in rows:
        if r["part"] not in ("recompute", "case", "overlap") or "xla_peak_bytes" not in r:
            continue
        mode = r.get("mode", "none")
        ex = load_example(ROOT / "examples" / f"{r['model']}.py", r["preset"], r["overrides"], abstract=True)
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=hardware, time_budget_s=10,
                              memory_budget=1e15, recompute=mode)
        # None: compiled, but ran out of memory
        meas = r.get("emit_median_s", r.get("jit_median_s", r.get("synced_median_s")))
        name = f"{r['model']}-{r['preset']}-{'-'.join(r['overrides'])}-{mode}"
        pm, xm = plan.peak_memory, r["xla_peak_bytes"]
        ps = plan.predicted_step_time
        timing = f"{meas * 1e3:8.1f} {ps / meas:6.2f}" if meas else f"{'-':>8} {'-':>6}"
        b2b = r.get("back_to_back_s")
        timing += f"   {b2b * 1e3:8.1f} {ps / b2b:6.2f}" if b2b else ""
        print(f"{name:<44} {pm / 1e9:8.2f} {xm / 1e9:8.2f} {pm / xm:6.2f}   {ps * 1e3:8.1f} {timing}")


def write_profile(path: Path, rows_path: Path) -> None:
    """The ``h100`` preset with the measured matmuls of ``rows_path`` as its samples (a batched product's
    batch folded into ``m``, as ``CostModel.matmul_time`` looks it up)."""
    import dataclasses

    from cost_models import load_profile
    from cost_models.profile import MatmulSample

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    env = next(r for r in rows if r["part"] == "env")
    samples = tuple(MatmulSample(m=r["b"] * r["m"], n=r["n"], k=r["k"], dtype=r["dtype"], seconds=r["s"])
                    for r in rows if r["part"] == "matmul")
    profile = dataclasses.replace(
        load_profile("h100"), name=path.stem, created=env["date"],
        environment={"jax": env["jax"], "platform": env["platform"], "device_kind": env["device"]},
        notes=(f"the h100 preset with {len(samples)} matmul rates measured on one {env['device']} by "
               f"benchmarks/gpu_truth.py ({rows_path.name}); collectives and memory stay analytic"),
        matmuls=samples)
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    print(f"wrote {path}: {len(samples)} matmul samples")


def kernels(trace_path: Path, steps: int = 3, top: int = 15) -> dict[str, float]:
    """Read a profile part's ``trace.json.gz``: the GPU's span and busy time per step (``steps`` steps ran
    back to back while tracing) and the kernels that took the most time; prints them and returns the first
    two (seconds)."""
    import collections
    import gzip

    with gzip.open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e["args"]["name"]}
    ev = sorted((e for e in events if e.get("ph") == "X" and e["pid"] in gpu), key=lambda e: e["ts"])
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) / steps / 1e6
    busy = sum(e["dur"] for e in ev) / steps / 1e6
    by_name: collections.Counter[str] = collections.Counter()
    for e in ev:
        by_name[e["name"]] += e["dur"] / steps / 1e3
    print(f"{trace_path}: {len(ev) // steps} kernels a step; GPU span {span * 1e3:.2f} ms, busy {busy * 1e3:.2f} ms a step")
    for name, ms in by_name.most_common(top):
        print(f"  {ms:8.2f} ms  {name[:90]}")
    return {"span_s": span, "busy_s": busy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="append measured rows (JSON lines) to this file")
    ap.add_argument("--parts", nargs="*", default=["recompute", "matmuls", "cases"])
    ap.add_argument("--matmul-seconds", type=float, default=120.0)
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds from the start by which every part stops (rows that would end later are skipped)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", nargs="*", default=["none", "selective", "full"],
                    help="the recompute part's modes (the others are skipped)")
    ap.add_argument("--trace-dir", type=Path, default=Path("traces"), help="where the profile part writes")
    ap.add_argument("--done", type=Path, help="rows of an earlier run: the matmuls in it are not measured again")
    ap.add_argument("--predict", type=Path, help="print the planner's predictions for these measured rows")
    ap.add_argument("--hardware", default="h100", help="the preset --predict prices with (h100, h200, ...)")
    ap.add_argument("--profile", nargs=2, type=Path, metavar=("PROFILE", "ROWS"),
                    help="write the matmul rows of ROWS as a profile of the h100 preset to PROFILE")
    ap.add_argument("--kernels", type=Path, nargs="*", help="summarise the profile part's trace.json.gz files")
    args = ap.parse_args(argv)
    if args.kernels:
        for path in args.kernels:
            kernels(path)
        return 0
    if args.profile:
        write_profile(*args.profile)
        return 0
    if args.predict:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        predict(args.predict, args.hardware)
        return 0
    global DEADLINE
    DEADLINE = time.perf_counter() + args.deadline
    import jax

    assert args.out is not None, "--out is required when measuring"
    done = set()  # matmuls already measured (--done): skipped
    for line in (args.done.read_text().splitlines() if args.done else []):
        r = json.loads(line)
        if r["part"] == "matmul":
            done.add((r["dtype"], r["b"], r["m"], r["n"], r["k"]))
    dev = jax.devices()[0]
    _emit_row(args.out, {"part": "env", "date": time.strftime("%Y-%m-%d"), "device": dev.device_kind,
                         "platform": dev.platform, "jax": jax.__version__})
    for part in args.parts:
        t0 = time.perf_counter()
        {"matmuls": lambda: part_matmuls(args.out, args.matmul_seconds, done),
         "recompute": lambda: part_recompute(args.out, args.repeats, tuple(args.modes)),
         "profile": lambda: part_profile(args.out, args.trace_dir),
         "overlap": lambda: part_overlap(args.out, args.repeats),
         "cases": lambda: part_cases(args.out, args.repeats)}[part]()
        print(f"part {part}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
