"""``Graph.summary()``: a plain-text report a person reads before planning."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from autoshard.trace.roles import Role

if TYPE_CHECKING:
    from autoshard.trace.graph import Graph


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(out)


def format_summary(graph: Graph, top: int = 10) -> str:
    stats = graph.stats()
    total = graph.total_flops or 1.0
    phases = stats["flops_by_phase"]
    parts = [
        f"ops {stats['ops']} (+{stats['nested_ops']} in nested bodies), tensors {stats['tensors']} "
        f"(+{stats['nested_tensors']} nested)",
        f"flops {human_count(graph.total_flops)} ("
        + ", ".join(f"{k} {human_count(v)}" for k, v in sorted(phases.items()))
        + ")",
        f"parameters {human_count(stats['param_count'])}; inputs by role: "
        + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(stats["bytes_by_role"].items())),
        f"peak live bytes (unsharded, schedule order): {human_bytes(stats['peak_live_bytes_unsharded'])}",
        "",
    ]

    count: dict[str, int] = defaultdict(int)
    flops: dict[str, float] = defaultdict(float)
    out_bytes: dict[str, int] = defaultdict(int)
    for _, op in graph.walk():
        count[op.primitive] += 1
        out_bytes[op.primitive] += op.bytes_out
    for op in graph.ops:  # flops at the top level already include nested bodies times trip counts
        flops[op.primitive] += op.flops
    rows = [
        [p, str(count[p]), human_count(flops[p]), f"{100 * flops[p] / total:.1f}%", human_bytes(out_bytes[p])]
        for p in sorted(count, key=lambda p: (-flops[p], -count[p], p))
    ]
    parts.append("ops by primitive")
    parts.append(_table(["primitive", "count", "flops", "share", "bytes out"], rows[:top + 10]))
    if len(rows) > top + 10:
        parts.append(f"... {len(rows) - top - 10} more primitives")

    loops = [op for op in graph.ops if op.bodies]
    if loops:
        parts += ["", "control flow and nested bodies"]
        rows = [
            [f"{op.primitive} (op {op.id})", op.scope or "-", str(op.trip_count or "?"),
             str(sum(len(b.ops) for b in op.bodies)), human_count(op.flops)]
            for op in loops[:top]
        ]
        parts.append(_table(["op", "scope", "trips", "body ops", "flops"], rows))

    params = graph.input_tensors(Role.PARAM)
    if params:
        parts += ["", f"parameters: {len(params)} arrays"]
        biggest = sorted(params, key=lambda t: -t.nbytes)[:top]
        rows = [[t.name, str(list(t.shape)), t.dtype, human_bytes(t.nbytes)] for t in biggest]
        parts.append(_table(["name", "shape", "dtype", "bytes"], rows))

    parts += ["", f"largest tensors (top {top})"]
    biggest = sorted(graph.tensors, key=lambda t: -t.nbytes)[:top]
    rows = []
    for t in biggest:
        where = "input"
        if t.producer is not None:
            op = graph.ops[t.producer]
            where = f"{op.primitive} @ {op.source.split('/')[-1]}" if op.source else op.primitive
        rows.append([t.name, str(list(t.shape)), t.dtype, t.role.value, human_bytes(t.nbytes), where])
    parts.append(_table(["name", "shape", "dtype", "role", "bytes", "made by"], rows))
    return "\n".join(parts)
