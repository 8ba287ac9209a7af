"""``format_plan``: the readable summary of a Plan that ``autoshard plan`` prints; shared formatting helpers."""

from __future__ import annotations

import re
from collections import defaultdict

from autoshard.planner.plan import Plan
from autoshard.planner.utilization import ModelFlops
from autoshard.trace import remat
from autoshard.trace.summary import human_bytes

_LAYER_INDEX = re.compile(r"_\d+(?=\.|$)|\[\d+\](?=\.)|(?<=\.)\d+(?=\.)")  # block_3, [3], layers.3


def human_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def mfu_line(mfu: float, flops: ModelFlops | None) -> str:
    """``predicted MFU 41.2% (model flops 3.1 PFLOP a step at a 989 TFLOP/s peak per device)``."""
    assert flops is not None
    return (f"predicted MFU {100 * mfu:.1f}% (model flops {flops.flops / 1e15:.4g} PFLOP a step, 3x the forward "
            f"matmuls, at a {flops.peak / 1e12:.4g} TFLOP/s peak per device)")


def tensor_class(name: str) -> str:
    """A parameter's class: its name with layer indices folded, ``state.params.block_*.mlp.fc.kernel``."""
    return _LAYER_INDEX.sub(lambda m: "_*" if m.group(0).startswith("_") else "[*]" if m.group(0).startswith("[")
                            else "*", name)


def format_plan(plan: Plan, *, max_classes: int = 40) -> str:
    lines = [
        f"mesh {plan.mesh}   hardware {plan.hardware or '?'}",
        f"predicted step time {human_time(plan.predicted_step_time)}   peak memory per device "
        f"{human_bytes(plan.peak_memory)}"
        + (f" of a {human_bytes(plan.memory_budget)} budget" if plan.memory_budget else " (no budget)"),
    ]
    if plan.mfu is not None:
        lines.append(mfu_line(plan.mfu, plan.model_flops))
    if plan.recompute:
        lines.append(f"recompute: {remat.summary(plan.recompute)} (their forward ops run again "
                     "in the backward pass; counted in compute)")
    lines += [
        "",
        "time by category",
    ]
    total = plan.predicted_step_time or 1.0
    for k, v in sorted(plan.time_breakdown.items(), key=lambda kv: -kv[1]):
        if k == "resharding":
            continue
        n = plan.collective_counts.get(k)
        issued = f"  {n} issued" if n else ""
        lines.append(f"  {k:<28} {human_time(v):>12}  {100 * v / total:5.1f}%{issued}")
    if plan.time_breakdown.get("resharding"):
        lines.append(f"  (of the collectives, {human_time(plan.time_breakdown['resharding'])} is resharding between ops)")

    classes: dict[tuple[str, str, tuple[int, ...]], dict[str, object]] = {}
    for t in plan.inputs:
        key = (t.role, tensor_class(t.name), t.shape)
        c = classes.setdefault(key, {"count": 0, "specs": defaultdict(int), "shape": t.shape, "bytes": 0})
        c["count"] += 1  # type: ignore[operator]
        c["specs"][str(t.spec)] += 1  # type: ignore[index]
    lines += ["", "layouts of the step's inputs (layer indices folded)"]
    rows = sorted(classes.items(), key=lambda kv: (kv[0][0] != "param", kv[0][0], kv[0][1]))
    for (role, name, _), c in rows[:max_classes]:
        specs = ", ".join(f"{s}" + (f" x{n}" if n > 1 else "") for s, n in c["specs"].items())  # type: ignore[union-attr]
        lines.append(f"  {role:<9} {name:<56} {list(c['shape'])!s:<18} {specs}")
    if len(rows) > max_classes:
        lines.append(f"  ... {len(rows) - max_classes} more classes")
    s = plan.solver
    lines += [
        "",
        f"solver: {s.status}{'' if s.optimal else ' (not proven optimal)'}, {s.nodes} nodes, {s.edges} edges, "
        + (f"trace {s.trace_seconds:.1f} s, " if s.trace_seconds is not None else "")
        + f"build {s.build_seconds:.1f} s, seeds {s.seed_seconds:.1f} s, solve {s.solve_seconds:.1f} s",
    ]
    return "\n".join(lines)
