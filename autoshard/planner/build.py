"""Build the intra-operator sharding problem (``solvers.IntraOpProblem``) from a traced Graph.

Nodes
-----
- one node per *input* of the step that something reads (parameters, optimizer state, batch, other
  state): its strategies are the layouts of that tensor, its cost 0, its memory the bytes per device of
  the layout, live from the start of the step to its last use (the buffer is donated afterwards);
- one node per *op group*: an op together with the unary elementwise ops that can only follow it (a
  ``convert``, ``exp``, ``mul`` by a scalar...), merged before solving so the solver sees fewer nodes.
  A group's strategies are its leader's; each follower takes the leader's output layout;
- control flow is planned in place: the bodies of ``scan``, ``while``, ``cond`` and ``remat`` become
  nodes of the same problem, their costs multiplied by the trip count; a body input gets a *port* node
  fed by the outer operand, a loop's carried value is tied to itself across iterations by a resharding
  edge weighted by the trip count, and each result of the op gets a port node fed by the body's output.
  A body's ops get time steps of their own inside the enclosing op's (``trace.buffers.Clock``), so its
  values are live only while it runs (one loop iteration's; a remat body's recomputation only during
  the backward op that runs it); a body input is a view of the outer operand and holds no memory.

For strategy s of node i: ``c_i[s]`` = compute time + the op's own collectives (``autoshard.strategies``)
+ ε·m_i[s] with ε = 1% of the time to read a byte from device memory (a tie-break toward layouts that hold
less: slicing an input is free, so time alone cannot choose between a replicated and a split batch; for an
op that makes a value from nothing, an iota or a broadcast constant, ``m_i`` counts that value even when it
is fused: the causal mask is built split like the scores that read it, not replicated and sliced);
``m_i[s]`` = peak bytes per device of the group's *held* tensors over their buffers' live ranges, and the
node's interval spans those ranges. Which values hold a buffer, and until when, follows XLA's GPU buffer
assignment (``trace.buffers``): a value fused into all its readers holds none and keeps its operands
alive instead, an in-place update shares its operand's buffer, the optimizer update runs as each gradient
arrives. On the H100 measurements of ``tests/data/h100_fidelity.json`` the predicted peak lands within
15% of XLA's for every case (it was 1.5-2.2x before these rules).

Edges
-----
For each tensor produced in node u and read in node v, ``R_uv[s, t]`` = seconds to reshard it from u's
output layout under s to the layout v's reader needs under t (``CostModel.reshard_time``, which prices
pending partial sums as all-reduce or reduce-scatter). Train state that the step returns (new parameters,
new optimizer state) is tied to the input node it replaces by an edge from its producer: returning it in
another layout than it came in costs that resharding.

Gradients reduced together
--------------------------
XLA's all-reduce combiner issues independent all-reduces over the same devices as one instruction, and the
gradients of a data-parallel step are that: each reduced as the backward pass ends, none read by the backward
pass again (nor is the loss the step returns). The all-reduce of a pending sum on such a *gradient tensor*
(``gradient_tensors``: made by the backward pass or the update, or returned by the step, and read only by the
update, as a result, or by one-operand backward ops that make only gradient tensors: a reshape, a transpose,
a bias's sum) is priced ``collectives.combined`` with ``k`` = the parameters the step reads: its time less
``(1 - 1/k)·α``, α the latency of that all-reduce, so ``k`` gradients pay it once between them. That is
exact for an affine price when all ``k`` are reduced on the same axes; ``m < k`` of them pay ``m/k·α``
(an underestimate of ``(1 - m/k)·α``: a Megatron step that reduces its loss alone pays ``α/k`` for it),
and the loss beside ``k`` gradients adds ``α/k`` where XLA adds nothing. It holds wherever the
reduction lands: in the op's own strategy, in a follower, on an edge, or as the step returns the sum.
All-reduces of activations stay priced one by one: each waits for the previous layer's.

An op that makes such a pending sum from an operand sliced for free (read split from a layout that is not)
gets ``(1 - 1/k)·α`` back on that edge (``_Build.sliced_into_sum``): XLA, handed the layouts the plan pins
(never a pending sum), computes that value whole where it lies and issues no all-reduce, so the cheap shared
latency must not buy the plan a split of work that never runs (a Megatron step's bias gradients summed over
a quarter of a replicated batch each and reduced).

The solver then minimises ``Σ_i c_i[s_i] + Σ_uv R_uv[s_u, s_v]`` subject to, at every time step t,
``Σ_{i live at t} m_i[s_i] <= memory budget`` (see ``solvers.intra_op`` for the ILP).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from autoshard.strategies import RuleContext, Strategy, strategies_for
from autoshard.strategies.elementwise import UNARY_FOLLOWERS
from autoshard.strategies.registry import Candidate, enumerate_specs, price
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.buffers import Buffers, Clock, buffers, steps
from autoshard.trace.costs import ELEMENTWISE
from autoshard.trace.graph import Graph, Op, Role, Scope
from cost_models import CostModel, ShardingSpec
from solvers import IntraOpProblem

TensorKey = tuple[Scope, int]
# an optimization barrier is no follower: the replayed copy it passes on lives in the block's backward pass, far
# from its leader (a forward op), and a group holds its results' peak over the whole of their span (a barrier
# with no anchor, merged into the forward matmul whose output it ties, held that output twice over the step)
_FOLLOW = (frozenset(ELEMENTWISE) | UNARY_FOLLOWERS) - {"optimization_barrier"}
MEMORY_TIE_BREAK = 0.01
GENERATED = frozenset({"iota", "full", "empty", "empty2", "broadcast"})  # values made from nothing


class Layouts(Sequence[list[tuple[TensorKey, "ShardingSpec | None"]]]):
    """Per strategy, the (tensor, layout) pairs of a node, as a list of lists reads them; the tensors, the
    same for every strategy, kept once (``keys``) beside each strategy's layouts (``rows[s][j]`` is
    ``keys[j]``'s). An op's rows are shared by every op priced alike (``_Build.group_rows``): never edited."""

    __slots__ = ("_index", "keys", "rows")

    def __init__(self, keys: Sequence[TensorKey], rows: Sequence[Sequence[ShardingSpec | None]]) -> None:
        self.keys = tuple(keys)
        self.rows = rows
        self._index: dict[TensorKey, int] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, s: Any) -> Any:
        if isinstance(s, slice):
            return [list(zip(self.keys, row, strict=True)) for row in self.rows[s]]
        return list(zip(self.keys, self.rows[s], strict=True))

    def __iter__(self) -> Iterator[list[tuple[TensorKey, ShardingSpec | None]]]:
        keys = self.keys
        return (list(zip(keys, row, strict=True)) for row in self.rows)

    def position(self, key: TensorKey) -> int:
        """Where ``key`` is in every strategy's pairs (KeyError: not there)."""
        if self._index is None:
            self._index = {}
            for j, k in enumerate(self.keys):
                self._index.setdefault(k, j)
        return self._index[key]

    def column(self, j: int) -> list[ShardingSpec | None]:
        """The layout of ``keys[j]`` under each strategy."""
        return [row[j] for row in self.rows]


Pairs = list[list[tuple[TensorKey, "ShardingSpec | None"]]] | Layouts


@dataclasses.dataclass(slots=True)
class NodeInfo:
    """One solver node: what it stands for and, per strategy, the layout of every tensor it produces and
    the layout it needs for every tensor it reads."""

    name: str
    kind: str  # "input", "op", "port"
    ops: list[tuple[Scope, int]]
    produces: Pairs  # per strategy; same keys in the same order
    reads: Pairs  # per strategy; same keys in the same order (a port's are filled in by its caller)
    cost: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    memory: np.ndarray
    interval: tuple[int, int]
    weight: float = 1.0
    strategies: list[Strategy | None] = dataclasses.field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.produces)

    def produced(self, key: TensorKey, s: int) -> ShardingSpec:
        """The layout this node gives tensor ``key`` under strategy ``s``."""
        if isinstance(self.produces, Layouts):
            return self.produces.rows[s][self.produces.position(key)]  # type: ignore[return-value]
        for k, spec in self.produces[s]:
            if k == key:
                return spec  # type: ignore[return-value]
        raise KeyError(key)

    def needed(self, key: TensorKey, s: int) -> ShardingSpec | None:
        """The layout this node needs tensor ``key`` in under strategy ``s`` (None: no layout works)."""
        if isinstance(self.reads, Layouts):
            return self.reads.rows[s][self.reads.position(key)]
        for k, spec in self.reads[s]:
            if k == key:
                return spec
        raise KeyError(key)

    def produced_keys(self) -> Sequence[TensorKey]:
        """The tensors this node produces (under every strategy)."""
        if isinstance(self.produces, Layouts):
            return self.produces.keys
        return [k for k, _ in self.produces[0]] if self.produces else []

    def read_keys(self) -> Sequence[TensorKey]:
        """The tensors this node reads (under every strategy), in order."""
        if isinstance(self.reads, Layouts):
            return self.reads.keys
        return [k for k, _ in self.reads[0]] if self.reads else []

    def produced_specs(self, s: int) -> Sequence[ShardingSpec]:
        """The layouts this node gives its tensors under strategy ``s``, in ``produced_keys`` order."""
        if isinstance(self.produces, Layouts):
            return self.produces.rows[s]  # type: ignore[return-value]
        return [spec for _, spec in self.produces[s]]  # type: ignore[misc]

    def needed_specs(self, s: int) -> Sequence[ShardingSpec | None]:
        """The layouts this node needs its reads in under strategy ``s``, in ``read_keys`` order."""
        if isinstance(self.reads, Layouts):
            return self.reads.rows[s]
        return [spec for _, spec in self.reads[s]]

    def produced_all(self, key: TensorKey) -> list[ShardingSpec]:
        """The layout this node gives tensor ``key`` under each strategy."""
        if isinstance(self.produces, Layouts):
            return self.produces.column(self.produces.position(key))  # type: ignore[return-value]
        return [self.produced(key, s) for s in range(self.k)]

    def needed_all(self, j: int) -> list[ShardingSpec | None]:
        """The layout this node needs its ``j``-th read tensor in under each strategy."""
        if isinstance(self.reads, Layouts):
            return self.reads.column(j)
        return [row[j][1] for row in self.reads]


@dataclasses.dataclass(frozen=True, slots=True)
class EdgeInfo:
    u: int
    v: int
    tensor: TensorKey  # produced by u
    weight: float
    kind: str  # "data" (v reads the tensor), "state" (returned train state), "carry" (loop-carried value)
    target: TensorKey  # for "data" the same tensor; for ties the tensor v produces that it must match


@dataclasses.dataclass(frozen=True, slots=True)
class BuiltProblem:
    problem: IntraOpProblem
    nodes: tuple[NodeInfo, ...]
    edges: tuple[EdgeInfo, ...]
    graphs: dict[Scope, Graph]
    activation_weight: float = 1.0
    gradients: frozenset[TensorKey] = frozenset()  # gradient tensors (module docstring), top level only
    combine: int = 1  # how many gradient all-reduces XLA issues as one (the parameters the step reads)
    # nodes holding an activation from the forward into the backward pass (``_Build.stashed``): what the
    # activation weight multiplies
    stashed: frozenset[int] = frozenset()

    def combine_of(self, key: TensorKey) -> int:
        """How many all-reduces a reduction of tensor ``key``'s pending sum is issued with (1: on its own)."""
        return self.combine if key in self.gradients else 1


class _Build:
    def __init__(self, graph: Graph, cost: CostModel, activation_weight: float = 1.0,
                 reduction_weight: float = 1.0) -> None:
        self.activation_weight = activation_weight
        self.reduction_weight = reduction_weight
        self.root = graph
        self.cost = cost
        self.mesh = cost.mesh
        self.nodes: list[NodeInfo] = []
        self.edges: list[EdgeInfo] = []
        self.producer: dict[TensorKey, int] = {}  # tensor -> node that produces it
        self.graphs: dict[Scope, Graph] = {(): graph}
        self.warned: set[str] = set()
        # pure functions of the cost model (and its mesh): shared by every problem built with it
        self._strategy_cache: dict[Any, list[Strategy]] = cost.memo("autoshard.build.strategies")
        self._spec_cache: dict[tuple[int, ...], list[ShardingSpec]] = cost.memo("autoshard.build.specs")
        self._matrix_cache: dict[Any, np.ndarray] = cost.memo("autoshard.build.matrices")
        # per (shape, dtype, combine): the layouts seen, numbered, and a table of reshard seconds between
        # them by number, NaN where not priced yet (``reshard_matrix``)
        self._pair_cache: dict[Any, _PairTable] = cost.memo("autoshard.build.pairs")
        self._follow_cache: dict[Any, Strategy] = cost.memo("autoshard.build.follow")
        self._group_rows: dict[Any, Any] = cost.memo("autoshard.build.group_rows")  # ``group_rows``
        self._group_memory: dict[Any, np.ndarray] = cost.memo("autoshard.build.group_memory")
        # an op's key (``_op_key``) interned as a small number, so the caches hash an int, not its tuple
        self._key_ids: dict[tuple[Any, ...], int] = cost.memo("autoshard.build.key_ids")
        self._op_keys: dict[int, int] = {}  # id(op) -> op_key, for this build's graphs
        self._shards: dict[ShardingSpec, int] = cost.memo("autoshard.build.shards")
        self.ties: list[tuple[TensorKey, TensorKey, float, str]] = []
        self.bufs: dict[Scope, Buffers] = {}  # which tensors hold a buffer, and when (trace.buffers)
        self.clocks: dict[Scope, Clock] = {}  # where each scope's ops sit on the problem's time axis
        self._boundary: int | None = -1  # time of the first backward op (None: none; -1: not yet found)
        grads, self.combine = combined_reductions(graph)
        self.gradients = frozenset(((), t) for t in grads)
        self._created: dict[int, list[tuple[frozenset[str], float]] | None] = {}

    def combine_of(self, key: TensorKey) -> int:
        return self.combine if key in self.gradients else 1

    # ---- helpers ---------------------------------------------------------------------------------------

    def specs(self, shape: tuple[int, ...], ctx: RuleContext) -> list[ShardingSpec]:
        if shape not in self._spec_cache:
            self._spec_cache[shape] = enumerate_specs(shape, ctx)
        return self._spec_cache[shape]

    def bytes_on_device(self, nbytes: int, spec: ShardingSpec) -> float:
        shards = self._shards.get(spec)
        if shards is None:
            shards = self._shards[spec] = max(1, spec.num_shards(self.mesh))
        return nbytes / shards

    def op_key(self, op: Op, ctx: RuleContext) -> int:
        """What an op's priced strategies depend on (ops with equal keys share them), as a number."""
        hit = self._op_keys.get(id(op))
        if hit is None:
            hit = self._op_keys[id(op)] = self._key_ids.setdefault(self._op_key(op, ctx), len(self._key_ids))
        return hit

    def _op_key(self, op: Op, ctx: RuleContext) -> tuple[Any, ...]:
        g = ctx.graph
        return (
            op.primitive,
            op.params,
            tuple((g.tensors[t].shape, g.tensors[t].dtype) for t in op.inputs),
            tuple((g.tensors[t].shape, g.tensors[t].dtype, ctx.fanout(t)) for t in op.outputs),
            op.flops,
            tuple(t in ctx.fused for t in (*op.inputs, *op.outputs)),  # fused tensors cost no traffic
            next((k for k, t in enumerate(op.inputs) if g.tensors[t].shape), None),
            op.id in ctx.dead,  # removed by XLA: free
            ctx.copies.get(op.id, 1),  # kernels that read a fused op's operands
        )

    def op_strategies(self, op: Op, ctx: RuleContext) -> list[Strategy]:
        key = self.op_key(op, ctx)
        hit = self._strategy_cache.get(key)
        if hit is None:
            hit = strategies_for(op, ctx, self.cost, self.warned)
            self._strategy_cache[key] = hit
        return hit

    def add_node(self, node: NodeInfo) -> int:
        idx = len(self.nodes)
        self.nodes.append(node)
        for key in node.produced_keys():
            self.producer[key] = idx
        return idx

    def port_node(self, name: str, key: TensorKey, shape: tuple[int, ...], nbytes: int, ctx: RuleContext,
                  interval: tuple[int, int], kind: str = "port", hold: bool = True) -> int:
        """A node whose strategies are the layouts of one tensor; what it reads is filled in by its caller.
        ``hold``: False for a view of a buffer charged elsewhere (a body's input reads the outer one)."""
        specs = self.specs(shape, ctx)
        k = len(specs)
        mem = np.array([self.bytes_on_device(nbytes, s) if hold else 0.0 for s in specs])
        zeros = np.zeros(k)
        return self.add_node(NodeInfo(
            name=name, kind=kind, ops=[], produces=[[(key, s)] for s in specs],
            reads=[[] for _ in specs],
            cost=zeros, compute=zeros, comm=zeros, memory=mem, interval=interval,
            strategies=[None] * k,
        ))

    # ---- graphs ------------------------------------------------------------------------------------

    def enter_scope(self, graph: Graph, scope: Scope, base: int) -> None:
        """Place ``graph``'s ops on the time axis from ``base`` and find which of its tensors hold buffers."""
        self.graphs[scope] = graph
        self.clocks[scope] = Clock.of(graph, base)
        self.bufs[scope] = buffers(graph)

    def build_scope(self, graph: Graph, scope: Scope, weight: float, base: int) -> None:
        """Add nodes for every op of ``graph``, placed on the time axis from ``base`` (``Clock``: a body's
        ops get time steps of their own inside the enclosing op's)."""
        if scope not in self.clocks:
            self.enter_scope(graph, scope, base)
        ctx = RuleContext.of(graph, self.mesh)
        followers = self.find_followers(graph, scope)
        groups: dict[int, list[int]] = defaultdict(list)
        for f, lead in followers.items():
            groups[lead].append(f)
        when = self.clocks[scope].span

        for op in graph.ops:
            if op.id in followers:
                continue
            if op.primitive in jc.CONTROL_FLOW and op.bodies:
                self.build_control_flow(graph, scope, op, weight, ctx, when)
                continue
            self.group_node(graph, scope, [op.id, *groups[op.id]], weight, ctx, when)

    def find_followers(self, graph: Graph, scope: Scope) -> dict[int, int]:
        """op id -> the op id it follows (its single non-scalar operand's producer), for unary elementwise
        ops whose leader is an ordinary op of the same scope."""
        out: dict[int, int] = {}
        for op in graph.ops:
            if op.primitive not in _FOLLOW or len(op.outputs) != 1:
                continue
            big = [t for t in op.inputs if graph.tensors[t].shape]
            if len(big) != 1:
                continue
            t = graph.tensors[big[0]]
            if t.shape != graph.tensors[op.outputs[0]].shape or t.producer is None:
                continue
            leader = graph.ops[t.producer]
            if leader.bodies or len(leader.outputs) != 1:
                continue
            out[op.id] = out.get(leader.id, leader.id)
        return out

    def group_node(self, graph: Graph, scope: Scope, group: list[int], weight: float, ctx: RuleContext,
                   when: Any) -> None:
        """The node of an op and the followers it lays out (``find_followers``): per strategy of the leader,
        what the group produces and reads, its time, and its peak (over a fixed order of the held results'
        allocations and frees). All but the peak are functions of the ops' keys (``op_key``) and wiring,
        computed once per such group shape (``group_rows``); the peak once per shape and liveness."""
        leader = graph.ops[group[0]]
        members = [graph.ops[i] for i in sorted(group)]
        buf = self.bufs[scope]
        made = list(dict.fromkeys(leader.outputs))
        pos = {t: j for j, t in enumerate(made)}
        followers = []  # (op, position of the operand that carries the layout, combine, other operands)
        for f in members[1:]:
            src = next(t for t in f.inputs if graph.tensors[t].shape)
            others = tuple(j for j, t in enumerate(f.inputs) if t != src)
            followers.append((f, pos[src], self.combine_of((scope, src)), others))
            pos[f.outputs[0]] = len(made)
            made.append(f.outputs[0])
        combine = min(self.combine_of((scope, t)) for t in leader.outputs) if leader.outputs else 1
        key = (self.op_key(leader, ctx), tuple(pos[t] for t in leader.outputs),
               tuple((self.op_key(f, ctx), *rest) for f, *rest in followers), combine)
        rows = self._group_rows.get(key)
        if rows is None:
            rows = self._group_rows[key] = self.group_rows(leader, followers, len(made), combine, ctx)
        strategies, out_rows, in_rows, compute, comm = rows
        held = tuple(j for j, t in enumerate(made) if buf.held[t])
        order = tuple(self.event_order(graph, [made[j] for j in held], when, buf))
        mkey = (key, held, order)
        memory = self._group_memory.get(mkey)
        if memory is None:
            nbytes = [graph.tensors[made[j]].nbytes for j in held]
            memory = np.empty(len(out_rows))
            for s, row in enumerate(out_rows):
                sizes = [self.bytes_on_device(n, row[j]) for n, j in zip(nbytes, held, strict=True)]
                memory[s] = sizes[0] if len(sizes) == 1 else _peak_in_order(order, sizes)
            self._group_memory[mkey] = memory
        in_keys = [(scope, t) for t in leader.inputs]
        for f, _, _, others in followers:
            in_keys += [(scope, f.inputs[j]) for j in others]
        produces = Layouts([(scope, t) for t in made], out_rows)
        spans = [buf.live[t] for t in made if buf.held[t]]
        if spans:
            interval = when(min(s for s, _ in spans), max(e for _, e in spans))
        else:  # everything the group computes is fused into its readers, or it has no results (a callback)
            interval = when(leader.id, leader.id + 1)
        name = leader.where() + (f" (+{len(members) - 1} followers)" if len(members) > 1 else "")
        compute_a, comm_a = compute * weight, comm * weight
        self.add_node(NodeInfo(
            name=name, kind="op", ops=[(scope, i) for i in sorted(group)], produces=produces,
            reads=Layouts(in_keys, in_rows), cost=compute_a + comm_a, compute=compute_a, comm=comm_a,
            memory=memory.copy(), interval=interval, weight=weight, strategies=list(strategies),
        ))

    def group_rows(self, leader: Op, followers: list[tuple[Op, int, int, tuple[int, ...]]], n_made: int,
                   combine: int, ctx: RuleContext) -> tuple[list[Strategy], list[tuple[ShardingSpec, ...]],
                                                            list[tuple[ShardingSpec | None, ...]], np.ndarray,
                                                            np.ndarray]:
        """Per strategy of ``leader``: the layouts of what the group makes (the leader's distinct results,
        then each follower's, by position), of what it reads (the leader's operands, then each follower's
        other operands), its compute and its communication seconds (the leader's all-reduces of gradients
        one of ``combine`` issued as one)."""
        strategies = self.op_strategies(leader, ctx)
        distinct = list(dict.fromkeys(leader.outputs))
        at = [distinct.index(t) for t in leader.outputs]
        first = len(distinct)  # where the followers' results start
        out_rows, in_rows, compute, comm = [], [], [], []
        for st in strategies:
            specs: list[Any] = [None] * n_made
            for j, spec in zip(at, st.out_specs, strict=True):
                specs[j] = spec
            rd = list(st.in_specs)
            c_time, m_time = st.compute_time, st.comm_time
            for n, (f, src, f_combine, others) in enumerate(followers):
                fst = self.follow(f, specs[src], ctx, f_combine)
                c_time += fst.compute_time
                m_time += fst.comm_time
                rd += [fst.in_specs[j] for j in others]
                specs[first + n] = fst.out_specs[0]
            if combine > 1:  # the leader's all-reduces reduce gradients: one of k issued as one
                m_time -= sum(x.time - self.cost.step_time(x.kind, x.nbytes, x.axes, combine) for x in st.comm)
            out_rows.append(tuple(specs))
            in_rows.append(tuple(rd))
            compute.append(c_time)
            comm.append(m_time)
        return strategies, out_rows, in_rows, np.array(compute, dtype=float), np.array(comm, dtype=float)

    def follow(self, op: Op, in_spec: ShardingSpec, ctx: RuleContext, combine: int = 1) -> Strategy:
        """The follower's strategy when its operand arrives as ``in_spec``: same layout out; a pending sum
        is reduced first unless the op is linear in it (an all-reduce one of ``combine`` issued as one)."""
        key = (self.op_key(op, ctx), in_spec, combine)
        hit = self._follow_cache.get(key)
        if hit is None:
            hit = self._follow_cache[key] = self._follow(op, in_spec, ctx, combine)
        return hit

    def _follow(self, op: Op, in_spec: ShardingSpec, ctx: RuleContext, combine: int) -> Strategy:
        g = ctx.graph
        src = next(t for t in op.inputs if g.tensors[t].shape)
        linear = op.primitive in ("neg", "convert_element_type", "copy", "copy_p", "reduce_precision", "mul",
                                  "div") and (op.primitive != "div" or op.inputs[0] == src)
        spec = in_spec if (linear or not in_spec.partial) else ShardingSpec(dims=in_spec.dims)
        in_specs = tuple(spec if t == src else ShardingSpec.replicated(len(g.tensors[t].shape)) for t in op.inputs)
        st = price(op, Candidate(in_specs, (spec,)), ctx, self.cost)
        if spec is not in_spec:  # the reduction happens here
            t = g.tensors[src]
            extra = self.cost.reshard_time(t.shape, t.dtype, in_spec, spec, combine=combine)
            st = dataclasses.replace(st, in_specs=tuple(in_spec if x == src else s for x, s in
                                                        zip(op.inputs, in_specs, strict=True)),
                                     comm_time=st.comm_time + extra)
        return st

    @staticmethod
    def event_order(graph: Graph, tids: Sequence[int], when: Any, buf: Buffers) -> list[tuple[int, int]]:
        """The allocations (+1) and frees (-1) of ``tids`` (by index) in the order ``peak_bytes`` sums them:
        by time, a free before an allocation at the same step (the order is the same whatever the sizes)."""
        events = []
        for j, tid in enumerate(tids):
            s, e = when(*buf.live[tid])
            events += [(s, 1, j), (e, -1, j)]
        events.sort(key=lambda x: (x[0], x[1]))
        return [(j, sign) for _, sign, j in events]

    # ---- control flow ------------------------------------------------------------------------------

    def build_control_flow(self, graph: Graph, scope: Scope, op: Op, weight: float, ctx: RuleContext,
                           when: Any) -> None:
        t_op = self.clocks[scope].body_base(op.id)  # where its bodies' time steps begin
        trips = float(op.trip_count or 1)
        p = op.primitive
        if p == "scan":
            body = op.bodies[0]
            layout = jc.scan_layout(op.eqn)
            n_consts, n_carry = layout.num_consts, layout.num_carry
            outer_in = list(op.inputs)
            sub = (*scope, (op.id, 0))
            self.enter_body(body, sub, outer_in, weight * trips, t_op, stacked_from=n_consts + n_carry)
            carry_in = body.inputs[n_consts:n_consts + n_carry]
            carry_out = body.outputs[:n_carry]
            for ci, co in zip(carry_in, carry_out, strict=True):
                self.tie(sub, co, sub, ci, weight * trips, "carry")
            self.result_ports(graph, scope, op, [(sub, t) for t in body.outputs], ctx, when,
                              stacked=[k >= n_carry for k in range(len(op.outputs))])
        elif p == "while":
            cond, body = op.bodies
            w = jc.while_layout(op.eqn)
            nc, nb = w.cond_nconsts, w.body_nconsts
            carry = list(op.inputs[nc + nb:])
            s_cond, s_body = (*scope, (op.id, 0)), (*scope, (op.id, 1))
            self.enter_body(cond, s_cond, list(op.inputs[:nc]) + carry, weight * trips, t_op)
            self.enter_body(body, s_body, list(op.inputs[nc:nc + nb]) + carry, weight * trips, t_op)
            for k, co in enumerate(body.outputs):
                self.tie(s_body, co, s_body, body.inputs[nb + k], weight * trips, "carry")
            self.result_ports(graph, scope, op, [(s_body, t) for t in body.outputs], ctx, when)
        elif p == "cond":
            branch_outs = []
            for b_idx, branch in enumerate(op.bodies):
                sub = (*scope, (op.id, b_idx))
                self.enter_body(branch, sub, list(op.inputs[1:]), weight, t_op)
                branch_outs.append([(sub, t) for t in branch.outputs])
            self.result_ports(graph, scope, op, branch_outs[0], ctx, when, also=branch_outs[1:])
        else:  # remat
            body = op.bodies[0]
            sub = (*scope, (op.id, 0))
            self.enter_body(body, sub, list(op.inputs), weight, t_op)
            self.result_ports(graph, scope, op, [(sub, t) for t in body.outputs], ctx, when)

    def enter_body(self, body: Graph, sub: Scope, outer: Sequence[int], weight: float, t_op: int,
                   stacked_from: int | None = None) -> None:
        """Port nodes for the body's inputs, fed by the outer operands; then the body's own nodes. The body
        starts at time ``t_op``; its inputs are views of the outer operands' buffers (a loop's slice of a
        stacked input is fused into its readers, a carry updated in place) and hold nothing of their own."""
        self.enter_scope(body, sub, t_op)
        bctx = RuleContext.of(body, self.mesh)
        parent = sub[:-1]
        for k, (tid, outer_tid) in enumerate(zip(body.inputs, outer, strict=True)):
            t = body.tensors[tid]
            if t.role is Role.CONST and not t.shape:
                continue
            port = self.port_node(f"{t.name} (into {self.root_name(sub)})", (sub, tid), t.shape, t.nbytes, bctx,
                                  (t_op, t_op + steps(body)), hold=False)
            is_stacked = stacked_from is not None and k >= stacked_from
            self.feed(parent, outer_tid, port, stacked=is_stacked)
        self.build_scope(body, sub, weight, t_op)

    def root_name(self, sub: Scope) -> str:
        op_id, b = sub[-1]
        g = self.graphs[sub[:-1]]
        return f"{g.ops[op_id].primitive} (op {op_id}) body {b}"

    def feed(self, parent: Scope, outer_tid: int, port: int, *, stacked: bool) -> None:
        """Record that ``port`` reads outer tensor ``outer_tid`` (its per-iteration slice when stacked)."""
        node = self.nodes[port]
        for s in range(node.k):
            spec = node.produces[s][0][1]
            need = ShardingSpec(dims=((), *spec.dims)) if stacked else spec
            node.reads[s] = [((parent, outer_tid), need)]

    def tie(self, s_from: Scope, t_from: int, s_to: Scope, t_to: int, weight: float, kind: str) -> None:
        self.ties.append(((s_from, t_from), (s_to, t_to), weight, kind))

    def result_ports(self, graph: Graph, scope: Scope, op: Op, sources: list[TensorKey], ctx: RuleContext,
                     when: Any, stacked: Sequence[bool] | None = None,
                     also: Sequence[list[TensorKey]] = ()) -> None:
        buf = self.bufs[scope]
        for k, (tid, src) in enumerate(zip(op.outputs, sources, strict=True)):
            t = graph.tensors[tid]
            interval = when(*buf.live[tid])
            port = self.port_node(f"{t.name} (result {k} of {op.where()})", (scope, tid), t.shape, t.nbytes,
                                  ctx, interval)
            node = self.nodes[port]
            node.ops = [(scope, op.id)]
            st = bool(stacked[k]) if stacked is not None else False
            for s in range(node.k):
                spec = node.produces[s][0][1]
                inner = ShardingSpec(dims=spec.dims[1:]) if st else spec
                if st and spec.dims[0]:
                    inner = None  # a stacked result split on the iteration axis: no body layout gives it
                node.reads[s] = [(src, inner)] + [(alt[k], inner) for alt in also]

    # ---- finishing -------------------------------------------------------------------------------------

    def build(self) -> BuiltProblem:
        g = self.root
        ctx = RuleContext.of(g, self.mesh)
        self.enter_scope(g, (), 0)
        buf, clock = self.bufs[()], self.clocks[()]
        for tid in g.inputs:
            t = g.tensors[tid]
            if not t.consumers and tid not in g.outputs:
                continue
            self.port_node(t.name, ((), tid), t.shape, t.nbytes, ctx, clock.span(*buf.live[tid]), kind="input")
        self.build_scope(g, (), 1.0, 0)
        edge_u, edge_v, mats = [], [], []
        for v, node in enumerate(self.nodes):
            for j, key in enumerate(node.read_keys()):
                u = self.producer.get(key)
                if u is None or u == v:
                    continue  # constants, literals, or read inside the same group
                edge_u.append(u)
                edge_v.append(v)
                mat = self.matrix(key, u, v, j, self.combine_of(key))
                sliced = self.sliced_into_sum(key, u, v, j)
                mats.append((mat if sliced is None else mat + sliced) * node.weight)
                self.edges.append(EdgeInfo(u, v, key, node.weight, "data", key))
        for src, dst, weight, kind in self.ties:
            self.add_tie(src, dst, weight, kind, edge_u, edge_v, mats)
        for o, i in g.output_aliases.items():
            src, dst = ((), g.outputs[o]), ((), g.inputs[i])
            if dst in self.producer and src in self.producer and self.producer[src] != self.producer[dst]:
                self.add_tie(src, dst, 1.0, "state", edge_u, edge_v, mats)
        # A result leaves the step materialised: a pending sum is reduced before it is returned (weighted:
        # a microbatch's gradients are reduced once per step of B microbatches, ``reduction_weight`` 1/B).
        for tid in dict.fromkeys(g.outputs):
            u = self.producer.get(((), tid))
            if u is None:
                continue
            node, t = self.nodes[u], g.tensors[tid]
            for s in range(node.k):
                spec = node.produced(((), tid), s)
                if spec.partial:
                    extra = self.reduction_weight * self.cost.reshard_time(
                        t.shape, t.dtype, spec, ShardingSpec(dims=spec.dims), combine=self.combine_of(((), tid)))
                    node.cost[s] += extra
                    node.comm[s] += extra
        # Tie-break toward less memory: holding a byte costs 1% of reading it once. Between layouts of
        # equal time (slicing an input is free), the one that keeps less per device wins.
        # A value made from nothing (an iota, a broadcast constant: the causal mask's pieces) counts its bytes
        # as if held, fused or not: of the layouts its reader slices for free, the split one wins, and the
        # emitter builds only each device's part (not a replicated [S, S] iota sliced afterwards).
        hold = MEMORY_TIE_BREAK / self.cost.memory_bandwidth
        w = self.activation_weight
        stashed = frozenset(i for i, n in enumerate(self.nodes) if self.stashed(n))
        memory = [n.memory * w if w != 1.0 and i in stashed else n.memory for i, n in enumerate(self.nodes)]
        problem = IntraOpProblem(
            node_costs=[n.cost + hold * (m + self.made_bytes(n)) for n, m in zip(self.nodes, memory, strict=True)],
            node_memory=memory,
            intervals=np.array([n.interval for n in self.nodes], dtype=np.int64).reshape(-1, 2),
            edges=np.array(list(zip(edge_u, edge_v, strict=True)), dtype=np.int64).reshape(-1, 2),
            edge_costs=mats,
            node_names=[self.label(n) for n in self.nodes],
        )
        return BuiltProblem(problem, tuple(self.nodes), tuple(self.edges), dict(self.graphs),
                            self.activation_weight, self.gradients, self.combine, stashed)

    def created_sums(self, v: int) -> list[tuple[frozenset[str], float]] | None:
        """Per strategy of node ``v``: the mesh axes over which it makes a pending sum of gradients that is
        reduced as one of ``combine`` (a partial result it does not read as partial, or its own all-reduce),
        and the latency that sharing saves, ``(1 - 1/k)·α`` of an all-reduce over those axes; None where no
        strategy saves any."""
        if v in self._created:
            return self._created[v]
        node, out = self.nodes[v], []
        k = self.combine
        # every strategy produces the same tensors (in its own layouts): are they all gradients?
        made = node.produced_keys()
        sums = k > 1 and node.kind == "op" and bool(made) and all(key in self.gradients for key in made)
        if not sums:
            self._created[v] = None
            return None
        for s in range(node.k):
            axes: set[str] = set()
            for spec in node.produced_specs(s):
                axes |= spec.partial
            st = node.strategies[s]
            for c in st.comm if st is not None else ():
                if c.kind == "all_reduce":
                    axes |= set(c.axes)
            for spec in node.needed_specs(s):
                axes -= spec.partial if spec is not None else set()
            saved = (1 - 1 / k) * self.cost.latency("all_reduce", tuple(sorted(axes))) if axes and k > 1 else 0.0
            out.append((frozenset(axes), saved))
        self._created[v] = out if any(saved for _, saved in out) else None
        return self._created[v]

    def sliced_into_sum(self, key: TensorKey, u: int, v: int, j: int) -> np.ndarray | None:
        """The latency taken back (``created_sums``) where node ``v`` makes its pending sum of gradients from
        operand ``key`` sliced for free from a layout not split over those axes: XLA computes such a value
        whole where it lies and issues no all-reduce, so the sum would be a reduction of its own, not one of
        the data-parallel step's. (Charged on each such operand: an op that slices two pays it twice.)"""
        created = self.created_sums(v)
        if created is None:
            return None
        src = self.nodes[u].produced_all(key)
        needs = self.nodes[v].needed_all(j)
        extra = np.zeros((len(src), len(created)))
        for b, (axes, saved) in enumerate(created):
            need = needs[b]
            if not saved or need is None:
                continue
            sliced = axes & need.axes_used
            for a, spec in enumerate(src):
                if sliced - spec.axes_used:
                    extra[a, b] = saved
        return extra

    def made_bytes(self, node: NodeInfo) -> np.ndarray | float:
        """Per strategy, the bytes per device of the value a generating op (``GENERATED``, or a broadcast of a
        scalar) makes; 0 for any other node."""
        if node.kind != "op" or not node.ops:
            return 0.0
        scope, op_id = node.ops[0]
        g = self.graphs[scope]
        op = g.ops[op_id]
        if not (op.primitive in GENERATED or (op.primitive == "broadcast_in_dim"
                                              and all(not g.tensors[t].shape for t in op.inputs))):
            return 0.0
        key = (scope, op.outputs[0])
        return np.array([self.bytes_on_device(g.tensors[op.outputs[0]].nbytes, node.produced(key, s))
                         for s in range(node.k)])

    def stashed(self, node: NodeInfo) -> bool:
        """Whether a node holds an activation from the forward pass into the backward pass: what a
        pipeline stage keeps once per microbatch in flight. Values that live and die within one pass (a
        remat body's recomputed activations, a backward temporary, a gradient) exist once whatever the
        number of microbatches in flight. Without a backward pass every computed value counts."""
        if node.kind == "input":
            return False
        if self._boundary == -1:
            first_bwd = next((op.id for op in self.root.ops if op.phase == "backward"), None)
            self._boundary = None if first_bwd is None else self.clocks[()].at(first_bwd)
        return self._boundary is None or node.interval[0] < self._boundary < node.interval[1]

    def label(self, node: NodeInfo) -> str:
        """How the solver's messages name a node: an input with the op that first reads it (where to look
        in the user's code when it does not fit), anything else by its name."""
        if node.kind != "input" or not node.produces or not node.produces[0]:
            return node.name
        (_, tid), _spec = node.produces[0][0]
        readers = self.root.tensors[tid].consumers
        return f"{node.name}, read by {self.root.ops[readers[0]].where()}" if readers else node.name

    def add_tie(self, src: TensorKey, dst: TensorKey, weight: float, kind: str,
                edge_u: list[int], edge_v: list[int], mats: list[np.ndarray]) -> None:
        u, v = self.producer.get(src), self.producer.get(dst)
        if u is None or v is None or u == v:
            return
        g = self.graphs[src[0]]
        t = g.tensors[src[1]]
        a, b = self.nodes[u].produced_all(src), self.nodes[v].produced_all(dst)
        mats.append(self.reshard_matrix(t.shape, t.dtype, a, b) * weight)
        edge_u.append(u)
        edge_v.append(v)
        self.edges.append(EdgeInfo(u, v, src, weight, kind, dst))

    def matrix(self, key: TensorKey, u: int, v: int, j: int, combine: int = 1) -> np.ndarray:
        g = self.graphs[key[0]]
        t = g.tensors[key[1]]
        return self.reshard_matrix(t.shape, t.dtype, self.nodes[u].produced_all(key), self.nodes[v].needed_all(j),
                                   combine)

    def reshard_matrix(self, shape: tuple[int, ...], dtype: str, src: Sequence[ShardingSpec],
                       dst: Sequence[ShardingSpec | None], combine: int = 1) -> np.ndarray:
        key = (shape, dtype, tuple(src), tuple(dst), combine)
        hit = self._matrix_cache.get(key)
        if hit is not None:
            return hit
        pairs = self._pair_cache.get((shape, dtype, combine))
        if pairs is None:
            pairs = self._pair_cache[(shape, dtype, combine)] = _PairTable()
        ndim = len(shape)
        # a layout of another rank (or none at all: no layout works) is never reached
        a_id = pairs.numbers([a if len(a.dims) == ndim else None for a in src])
        b_id = pairs.numbers([b if b is not None and len(b.dims) == ndim else None for b in dst])
        rows, cols = np.ix_(np.maximum(a_id, 0), np.maximum(b_id, 0))
        todo = np.isnan(pairs.table[rows, cols]) & (a_id >= 0)[:, None] & (b_id >= 0)[None, :]
        for x, y in {(int(a_id[i]), int(b_id[j])) for i, j in np.argwhere(todo)}:
            pairs.table[x, y] = (self.cost.reshard_time(shape, dtype, pairs.specs[x], pairs.specs[y],
                                                        combine=combine) if x != y else 0.0)
        sub = pairs.table[rows, cols]
        sub[a_id < 0, :] = math.inf
        sub[:, b_id < 0] = math.inf
        m = sub
        self._matrix_cache[key] = m
        return m


class _PairTable:
    """The reshard seconds between layouts of one (shape, dtype, combine), priced once each: the layouts
    numbered as first seen, a square table by number (NaN: not priced yet), grown by doubling."""

    def __init__(self) -> None:
        self.ids: dict[ShardingSpec, int] = {}
        self.specs: list[ShardingSpec] = []
        self.table = np.full((16, 16), np.nan)

    def numbers(self, specs: Sequence[ShardingSpec | None]) -> np.ndarray:
        """Each layout's number (-1 for None), numbering the new ones."""
        out = np.empty(len(specs), dtype=np.int64)
        for i, spec in enumerate(specs):
            if spec is None:
                out[i] = -1
                continue
            n = self.ids.get(spec)
            if n is None:
                n = self.ids[spec] = len(self.specs)
                self.specs.append(spec)
            out[i] = n
        if len(self.specs) > self.table.shape[0]:
            grown = np.full((2 * len(self.specs),) * 2, np.nan)
            grown[:self.table.shape[0], :self.table.shape[1]] = self.table
            self.table = grown
        return out


def combined_reductions(graph: Graph) -> tuple[set[int], int]:
    """(``gradient_tensors``, ``k``: how many of their all-reduces XLA issues as one, the parameters the
    step reads): how the problem prices the reduction of those tensors' pending sums."""
    return gradient_tensors(graph), max(1, sum(1 for t in graph.input_tensors(Role.PARAM) if t.consumers))


def gradient_tensors(graph: Graph) -> set[int]:
    """The top-level tensors whose pending sums XLA reduces together (module docstring): made by a backward
    or update op (or a result of the step, as the loss), and read only by update ops or by backward ops of
    one operand (a reshape, a transpose, a sum, a scaling) whose results are all such tensors. A backward op
    of several operands (the matmul of an input gradient, a mask) makes the next layer's gradients wait for
    the reduction: not such a tensor."""
    out: set[int] = set()
    results = set(graph.outputs)

    def chain(r: Op) -> bool:
        return (r.phase == "backward" and len({t for t in r.inputs if graph.tensors[t].shape}) == 1
                and all(o in out for o in r.outputs))

    for op in reversed(graph.ops):  # readers come after the tensors they read
        if op.bodies:
            continue
        for tid in op.outputs:
            if op.phase == "forward" and tid not in results:
                continue
            readers = [graph.ops[c] for c in graph.tensors[tid].consumers]
            if all(not r.bodies and (r.phase not in ("forward", "backward") or chain(r)) for r in readers):
                out.add(tid)
    return out


def _peak_in_order(order: Sequence[tuple[int, int]], sizes: Sequence[float]) -> float:
    """The largest running sum of ``sizes`` allocated (+1) and freed (-1) in ``order`` (``event_order``)."""
    cur = peak = 0.0
    for j, sign in order:
        cur += sign * sizes[j]
        peak = max(peak, cur)
    return peak


def build_problem(graph: Graph, cost: CostModel, memory_budget: float | None, *,
                  activation_weight: float = 1.0, reduction_weight: float = 1.0) -> BuiltProblem:
    """The solver problem for ``graph`` on ``cost.mesh`` (see the module docstring).

    ``activation_weight``: the activations the forward pass keeps for the backward pass count this many
    times against the memory limit, everything else once (a pipeline stage holds the stashed activations
    of several microbatches at once, but runs one microbatch's pass at a time; see ``_Build.stashed``).
    ``reduction_weight``: the reduction of a pending sum the graph returns costs this fraction of its
    time (a microbatch's gradients, accumulated unreduced and reduced once per step of ``B``: ``1/B``)."""
    built = _Build(graph, cost, activation_weight, reduction_weight).build()
    problem = dataclasses.replace(built.problem, memory_limit=memory_budget)
    return dataclasses.replace(built, problem=problem)


def seconds_by_op(built: BuiltProblem, choice: Sequence[int] | np.ndarray) -> dict[int, float]:
    """Top-level op id -> the compute seconds the problem charges it under ``choice`` (a group's on its
    leader, a body's on its control-flow op): the prices ``trace.recompute.estimate`` needs."""
    out: dict[int, float] = defaultdict(float)
    for i, node in enumerate(built.nodes):
        if node.kind == "op" and node.ops:
            out[node.ops[0][0][0][0] if node.ops[0][0] else node.ops[0][1]] += float(node.compute[int(choice[i])])
    return dict(out)
