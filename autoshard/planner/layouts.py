"""Hand-written layouts: a layout for every input of a step (parameters, optimizer state, batch, other
state), by input name (``HandLayout``). ``compare.price_layout`` prices one with the planner's own cost
model (its best completion).

Ways to write a layout:

- ``from_rules(graph, mesh, [(pattern, spec), ...])``: ``fnmatch`` patterns over input names
  (``"*.mlp.fc.kernel"``; ``*`` also matches dots), first match wins; a spec is a ``ShardingSpec``, its
  printed form ``"R·S(y)"``, or a PartitionSpec-like tuple ``(None, "y")`` / ``jax.sharding.PartitionSpec``
  (shorter than the rank: the rest unsplit). Unmatched inputs are replicated.
- ``from_logical_axes(graph, mesh, annotations, rules)``: MaxText's logical-axis rules. ``annotations``
  give each input's dimensions logical names by pattern (``("*.qkv.kernel", ("embed", "heads"))``);
  ``rules`` map a logical name to mesh axes (``("heads", "y")``, ``("batch", ("x", "y"))``); a dimension
  takes the first rule for its name whose axes are unused in the tensor and divide it, else stays whole.
- The ready-made textbook layouts, for graphs of examples/gpt.py- and examples/mlp.py-like models:
  ``data_parallel``; ``zero`` (stages 1-3); ``megatron`` (tensor parallel by name rules, optionally with
  data parallel and ZeRO over other axes); ``grid`` (on a 2-D mesh, each axis data or tensor parallel,
  with the ZeRO variants). How each is built is in its docstring.

ZeRO-2 pins the same inputs as ZeRO-1: gradients are not inputs of the step, and the best completion
already reduce-scatters them into the sharded optimizer update whenever that is cheaper, which is
ZeRO-2's communication and gradient memory. The two are therefore priced the same; ``grid`` lists stage
1 and stage 3. Pipeline degrees are not part of the grid (``autoshard.pipeline.plan_pipeline`` with
``stage_shape`` prices a fixed pipeline shape; pinning its per-stage layouts by hand is not supported).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from autoshard.planner.plan import PlanError
from autoshard.trace.graph import Graph, Role, Tensor
from cost_models import LogicalMesh, ShardingSpec

LeafSpec = ShardingSpec | str | Sequence[str | Sequence[str] | None] | None
Parallel = Literal["column", "row", "vocab", "replicate"]

# Megatron-LM's tensor-parallel pattern by parameter name (first match wins). "column": split the output
# features (a kernel's last dimension) and the bias with them; "row": split the input features (the
# dimension before the last), bias whole; "vocab": an embedding table [vocab, hidden] split by rows.
MEGATRON_RULES: tuple[tuple[str, Parallel], ...] = (
    ("*q_proj*kernel", "column"), ("*k_proj*kernel", "column"), ("*v_proj*kernel", "column"),
    ("*up_proj*kernel", "column"), ("*gate_proj*kernel", "column"), ("*down_proj*kernel", "row"),
    ("*o_proj*kernel", "row"), ("*qkv*kernel", "column"), ("*query*kernel", "column"),
    ("*key*kernel", "column"), ("*value*kernel", "column"), ("*fc*kernel", "column"),
    ("*wi*kernel", "column"), ("*wo*kernel", "row"), ("*proj*kernel", "row"), ("*out*kernel", "row"),
    ("*lm_head*kernel", "column"), ("*wte*embedding", "vocab"), ("*tok*embedding", "vocab"),
    ("*embed_tokens*", "vocab"),
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HandLayout:
    """A layout for every input of a step, by input name."""

    name: str
    specs: Mapping[str, ShardingSpec]
    description: str = ""


# ---- specs ---------------------------------------------------------------------------------------------


def to_spec(x: LeafSpec, shape: Sequence[int], mesh: LogicalMesh | None = None, *, where: str = "") -> ShardingSpec:
    """A ``ShardingSpec`` from any of the accepted forms (see the module docstring), checked against
    ``shape`` and, when given, ``mesh`` (axes exist, split dimensions divide evenly)."""
    ndim = len(shape)
    if x is None:
        spec = ShardingSpec.replicated(ndim)
    elif isinstance(x, ShardingSpec):
        spec = x
    elif isinstance(x, str):
        spec = ShardingSpec.parse(x)
    else:
        entries = list(x)
        if len(entries) > ndim:
            raise PlanError(f"layout {tuple(entries)} for {where or 'a tensor'} {list(shape)} has more entries "
                            "than dimensions")
        dims = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
        spec = ShardingSpec(dims=(*dims, *[()] * (ndim - len(dims))))
    if mesh is not None:
        try:
            spec.validate(shape, mesh, require_divisible=True)
        except ValueError as e:
            raise PlanError(f"layout of {where or 'a tensor'} {list(shape)}: {e}") from None
    return _mesh_order(spec, mesh) if mesh is not None else spec


def _mesh_order(spec: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec:
    """Axes within a dimension in mesh order (major to minor), the order the planner enumerates."""
    rank = {a: i for i, a in enumerate(mesh.axis_names)}
    return spec.with_dims(tuple(sorted(d, key=rank.__getitem__)) for d in spec.dims)


def _match(patterns: Sequence[tuple[str, Any]], name: str) -> Any | None:
    for pattern, value in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return None


def from_rules(graph: Graph, mesh: LogicalMesh, rules: Sequence[tuple[str, LeafSpec]], *,
               name: str = "hand", description: str = "") -> HandLayout:
    """Layouts by name pattern, first match wins; unmatched inputs are replicated."""
    specs = {}
    for t in graph.input_tensors():
        value = _match(rules, t.name)
        specs[t.name] = to_spec(value, t.shape, mesh, where=t.name)
    return HandLayout(name=name, specs=specs, description=description)


def from_logical_axes(graph: Graph, mesh: LogicalMesh,
                      annotations: Sequence[tuple[str, Sequence[str | None]]],
                      rules: Sequence[tuple[str, str | Sequence[str] | None]], *,
                      name: str = "logical", description: str = "") -> HandLayout:
    """MaxText-style logical axes: ``annotations`` name each input's dimensions by pattern, ``rules`` map
    logical names to mesh axes (see the module docstring). Unannotated inputs are replicated."""
    specs = {}
    for t in graph.input_tensors():
        logical = _match(annotations, t.name)
        if logical is None:
            specs[t.name] = ShardingSpec.replicated(len(t.shape))
            continue
        if len(logical) != len(t.shape):
            raise PlanError(f"logical axes {tuple(logical)} for {t.name} {list(t.shape)}: give one name (or "
                            "None) per dimension")
        used: set[str] = set()
        dims: list[tuple[str, ...]] = []
        for size, lname in zip(t.shape, logical, strict=True):
            chosen: tuple[str, ...] = ()
            for rule_name, axes in rules:
                if rule_name != lname or axes is None:
                    continue
                axes = (axes,) if isinstance(axes, str) else tuple(axes)
                if used.isdisjoint(axes) and all(a in mesh.axis_names for a in axes) and \
                        size % math.prod(mesh.axis_size(a) for a in axes) == 0:
                    chosen = axes
                    break
            used.update(chosen)
            dims.append(chosen)
        specs[t.name] = to_spec(ShardingSpec(dims=tuple(dims)), t.shape, mesh, where=t.name)
    return HandLayout(name=name, specs=specs, description=description)


# ---- the textbook layouts ----------------------------------------------------------------------------------


def _axes(mesh: LogicalMesh, axes: str | Sequence[str] | None) -> tuple[str, ...]:
    if axes is None:
        return tuple(a for a, n in zip(mesh.axis_names, mesh.shape, strict=True) if n > 1)
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in axes:
        if a not in mesh.axis_names:
            raise PlanError(f"mesh axis {a!r} is not in the mesh; its axes are {mesh.axis_names}")
    return axes


def _size(mesh: LogicalMesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)


def mirrored_params(graph: Graph) -> dict[str, str]:
    """Optimizer-state leaf name -> the parameter it mirrors (Adam's ``mu.block_0.mlp.fc.kernel`` mirrors
    ``params.block_0.mlp.fc.kernel``): the parameter whose path after ``params.`` ends the leaf's name,
    with the same shape."""
    params = {t.name.partition("params.")[2] or t.name: t for t in graph.input_tensors(Role.PARAM)}
    out = {}
    for t in graph.input_tensors(Role.OPT_STATE):
        for rel, p in params.items():
            if t.shape == p.shape and (t.name.endswith("." + rel) or t.name == rel):
                out[t.name] = p.name
                break
    return out


def _tp_role(name: str, rules: Sequence[tuple[str, Parallel]], fallback: dict[str, Parallel]) -> Parallel:
    role = _match(rules, name)
    return role if role is not None else fallback.get(name, "replicate")


def _alternating(graph: Graph, rules: Sequence[tuple[str, Parallel]]) -> dict[str, Parallel]:
    """Kernels no rule names, in name order, alternate column, row (Megatron's MLP pair)."""
    kernels = [t for t in graph.input_tensors(Role.PARAM)
               if t.name.endswith("kernel") and len(t.shape) >= 2 and _match(rules, t.name) is None]
    return {t.name: ("column" if i % 2 == 0 else "row") for i, t in enumerate(kernels)}


def _tensor_parallel(t: Tensor, role: Parallel, tp: tuple[str, ...], mesh: LogicalMesh) -> ShardingSpec:
    dims: list[tuple[str, ...]] = [()] * len(t.shape)
    n = _size(mesh, tp)
    dim = {"column": len(t.shape) - 1, "row": len(t.shape) - 2, "vocab": 0}.get(role)
    if tp and dim is not None and 0 <= dim < len(t.shape) and t.shape[dim] % n == 0:
        dims[dim] = tp
    return ShardingSpec(dims=tuple(dims))


def _add_shard(spec: ShardingSpec, shape: Sequence[int], axes: tuple[str, ...], mesh: LogicalMesh) -> ShardingSpec:
    """ZeRO: also split over ``axes``, on the dimension with the most elements per device that still divides
    evenly (a tensor no dimension of which divides stays as it is)."""
    if not axes:
        return spec
    n = _size(mesh, axes)
    best = None
    for i, size in enumerate(shape):
        local = size // spec.num_shards(mesh, i)
        if len(spec.dims[i]) + len(axes) > 2 or local % n:
            continue
        if best is None or local > best[1]:
            best = (i, local)
    if best is None:
        return spec
    dims = list(spec.dims)
    dims[best[0]] = (*dims[best[0]], *axes)
    return _mesh_order(ShardingSpec(dims=tuple(dims)), mesh)


def _batch_spec(t: Tensor, dp: tuple[str, ...], mesh: LogicalMesh, notes: list[str]) -> ShardingSpec:
    """The first dimension split over as many of the ``dp`` axes, in order, as divide it."""
    if not t.shape:
        return ShardingSpec(dims=())
    used: list[str] = []
    for a in dp:
        if t.shape[0] % _size(mesh, (*used, a)) == 0:
            used.append(a)
    if len(used) < len(dp):
        left = [a for a in dp if a not in used]
        notes.append(f"{t.name} [{t.shape[0]}, ...] does not divide over {','.join(dp)}: split over "
                     f"{','.join(used) or 'nothing'}, replicated over {','.join(left)}")
    return ShardingSpec(dims=(tuple(used), *[()] * (len(t.shape) - 1)))


def hybrid(graph: Graph, mesh: LogicalMesh, *, dp: str | Sequence[str] = (), tp: str | Sequence[str] = (),
           zero: int = 0, rules: Sequence[tuple[str, Parallel]] = MEGATRON_RULES,
           name: str | None = None) -> HandLayout:
    """Data parallel over ``dp`` × Megatron tensor parallel over ``tp``, with ZeRO stage ``zero`` over ``dp``.

    - batch: the first dimension split over ``dp`` (replicated if it does not divide);
    - parameters: by ``rules`` (``MEGATRON_RULES`` by default) column-parallel (last dimension over ``tp``,
      bias with it), row-parallel (the dimension before the last), vocab-parallel (an embedding's rows);
      kernels no rule names alternate column, row in name order (an MLP's dense_0, dense_1, ...);
      everything else replicated; a dimension that does not divide stays whole;
    - optimizer state: its parameter's layout;
    - ZeRO 1 and 2: optimizer state also split over ``dp`` on its largest evenly dividing dimension;
      ZeRO 3 (FSDP): parameters too (and so their optimizer state, the same way);
    - other state (step counters): replicated.
    """
    dp_axes = () if not dp else _axes(mesh, dp)
    tp_axes = () if not tp else _axes(mesh, tp)
    if set(dp_axes) & set(tp_axes):
        raise PlanError(f"a mesh axis cannot be both data parallel {dp_axes} and tensor parallel {tp_axes}")
    if zero not in (0, 1, 2, 3):
        raise PlanError(f"ZeRO stage {zero}: expected 0 (none), 1, 2 or 3")
    fallback = _alternating(graph, rules) if tp_axes else {}
    params: dict[str, ShardingSpec] = {}
    roles: dict[str, Parallel] = {}
    for t in graph.input_tensors(Role.PARAM):
        roles[t.name] = _tp_role(t.name, rules, fallback) if tp_axes else "replicate"
    for t in graph.input_tensors(Role.PARAM):
        role = roles[t.name]
        if t.name.endswith("bias") and role == "replicate":  # a column-parallel kernel's bias follows it
            kernel = roles.get(t.name[: -len("bias")] + "kernel")
            role = "column" if kernel == "column" else "replicate"
        spec = _tensor_parallel(t, role, tp_axes, mesh)
        params[t.name] = _add_shard(spec, t.shape, dp_axes, mesh) if zero >= 3 else spec
    mirrors = mirrored_params(graph)
    notes: list[str] = []
    specs: dict[str, ShardingSpec] = {}
    for t in graph.input_tensors():
        if t.role is Role.PARAM:
            spec = params[t.name]
        elif t.role is Role.OPT_STATE and t.name in mirrors:
            spec = params[mirrors[t.name]]
            if 1 <= zero < 3:
                spec = _add_shard(spec, t.shape, dp_axes, mesh)
        elif t.role is Role.BATCH:
            spec = _batch_spec(t, dp_axes, mesh, notes)
        else:
            spec = ShardingSpec.replicated(len(t.shape))
        specs[t.name] = _mesh_order(spec, mesh)
    if name is None:
        name = layout_name(dp_axes, tp_axes, zero)
    what = [f"batch over {','.join(dp_axes)}" if dp_axes else "batch replicated"]
    if tp_axes:
        what.append(f"Megatron tensor parallel over {','.join(tp_axes)}")
    if zero:
        what.append(f"ZeRO-{zero} over {','.join(dp_axes)}: "
                    + ("parameters and optimizer state sharded" if zero == 3 else "optimizer state sharded"))
    elif not tp_axes:
        what.append("parameters and optimizer state replicated")
    return HandLayout(name=name, specs=specs, description="; ".join(what + notes))


def layout_name(dp: Sequence[str], tp: Sequence[str], zero: int) -> str:
    parts = []
    if dp:
        parts.append(f"dp({','.join(dp)})")
    if tp:
        parts.append(f"tp({','.join(tp)})")
    name = " x ".join(parts) or "replicated"
    return name + (f" zero{zero}" if zero else "")


def data_parallel(graph: Graph, mesh: LogicalMesh, axes: str | Sequence[str] | None = None) -> HandLayout:
    """Batch split over ``axes`` (default: every mesh axis), parameters and optimizer state replicated."""
    return hybrid(graph, mesh, dp=_axes(mesh, axes))


def zero(graph: Graph, mesh: LogicalMesh, stage: int, axes: str | Sequence[str] | None = None) -> HandLayout:
    """ZeRO stage 1/2 (optimizer state sharded) or 3 (FSDP: parameters too) over ``axes`` (default all)."""
    return hybrid(graph, mesh, dp=_axes(mesh, axes), zero=stage)


def megatron(graph: Graph, mesh: LogicalMesh, tp: str | Sequence[str] | None = None, *,
             dp: str | Sequence[str] = (), zero: int = 0,
             rules: Sequence[tuple[str, Parallel]] = MEGATRON_RULES) -> HandLayout:
    """Megatron tensor parallel over ``tp`` (default: every mesh axis), data parallel over ``dp``."""
    return hybrid(graph, mesh, dp=dp, tp=_axes(mesh, tp), zero=zero, rules=rules)


def grid(graph: Graph, mesh: LogicalMesh, *, rules: Sequence[tuple[str, Parallel]] = MEGATRON_RULES
         ) -> list[HandLayout]:
    """The dp × tp grid: every way to make each mesh axis (of size > 1) data or tensor parallel; with any
    data-parallel axis, also ZeRO-1 and ZeRO-3 over those axes. On a 2-D mesh (x, y): dp(x,y) and its
    two ZeRO variants, dp(x) x tp(y) and dp(y) x tp(x) with theirs, and tp(x,y): 10 layouts."""
    axes = _axes(mesh, None)
    out = []
    for mask in range(2 ** len(axes)):
        dp = tuple(a for i, a in enumerate(axes) if not mask >> i & 1)
        tp = tuple(a for i, a in enumerate(axes) if mask >> i & 1)
        for z in ((0, 1, 3) if dp else (0,)):
            out.append(hybrid(graph, mesh, dp=dp, tp=tp, zero=z, rules=rules))
    return out


def fallbacks(graph: Graph, mesh: LogicalMesh) -> list[HandLayout]:
    """The layouts no automatic plan may lose to, as seeds keep them when time is short: data parallel and
    ZeRO-3 over every axis (named as ``grid`` names them)."""
    if not _axes(mesh, None):
        return []
    return [data_parallel(graph, mesh), zero(graph, mesh, 3)]
