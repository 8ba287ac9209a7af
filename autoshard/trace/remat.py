"""Recompute applied to a traced step: a Graph rewritten so that chosen blocks rematerialise their stash.

The traced step is forward and backward already differentiated, so ``jax.checkpoint`` cannot be applied
to it afterwards; this pass does at the jaxpr level what ``jax.checkpoint`` does inside AD. For each block
(a layer tag, ``Op.layer``) given a mode (``trace.recompute.MODES``):

- the *recomputed set* ``R`` is the block's stash (``recompute.stashes``: held values a forward op of the
  block makes and the backward pass reads), less what the mode keeps (``selective``: the weight products'
  outputs, ``recompute.saved_by_selective``) and less any value a backward op reads *before* the block's
  own backward pass begins (the block's output, read by the next block's backward first: it stays, as a
  checkpoint's input would); plus the fused values the backward reads (``trace.buffers``: a cheap
  elementwise output that XLA computes inside its reader's fusion from the producer's operands) whose
  operands, directly or through other fused values, include a value of ``R``: read from the forward pass,
  such a value would keep the original of a recomputed value (the MLP's pre-activation, say) live until
  the block's backward, undoing the saving;
- the *replay* is the block's forward ops that produce ``R`` or the values ``R`` is computed from, back to
  the values that stay (the block's inputs, what the mode keeps, anything made outside the block);
- at the block's first backward op, the replay runs again on the values that stay, each passed through
  a ``jax.lax.optimization_barrier`` of its own together with the block's *anchor* (the incoming
  cotangent reduced to a scalar, ``jaxpr_compat.anchor``), so that XLA neither merges the copy with the
  forward (CSE) nor runs it before the backward needs it; every backward op from there reads the
  replayed values. The forward's copies die after their last forward reader. One barrier per value, and
  a scalar anchor, leave every value its own layout: a barrier of several shapes has one layout per
  candidate (``strategies.elementwise.barrier``), and one barrier holding a block's fp32 weight
  matrices beside its ``[b, s, h]`` activations and cotangent was priced, and emitted, with the weights
  or the cotangent gathered every block and microbatch.

A fourth mode, ``invariant`` (``REMAT_MODES``; pipelines only, ``pipeline.recompute``), replays only the
values of the block's stash that do not depend on the batch (``batch_dependent``) and that
``CHEAP_INVARIANT`` ops make from what stays: its weights cast to bf16, a mask built from an iota.
``selective`` and ``full`` replay those too. A pipeline stage holds a block's stash once per microbatch in
flight, and such a value is the same for every one of them; replayed, it costs a cast.

The result is an ordinary Graph, rewritten in place of a trace (``_Rewrite``: no JAX tracing, one pass
over the ops): each op keeps its equation, a replayed op a copy of its forward equation under the
block's backward name stack (``jaxpr_compat.eqn_in``), the anchor and the barriers equations of their
own (``jaxpr_compat.anchor_eqn``, ``barrier_eqn``), so the emitter binds them like any op. The ops, their order, what each
reads and the values they make are those of the step traced again with the replays bound in place
(``tests/test_remat.py`` checks this against such a trace); constants keep the traced step's tensors (a
replayed op reads the constant its original reads). The step's jaxpr (``Graph.jaxpr``) is kept for its
signature: inputs, outputs and their avals are unchanged. The planner prices the extra forward work and
the shorter live ranges with its own rules (``trace.buffers``: the replayed values live only during the
block's backward), and the emitter emits it like any step: numerics are those of the original step (the
replay computes the same values).
"""

from __future__ import annotations

import collections
import gc
import logging
from collections.abc import Mapping
from typing import Any

import jax
from jax.extend.core import Literal

from autoshard.errors import TraceError
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.buffers import buffers
from autoshard.trace.costs import op_flops
from autoshard.trace.graph import Graph, Op, Tensor, links
from autoshard.trace.recompute import saved_by_selective, stashes
from autoshard.trace.roles import Role
from autoshard.trace.tracer import dtype_info, params_digest

log = logging.getLogger("autoshard")


def blocks(graph: Graph) -> list[str]:
    """The step's recomputable blocks (layer tags with a stash), in forward order."""
    return list(stashes(graph))


# The per-block modes the rewrite takes: ``trace.recompute.MODES`` and ``invariant`` (the module docstring).
REMAT_MODES = ("none", "invariant", "selective", "full")
# Ops cheap enough to run again in the backward pass when their value does not depend on the batch
# (``invariant``): casts, layout changes, constants and the elementwise ops that build masks from them.
CHEAP_INVARIANT = frozenset({
    "convert_element_type", "broadcast_in_dim", "iota", "reshape", "transpose", "squeeze", "expand_dims",
    "slice", "concatenate", "copy", "copy_p", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not",
    "select_n", "add", "sub", "mul", "neg"})


def batch_dependent(graph: Graph) -> list[bool]:
    """Per tensor: whether its value depends on a batch input (``Role.BATCH``) through the dataflow."""
    dep = [False] * len(graph.tensors)
    for t in graph.inputs:
        dep[t] = graph.tensors[t].role == Role.BATCH
    for op in graph.ops:
        if any(dep[i] for i in op.inputs):
            for o in op.outputs:
                dep[o] = True
    return dep


def _plan(graph: Graph, modes: Mapping[str, str]) -> dict[int, tuple[list[int], set[int]]]:
    """First backward op of each recomputed block -> (replay op ids in order, recomputed tensor ids)."""
    buf = buffers(graph)
    stash = stashes(graph, buf)
    read_back = _read_by_backward(graph)
    first_bwd: dict[str, int] = {}
    for op in graph.ops:
        if op.phase == "backward" and op.layer and op.layer not in first_bwd:
            first_bwd[op.layer] = op.id
    outputs = set(graph.outputs)
    dep = batch_dependent(graph) if any(m != "none" for m in modes.values()) else []
    out: dict[int, tuple[list[int], set[int]]] = {}
    for layer, mode in modes.items():
        if mode not in REMAT_MODES:
            raise TraceError(f"recompute mode {mode!r} for block {layer!r}: expected one of "
                             f"{', '.join(REMAT_MODES)}")
        if mode == "none" or layer not in stash or layer not in first_bwd:
            continue
        again = first_bwd[layer]

        def kept(tid: int, layer: str = layer, mode: str = mode) -> bool:
            t = graph.tensors[tid]
            if t.producer is None:
                return True
            op = graph.ops[t.producer]
            if op.layer != layer or op.phase != "forward":
                return True
            if not dep[tid] and op.primitive in CHEAP_INVARIANT:
                return False
            return mode == "invariant" or (mode == "selective" and saved_by_selective(op))

        def late(tid: int, again: int = again) -> bool:
            return (tid not in outputs
                    and not any(graph.ops[c].phase == "backward" and c < again for c in graph.tensors[tid].consumers))

        recomputed = {tid for tid in stash[layer] if not kept(tid) and late(tid)}
        drags: dict[int, bool] = {}

        def dragging(tid: int, drags: dict[int, bool] = drags, recomputed: set[int] = recomputed) -> bool:
            """Whether fused value ``tid``, read in the backward, would keep a recomputed value alive (its
            operands, through other fused values, include one)."""
            if tid not in drags:
                drags[tid] = False  # (a cycle cannot occur; this only stops a revisit)
                op = graph.ops[graph.tensors[tid].producer]  # type: ignore[index]
                drags[tid] = any(i in recomputed or (not buf.held[i] and not kept(i) and dragging(i))
                                 for i in op.inputs)
            return drags[tid]

        recomputed |= {tid for tid in read_back.get(layer, ())
                       if not buf.held[tid] and not kept(tid) and late(tid) and dragging(tid)}
        if not recomputed:
            continue
        replay: set[int] = set()
        todo = [graph.tensors[t].producer for t in recomputed]
        while todo:
            o = todo.pop()
            if o is None or o in replay:
                continue
            replay.add(o)
            todo += [graph.tensors[i].producer for i in graph.ops[o].inputs if not kept(i)]
        produced = {t for o in replay for t in graph.ops[o].outputs}
        out[again] = (sorted(replay), produced)
    return out


def _read_by_backward(graph: Graph) -> dict[str, set[int]]:
    """Block tag -> the values its forward ops make that a backward op reads, held or fused."""
    out: dict[str, set[int]] = {}
    for op in graph.ops:
        if op.phase != "backward":
            continue
        for tid in op.inputs:
            p = graph.tensors[tid].producer
            if p is not None and graph.ops[p].phase == "forward" and graph.ops[p].layer:
                out.setdefault(graph.ops[p].layer, set()).add(tid)
    return out


def rematerialize(graph: Graph, modes: Mapping[str, str], *, level: int = logging.INFO) -> Graph:
    """``graph`` with each block of ``modes`` (block tag -> ``none``/``invariant``/``selective``/``full``)
    recomputed in its backward pass (see the module docstring). Blocks not named, and ``none``, are left as
    traced. ``level``: of the log line saying what was rewritten (a search's trial rewrites: DEBUG)."""
    plan = _plan(graph, modes)
    if not plan:
        return graph
    gc.freeze()  # the step's objects (millions on a large model) out of the full collections the rewrite's
    try:  # allocations set off: they walked them all, doubling its time (``planner.planning._gc_frozen``)
        out = _Rewrite(graph).run(plan)
    finally:
        gc.unfreeze()
    log.log(level, "recompute: %s replay %d ops in their backward pass", summary(modes),
            sum(len(r) for r, _ in plan.values()))
    return out


class _Rewrite:
    """The rewritten step, built op by op in the order a trace of it would make its ops and tensors (see
    the module docstring): ids are positions, tensors numbered as they are made (the constants and inputs
    first, then each op's literal operands and results), so the step's own ops and values keep their
    order and the replays' are numbered where they run."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.tensors: list[dict[str, Any]] = []  # the new tensors' fields, consumers and live range aside
        self.ops: list[dict[str, Any]] = []
        self.constants: dict[int, Any] = {}
        self.new: dict[int, int] = {}  # tensor of ``graph`` -> its id in the rewritten step
        self.again: dict[int, int] = {}  # tensor of ``graph`` -> its replayed copy, read by backward ops
        self._made = 0  # tensors of ``graph`` below this id are numbered (``_catch_up``)

    # ---- tensors -------------------------------------------------------------------------------------

    def _tensor(self, t: Tensor, producer: int | None, *, copy: bool) -> int:
        """A new tensor shaped like ``t``: ``t`` itself (``copy=False``), or a copy of it (a replayed value,
        a barrier's result, or a literal a replayed op reads again)."""
        tid = len(self.tensors)
        role, name = t.role, t.name
        if producer is not None and (copy or name == f"t{t.id}"):
            name = f"t{tid}"  # the tracer's name for an unnamed value
        if copy and producer is not None:
            role = Role.ACTIVATION
        self.tensors.append(dict(id=tid, name=name, shape=t.shape, dtype=t.dtype, nbytes=t.nbytes, role=role,
                                 producer=producer))
        if producer is None and t.id in self.graph.constants:
            self.constants[tid] = self.graph.constants[t.id]
        return tid

    def _catch_up(self, upto: int) -> None:
        """Number the step's constants, inputs and literals made before its tensor ``upto``."""
        while self._made < upto:
            t = self.graph.tensors[self._made]
            if t.producer is None:
                self.new[t.id] = self._tensor(t, None, copy=False)
            self._made += 1

    def _aval(self, tid: int) -> Any:
        """The abstract value of tensor ``tid`` of the step (weak type included), as its equation has it."""
        g, t = self.graph, self.graph.tensors[tid]
        if t.producer is not None:
            op = g.ops[t.producer]
            return op.eqn.outvars[op.outputs.index(tid)].aval
        if tid in g.inputs:
            return g.jaxpr.jaxpr.invars[g.inputs.index(tid)].aval
        return jax.typeof(g.constants[tid])

    def _read(self, tid: int) -> int:
        if tid not in self.new:  # a literal of an op without results: numbered when first read
            self.new[tid] = self._tensor(self.graph.tensors[tid], None, copy=False)
        return self.new[tid]

    # ---- ops -----------------------------------------------------------------------------------------

    def _op(self, op: Op, inputs: list[int], outputs: list[Tensor], *, copy: bool, phase: str | None = None,
            eqn: Any = None, scope: str | None = None) -> list[int]:
        """Append ``op`` (or, with ``copy``, a replay of it) reading ``inputs``; returns its results' ids."""
        oid = len(self.ops)
        outs = [self._tensor(t, oid, copy=copy) for t in outputs]
        if not copy:
            for t, n in zip(outputs, outs, strict=True):
                self.new[t.id] = n
        nbytes = [self.tensors[i]["nbytes"] for i in inputs]
        self.ops.append(dict(
            id=oid, primitive=op.primitive, inputs=tuple(inputs), outputs=tuple(outs), flops=op.flops,
            bytes_in=sum(nbytes), bytes_out=sum(self.tensors[i]["nbytes"] for i in outs), source=op.source,
            scope=op.scope if scope is None else scope, layer=op.layer, phase=phase or op.phase,
            params=op.params, bodies=op.bodies, trip_count=op.trip_count, eqn=op.eqn if eqn is None else eqn))
        return outs

    def _template(self, tid: int) -> Tensor:
        """A template for a copy of the rewritten step's tensor ``tid`` (``_tensor`` reads its fields)."""
        t = self.tensors[tid]
        return Tensor(id=-1, name="", shape=t["shape"], dtype=t["dtype"], nbytes=t["nbytes"], role=t["role"],
                      producer=t["producer"], consumers=(), live=(0, 0))

    def _anchor(self, op: Op, tid: int, original: int) -> tuple[int, Any]:
        """The value the barriers before ``op`` hold beside what they pass: the incoming cotangent ``tid``
        (the rewritten step's id of ``original``) reduced to a scalar (``jaxpr_compat.anchor``) in ``op``'s
        scope; the cotangent itself where it is a scalar already or not a number. Returns its id and
        abstract value. A scalar asks nothing of a layout: a barrier holding the ``[b, s, h]`` cotangent
        beside ``[h, 4h]`` weights replicated whichever was not of the largest operand's rank
        (``strategies.elementwise.barrier``), so GPT-1T's cotangent or weights were gathered every block
        and microbatch."""
        aval = self._aval(original)
        if not aval.shape or not jax.numpy.issubdtype(aval.dtype, jax.numpy.number):
            return tid, aval
        eqn = jc.anchor_eqn(aval, "backward", op.scope)
        (out,) = eqn.outvars
        shape = tuple(aval.shape)
        red = Op(id=-1, primitive="reduce_max", inputs=(), outputs=(), source=op.source, scope=op.scope,
                 flops=op_flops("reduce_max", [shape], [()], eqn.params) or 0.0, bytes_in=0, bytes_out=0,
                 layer=op.layer, phase="backward", params=params_digest(eqn.params), eqn=eqn)
        _, dtype, nbytes = dtype_info(out.aval)
        scalar = Tensor(id=-1, name="", shape=(), dtype=dtype, nbytes=nbytes, role=Role.ACTIVATION, producer=None,
                        consumers=(), live=(0, 0))
        (made,) = self._op(red, [tid], [scalar], copy=True)
        return made, out.aval

    def _replay(self, op: Op, replay: list[int], produced: set[int]) -> None:
        """Before ``op`` (its block's first backward op): the barriers and the block's replayed forward ops.
        Each value the replay reads from outside it passes through a barrier of its own beside the anchor
        (``_anchor``), so that each keeps its own layout."""
        g = self.graph
        anchor = _incoming(g, op)
        stay = sorted({t for o in replay for t, a in zip(g.ops[o].inputs, g.ops[o].eqn.invars, strict=True)
                       if t not in produced and not isinstance(a, Literal)})
        local: dict[int, int] = {}
        if stay:
            scope = op.layer or op.scope
            tie = None if anchor is None else self._anchor(op, self.again.get(anchor, self.new[anchor]), anchor)
            for t in stay:
                tied = [self.new[t], *([tie[0]] if tie else [])]
                eqn = jc.barrier_eqn([self._aval(t), *([tie[1]] if tie else [])], "backward", scope)
                barrier = Op(id=-1, primitive="optimization_barrier", inputs=(), outputs=(), flops=0.0,
                             bytes_in=0, bytes_out=0, source=op.source, scope=scope, layer=op.layer,
                             phase="backward", params=params_digest(eqn.params), eqn=eqn)
                outs = self._op(barrier, tied, [self._template(i) for i in tied], copy=True)
                local[t] = outs[0]
        for o in replay:
            rop = g.ops[o]
            ins = [self._tensor(g.tensors[t], None, copy=True) if isinstance(a, Literal)
                   else local[t] if t in local else self.again[t] if t in self.again else self._read(t)
                   for t, a in zip(rop.inputs, rop.eqn.invars, strict=True)]
            outs = self._op(rop, ins, [g.tensors[t] for t in rop.outputs], copy=True, phase="backward",
                            eqn=jc.eqn_in(rop.eqn, "backward", rop.scope))
            self.again.update(zip(rop.outputs, outs, strict=True))

    def run(self, plan: Mapping[int, tuple[list[int], set[int]]]) -> Graph:
        g = self.graph
        for op in g.ops:
            if op.id in plan:
                self._replay(op, *plan[op.id])
            if op.outputs:
                self._catch_up(op.outputs[0])
            backward = op.phase == "backward"
            ins = [self.again[t] if backward and t in self.again else self._read(t) for t in op.inputs]
            self._op(op, ins, [g.tensors[t] for t in op.outputs], copy=False)
            if op.outputs:
                self._made = op.outputs[-1] + 1
        self._catch_up(len(g.tensors))
        return _finish(g, self.ops, self.tensors, [self.new[t] for t in g.inputs],
                       [self._read(t) for t in g.outputs], self.constants)


def _incoming(g: Graph, op: Op) -> int | None:
    """The anchor's value for the replay before ``op``, its block's first backward op: the first value the
    block's backward ops read (``op``'s first) that a backward op made before ``op``, i.e. the cotangent
    arriving from the blocks after it. A block's backward may begin with ops that read no such value (an
    unrolled ``nn.scan`` stack's rebuilds its causal mask from an iota first)."""
    for o in g.ops[op.id:]:
        if o.phase == "forward":
            break  # past the backward pass (a second differentiation's forward): no value found in it
        if o.layer != op.layer or o.phase != "backward":
            continue
        for t, a in zip(o.inputs, o.eqn.invars, strict=True):
            p = g.tensors[t].producer
            if not isinstance(a, Literal) and p is not None and p < op.id and g.ops[p].phase == "backward":
                return t
    return None


def _finish(graph: Graph, ops: list[dict[str, Any]], tensors: list[dict[str, Any]], inputs: list[int],
            outputs: list[int], constants: dict[int, Any]) -> Graph:
    """The Graph of ``ops`` and ``tensors`` (consumers and live ranges as ``tracer`` gives them), with
    ``graph``'s signature: its names, aliases, pytrees and jaxpr (whose inputs and outputs it keeps)."""
    consumers, live = links([op["inputs"] for op in ops], [t["producer"] for t in tensors], outputs)
    made = [Tensor(**t, consumers=c, live=span) for t, c, span in zip(tensors, consumers, live, strict=True)]
    return Graph(ops=tuple(Op(**op) for op in ops), tensors=tuple(made), inputs=tuple(inputs),
                 outputs=tuple(outputs), output_names=graph.output_names, output_aliases=graph.output_aliases,
                 jaxpr=graph.jaxpr, in_tree=graph.in_tree, out_tree=graph.out_tree, constants=constants)


def uniform(graph: Graph, mode: str, first: int | None = None) -> dict[str, str]:
    """``mode`` for every block (or the ``first`` ones in forward order), ``none`` for the rest."""
    names = blocks(graph)
    k = len(names) if first is None else first
    return {b: (mode if i < k else "none") for i, b in enumerate(names)}


def summary(modes: Mapping[str, str]) -> str:
    """How reports name a recompute setting per block: ``full on 12 blocks, selective on 36`` (full first,
    then selective, then invariant; blocks as traced left out; ``none`` when no block recomputes)."""
    counts = collections.Counter(m for m in modes.values() if m != "none")
    named = [m for m in reversed(REMAT_MODES) if counts[m]]
    if not named:
        return "none"
    first, *rest = named
    return ", ".join([f"{first} on {counts[first]} block{'' if counts[first] == 1 else 's'}",
                      *(f"{m} on {counts[m]}" for m in rest)])
