"""Sharded plans against the XLA GPU compiler (issue #33): 8-way programs compiled on one GPU, and the parts of
a sharded step that one GPU can run.

Parts (each writes one JSON line per row to ``--out`` as the row completes, cheapest first, so a run stopped
at its limit keeps what it measured; ``--md`` appends a markdown table of the run's rows):

``probe`` (GPU only)
    Which mock topologies initialise the GPU client here: ``jax_mock_gpu_topology`` values tried in fresh
    subprocesses, each reporting ``jax.device_count()``, ``jax.local_device_count()``, the platform, and
    whether an 8-way ``psum`` compiles (its all-reduce count and ``memory_analysis()``), or the error.

``mock``
    For GPT (350M and 1.3B in bf16, batch 8; ``--quick``: the tiny preset with 4 blocks) the emitted program
    (``autoshard.emit``) of each plan, lowered from abstract arguments and compiled for 8 devices: Megatron
    tensor parallel over 8 (``tp8``), ZeRO-3/FSDP over 8 (``zero3``), 2x4 data x tensor parallel
    (``dp2xtp4``), the automatic plan on 2x4 (``auto``), the programs of stage 0 of a 1F1B pipeline of 4
    stages of 2 devices (``pipe-stage0-forward`` / ``-backward`` / ``-update``: the MPMD runtime's programs),
    and the SPMD pipeline program of the same plan (``spmd-pipeline``, when ``autoshard.pipeline.spmd_program``
    is importable). Per row: ``memory_analysis()`` (``xla_*_bytes``; peak = temp + arguments + outputs -
    aliased) beside the plan's predicted per-device peak, the collectives of the optimized HLO by kind
    (instructions, values, result bytes) beside the plan's ``collective_counts`` by kind, and seconds to plan,
    lower and compile. Hand layouts are priced with ``planner.compare.price_layout`` (their best completion),
    the automatic plan with ``autoshard.plan``. Sequence parallelism has no layout yet: no row.

``one-device``
    On one device: GPT with ``scan_layers`` true and false (350M bf16 b8, 1.3B bf16 b4; ``--quick``: tiny),
    jitted with the state donated, XLA's peak and the median step time; the host time of a program call
    (a trivial jitted program and the emitted tiny GPT step: seconds until the call returns, dispatched back
    to back, and the synchronised round trip); and one tick of a pipeline stage (stage 0 of a 4-stage plan
    of one device each: its forward and backward programs run on zeros, beside the plan's ``micro_time``).

How 8 GPUs are mocked on one (``--mock`` on a GPU): ``jax_mock_gpu_topology`` (env
``JAX_MOCK_GPU_TOPOLOGY``) "<slices>x<hosts per slice>x<devices per host>" and ``mock_num_gpu_processes``
(env ``MOCK_NUM_GPU_PROCESSES``) are read by ``jax._src.xla_bridge`` when the CUDA client is made (the
first ``jax.devices()``), so they are set before that. XLA's GPU client requires the devices per host to
equal the local GPUs and slices x hosts to equal the mocked process count, so on one GPU "1x1x8" is refused
and "1x8x1" (8 mocked processes of one GPU each; ``jax.devices()`` has 8, 1 addressable) is the form that
can work: ``--topology`` sets it, the ``probe`` part records what each form does. A program is compiled only
if one of its devices is the local one, which is why the pipeline rows are stage 0's. On CPU the same code
runs on 8 host-platform devices (``--xla_force_host_platform_device_count=8``), the mock settings unused.

Plans need the LP solver (pulp, highspy). ``--plans FILE`` caches them by case and traced-graph digest: a
plan in the file whose digest matches the trace is reused (no solve), others are planned and added, so
``--plan-only`` here (same jax version as the GPU's) can save the GPU's time.

Here (CPU, 8 host devices; a smoke test of every code path)::

    python benchmarks/gpu_truth_sharded.py --quick --parts mock one-device --out /tmp/rows.jsonl

On the GPU machine (jax 0.11 + CUDA, no internet): the one command of about 8 minutes, the wheels it needs
and the plan cache to carry are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GPT = ROOT / "examples" / "gpt.py"
DEVICES = 8
MICROBATCHES = 4
TICK_STAGES = 4  # the one-device tick: stage 0 of 4 stages of one device each
TOPOLOGY = "1x8x1"  # on one GPU: 8 mocked processes of one device each (see the module docstring)
PROBE_TOPOLOGIES = ("1x1x8", "1x8x1")

# (preset, overrides) of the sharded cases, cheapest first; --quick uses QUICK
SHARDED_MODELS = [("350m", ["dtype=bfloat16", "batch=8"]), ("1.3b", ["dtype=bfloat16", "batch=8"])]
QUICK = [("tiny", ["layers=4", "heads=8", "batch=8"])]
# long-sequence cases (issue #46): the automatic plan on 8 devices of one sequence through the flash kernels.
# ``sp-ulysses``: 16 heads, which the plan splits over the devices between sequence-split projections and MLP
# (DeepSpeed-Ulysses sequence parallelism, its all-to-alls); ``cp-ring``: 4 heads (head_dim 128), fewer than
# the devices, so the attention is split along the sequence as a zig-zag ring (context parallelism).
LONG_CASES = {"sp-ulysses": ("350m", ["dtype=bfloat16", "batch=1", "seq_len=16384", "flash=true"]),
              "cp-ring": ("350m", ["dtype=bfloat16", "batch=1", "seq_len=16384", "heads=4", "hidden=512",
                                   "flash=true", "ring=true"])}
QUICK_LONG = {"sp-ulysses": ("tiny", ["heads=8", "batch=1", "seq_len=64", "flash=true"]),
              "cp-ring": ("tiny", ["heads=2", "batch=1", "seq_len=64", "flash=true", "ring=true"])}
HARDWARE = "h100"  # the planner's preset (--hardware); h200 for an H200's times
SCAN_MODELS = [("350m", ["dtype=bfloat16", "batch=8"]), ("1.3b", ["dtype=bfloat16", "batch=4"])]
LAYOUTS = ("tp8", "zero3", "dp2xtp4", "auto", "pipeline", "spmd-pipeline", "sp-ulysses", "cp-ring")
# rough GPU seconds per case (trace + plan + compile), for the printed estimate; measured rows replace them
GPU_SECONDS = {"tiny": 3.0, "350m": 25.0, "1.3b": 35.0}

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")

DEADLINE = float("inf")  # perf_counter() by which every part stops (--deadline)
HLO_DIR: Path | None = None  # --hlo-dir: each compiled program's optimized HLO, gzipped, for counting offline


# ---- counting collectives --------------------------------------------------------------------------------


def _shapes(text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array shape in an HLO result type (tuples flattened; layouts ignored)."""
    out = []
    for dtype, dims in _SHAPE.findall(re.sub(r"\{[^}]*\}", "", text)):
        if dtype not in _BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        out.append((dtype, n * _BYTES[dtype]))
    return out


def count_collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Collectives in compiled HLO text by kind (``all_reduce``, ...): ``ops`` (instructions; an async pair
    counts once, at its ``-start``), ``values`` (arrays moved: a combined tuple collective counts each element,
    so XLA's combining does not change the count, as ``tests/test_golden.py`` counts) and ``bytes`` (their
    result sizes per device: all-gather's gathered arrays, reduce-scatter's scattered ones). An async
    all-gather / collective-permute ``-start`` returns (operands, results[, contexts]): only its results
    count; its ``u32[]`` contexts are dropped. A collective inside an async wrapper computation is counted
    where it is written (the wrapper's ``async-start`` is not)."""
    out: dict[str, dict[str, int]] = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        result, kind, start = m.group(1), m.group(2), m.group(3)
        shapes = _shapes(result)
        if start and kind in ("all-gather", "collective-permute"):
            shapes = [s for s in shapes if not (s[0] in ("u32", "s32") and s[1] == 4)]
            shapes = shapes[len(shapes) // 2:] if len(shapes) > 1 else shapes
        row = out.setdefault(kind.replace("-", "_"), {"ops": 0, "values": 0, "bytes": 0})
        row["ops"] += 1
        row["values"] += len(shapes)
        row["bytes"] += sum(b for _, b in shapes)
    return out


def plan_collectives(plan: Any) -> dict[str, int]:
    """The plan's ``collective_counts`` summed by kind over mesh axes (``all_reduce(data)`` -> ``all_reduce``)."""
    out: dict[str, int] = {}
    for key, n in getattr(plan, "collective_counts", {}).items():
        kind = key.split("(")[0]
        out[kind] = out.get(kind, 0) + int(n)
    return out


def xla_memory(compiled: Any) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program; its peak is temp + arguments + outputs - aliased."""
    mem = compiled.memory_analysis()
    row = {"xla_temp_bytes": int(mem.temp_size_in_bytes), "xla_arg_bytes": int(mem.argument_size_in_bytes),
           "xla_out_bytes": int(mem.output_size_in_bytes), "xla_alias_bytes": int(mem.alias_size_in_bytes)}
    row["xla_peak_bytes"] = (row["xla_temp_bytes"] + row["xla_arg_bytes"] + row["xla_out_bytes"]
                             - row["xla_alias_bytes"])
    return row


# ---- output ----------------------------------------------------------------------------------------------


def env_row() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return {"part": "env", "date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "platform": dev.platform,
            "jax": jax.__version__, "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(), "process_count": jax.process_count(),
            "mock_gpu_topology": jax.config.read("jax_mock_gpu_topology") or None}


def write_row(out: Path | None, row: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> None:
    print(json.dumps(row), flush=True)
    if rows is not None:
        rows.append(row)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _late(seconds: float) -> bool:
    if time.perf_counter() + seconds > DEADLINE:
        print("deadline: the rest of this part is skipped", flush=True)
        return True
    return False


def _gb(x: Any) -> str:
    return "" if x is None else f"{x / 1e9:.3f}"


def _kinds(d: dict[str, Any] | None, field: str | None = None) -> str:
    if not d:
        return "-"
    return " ".join(f"{k.replace('_', '-')}:{v[field] if field else v}" for k, v in sorted(d.items()))


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as markdown: the env line, one table per part."""
    lines = []
    for r in rows:
        if r["part"] == "env":
            lines.append(f"{r['date']}, {r['device']} ({r['platform']}, {r['device_count']} devices, "
                         f"{r['local_device_count']} local), jax {r['jax']}, mock topology "
                         f"{r['mock_gpu_topology']}\n")
    probe = [r for r in rows if r["part"] == "probe"]
    if probe:
        lines += ["| topology | devices | local | platform | psum all-reduces | error |", "|---|---:|---:|---|---:|---|"]
        lines += [f"| {r['topology']} | {r.get('device_count', '')} | {r.get('local_device_count', '')} | "
                  f"{r.get('platform', '')} | {r.get('all_reduce_ops', '')} | {r.get('error', '')[:120]} |"
                  for r in probe]
        lines.append("")
    sharded = [r for r in rows if r["part"] == "sharded"]
    if sharded:
        lines += ["| model | case | mesh | pred GB | XLA GB | pred/XLA | temp | args | outs | alias | "
                  "HLO values | plan counts | HLO ops | compile s | error |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|"]
        for r in sharded:
            ratio = (f"{r['predicted_peak_bytes'] / r['xla_peak_bytes']:.2f}"
                     if r.get("xla_peak_bytes") and r.get("predicted_peak_bytes") else "")
            lines.append(
                f"| {r['preset']} | {r['case']} | {r.get('mesh', '')} | {_gb(r.get('predicted_peak_bytes'))} | "
                f"{_gb(r.get('xla_peak_bytes'))} | {ratio} | {_gb(r.get('xla_temp_bytes'))} | "
                f"{_gb(r.get('xla_arg_bytes'))} | {_gb(r.get('xla_out_bytes'))} | {_gb(r.get('xla_alias_bytes'))} | "
                f"{_kinds(r.get('hlo_collectives'), 'values')} | {_kinds(r.get('plan_collectives'))} | "
                f"{_kinds(r.get('hlo_collectives'), 'ops')} | {r.get('compile_s', 0):.1f} | "
                f"{r.get('error', '')[:120]} |")
        lines.append("")
    one = [r for r in rows if r["part"] in ("scan", "dispatch", "tick")]
    if one:
        lines += ["| part | case | XLA GB | median ms | host ms / call | predicted ms | error |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in one:
            med = r.get("median_s")
            host = r.get("host_s")
            pred = r.get("predicted_s")
            lines.append(f"| {r['part']} | {r['case']} | {_gb(r.get('xla_peak_bytes'))} | "
                         f"{'' if med is None else f'{med * 1e3:.3f}'} | "
                         f"{'' if host is None else f'{host * 1e3:.3f}'} | "
                         f"{'' if pred is None else f'{pred * 1e3:.3f}'} | {r.get('error', '')[:120]} |")
        lines.append("")
    return "\n".join(lines)


# ---- plans -----------------------------------------------------------------------------------------------


class PlanCache:
    """Plans by case name and traced-graph digest, in a JSON file (``--plans``); None: plan every time."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path and path.exists() else {}

    def get(self, key: str, digest: str, make: Callable[[], Any]) -> tuple[Any, float, bool]:
        """The plan, the seconds spent planning (0 when cached), and whether it came from the file."""
        from autoshard.pipeline.pipeline_plan import PipelinePlan
        from autoshard.planner.plan import Plan

        hit = self.data.get(key)
        if hit and hit["digest"] == digest:
            cls = PipelinePlan if hit["kind"] == "pipeline" else Plan
            return cls.from_dict(hit["plan"]), 0.0, True
        t0 = time.perf_counter()
        plan = make()
        seconds = time.perf_counter() - t0
        if self.path is not None:
            import jax

            kind = "pipeline" if isinstance(plan, PipelinePlan) else "plan"
            self.data[key] = {"digest": digest, "kind": kind, "jax": jax.__version__, "plan": plan.to_dict()}
            self.path.write_text(json.dumps(self.data))
        return plan, seconds, False


def _intra_plan(layout: str, graph: Any, time_budget: float) -> Any:
    """The plan of ``layout`` (a hand layout's best completion, or the automatic plan) on its logical mesh."""
    import autoshard
    from autoshard.planner import layouts as hand
    from autoshard.planner.compare import price_layout
    from cost_models import CostModel

    if layout in LONG_CASES:
        return autoshard.plan(graph, mesh=(DEVICES,), hardware=HARDWARE, time_budget_s=time_budget)
    if layout == "auto":
        return autoshard.plan(graph, mesh={"data": 2, "model": 4}, hardware=HARDWARE, time_budget_s=time_budget,
                              recompute="none")
    shape, names = {"tp8": ((8,), ("model",)), "zero3": ((8,), ("data",)),
                    "dp2xtp4": ((2, 4), ("data", "model"))}[layout]
    cost = CostModel.load(HARDWARE, mesh_shape=shape, axis_names=names)
    hl = {"tp8": lambda: hand.megatron(graph, cost.mesh, "model"),
          "zero3": lambda: hand.zero(graph, cost.mesh, 3, "data"),
          "dp2xtp4": lambda: hand.hybrid(graph, cost.mesh, dp="data", tp="model")}[layout]()
    return price_layout(graph, cost, hl, hardware=HARDWARE, time_budget_s=time_budget).plan


def _pipeline_plan(micro: Any, time_budget: float, stage_shape: tuple[int, int], devices: int = DEVICES) -> Any:
    """A 1F1B pipeline of ``micro`` over ``devices`` devices of one host, every stage ``stage_shape``."""
    from autoshard.pipeline.stages import plan_pipeline
    from autoshard.target import cost_model_for

    cost = cost_model_for(HARDWARE, (devices,), ("x",))
    return plan_pipeline(micro, cost, hardware=HARDWARE, num_microbatches=MICROBATCHES, schedule_name="1f1b",
                         time_budget_s=time_budget, stage_shape=stage_shape)


def _layout_facts(graph: Any, plan: Any) -> dict[str, Any]:
    """What a plan did that the row's numbers depend on: the share of LayerNorms laid out along the sequence
    (``megatron.sequence_parallel``: Megatron SP), the layouts of the attention kernel calls' first results
    ([b, s, h, d], counted: ``R·S(x)·R·R`` is a ring along the sequence, ``R·R·S(x)·R`` a head split), the
    recompute modes, and the predicted step."""
    from autoshard.megatron import sequence_parallel

    calls: dict[str, int] = {}
    for op in graph.ops:
        if op.primitive == "custom_partitioning" and op.phase == "forward":
            spec = plan.specs.get((), {}).get(op.outputs[0])
            calls[str(spec)] = calls.get(str(spec), 0) + 1
    return {"sequence_parallel": sequence_parallel(graph, plan), "attention_calls": calls or None,
            "recompute": sorted(set(dict(plan.recompute).values())) or None}


def _specs(plan: Any) -> dict[Any, dict[int, Any]]:
    """The plan's spec map with pending partial sums dropped (emission pins dimensions only)."""
    from cost_models import ShardingSpec

    return {s: {t: ShardingSpec(dims=v.dims) for t, v in table.items()} for s, table in plan.specs.items()}


# ---- part: probe -----------------------------------------------------------------------------------------

_PROBE = r"""
import json, sys
import jax
jax.config.update("jax_mock_gpu_topology", sys.argv[1])
row = {"topology": sys.argv[1]}
try:
    devs = jax.devices()
    row.update(platform=devs[0].platform, device_count=jax.device_count(),
               local_device_count=jax.local_device_count(), process_count=jax.process_count())
    mesh = jax.sharding.Mesh(devs, ("x",))
    from jax.sharding import NamedSharding, PartitionSpec as P
    f = jax.jit(lambda x: x.sum(), in_shardings=NamedSharding(mesh, P("x")), out_shardings=NamedSharding(mesh, P()))
    c = f.lower(jax.ShapeDtypeStruct((len(devs) * 128,), "float32")).compile()
    row["all_reduce_ops"] = c.as_text().count("all-reduce-start(") or c.as_text().count("all-reduce(")
    m = c.memory_analysis()
    row["temp_bytes"] = m.temp_size_in_bytes
except Exception as e:
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
print("PROBE " + json.dumps(row))
"""


def part_probe(out: Path | None, rows: list[dict[str, Any]]) -> None:
    """Each ``PROBE_TOPOLOGIES`` form in a fresh process (the client is made once per process)."""
    for topo in PROBE_TOPOLOGIES:
        if _late(30):
            return
        t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_MOCK_GPU_TOPOLOGY", "MOCK_NUM_GPU_PROCESSES")}
        try:
            res = subprocess.run([sys.executable, "-c", _PROBE, topo], capture_output=True, text=True, env=env,
                                 timeout=120)
            line = [x for x in res.stdout.splitlines() if x.startswith("PROBE ")]
            row = json.loads(line[-1][6:]) if line else {"topology": topo,
                                                         "error": (res.stderr or res.stdout)[-400:]}
        except subprocess.TimeoutExpired:
            row = {"topology": topo, "error": "timed out after 120 s"}
        row = {"part": "probe", **row, "wall_s": time.perf_counter() - t0}
        write_row(out, row, rows)


# ---- part: mock (sharded programs for 8 devices) -----------------------------------------------------------


def _base(preset: str, overrides: list[str], case: str) -> dict[str, Any]:
    return {"part": "sharded", "model": "gpt", "preset": preset, "overrides": overrides, "case": case}


def _compiled_row(row: dict[str, Any], lower: Callable[[], Any], plan_peak: float,
                  plan_counts: dict[str, int] | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    row.update(xla_memory(compiled))
    row["predicted_peak_bytes"] = float(plan_peak)
    text = compiled.as_text()
    row["hlo_collectives"] = count_collectives(text)
    if HLO_DIR is not None:  # the 2026-11-28 rows could not say which all-reduces XLA dropped: keep the text
        import gzip

        HLO_DIR.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{row.get('preset')}_{row.get('case')}")
        (HLO_DIR / f"{name}.hlo.gz").write_bytes(gzip.compress(text.encode()))
    row["plan_collectives"] = plan_counts
    row["lower_s"], row["compile_s"] = t1 - t0, t2 - t1
    return row


def sharded_rows(preset: str, overrides: list[str], layouts: Sequence[str], devices: Sequence[Any],
                 cache: PlanCache, time_budget: float, out: Path | None,
                 rows: list[dict[str, Any]]) -> None:
    """The rows of one model: every layout in ``layouts`` (see ``LAYOUTS``)."""
    import jax
    import numpy as np

    from autoshard._examples import load_example
    from autoshard.emit import emit
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.pipeline.pipeline_plan import graph_digest
    from autoshard.trace import trace
    from autoshard.trace.remat import rematerialize

    ex = load_example(GPT, preset, overrides, abstract=True)
    t0 = time.perf_counter()
    graph = trace(ex.train_step, *ex.args)
    trace_s = time.perf_counter() - t0
    digest = graph_digest(graph)
    for layout in [x for x in layouts if x not in ("pipeline", "spmd-pipeline")]:
        if _late(GPU_SECONDS.get(preset, 30.0)):
            return
        row = _base(preset, overrides, layout)
        t0 = time.perf_counter()
        try:
            plan, row["plan_s"], row["plan_cached"] = cache.get(f"{HARDWARE}:{preset}:{','.join(overrides)}:{layout}", digest,
                                                                lambda lay=layout: _intra_plan(lay, graph, time_budget))
            g = rematerialize(graph, dict(plan.recompute)) if plan.recompute else graph
            shape, names = tuple(plan.mesh.shape), tuple(plan.mesh.axis_names)
            mesh = jax.sharding.Mesh(np.array(list(devices)[: int(np.prod(shape))]).reshape(shape), names)
            row["mesh"] = "x".join(map(str, shape))
            row["predicted_step_s"] = plan.predicted_step_time
            row["trace_s"] = trace_s
            row.update(_layout_facts(graph, plan))
            step = emit(g, _specs(plan), mesh)
            _compiled_row(row, lambda s=step: s.lowered(*ex.args), plan.peak_memory, plan_collectives(plan))
        except Exception as e:  # a failure is a row too
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["case_wall_s"] = time.perf_counter() - t0
        write_row(out, row, rows)
        jax.clear_caches()
    if not {"pipeline", "spmd-pipeline"} & set(layouts) or _late(GPU_SECONDS.get(preset, 30.0)):
        return
    t0 = time.perf_counter()
    try:
        micro = trace_microbatch(ex.train_step, ex.args, graph, MICROBATCHES)
        pplan, plan_s, cached = cache.get(f"{HARDWARE}:{preset}:{','.join(overrides)}:pipeline-4x2", graph_digest(micro),
                                          lambda: _pipeline_plan(micro, time_budget, (1, 2)))
    except Exception as e:
        row = _base(preset, overrides, "pipeline")
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        write_row(out, row, rows)
        return
    if "pipeline" in layouts:
        _pipeline_stage_rows(preset, overrides, micro, pplan, plan_s, cached, devices, out, rows)
    if "spmd-pipeline" in layouts and not _late(GPU_SECONDS.get(preset, 30.0)):
        row = _base(preset, overrides, "spmd-pipeline")
        t1 = time.perf_counter()
        try:
            from autoshard.pipeline.spmd_program import spmd_pipeline_step, tail_graph

            step = spmd_pipeline_step(micro, graph, pplan, list(devices),
                                      tail_graph(ex.train_step, ex.args, graph, pplan))
            row["mesh"] = f"{pplan.num_physical_stages}x{pplan.stages[0].num_devices}"
            row["predicted_step_s"] = pplan.predicted_step_time
            _compiled_row(row, lambda: step.lower(*ex.args), pplan.peak_memory, None)
        except ImportError as e:
            row["error"] = f"not available: {e}"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["case_wall_s"] = time.perf_counter() - t1
        write_row(out, row, rows)
        jax.clear_caches()


def _pipeline_stage_rows(preset: str, overrides: list[str], micro: Any, pplan: Any, plan_s: float, cached: bool,
                         devices: Sequence[Any], out: Path | None, rows: list[dict[str, Any]]) -> None:
    """Stage 0's programs (forward, backward, update) of the MPMD runtime, compiled on its submesh. The plan
    prices the stage's memory (``StagePlan.memory``: update state and the microbatches in flight) as one number;
    each program's row holds it, to be compared with the programs together."""
    import jax

    from autoshard.pipeline.runtime import build_pipelined_step

    try:
        step = build_pipelined_step(micro, pplan, list(devices))
    except Exception as e:
        row = _base(preset, overrides, "pipe-stage0")
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        write_row(out, row, rows)
        return
    st = pplan.stages[0]
    tensors = micro.tensors
    for (stage, kind, level), prog in sorted(step.programs.items(), key=lambda kv: str(kv[0])):
        if stage != 0 or _late(15):
            continue
        row = _base(preset, overrides, f"pipe-stage0-{kind}{level or ''}")
        row.update(mesh="x".join(map(str, st.mesh.shape)), plan_s=plan_s, plan_cached=cached,
                   layers=list(st.layers), stages=pplan.num_physical_stages, microbatches=pplan.num_microbatches,
                   predicted_micro_s=st.micro_time, predicted_update_s=st.update_time)
        t0 = time.perf_counter()
        try:
            avals = [jax.ShapeDtypeStruct(tensors[t].shape, tensors[t].dtype, sharding=sh)
                     for t, sh in zip(prog.segment.inputs, prog.in_shardings, strict=True)]
            _compiled_row(row, lambda p=prog, a=avals: p.jitted.lower(*a), st.memory, None)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["case_wall_s"] = time.perf_counter() - t0
        write_row(out, row, rows)
    jax.clear_caches()


def part_mock(models: Sequence[tuple[str, list[str]]], layouts: Sequence[str], cache: PlanCache,
              time_budget: float, out: Path | None, rows: list[dict[str, Any]],
              long_cases: dict[str, tuple[str, list[str]]] = LONG_CASES) -> None:
    import jax

    devices = jax.devices()
    if len(devices) < DEVICES:
        write_row(out, {"part": "sharded", "error": f"{len(devices)} devices: 8 are needed (mock topology or "
                        "--xla_force_host_platform_device_count=8)"}, rows)
        return
    est = sum(GPU_SECONDS.get(p, 30.0) for p, _ in models) * len(layouts)
    print(f"mock: {len(models)} model(s) x {len(layouts)} layout(s), about {est:.0f} s on a GPU machine "
          f"(planning there adds ~{time_budget:.0f} s a plan unless --plans has it)", flush=True)
    for preset, overrides in models:
        sharded_rows(preset, overrides, [x for x in layouts if x not in LONG_CASES], devices[:DEVICES], cache,
                     time_budget, out, rows)
    for case in [x for x in layouts if x in long_cases]:
        if _late(GPU_SECONDS.get(long_cases[case][0], 30.0)):
            return
        sharded_rows(*long_cases[case], [case], devices[:DEVICES], cache, time_budget, out, rows)


# ---- part: one device --------------------------------------------------------------------------------------


def _host_and_synced(call: Callable[[], Any], n: int) -> tuple[float, float]:
    """Seconds per call dispatched ``n`` times back to back (until each call returns, results not awaited),
    and the median synchronised round trip."""
    import jax

    jax.block_until_ready(call())
    t0 = time.perf_counter()
    outs = [call() for _ in range(n)]
    host = (time.perf_counter() - t0) / n
    jax.block_until_ready(outs)
    synced = []
    for _ in range(max(5, n // 10)):
        t1 = time.perf_counter()
        jax.block_until_ready(call())
        synced.append(time.perf_counter() - t1)
    return host, statistics.median(synced)


def dispatch_rows(out: Path | None, rows: list[dict[str, Any]]) -> None:
    """Host time of a program call: a trivial jitted program, and the emitted tiny GPT step (not donated, so
    the same arguments serve every call)."""
    import jax
    import jax.numpy as jnp

    from autoshard._examples import load_example
    from autoshard.emit import emit
    from autoshard.trace import trace

    x = jnp.ones((8,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    host, synced = _host_and_synced(lambda: f(x), 1000)
    write_row(out, {"part": "dispatch", "case": "trivial jit (x + 1, f32[8])", "host_s": host, "median_s": synced},
              rows)
    ex = load_example(GPT, "tiny", [], abstract=False)
    graph = trace(ex.train_step, *ex.args)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    step = emit(graph, {}, mesh, donate=False)
    args = step.place(*ex.args)
    host, synced = _host_and_synced(lambda: step(*args), 200)
    write_row(out, {"part": "dispatch", "case": f"emitted gpt tiny step ({len(graph.inputs)} leaves)",
                    "host_s": host, "median_s": synced}, rows)


def scan_rows(models: Sequence[tuple[str, list[str]]], repeats: int, out: Path | None,
              rows: list[dict[str, Any]]) -> None:
    """GPT with scan_layers true and false, jitted with the state donated: XLA's peak and the median step."""
    import jax
    from gpu_truth import time_steps

    from autoshard._examples import load_example

    for preset, overrides in models:
        for scan in (False, True):
            if _late(60):
                return
            case = f"gpt {preset} {' '.join(overrides)} scan_layers={str(scan).lower()}"
            row: dict[str, Any] = {"part": "scan", "case": case, "preset": preset, "overrides": overrides,
                                   "scan_layers": scan}
            t0 = time.perf_counter()
            try:
                ex = load_example(GPT, preset, [*overrides, f"scan_layers={str(scan).lower()}"], abstract=False)
                compiled = jax.jit(ex.train_step, donate_argnums=0).lower(*ex.args).compile()
                row["compile_s"] = time.perf_counter() - t0
                row.update(xla_memory(compiled))
                row["median_s"], row["min_s"] = time_steps(compiled, ex.args, repeats)
                del ex
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row["case_wall_s"] = time.perf_counter() - t0
            write_row(out, row, rows)
            jax.clear_caches()


def tick_rows(preset: str, overrides: list[str], cache: PlanCache, time_budget: float, repeats: int,
              out: Path | None, rows: list[dict[str, Any]]) -> None:
    """One tick of stage 0 of a 4-stage pipeline of one device a stage: its forward and backward programs
    for one microbatch, on random inputs (integers in [0, 1000)) on the local device, each timed alone and the
    pair back to back, beside ``ticks.price``'s actions (``f = micro_time / 3``, ``b = 2·micro_time / 3``)
    and the host seconds a program call takes to return (``ticks.DISPATCH_S`` prices one a step)."""
    import jax
    import jax.numpy as jnp

    from autoshard._examples import load_example
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.pipeline.pipeline_plan import graph_digest
    from autoshard.pipeline.runtime import build_pipelined_step
    from autoshard.trace import trace

    row: dict[str, Any] = {"part": "tick", "case": f"gpt {preset} {' '.join(overrides)} stage 0 of 4 (1 device)",
                           "preset": preset, "overrides": overrides}
    t0 = time.perf_counter()
    try:
        ex = load_example(GPT, preset, overrides, abstract=True)
        graph = trace(ex.train_step, *ex.args)
        micro = trace_microbatch(ex.train_step, ex.args, graph, MICROBATCHES)
        pplan, row["plan_s"], row["plan_cached"] = cache.get(
            f"{HARDWARE}:{preset}:{','.join(overrides)}:pipeline-4x1", graph_digest(micro),
            lambda: _pipeline_plan(micro, time_budget, (1, 1), TICK_STAGES))
        devices = [jax.devices()[0]] * TICK_STAGES  # only stage 0's programs run, on the local device
        step = build_pipelined_step(micro, pplan, devices)
        st = pplan.stages[0]
        from autoshard.pipeline.ticks import DISPATCH_S

        row.update(layers=list(st.layers), stages=pplan.num_physical_stages, predicted_s=st.micro_time,
                   predicted_forward_s=st.micro_time / 3, predicted_backward_s=2 * st.micro_time / 3,
                   predicted_dispatch_s=DISPATCH_S, hardware=HARDWARE)
        progs = [(kind, p) for (s, kind, _), p in sorted(step.programs.items(), key=lambda kv: str(kv[0]))
                 if s == 0 and kind in ("forward", "backward")]
        tensors = micro.tensors
        calls = []
        key = jax.random.key(0)
        for kind, p in progs:
            args = []
            for t, sh in zip(p.segment.inputs, p.in_shardings, strict=True):
                key, sub = jax.random.split(key)
                # integers (the tokens) drawn too: all-zero tokens make the embedding gradient's scatter-add
                # hit one row, serialised atomics (56.6 ms for this backward on the H200, 2026-11-28)
                x = (jax.random.normal(sub, tensors[t].shape, jnp.float32).astype(tensors[t].dtype) * 0.02
                     if jnp.issubdtype(tensors[t].dtype, jnp.floating)
                     else jax.random.randint(sub, tensors[t].shape, 0, 1000).astype(tensors[t].dtype))
                args.append(jax.device_put(x, sh))
            compiled = p.jitted.lower(*args).compile()
            calls.append((compiled, args))
            host, synced = _host_and_synced(lambda c=compiled, a=args: c(*a), 20)
            row[f"{kind}_s"], row[f"{kind}_host_s"] = synced, host

        def tick() -> Any:
            return [c(*a) for c, a in calls]

        jax.block_until_ready(tick())
        times = []
        for _ in range(repeats + 2):
            t1 = time.perf_counter()
            jax.block_until_ready(tick())
            times.append(time.perf_counter() - t1)
        row["median_s"] = statistics.median(times[2:])
        row["programs"] = len(calls)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    row["case_wall_s"] = time.perf_counter() - t0
    write_row(out, row, rows)
    jax.clear_caches()


def part_one_device(quick: bool, cache: PlanCache, time_budget: float, repeats: int, out: Path | None,
                    rows: list[dict[str, Any]], which: Sequence[str] = ("dispatch", "tick", "scan"),
                    scan_presets: Sequence[str] | None = None) -> None:
    if "dispatch" in which:
        dispatch_rows(out, rows)
    if "tick" in which and not _late(40):  # the tick before the scanned stacks (issue #46's order)
        tick_rows(*(QUICK[0] if quick else SHARDED_MODELS[0]), cache, time_budget, repeats, out, rows)
    if "scan" in which:
        scan_rows([("tiny", ["layers=4"])] if quick else
                  [m for m in SCAN_MODELS if not scan_presets or m[0] in scan_presets], repeats, out, rows)


# ---- main ------------------------------------------------------------------------------------------------


def configure(parts: Sequence[str], topology: str) -> None:
    """Before the backend starts: 8 host devices on CPU; on a GPU, the mock topology (``--mock`` only)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if not platforms or "cpu" in platforms:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    if "mock" in parts and platforms.startswith(("cuda", "gpu")):
        import jax

        jax.config.update("jax_mock_gpu_topology", topology)
        jax.config.update("jax_cuda_visible_devices", "0")


def main(argv: list[str] | None = None) -> int:
    global DEADLINE, HARDWARE, HLO_DIR
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="*", default=["mock"], choices=["probe", "mock", "one-device"])
    ap.add_argument("--one", nargs="*", default=["dispatch", "tick", "scan"], choices=["dispatch", "tick", "scan"],
                    help="the one-device part's rows")
    ap.add_argument("--scan-models", nargs="*", help="presets of the scan rows (default 350m 1.3b)")
    ap.add_argument("--quick", action="store_true", help="the tiny GPT (a CPU smoke test of every path)")
    ap.add_argument("--models", nargs="*", help="presets of the mock part (default 350m 1.3b)")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--topology", default=TOPOLOGY, help="jax_mock_gpu_topology on a GPU (default 1x8x1)")
    ap.add_argument("--plans", type=Path, help="plan cache (JSON): reused when the trace's digest matches")
    ap.add_argument("--plan-only", action="store_true", help="fill --plans and compile nothing")
    ap.add_argument("--time-budget", type=float, default=10.0, help="solver seconds per plan")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hardware", default=HARDWARE, help="the planner's preset (h100, h200)")
    ap.add_argument("--predict", type=Path, help="rows of the one-device part: the planner's step and peak beside "
                    "each scan row (1-device mesh, --hardware), as JSON lines")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds from the start for all parts")
    ap.add_argument("--out", type=Path, help="append the rows (JSON lines) here")
    ap.add_argument("--hlo-dir", type=Path, help="write each compiled program's optimized HLO here (gzipped)")
    ap.add_argument("--md", type=Path, help="append the rows as a markdown table here")
    args = ap.parse_args(argv)
    DEADLINE = time.perf_counter() + args.deadline
    HARDWARE = args.hardware
    HLO_DIR = args.hlo_dir
    configure(args.parts, args.topology)
    models = QUICK if args.quick else [m for m in SHARDED_MODELS if not args.models or m[0] in args.models]
    cache = PlanCache(args.plans)
    if args.predict:
        return predict_scan(args.predict, args.time_budget)
    if args.plan_only:
        return plan_only(models, args.layouts, cache, args.time_budget, QUICK_LONG if args.quick else LONG_CASES)
    rows: list[dict[str, Any]] = []
    write_row(args.out, env_row(), rows)
    for part in args.parts:
        t0 = time.perf_counter()
        if part == "probe":
            part_probe(args.out, rows)
        elif part == "mock":
            part_mock(models, args.layouts, cache, args.time_budget, args.out, rows,
                      QUICK_LONG if args.quick else LONG_CASES)
        else:
            part_one_device(args.quick, cache, args.time_budget, args.repeats, args.out, rows, args.one,
                            args.scan_models)
        print(f"part {part}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.md:
        with args.md.open("a") as f:
            f.write(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


def predict_scan(rows_path: Path, time_budget: float) -> int:
    """The planner's price of each measured ``scan`` row's step on one device (recompute none, no memory
    limit), printed as the row with ``predicted_step_s`` and ``predicted_peak_bytes`` added."""
    import autoshard
    from autoshard._examples import load_example

    for line in rows_path.read_text().splitlines():
        row = json.loads(line)
        if row.get("part") != "scan":
            continue
        ex = load_example(GPT, row["preset"], [*row["overrides"], f"scan_layers={str(row['scan_layers']).lower()}"],
                          abstract=True)
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=HARDWARE, time_budget_s=time_budget,
                              memory_budget=1e15, recompute="none")
        row.update(predicted_step_s=plan.predicted_step_time, predicted_peak_bytes=plan.peak_memory,
                   hardware=HARDWARE)
        print(json.dumps(row), flush=True)
    return 0


def plan_only(models: Sequence[tuple[str, list[str]]], layouts: Sequence[str], cache: PlanCache,
              time_budget: float, long_cases: dict[str, tuple[str, list[str]]] = LONG_CASES) -> int:
    """Plan every case into ``cache`` (no compiling): run here, with the GPU's jax version, to spare its time."""
    from autoshard._examples import load_example
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.pipeline.pipeline_plan import graph_digest
    from autoshard.trace import trace

    cases = [(p, o, [x for x in layouts if x not in long_cases]) for p, o in models]
    cases += [(*long_cases[x], [x]) for x in layouts if x in long_cases]
    for preset, overrides, case_layouts in cases:
        ex = load_example(GPT, preset, overrides, abstract=True)
        graph = trace(ex.train_step, *ex.args)
        for layout in [x for x in case_layouts if x not in ("pipeline", "spmd-pipeline")]:
            _, s, hit = cache.get(f"{HARDWARE}:{preset}:{','.join(overrides)}:{layout}", graph_digest(graph),
                                  lambda lay=layout, g=graph: _intra_plan(lay, g, time_budget))
            print(f"{preset} {layout}: {'cached' if hit else f'planned in {s:.1f} s'}", flush=True)
        if not {"pipeline", "spmd-pipeline"} & set(case_layouts):
            continue
        micro = trace_microbatch(ex.train_step, ex.args, graph, MICROBATCHES)
        for name, shape, n in (("pipeline-4x2", (1, 2), DEVICES), ("pipeline-4x1", (1, 1), TICK_STAGES)):
            _, s, hit = cache.get(f"{HARDWARE}:{preset}:{','.join(overrides)}:{name}", graph_digest(micro),
                                  lambda sh=shape, n=n, m=micro: _pipeline_plan(m, time_budget, sh, n))
            print(f"{preset} {name}: {'cached' if hit else f'planned in {s:.1f} s'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
