"""``format_plan``: the readable summary ``autoshard plan`` prints and ``parallelize.explain()`` returns."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING

from autoshard.planner.plan import Plan
from autoshard.trace.summary import human_bytes

if TYPE_CHECKING:
    from autoshard.pipeline.planner import PipelinePlan

_LAYER_INDEX = re.compile(r"_\d+(?=\.|$)|\[\d+\](?=\.)")


def _us(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def tensor_class(name: str) -> str:
    """A parameter's class: its name with layer indices folded, ``state.params.block_*.mlp.fc.kernel``."""
    return _LAYER_INDEX.sub(lambda m: "_*" if m.group(0).startswith("_") else "[*]", name)


def format_plan(plan: Plan, *, max_classes: int = 40) -> str:
    lines = [
        f"mesh {plan.mesh}   hardware {plan.hardware or '?'}",
        f"predicted step time {_us(plan.predicted_step_time)}   peak memory per device "
        f"{human_bytes(plan.peak_memory)}"
        + (f" of a {human_bytes(plan.memory_budget)} budget" if plan.memory_budget else " (no budget)"),
        "",
        "time by category",
    ]
    total = plan.predicted_step_time or 1.0
    for k, v in sorted(plan.time_breakdown.items(), key=lambda kv: -kv[1]):
        if k == "resharding":
            continue
        lines.append(f"  {k:<28} {_us(v):>12}  {100 * v / total:5.1f}%")
    if plan.time_breakdown.get("resharding"):
        lines.append(f"  (of the collectives, {_us(plan.time_breakdown['resharding'])} is resharding between ops)")

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
        f"solver: {s.get('status')}{'' if s.get('optimal') else ' (not proven optimal)'}, "
        f"{s.get('nodes')} nodes, {s.get('edges')} edges, "
        + (f"trace {s['trace_seconds']:.1f} s, " if "trace_seconds" in s else "")
        + f"build {s.get('build_seconds', 0):.1f} s, "
        f"solve {s.get('solve_seconds', 0):.1f} s",
    ]
    return "\n".join(lines)


def format_pipeline_plan(plan: PipelinePlan) -> str:
    """Stages, their submeshes, per-stage time and memory, and the bubble."""
    S = len(plan.stages)
    lines = [
        f"mesh {plan.mesh}   hardware {plan.hardware or '?'}",
        f"pipeline: {S} stage{'s' if S != 1 else ''}, {plan.num_microbatches} microbatches, schedule "
        f"{plan.schedule}, {plan.num_layers} layers",
        f"predicted step time {_us(plan.predicted_step_time)}   bubble {100 * plan.bubble_fraction:.1f}%   "
        f"peak memory per device {human_bytes(plan.peak_memory)}"
        + (f" of a {human_bytes(plan.memory_budget)} budget" if plan.memory_budget else " (no budget)"),
        "",
        f"  {'stage':<6}{'layers':<10}{'submesh':<10}{'devices':<16}{'fwd+bwd/microbatch':>20}{'update':>12}"
        f"{'memory/device':>16}",
    ]
    cluster = plan.cluster
    for s, st in enumerate(plan.stages):
        devs = st.devices(cluster)
        dev = f"{devs[0]}..{devs[-1]}" if len(devs) > 1 else str(devs[0])
        lines.append(f"  {s:<6}{f'{st.layers[0]}..{st.layers[1]}':<10}{f'{st.submesh[0]}x{st.submesh[1]}':<10}"
                     f"{dev:<16}{_us(st.micro_time):>20}{_us(st.update_time):>12}{human_bytes(st.memory):>16}")
    sv = plan.solver
    lines += ["", f"planner: {sv.get('distinct_layers')} distinct layers priced on each submesh shape "
              f"({sv.get('layer_solves')} intra-op solves), stage DP {sv.get('dp_seconds', 0):.2f} s, "
              f"total {sv.get('planning_seconds', 0):.1f} s"]
    return "\n".join(lines)
