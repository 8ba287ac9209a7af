"""Which tensors of a Graph hold a device buffer, and when: XLA's GPU buffer assignment, on the jaxpr.

The jaxpr names every intermediate value, but XLA's GPU compiler keeps few of them in memory. Charging
every jaxpr value from its producer to its last reader over-counted the step's peak by 1.5-2.2x on the
H100 measurements of ``tests/data/h100_fidelity.json`` (GPT-125M bf16 batch 16: 44.7 GB predicted,
22.6 GB compiled). The rules below follow what XLA does; the evidence for each is named.

Rules
-----
0. **Dead code holds nothing and costs nothing.** XLA removes an instruction whose result nothing reads
   (``HloDCE``, run before and after fusion), and with it any instruction read only by removed ones. A
   differentiated step has such values: the linearisation of ``jnp.where`` saves a zeros tangent
   ``broadcast_in_dim 0.0`` of the operand's shape that the transpose never reads (in GPT's attention a
   float32 [B, heads, S, S]: at seq 16384, batch 8 on 8 devices, 34 GB per device and 12 ms a layer, 10.7%
   of the predicted step, before this rule). ``dead_ops`` finds them; they hold no buffer here and the
   strategies price them at zero (``strategies.registry.price``).
1. **Fusion: a value that never leaves a fusion holds no buffer.** XLA's GPU compiler
   (``PriorityFusion``, the default fusion pass since 2024) fuses a producer into *all* its consumers
   (duplicating it) when every consumer can take it (``CanFuseWithAllNonBitcastUsers``) and its
   performance model says the fused kernels run faster. For an elementwise or layout producer (add, mul,
   exp, tanh, convert, broadcast, reshape, transpose, slice, select, ...) read by elementwise ops or
   reductions that is the rule, not the exception: recomputing a few flops per element is cheaper than
   writing the value and reading it back. Such a value is *virtual* (``held`` False). A value read by a
   matmul, a convolution, a scatter, a gather, control flow, or returned by the step is materialised.
2. **A virtual value keeps its operands alive instead.** The consumers of a fused value read the
   producer's operands directly, so each operand's buffer lives until the virtual value's last reader
   (recursively through chains of virtual values). This is what makes the backward pass of a bf16
   model keep the bf16 matmul output rather than its float32 upcast, and the [S, S] causal mask
   rather than its [B, heads, S, S] broadcast.
3. **Buffers die at their last reader.** The backward pass frees each saved activation once the last
   backward op reading it has run (XLA's buffer assignment reuses the space of a value whose live range
   ended; the schedule is the jaxpr's, forward then backward).
4. **In place.** A scatter or dynamic-update-slice writes into its operand's buffer when the operand
   has no later reader (XLA's in-place ``HloDataflowAnalysis::GetInPlaceInputOutputPairs``): the zeros a
   gather's transpose scatters into and the result are one buffer. **Donation**: a train-state input
   lives until its last reader and the new state, written in place of the old (the compiled step
   reports them as aliased, ``xla_alias_bytes``), from its producer: the two are never both charged
   for the whole step. **Elementwise results in place**: an elementwise op's result (a loop fusion rooted
   at it) takes the buffer of a held operand of its shape and size that dies there
   (``HloDataflowAnalysis::CanShareOperandBufferWithUser``). GPT-350M fp32 batch 8 with every block fully
   recomputed peaks in the loss's backward, where the sum of the cross-entropy's two logit gradients is
   written over one of them: charged as a third [8, 1024, 51200] buffer the step was 10.4 GB against the
   compiled 8.8 GB; with the rule 8.7 GB (GPT-125M fp32: 1.09 -> 1.01 of XLA's peak, MoE-380M 1.04 -> 1.00).
5. **Bodies live only while they run.** A ``scan``/``while``/``cond``/``remat`` body's values exist
   only during its op; see ``Clock`` (one iteration of a loop body, since XLA's while loop reuses its
   buffers across iterations, and a remat body's recomputed activations only during the backward op
   that recomputes them).
6. **The optimizer update runs as each gradient is ready.** XLA schedules the step with the schedule
   that needs the least memory of several it tries (``DefaultMemoryScheduler``: list, DFS and post
   order); all of them run a parameter's update, which frees its gradient, as soon as that gradient
   exists rather than after the whole backward pass. So the ops after the backward pass are placed as
   early as their operands allow (``positions``); without this the gradients of every layer would be
   charged at once (GPT-1.3B with remat: 4.9 GB more than the compiled step's whole 4.0 GB of temps).

Times here are op positions of the graph (``positions``: the op index, or earlier for the optimizer
update): a held tensor's ``live`` is ``[start, end)`` with ``start`` its producer's position (0 for
inputs) and ``end`` one past the last position that reads it directly or through virtual values; graph
outputs live to ``len(ops)``. Not modelled: XLA's rematerialisation under memory pressure, buffer
fragmentation, and the cuBLAS/cuDNN workspaces (a few hundred MB at most).
"""

from __future__ import annotations

import dataclasses

from autoshard.trace.costs import REDUCTIONS
from autoshard.trace.graph import Graph, peak_of_intervals

# Elementwise and layout ops (``InstructionFusion::IsExpensive`` false, and jax ops lowering to them)
CHEAP = frozenset(
    "add add_any sub mul neg max min and or xor not select_n eq ne lt le gt ge clamp floor ceil round "
    "is_finite sign abs sin cos integer_pow square imag real conj complex shift_left shift_right_logical "
    "shift_right_arithmetic population_count clz nextafter "
    "convert_element_type bitcast_convert_type copy copy_p reduce_precision stop_gradient "
    "broadcast_in_dim reshape squeeze expand_dims transpose slice pad concatenate rev iota "
    "sharding_constraint pvary pcast mesh_cast".split()
)
# Elementwise ops that IsExpensive calls expensive: PriorityFusion fuses them all the same
EXPENSIVE = frozenset(
    "exp exp2 expm1 log log1p logistic tanh div rem pow sqrt rsqrt cbrt erf erfc erf_inv tan asin acos "
    "atan atan2 sinh cosh asinh acosh atanh lgamma digamma".split()
)
# Elementwise ops whose result has its operands' shape (a loop fusion rooted at one can write in place)
ELEMENTWISE = (CHEAP | EXPENSIVE) - frozenset(
    "broadcast_in_dim reshape squeeze expand_dims transpose slice pad concatenate rev iota".split())
# Ops XLA runs in place on their first operand
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min", "scatter_max",
                      "dynamic_update_slice"})
# Consumers into which XLA fuses an elementwise producer (loop fusion, input fusion of a reduction, the
# operand of a gather or dynamic slice, which reads only the elements it picks)
FUSING = CHEAP | EXPENSIVE | frozenset(REDUCTIONS) | frozenset({"argmax", "argmin", "gather", "dynamic_slice"})


@dataclasses.dataclass(frozen=True, slots=True)
class Buffers:
    """Per tensor id: whether it holds a buffer, and the op-index interval its buffer is live over."""

    held: tuple[bool, ...]
    live: tuple[tuple[int, int], ...]

    def held_bytes(self, graph: Graph) -> int:
        """Bytes of all held tensors (inputs included): an upper bound on the step's footprint."""
        return sum(t.nbytes for t, h in zip(graph.tensors, self.held, strict=True) if h)

    def peak(self, graph: Graph) -> int:
        """Peak over the schedule of the held tensors' bytes (unsharded; nested bodies not included)."""
        return peak_of_intervals(((span, t.nbytes) for t, h, span in zip(graph.tensors, self.held, self.live,
                                                                         strict=True) if h), len(graph.ops))


def dead_ops(graph: Graph) -> frozenset[int]:
    """Rule 0: ids of the top-level ops XLA removes: ops without effects or bodies whose every result is
    neither returned nor read by a live op (found in one backward walk over the schedule)."""
    outputs = frozenset(graph.outputs)
    dead: set[int] = set()
    for op in reversed(graph.ops):
        if not op.outputs or op.bodies or getattr(op.eqn, "effects", None):
            continue
        if all(o not in outputs and all(c in dead for c in graph.tensors[o].consumers) for o in op.outputs):
            dead.add(op.id)
    return frozenset(dead)


def is_virtual(graph: Graph, tid: int, outputs: frozenset[int]) -> bool:
    """Rule 1: the tensor is fused into every reader and never materialised."""
    t = graph.tensors[tid]
    if t.producer is None or tid in outputs or not t.consumers:
        return False
    prim = graph.ops[t.producer].primitive
    if prim not in CHEAP and prim not in EXPENSIVE:
        return False
    return all(graph.ops[c].primitive in FUSING and not graph.ops[c].bodies for c in t.consumers)


def positions(graph: Graph) -> list[int]:
    """Rule 6: where each op runs. The ops after the backward pass (the optimizer update) run as soon as
    their operands exist, the others where the jaxpr has them."""
    pos = [op.id for op in graph.ops]
    last_bwd = max((op.id for op in graph.ops if op.phase == "backward"), default=None)
    if last_bwd is None:
        return pos
    for op in graph.ops[last_bwd + 1:]:
        pos[op.id] = max((pos[p] for i in op.inputs if (p := graph.tensors[i].producer) is not None), default=0)
    return pos


def buffers(graph: Graph, *, reschedule: bool = True) -> Buffers:
    """Apply rules 0-4 and 6 to the top level of ``graph`` (see the module docstring); ``reschedule``
    False keeps the jaxpr's order for every op (rule 6 off)."""
    n = len(graph.ops)
    outputs = frozenset(graph.outputs)
    pos = positions(graph) if reschedule else [op.id for op in graph.ops]
    virtual = [is_virtual(graph, t.id, outputs) for t in graph.tensors]
    dead = dead_ops(graph)
    # need[t] = the last position at which t is read, directly or through virtual values (rule 2)
    need = [-1] * len(graph.tensors)
    for tid in outputs:
        need[tid] = n
    for op in reversed(graph.ops):
        if op.id in dead:  # rule 0: removed, it reads nothing
            continue
        reach = pos[op.id]
        for o in op.outputs:
            if virtual[o]:
                reach = max(reach, need[o])
        for i in op.inputs:
            need[i] = max(need[i], reach)
    # rule 4: an in-place update writes into its operand's buffer when that operand dies there
    inplace: dict[int, int] = {}  # result -> the operand whose buffer it takes over
    for op in graph.ops:
        if op.primitive in IN_PLACE and op.inputs and len(op.outputs) == 1:
            x = op.inputs[0]
            if need[x] == pos[op.id] and x not in outputs and graph.tensors[x].producer is not None:
                inplace[op.outputs[0]] = x
    taken = set(inplace.values())
    # rule 4: an elementwise result takes over the buffer of a same-shaped operand that dies there
    for op in graph.ops:
        if op.primitive not in ELEMENTWISE or len(op.outputs) != 1 or op.bodies or virtual[op.outputs[0]]:
            continue
        out = graph.tensors[op.outputs[0]]
        for x in op.inputs:
            t = graph.tensors[x]
            if (not virtual[x] and t.producer is not None and x not in outputs and x not in taken
                    and need[x] == pos[op.id] and t.shape == out.shape and t.nbytes == out.nbytes):
                inplace[out.id] = x
                taken.add(x)
                break
    held, live = [], []
    for t in graph.tensors:
        start = 0 if t.producer is None else pos[t.producer]
        if t.producer in dead:
            held.append(False)
            live.append((start, start))
            continue
        if virtual[t.id] or t.id in taken or (not t.consumers and t.id not in outputs):
            # fused, or its buffer lives on as an in-place result's, or never read: at most a moment
            keep = not virtual[t.id] and t.id not in taken and t.producer is not None
            held.append(keep)
            live.append((start, start + 1 if keep else start))
            continue
        if t.id in inplace:  # the buffer was first allocated for the first value of the chain
            root = inplace[t.id]
            while root in inplace:
                root = inplace[root]
            x = graph.tensors[root]
            start = 0 if x.producer is None else pos[x.producer]
        held.append(True)
        end = n if need[t.id] >= n else need[t.id] + 1
        live.append((start, max(end, start + 1)))
    return Buffers(held=tuple(held), live=tuple(live))


@dataclasses.dataclass(frozen=True, slots=True)
class Clock:
    """Rule 5: a time axis on which nested bodies get time steps of their own.

    Op ``j`` of a graph placed at ``base`` occupies ``[base + offset[j], base + offset[j] + width[j])``:
    one step for the op itself and, for an op with bodies, after it as many steps as its longest body
    needs (a loop body once: its buffers are reused across iterations). A body of op ``j`` is placed at
    ``base + offset[j] + 1``. A tensor live over op indices ``[s, e)`` of the graph is live over
    ``span(s, e)``: from its producer's first step to the end of its last reader's steps, so a value
    read by a loop or a remat op stays live while the body runs, and the body's own values only then."""

    base: int
    offset: tuple[int, ...]
    width: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, graph: Graph, base: int = 0) -> Clock:
        offset, width = [], []
        cur = 0
        for op in graph.ops:
            offset.append(cur)
            w = 1 + max((steps(b) for b in op.bodies), default=0)
            width.append(w)
            cur += w
        return cls(base, tuple(offset), tuple(width), max(cur, 1))

    def at(self, i: int) -> int:
        """The first step of op ``i`` (``len(ops)``: the end of the graph)."""
        return self.base + (self.offset[i] if i < len(self.offset) else self.total)

    def span(self, s: int, e: int) -> tuple[int, int]:
        """Op-index interval ``[s, e)`` on this clock (at least one step long when ``e > s``)."""
        a = self.at(s)
        return (a, max(self.at(e), a + 1)) if e > s else (a, a)

    def body_base(self, op_id: int) -> int:
        return self.base + self.offset[op_id] + 1


def steps(graph: Graph) -> int:
    """Time steps ``graph`` takes on a ``Clock`` (bodies included)."""
    return Clock.of(graph).total
