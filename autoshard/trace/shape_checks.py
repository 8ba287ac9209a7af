"""Shape rules ``Graph.verify`` checks per op: outputs against the equation's avals, and primitive-specific
rules for the ops whose shapes the sharding rules rely on most (dot_general, elementwise)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard.errors import GraphError
from autoshard.trace.costs import ELEMENTWISE

if TYPE_CHECKING:
    from autoshard.trace.graph import Graph, Op

_ELEMENTWISE = frozenset(ELEMENTWISE)


def _fail(op: Op, msg: str) -> None:
    raise GraphError(f"{op.where()}: {msg}")


def check_op_shapes(graph: Graph, op: Op) -> None:
    ins = [graph.tensors[i].shape for i in op.inputs]
    outs = [graph.tensors[i].shape for i in op.outputs]
    eqn = op.eqn
    if eqn is not None:
        if len(eqn.outvars) != len(op.outputs):
            _fail(op, f"has {len(op.outputs)} outputs but its equation has {len(eqn.outvars)}")
        for k, (v, shape) in enumerate(zip(eqn.outvars, outs, strict=True)):
            aval_shape = tuple(getattr(v.aval, "shape", ()))
            if aval_shape != shape:
                _fail(op, f"output {k} has shape {shape}, its equation says {aval_shape}")
        if len(eqn.invars) != len(op.inputs):
            _fail(op, f"has {len(op.inputs)} inputs but its equation has {len(eqn.invars)}")
    if op.primitive == "dot_general" and eqn is not None:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        if [lhs[d] for d in lc] != [rhs[d] for d in rc] or [lhs[d] for d in lb] != [rhs[d] for d in rb]:
            _fail(op, f"contracting/batch dimensions disagree between {lhs} and {rhs}")
        free_l = [s for d, s in enumerate(lhs) if d not in lc and d not in lb]
        free_r = [s for d, s in enumerate(rhs) if d not in rc and d not in rb]
        expect = tuple([lhs[d] for d in lb] + free_l + free_r)
        if outs[0] != expect:
            _fail(op, f"output shape {outs[0]} but operands {lhs} x {rhs} give {expect}")
    elif op.primitive in _ELEMENTWISE:
        # jax >= 0.10 binary ops broadcast size-1 dimensions of equal-rank operands implicitly.
        out = outs[0]
        for k, s in enumerate(ins):
            if s != () and (len(s) != len(out) or any(a not in (b, 1) for a, b in zip(s, out, strict=True))):
                _fail(op, f"elementwise input {k} has shape {s}, output has {out}")
    if op.primitive == "scan" and op.bodies:
        body = op.bodies[0]
        if len(body.inputs) != len(op.inputs) or len(body.outputs) != len(op.outputs):
            _fail(op, "scan body arity differs from the op's inputs/outputs")
