"""Where the time of issue #34's long-sequence step goes: a kernel profile against the planner's per-op prices.

``benchmarks/gpu_longseq.py`` measured the per-device step of GPT-1.3B bf16, batch 1, seq 16384, with
autoshard's selective recompute rewrite, at 3.51 s on one H200 against 1.94 s predicted. This script takes
that same step (traced, every block rewritten by ``trace.remat.rematerialize`` in ``selective`` mode,
re-emitted by ``autoshard.emit`` for one device, state donated), runs 2 untraced steps, then 3 steps under
``jax.profiler.trace``, and writes to ``--out``:

``hlo.txt.gz``
    The optimized HLO of the step.
``trace.json.gz``
    The profiler's trace (every GPU kernel with its duration and HLO op); ``gpu_truth.py --kernels`` reads it.
``kernels.json``
    The kernel summary made on the device (so it does not depend on the raw trace coming back): per step,
    the GPU's span and busy time, and the kernels grouped by kind (``matmul``, ``reduction``,
    ``copy/transpose``, ``elementwise``, ``memset/memcpy``, ``collective``), each kind split by whether the
    kernel's HLO instruction (its operands, result or fused body) holds the ``[.., seq, seq]`` score tensor;
    with the bytes the HLO instruction's operands and result take (what it must move at least) and the
    top kernels.

Run on the GPU machine (with command buffers off, so that every kernel names its own HLO instruction)::

    XLA_FLAGS=--xla_gpu_enable_command_buffer= JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=.95 \\
        python benchmarks/gpu_longseq_profile.py --out OUTDIR --deadline 260

and here (no GPU), the planner's prices for the same rewrite (``h200`` preset, 1-device mesh) by the same
kinds, merged into the summary::

    python benchmarks/gpu_longseq_profile.py --predict OUTDIR/kernels.json --write summary.json

A CPU smoke test: ``JAX_PLATFORMS=cpu python benchmarks/gpu_longseq_profile.py --out /tmp/p --preset tiny
--seq 256`` (then ``--predict /tmp/p/kernels.json --preset tiny --seq 256``).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_truth import kernels as trace_span  # noqa: E402
from gpu_truth import synced_steps, xla_memory  # noqa: E402

KINDS = ("matmul", "reduction", "copy/transpose", "elementwise", "memset/memcpy", "collective")
_MATMUL_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass|cublas|cudnn|sm\d\d_|ampere|hopper|dot", re.I)
_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|nccl", re.I)
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# ``%name = type opcode(operands), ...`` (the result may be a tuple; ROOT may lead)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")


def _norm(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its opcode's ``(``."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i])
    return []


def parse_hlo(text: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The optimized HLO's instructions by normalised name (name, opcode, result type, operands, fusion kind,
    line, called computations) and each computation's body text by name."""
    instrs: dict[str, dict[str, Any]] = {}
    comps: dict[str, str] = {}
    current, body = None, []
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current, body = head.group(1), []
            continue
        if line.startswith("}") and current is not None:
            comps[current] = "\n".join(body)
            current = None
            continue
        if current is not None:
            body.append(line)
        m = _INSTR.match(line)
        if m:
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
            calls += [c.strip().lstrip("%") for grp in re.findall(r"called_computations=\{([^}]*)\}", line)
                      for c in grp.split(",")]
            kind = re.search(r"kind=(k\w+)", line)
            instrs[_norm(m.group(1))] = {"name": m.group(1), "opcode": m.group(3), "result": m.group(2),
                                         "operands": _operands(m.group(4)), "fusion_kind": kind and kind.group(1),
                                         "line": line.strip(), "calls": calls}
    return instrs, comps


def _shape_bytes(text: str) -> int:
    text = re.sub(r"\{[^{}]*\}", "", text)  # layouts
    total = 0
    for dt, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dt]
    return total


def instr_bytes(ins: dict[str, Any], instrs: dict[str, dict[str, Any]]) -> int:
    """Bytes of an instruction's result and operands (each operand's result type, looked up by name): what
    its kernel must read and write at least, if it reads each operand whole once."""
    total = _shape_bytes(ins["result"])
    for name in ins["operands"]:
        op = instrs.get(_norm(name))
        total += _shape_bytes(op["result"]) if op else 0
    return total


def classify(kernel: str, ins: dict[str, Any] | None, instrs: dict[str, dict[str, Any]], comps: dict[str, str],
             seq: int) -> tuple[str, bool]:
    """(kind, whether the [.., seq, seq] score tensor is the instruction's result or an operand, or is in its
    fused body)."""
    score_re = rf"\[(?:[0-9]+,)*{seq},{seq}\]"
    body = "\n".join(comps.get(c, "") for c in (ins["calls"] if ins else []))
    score = bool(ins) and bool(
        re.search(score_re, ins["result"]) or re.search(score_re, body)
        or any(re.search(score_re, instrs[_norm(o)]["result"]) for o in ins["operands"] if _norm(o) in instrs))
    op = ins["opcode"] if ins else ""
    line = ins["line"] if ins else ""
    name = (ins["name"] if ins else kernel).lower()
    lowk = kernel.lower()
    if "memset" in lowk or "memcpy" in lowk:
        return "memset/memcpy", score
    if _COLLECTIVE.search(op) or _COLLECTIVE.search(lowk):
        return "collective", score
    if (op in ("dot", "convolution") or _MATMUL_KERNEL.search(kernel) or re.search(r"gemm|dot", name)
            or re.search(r"__cublas|__cudnn|__triton_gemm", line)
            or (ins and ins["fusion_kind"] == "kCustom" and re.search(r"\b(dot|convolution)\(", body))):
        return "matmul", score
    if op in ("copy", "transpose") or re.search(r"copy|transpose", name):
        return "copy/transpose", score
    if (op in ("reduce", "reduce-window", "scatter", "sort", "select-and-scatter") or "reduce" in name
            or (ins and ins["fusion_kind"] in ("kInput", "kCustom") and re.search(r"\breduce\(", body))):
        return "reduction", score
    return "elementwise", score


def summarise(trace_path: Path, hlo_text: str, seq: int, steps: int = 3) -> dict[str, Any]:
    """The GPU kernels of ``steps`` traced steps grouped by kind and score, per step (ms); bytes from the HLO."""
    with gzip.open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e["args"]["name"]}
    ev = [e for e in events if e.get("ph") == "X" and e["pid"] in gpu]
    if not ev:  # a CPU run (the smoke test): XLA's thunks on the host name their HLO op
        ev = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    instrs, comps = parse_hlo(hlo_text)
    groups: dict[tuple[str, bool], dict[str, Any]] = {}
    by_kernel: dict[str, dict[str, Any]] = {}
    unmatched: collections.Counter[str] = collections.Counter()
    for e in ev:
        args = e.get("args", {})
        op = args.get("hlo_op", "")
        key = op if op and not op.startswith("command_buffer") else e["name"]
        ins = instrs.get(_norm(key)) or instrs.get(_norm(re.sub(r"_\d+$", "", e["name"]))) \
            or instrs.get(_norm(e["name"]))
        if ins is None:
            unmatched[e["name"][:80]] += e["dur"]
        kind, score = classify(e["name"], ins, instrs, comps, seq)
        g = groups.setdefault((kind, score), {"kind": kind, "score": score, "ms": 0.0, "kernels": 0,
                                               "hlo_bytes": 0})
        g["ms"] += e["dur"] / 1e3 / steps
        g["kernels"] += 1
        k = by_kernel.setdefault(e["name"], {"kernel": e["name"][:120], "hlo_op": ins["name"] if ins else op,
                                             "kind": kind, "score": score, "ms": 0.0, "calls": 0,
                                             "hlo_bytes": instr_bytes(ins, instrs) if ins else 0})
        k["ms"] += e["dur"] / 1e3 / steps
        k["calls"] += 1
    # bytes: each matched kernel's HLO instruction's bytes, once per launch
    for k in by_kernel.values():
        groups[(k["kind"], k["score"])]["hlo_bytes"] += k["hlo_bytes"] * k["calls"] / steps
    for g in groups.values():
        g["kernels"] = g["kernels"] / steps
        g["gb_per_s"] = g["hlo_bytes"] / (g["ms"] / 1e3) / 1e9 if g["ms"] > 0 and g["hlo_bytes"] else None
    top = sorted(by_kernel.values(), key=lambda k: -k["ms"])[:40]
    for k in top:
        k["calls"] = k["calls"] / steps
        k["gb_per_s"] = k["hlo_bytes"] * k["calls"] / (k["ms"] / 1e3) / 1e9 if k["ms"] > 0 else None
        ins = instrs.get(_norm(k["hlo_op"]))
        k["hlo_line"] = (ins["line"][:400] if ins else None)
    return {"groups": sorted(groups.values(), key=lambda g: -g["ms"]), "top_kernels": top,
            "kernels_per_step": len(ev) / steps, "unmatched_ms": sum(unmatched.values()) / 1e3 / steps,
            "unmatched_top": unmatched.most_common(10)}


def measure(args: argparse.Namespace) -> None:
    import statistics

    import jax

    from autoshard._examples import load_example
    from autoshard.emit import emit
    from autoshard.trace import trace
    from autoshard.trace.remat import blocks, rematerialize

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    info: dict[str, Any] = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:],
                            "xla_flags": os.environ.get("XLA_FLAGS", ""), "preset": args.preset,
                            "overrides": overrides(args), "mode": "selective", "seq": args.seq}
    ex = load_example(ROOT / "examples" / "gpt.py", args.preset, overrides(args), abstract=False)
    graph = trace(ex.train_step, *ex.args)
    graph = rematerialize(graph, {b: "selective" for b in blocks(graph)})
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    step = emit(graph, {}, mesh)
    state, batch = step.place(*ex.args)
    del ex
    compiled = step.compiled(state, batch)
    hlo = compiled.as_text()
    with gzip.open(out / "hlo.txt.gz", "wt") as f:
        f.write(hlo)
    info.update(xla_memory(compiled))
    info["compile_wall_s"] = time.perf_counter() - t0
    if info["compile_wall_s"] + 30 > args.deadline:
        (out / "kernels.json").write_text(json.dumps({"info": info, "error": "deadline after compiling"}))
        return
    print(json.dumps(info), flush=True)
    times, state = synced_steps(step, state, batch, 2)  # warm-up (the first one compiles if jit did not)
    info["warmup_s"] = times
    raw = out / "raw"
    t1 = time.perf_counter()
    with jax.profiler.trace(str(raw)):
        for _ in range(3):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    info["traced_3_steps_wall_s"] = time.perf_counter() - t1
    found = sorted(raw.rglob("*.trace.json.gz"))
    shutil.copy(found[0], out / "trace.json.gz")
    shutil.rmtree(raw, ignore_errors=True)
    info["trace_bytes"] = (out / "trace.json.gz").stat().st_size
    (out / "kernels.json").write_text(json.dumps({"info": info}, indent=1))  # in case summarising fails
    if dev.platform == "gpu":
        span = trace_span(out / "trace.json.gz", steps=3)
        info["gpu_span_ms"], info["gpu_busy_ms"] = span["span_s"] * 1e3, span["busy_s"] * 1e3
    summary = summarise(out / "trace.json.gz", hlo, args.seq)
    info["wall_s"] = time.perf_counter() - t0
    info["step_s_untraced_median"] = statistics.median(times[1:])
    (out / "kernels.json").write_text(json.dumps({"info": info, **summary}, indent=1))
    for g in summary["groups"]:
        print(f"{g['kind']:<16} score={g['score']!s:<5} {g['ms']:9.1f} ms {g['kernels']:7.0f} kernels "
              f"{(g['gb_per_s'] or 0):8.0f} GB/s", flush=True)


def overrides(args: argparse.Namespace) -> list[str]:
    return [f"dtype={args.dtype}", f"batch={args.batch}", f"seq_len={args.seq}"]


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's prices of the same step (``selective`` recompute, 1-device mesh, ``--hardware``
    preset), every op group (``readback.top_ops`` without its cut) summed by the measured kinds: a
    ``dot_general`` is a matmul, a ``reduce_*`` a reduction, everything else elementwise; the score part of
    each: the ops of the attention's core (examples/gpt.py's lines 97 to 101: the two einsums and their
    gradients, the scale, the causal mask, the softmax and its gradient, but not the final reshape) and any
    op whose result is [.., seq, seq]."""
    import functools

    import autoshard
    from autoshard._examples import load_example
    from autoshard.planner import readback

    orig = readback.top_ops
    readback.top_ops = functools.partial(orig, n=10**9)
    try:
        ex = load_example(ROOT / "examples" / "gpt.py", args.preset, overrides(args), abstract=True)
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=args.hardware, time_budget_s=60,
                              memory_budget=1e15, recompute="selective")
    finally:
        readback.top_ops = orig
    groups = plan.solver.top_ops
    seq = args.seq
    out: dict[str, Any] = collections.defaultdict(lambda: {"ms": 0.0, "ops": 0})
    prims: dict[str, Any] = collections.defaultdict(lambda: {"ms": 0.0, "ops": 0})
    for g in groups:
        shape = tuple(g["shape"])
        core = bool(re.search(r"gpt\.py:(97|98|99|100|101)\b", g["source"] or ""))
        if g["primitive"] == "dot_general":
            kind = "matmul"
            score = core or shape[-2:] == (seq, seq)
        else:
            kind = "reduction" if g["primitive"].startswith(("reduce", "argmax", "cumsum")) else "elementwise"
            score = (core and g["primitive"] not in ("reshape",)) or shape[-2:] == (seq, seq)
        o = out[f"{kind}|{score}"]
        o["ms"] += g["time"] * 1e3
        o["ops"] += g["count"]
        p = prims[f"{g['primitive']}|{score}"]
        p["ms"] += g["time"] * 1e3
        p["ops"] += g["count"]
    res = {"hardware": args.hardware, "predicted_step_ms": plan.predicted_step_time * 1e3,
           "time_breakdown_ms": {k: v * 1e3 for k, v in plan.time_breakdown.items()},
           "by_kind": dict(out), "by_primitive": dict(sorted(prims.items(), key=lambda kv: -kv[1]["ms"])),
           "groups_ms": sum(g["time"] for g in groups) * 1e3,
           "top_groups": [{k: g[k] for k in ("op", "primitive", "phase", "shape", "count", "time")}
                          for g in groups[:25]]}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="a folder for hlo.txt.gz, trace.json.gz and kernels.json")
    ap.add_argument("--preset", default="1.3b")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds: the run is not started past this (a guard; one step takes ~3.5 s)")
    ap.add_argument("--predict", type=Path, help="a measured kernels.json: add the planner's prices to it")
    ap.add_argument("--write", type=Path, help="--predict's merged output (default: print)")
    ap.add_argument("--hardware", default="h200")
    args = ap.parse_args(argv)
    if args.predict:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        measured = json.loads(args.predict.read_text())
        measured["predicted"] = predict(args)
        text = json.dumps(measured, indent=1)
        if args.write:
            args.write.write_text(text + "\n")
        else:
            print(text)
        return 0
    assert args.out is not None, "--out is required when measuring"
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
