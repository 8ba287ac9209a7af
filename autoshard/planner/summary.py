"""``format_plan``: the readable summary of a Plan that ``autoshard plan`` prints; shared formatting helpers."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

from autoshard.planner.plan import Plan, TensorLayout
from autoshard.planner.utilization import ModelFlops
from autoshard.trace import remat
from autoshard.trace.summary import human_bytes
from cost_models import LogicalMesh

# A layer's index inside a name, in every form models give one: a numbered name (``block_3``, flax's
# ``Block_3``), a list's index (``layers[3]``, ``layers['3']`` as a dict of lists' keys, ``layers.3``,
# ``layers/3`` in a name scope, ``h/3``). The number is the one group of the three that matched.
_LAYER_INDEX = re.compile(r"_(\d+)(?=[./\[]|$)|\[['\"]?(\d+)['\"]?\](?=[./\[]|$)|(?<=[./])(\d+)(?=[./\[]|$)")


def _starred(m: re.Match[str]) -> str:
    text = m.group(0)
    return "_*" if text.startswith("_") else text.replace(m.group(2), "*") if text.startswith("[") else "*"


def fold_layer_indices(name: str) -> str:
    """``name`` with every layer index folded to ``*`` (``state.params.layers['3'].mlp.kernel`` ->
    ``state.params.layers['*'].mlp.kernel``, ``GPT/block_3/attn`` -> ``GPT/block_*/attn``): one class for
    a parameter, or an op's scope, repeated in every layer. The one rule the summary, ``explain``,
    ``compare`` and the plan's top ops fold by. Blocks whose names carry no number (``self.first``,
    ``self.second``) are not folded: names only label (the blocks themselves are ``trace.structure``'s)."""
    return _LAYER_INDEX.sub(_starred, name)


def fold_block_labels(name: str, labels: frozenset[str]) -> str:
    """``name`` with every component (between ``.``, ``/``, or in ``['...']``) that is one of ``labels`` (the
    names blocks carry that tell them apart: ``first``, ``second``; ``trace.structure.block_labels``) folded
    to ``*``, then its layer indices (``fold_layer_indices``)."""
    if labels:
        name = re.sub(r"(?<=[./\[])(['\"]?)([A-Za-z_]\w*)\1(?=[./\]]|$)",
                      lambda m: f"{m.group(1)}*{m.group(1)}" if m.group(2) in labels else m.group(0), name)
    return fold_layer_indices(name)


def with_input_classes(plan: Plan, labels: frozenset[str]) -> Plan:
    """``plan`` with each input's and output's class recorded (``TensorLayout.group``) where ``labels`` (the
    step's ``trace.structure.block_labels``) fold what its name's indices do not."""
    if not labels:
        return plan

    def classed(t: TensorLayout) -> TensorLayout:
        group = fold_block_labels(t.name, labels)
        return dataclasses.replace(t, group=group) if group != fold_layer_indices(t.name) else t

    return dataclasses.replace(plan, inputs=tuple(map(classed, plan.inputs)), outputs=tuple(map(classed, plan.outputs)))


def input_class(t: TensorLayout) -> str:
    """An input's class as the summaries list it: the class the plan recorded (``TensorLayout.group``, from
    the blocks the step's structure found), else its name with layer indices folded."""
    return t.group or fold_layer_indices(t.name)


def layer_index(part: str) -> int | None:
    """The layer index a name's component ends with (``block_3``, ``[3]``, ``['3']``, ``3``), else None."""
    # ``_LAYER_INDEX``'s match that ends the component (a bare number is read after a separator)
    m = next((m for m in _LAYER_INDEX.finditer("." + part) if m.end() == len(part) + 1), None)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


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


def cpu_note(mesh: LogicalMesh, hardware: str) -> str | None:
    """For a plan made for CPU devices (the ``cpu`` preset or a profile measured on CPU: its links are
    ``cpu-*``), the warning its summary carries; else None. Simulated CPU devices share the host's cores
    and memory bandwidth, which no profile models: the shipped CPU profile predicted 647 ms for a step that
    ran in 86 ms on 8 simulated devices, 1.12 s for a 2-stage pipeline that ran in 0.23 s (issue 49)."""
    name = Path(hardware).name.lower() if hardware else ""
    if not (name.startswith("cpu") or any(link.name.startswith("cpu") for link in mesh.links)):
        return None
    return ("CPU devices: these predicted times are not meaningful as wall-clock (simulated devices share the "
            "host's cores, which the CPU profile does not model; several times off either way): compare plans "
            "with them, and plan for the accelerator you will run on (--hardware h100, hardware=\"h100\")")


def rewrite_lines(plan: Plan) -> list[str]:
    """How the step the plan runs differs from the step as written: its recompute, its unrolled layer stack."""
    lines = []
    if plan.recompute:
        lines.append(f"recompute: {remat.summary(plan.recompute)} (their forward ops run again "
                     "in the backward pass; counted in compute)")
    if plan.unrolled:
        lines.append("layer stack: the scan is unrolled into its layers, planned and run so (unroll_scans=False "
                     "keeps it)")
    return lines


def format_plan(plan: Plan, *, max_classes: int = 40) -> str:
    lines = [
        f"mesh {plan.mesh}   hardware {plan.hardware or '?'}",
        *([note] if (note := cpu_note(plan.mesh, plan.hardware)) else []),
        f"predicted step time {human_time(plan.predicted_step_time)}   peak memory per device "
        f"{human_bytes(plan.peak_memory)}"
        + (f" of a {human_bytes(plan.memory_budget)} budget" if plan.memory_budget else " (no budget)"),
    ]
    if plan.mfu is not None:
        lines.append(mfu_line(plan.mfu, plan.model_flops))
    lines += rewrite_lines(plan)
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
        key = (t.role, input_class(t), t.shape)
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
        *([f"time budget: {s.cut_short}"] if s.cut_short else []),
    ]
    return "\n".join(lines)
