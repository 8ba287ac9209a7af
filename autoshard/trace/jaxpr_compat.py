"""Every read of a jaxpr equation's structural params, for each jax release autoshard supports.

The tracer, the problem builder and the emitter look inside control flow (scan, while, cond, remat) and
inline calls (jit, custom_jvp/vjp); the params that say where a body is and how its operands are laid
out change between jax releases. They are read here and nowhere else, so a new release is one module.
(Params of ordinary primitives, such as ``dot_general``'s ``dimension_numbers``, are read by that
primitive's sharding and flop rules; they did not change between 0.10 and 0.11.)

What changed from jax 0.10 to 0.11, and how each accessor reads both:

- ``ClosedJaxpr`` and ``Jaxpr`` are one class in 0.11: ``ClosedJaxpr`` is an alias of ``Jaxpr``, which
  carries its own ``consts`` (``.jaxpr`` returns the jaxpr itself; ``ClosedJaxpr(jaxpr, consts)`` still
  builds one). ``as_closed`` gives a jaxpr whose ``.jaxpr.constvars`` pair with ``.consts`` in both.
- ``scan``: 0.10 has ``num_consts`` and ``num_carry`` (operands are consts, carry, xs; results are
  carry, ys). 0.11 replaces them by ``ft_in``, a ``jax._src.flattree`` tuple ``(consts, carry, xs)`` of
  ``None`` leaves, and ``ft_out``, ``(carry, ys)``. ``scan_layout`` reads either; ``scan_params`` writes
  either when a rebuilt body takes more leading constants. ``jaxpr``, ``length``, ``reverse`` and
  ``unroll`` are unchanged; the ``linear`` flags (one per operand) are gone since 0.10.
- ``cond``: ``branches`` are ``ClosedJaxpr`` in 0.10 and (closed) ``Jaxpr`` in 0.11: the same class
  there. The operand layout (index, then operands) is unchanged.
- ``while``: unchanged (``cond_jaxpr``, ``body_jaxpr``, ``cond_nconsts``, ``body_nconsts``).
- remat: the primitive is ``remat2`` with an open ``jaxpr`` and ``prevent_cse``/``differentiated``/
  ``policy`` in both. jax 0.11 adds ``jax_remat3`` (off by default in 0.11.2): with it on,
  ``jax.checkpoint`` binds ``call_hi_primitive`` whose ``_prim`` (a ``RematTraced``) holds the body;
  autoshard does not read that yet (an unknown primitive: replicated, 0 flops, one warning).
- ``shard_map``: unchanged (``mesh``, ``in_specs``, ``out_specs``, ``jaxpr``, ``newly_manual_axes``);
  under ``grad`` a forward region returns its results before its residuals in 0.11, after them in 0.10.
- ``jit`` (``jaxpr``), ``closed_call`` (``call_jaxpr``), ``custom_jvp_call`` (``call_jaxpr``) and
  ``custom_vjp_call`` (``call_jaxpr``): the same names; 0.11's call jaxprs carry their consts.

Other jax 0.11.2 changes the passes met, outside this module: the reductions' params gain
``out_sharding`` (the rules read ``axes`` only); tanh's derivative binds a new elementwise primitive,
``one_minus_square`` (``costs.ELEMENTWISE``); a scan body lowers inline in the while loop's region instead
of as a private ``@closed_call`` function. In both releases a jitted function called twice shares one
jaxpr (and its variables) between the call sites, which is why the tracer keeps constants per tensor
(``Graph.constants``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from autoshard.errors import TraceError

INLINE_KEYS: Mapping[str, str] = MappingProxyType({
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
})
"""Call primitives whose body the tracer inlines, and the param holding that body."""

REMAT: frozenset[str] = frozenset({"checkpoint", "remat2", "remat"})
"""Names the remat (``jax.checkpoint``) primitive has had; its body is the param ``jaxpr``."""

CONTROL_FLOW: frozenset[str] = frozenset({"scan", "while", "cond"}) | REMAT
"""Primitives whose bodies the planner plans and the emitter rebuilds."""


def _fail(eqn: Any, what: str) -> TraceError:
    name = eqn.primitive.name
    keys = ", ".join(sorted(eqn.params))
    return TraceError(
        f"a {name!r} equation has {what}; its params are [{keys}]. autoshard reads the params of jax 0.10 "
        f"and 0.11 (this is jax {jax.__version__}): install one of those, or teach "
        "autoshard/trace/jaxpr_compat.py this release's layout"
    )


def as_closed(j: Any) -> ClosedJaxpr:
    """``j`` as a jaxpr whose ``.jaxpr.constvars`` pair with ``.consts`` (an open one gets no consts)."""
    if isinstance(j, ClosedJaxpr) and len(j.jaxpr.constvars) == len(j.consts):
        return j
    if isinstance(j, ClosedJaxpr) and not isinstance(j, Jaxpr):  # pragma: no cover - malformed 0.10 jaxpr
        raise TraceError(f"a closed jaxpr has {len(j.jaxpr.constvars)} constvars but {len(j.consts)} consts")
    if j.constvars:
        raise TraceError(
            f"an open jaxpr with {len(j.constvars)} constvars and no values for them was found in an "
            "equation's params; autoshard cannot tell what those constants are (report this with the step)"
        )
    return ClosedJaxpr(j, ())


def inline_body(eqn: Any) -> ClosedJaxpr | None:
    """The body of a call the tracer inlines (``jit``, ``custom_jvp_call``, ...), else None."""
    key = INLINE_KEYS.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    return as_closed(eqn.params[key])


def sub_jaxprs(params: Mapping[str, Any]) -> list[ClosedJaxpr]:
    """Every jaxpr held in ``params`` (for primitives with bodies that autoshard does not rebuild); open
    jaxprs that close over constants without their values are left out."""
    out = []
    for j in jax.extend.core.jaxprs_in_params(params):
        if not (isinstance(j, ClosedJaxpr) and len(j.jaxpr.constvars) == len(j.consts)) and j.constvars:
            continue
        out.append(as_closed(j))
    return out


def bind_params(eqn: Any) -> tuple[list[Any], dict[str, Any]]:
    """``(subfuns, params)`` to bind ``eqn`` again: ``get_bind_params`` returns params only in jax 0.10 and
    0.11 (older releases returned a ``(subfuns, params)`` pair)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        return list(got[0]), got[1]
    return [], dict(got)


# ---- scan ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ScanLayout:
    """How a ``scan``'s operands split: ``num_consts`` constants, ``num_carry`` carried values, then
    ``num_xs`` scanned inputs; its results are the ``num_carry`` final carries, then the stacked ``ys``."""

    num_consts: int
    num_carry: int
    num_xs: int
    length: int
    reverse: bool

    @property
    def stacked_from(self) -> int:
        """Index of the first operand that is sliced along its leading axis (the first ``xs``)."""
        return self.num_consts + self.num_carry


def scan_layout(eqn: Any) -> ScanLayout:
    p = eqn.params
    n_in = len(eqn.invars)
    if "num_consts" in p and "num_carry" in p:  # jax 0.10
        nc, ncarry = int(p["num_consts"]), int(p["num_carry"])
    elif "ft_in" in p:  # jax 0.11: a flat tree (consts, carry, xs) of None leaves
        try:
            consts, carry, xs = p["ft_in"].unpack()
        except (AttributeError, TypeError, ValueError):
            raise _fail(eqn, "an 'ft_in' that is not a (consts, carry, xs) tuple") from None
        nc, ncarry = len(consts), len(carry)
        if nc + ncarry + len(xs) != n_in:
            raise _fail(eqn, f"{n_in} operands but an 'ft_in' of {nc}+{ncarry}+{len(xs)}")
    else:
        raise _fail(eqn, "neither 'num_consts'/'num_carry' (jax 0.10) nor 'ft_in' (jax 0.11)")
    if nc + ncarry > n_in or "length" not in p or "jaxpr" not in p:
        raise _fail(eqn, f"{n_in} operands, {nc} constants and {ncarry} carries")
    return ScanLayout(nc, ncarry, n_in - nc - ncarry, int(p["length"]), bool(p.get("reverse", False)))


def scan_body(eqn: Any) -> ClosedJaxpr:
    return as_closed(eqn.params["jaxpr"])


def scan_params(eqn: Any, body: Jaxpr, extra_consts: int) -> dict[str, Any]:
    """Params to bind ``eqn`` again with ``body`` (an open jaxpr without constvars), which takes
    ``extra_consts`` more leading constants than the traced body."""
    p = dict(eqn.params)
    p["jaxpr"] = ClosedJaxpr(body, ())
    if extra_consts == 0:
        return p
    if "num_consts" in p:  # jax 0.10
        p["num_consts"] = int(p["num_consts"]) + extra_consts
        if "linear" in p:  # jax < 0.10 kept one linearity flag per operand
            p["linear"] = (False,) * extra_consts + tuple(p["linear"])
        return p
    layout = scan_layout(eqn)
    from jax._src import flattree as ft  # jax 0.11; private, so imported only where 0.11 needs it

    _, carry, xs = p["ft_in"].unpack()
    p["ft_in"] = ft.pack((ft.nones(layout.num_consts + extra_consts), carry, xs))
    return p


# ---- while -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WhileLayout:
    """A ``while``'s operands: ``cond_nconsts`` constants of the condition, ``body_nconsts`` of the body,
    then the carry (the results are the final carry)."""

    cond_nconsts: int
    body_nconsts: int

    @property
    def carry_from(self) -> int:
        return self.cond_nconsts + self.body_nconsts


def while_layout(eqn: Any) -> WhileLayout:
    p = eqn.params
    if "cond_nconsts" not in p or "body_nconsts" not in p:
        raise _fail(eqn, "no 'cond_nconsts'/'body_nconsts'")
    return WhileLayout(int(p["cond_nconsts"]), int(p["body_nconsts"]))


def while_bodies(eqn: Any) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """``(cond, body)``."""
    return as_closed(eqn.params["cond_jaxpr"]), as_closed(eqn.params["body_jaxpr"])


def while_params(eqn: Any, cond: Jaxpr, body: Jaxpr, extra_cond: int, extra_body: int) -> dict[str, Any]:
    """Params to bind ``eqn`` again with rebuilt open jaxprs taking more leading constants."""
    layout = while_layout(eqn)
    p = dict(eqn.params)
    p.update(cond_jaxpr=ClosedJaxpr(cond, ()), body_jaxpr=ClosedJaxpr(body, ()),
             cond_nconsts=layout.cond_nconsts + extra_cond, body_nconsts=layout.body_nconsts + extra_body)
    return p


def while_trip_count(eqn: Any) -> int | None:
    """Trip count of a ``while`` that counts a carry from a literal start to a literal bound by +1."""
    layout = while_layout(eqn)
    nc, nb = layout.cond_nconsts, layout.body_nconsts
    cond_closed, body_closed = while_bodies(eqn)
    cond, body = cond_closed.jaxpr, body_closed.jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    a, bound = cond.eqns[0].invars
    if not isinstance(bound, Literal) or a not in cond.invars[nc:]:
        return None
    k = cond.invars[nc:].index(a)
    start = eqn.invars[nc + nb + k]
    if not isinstance(start, Literal):
        return None
    out = body.outvars[k]
    for e in body.eqns:
        if e.outvars and e.outvars[0] is out and e.primitive.name == "add":
            x, one = e.invars
            if x is body.invars[nb + k] and isinstance(one, Literal) and one.val == 1:
                return max(int(bound.val) - int(start.val), 0)
    return None


# ---- cond and remat --------------------------------------------------------------------------------------


def cond_branches(eqn: Any) -> tuple[ClosedJaxpr, ...]:
    """The branches; each takes the operands after the branch index (``eqn.invars[1:]``)."""
    if "branches" not in eqn.params:
        raise _fail(eqn, "no 'branches'")
    return tuple(as_closed(b) for b in eqn.params["branches"])


def cond_params(eqn: Any, branches: Sequence[ClosedJaxpr]) -> dict[str, Any]:
    p = dict(eqn.params)
    p["branches"] = tuple(branches)
    return p


def remat_body(eqn: Any) -> ClosedJaxpr:
    if "jaxpr" not in eqn.params:
        raise _fail(eqn, "no 'jaxpr'")
    return as_closed(eqn.params["jaxpr"])


def remat_params(eqn: Any, body: Jaxpr) -> dict[str, Any]:
    """Params to bind a remat ``eqn`` again with ``body``, an open jaxpr (the param stays open)."""
    p = dict(eqn.params)
    p["jaxpr"] = body
    return p


# ---- shard_map ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RegionLayout:
    """A ``shard_map`` equation's fixed layouts: the mesh it was written for (``names`` and ``sizes``), and
    per operand and per result the mesh axes of each dimension (a spec shorter than the array leaves its
    last dimensions whole)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    in_dims: tuple[tuple[tuple[str, ...], ...], ...]
    out_dims: tuple[tuple[tuple[str, ...], ...], ...]


def spec_dims(spec: Any, rank: int) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each of ``rank`` dimensions in a ``PartitionSpec`` (missing entries: none)."""
    entries = list(spec) if spec is not None else []
    dims = []
    for k in range(rank):
        e = entries[k] if k < len(entries) else None
        if isinstance(e, str):
            dims.append((e,))
        elif isinstance(e, tuple | list):
            dims.append(tuple(str(a) for a in e))
        else:  # None, or PartitionSpec.UNCONSTRAINED (no axes fixed)
            dims.append(())
    return tuple(dims)


def region_layout(eqn: Any) -> RegionLayout:
    """The layouts of a ``shard_map`` equation (its params ``mesh``, ``in_specs``, ``out_specs``)."""
    p = eqn.params
    if "mesh" not in p or "in_specs" not in p or "out_specs" not in p:
        raise _fail(eqn, "no 'mesh', 'in_specs' or 'out_specs'")
    mesh = p["mesh"]
    names = tuple(str(a) for a in mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    ins = tuple(spec_dims(s, len(getattr(v.aval, "shape", ()))) for s, v in zip(p["in_specs"], eqn.invars,
                                                                                  strict=True))
    outs = tuple(spec_dims(s, len(getattr(v.aval, "shape", ()))) for s, v in zip(p["out_specs"], eqn.outvars,
                                                                                   strict=True))
    return RegionLayout(names, sizes, ins, outs)


def region_on_mesh(params: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """A ``shard_map``'s bind params moved onto ``mesh`` (a ``jax.sharding.Mesh`` with the region's axis
    names, possibly more): the region runs on the devices the rest of the program runs on. A region
    written over an ``AbstractMesh`` gets ``mesh``'s abstract mesh."""
    p = dict(params)
    if isinstance(p.get("mesh"), jax.sharding.AbstractMesh):
        p["mesh"] = mesh.abstract_mesh
    elif "mesh" in p:
        p["mesh"] = mesh
    return p


# ---- re-binding equations -----------------------------------------------------------------------------

try:  # name stacks and tracebacks of re-bound equations (readable HLO metadata); optional
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover
    _siu = None


_PHASE_TRANSFORM = {"forward": "jvp", "backward": "transpose"}


def phase_scope(phase: str | None, scope: str, traceback: Any = None) -> contextlib.AbstractContextManager:
    """Bind under the name stack ``<transform>(<scope>)`` that the tracer reads back as ``scope`` in
    ``phase`` (``jvp`` for forward, ``transpose`` for backward, nothing for other); a no-op where JAX's
    name stacks are not reachable."""
    if _siu is None:
        return contextlib.nullcontext()
    return _siu.user_context(traceback, name_stack=_stack_in(_siu.current_name_stack(), phase, scope))


def _stack_in(name_stack: Any, phase: str | None, scope: str) -> Any:
    """``name_stack`` extended by ``<transform>(<scope>)``: what the tracer reads back as ``scope`` in ``phase``."""
    transform = _PHASE_TRANSFORM.get(phase or "")
    if transform is not None:
        name_stack = name_stack.transform(transform)
    for part in scope.split("/"):
        if part:
            name_stack = name_stack.extend(part)
    return name_stack


def eqn_context(eqn: Any, phase: str | None = None, scope: str | None = None) -> contextlib.AbstractContextManager:
    """Bind ``eqn``'s primitive again under its name stack, traceback and context manager (what the
    emitter and ``trace.remat`` do), so the new jaxpr keeps the scopes and source lines tracing found.

    ``phase`` and ``scope``: what the tracer gave the op (``Op.phase``, ``Op.scope``). An op inside a
    ``pjit`` inherits both from the call's name stack, which re-binding the flat op loses; given them, the
    op is bound under the name stack ``<transform>(<scope>)`` that the tracer reads back as the same scope
    and phase (``jvp`` for forward, ``transpose`` for backward; other transform wrappers are dropped)."""
    stack = contextlib.ExitStack()
    if scope is not None:
        stack.enter_context(phase_scope(phase, scope, eqn.source_info.traceback))
    elif _siu is not None:
        name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
        stack.enter_context(_siu.user_context(eqn.source_info.traceback, name_stack=name_stack))
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and getattr(ctx, "manager", None) is not None:
        stack.enter_context(ctx.manager)
    return stack


def eqn_in(eqn: Any, phase: str | None, scope: str) -> Any:
    """``eqn`` with the name stack ``<transform>(<scope>)`` the tracer reads back as ``scope`` in ``phase``
    (``phase_scope``'s stack, written into the equation instead of bound under): ``trace.remat`` copies a
    forward equation into the backward pass, and the emitter binds the copy under that stack. ``eqn``
    itself where name stacks are not reachable."""
    if _siu is None:
        return eqn
    name_stack = _stack_in(_siu.new_name_stack(), phase, scope)
    return eqn.replace(source_info=eqn.source_info.replace(name_stack=name_stack))


def barrier_eqn(avals: Sequence[Any], phase: str | None, scope: str) -> Any:
    """One ``optimization_barrier`` equation over values of ``avals``, under ``scope`` in ``phase``."""
    closed = jax.make_jaxpr(lambda *xs: jax.lax.optimization_barrier(xs))(*avals)
    (eqn,) = closed.jaxpr.eqns
    return eqn_in(eqn, phase, scope)


def anchor_eqn(aval: Any, phase: str | None, scope: str) -> Any:
    """One ``reduce_max`` equation of a value of ``aval`` to a scalar, under ``scope`` in ``phase``: the
    anchor ``trace.remat`` ties a block's replays to (``anchor``)."""
    closed = jax.make_jaxpr(anchor)(aval)
    (eqn,) = closed.jaxpr.eqns
    return eqn_in(eqn, phase, scope)


def anchor(x: Any) -> Any:
    """``x`` reduced to a scalar (its largest element): a value that exists only once ``x`` does and that
    every layout of ``x`` makes with a scalar all-reduce, so a barrier holding it beside any value asks
    nothing of that value's layout."""
    return jax.lax.reduce_max(x, tuple(range(len(x.shape))))
