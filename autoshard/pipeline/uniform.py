"""Cut a step traced at microbatch size into uniform pipeline stages (what ``spmd_program`` runs).

The step, traced at microbatch size and split by ``partition.split_step``, is cut by what its ops are:

- **blocks**: the forward ops of the repeated blocks (``op.layer``, found by ``trace.structure``), ``K`` of
  them, one run of identical blocks, and the backward ops ``trace.structure`` gives each block by dataflow;
- **head** (layer 0): the other forward ops no block output reaches (the embedding), and their backward;
- **tail** (layer ``K+1``): the forward ops after the blocks (final norm, LM head, loss), and their backward;
- **pre**: forward ops that read no batch value and are in no block (position tables, masks): run once
  per step, before the loop;
- **side**: head ops that make a value every block reads from the batch alone (a padding mask, position
  ids): run again by every stage on its microbatch, so that only the stream passes between stages;
- **update**: the optimizer (``UPDATE``), run once per step after the loop on the means of the values
  the microbatched part hands it (``partition``'s accumulated tensors).

With ``S`` stages each stage gets ``n = K / S`` consecutive blocks (a *chunk*). Every chunk must be the
same computation as chunk 0 up to its weights: the same ops in the same order with the same shapes,
parameters and constants (``_same_as_template``). Then chunk 0's ops, re-bound by the emitter's
interpreter, compute any chunk from that chunk's values. One exception: where the first block reads the
batch (no layer with parameters before it), nothing asks for its input's gradient and chunk 0's backward
lacks the transposes that make it; every stage then runs chunk 1's backward (``UniformStages.backward``)
and chunk 0's groups hold stage 0's values at chunk 1's positions (``_first_chunk_aligned``). Each
boundary tensor of a chunk is

- ``act``: the residual stream, produced by the chunk before (the head, for chunk 0);
- ``stacked``: a value made outside the loop that differs per chunk (its weights): stacked ``[S, ...]``
  and split over the stage axis, so each stage holds only its own;
- ``shared``: the same value for every chunk (a causal mask from ``pre``);
- ``res``: a forward value the chunk's backward reads (kept for it in a residual buffer);
- ``cot``: the cotangent of the residual stream, from the chunk after (the tail, for the last chunk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from autoshard.pipeline.draws import row_shaped
from autoshard.pipeline.partition import (
    BACKWARD,
    FORWARD,
    UPDATE,
    PipelineError,
    StepParts,
    boundary,
    input_gradient_ops,
    propagate_layers,
    split_step,
)
from autoshard.pipeline.ticks import cannot_run
from autoshard.trace.graph import Graph, Op, Role

# ---- what runs where (pure: tensor ids) ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """Some ops of the step (in schedule order) and what they exchange with the rest (``boundary``)."""

    ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @staticmethod
    def of(graph: Graph, ops: Sequence[int], keep: Collection[int] = ()) -> Group:
        """``ops``' group; ``keep``: constants counted among its inputs (``UniformStages.stage_constants``)."""
        ops = sorted(ops)
        ins, outs = boundary(graph, ops, keep)
        return Group(tuple(ops), tuple(ins), tuple(outs))


@dataclasses.dataclass(frozen=True, slots=True)
class UniformStages:
    """A microbatch step cut into ``S`` uniform stages (the module docstring's parts), as tensor ids.

    ``f_kinds[j]`` / ``b_kinds[j]``: the kind of chunk 0's forward / backward input ``j`` ("act:k" the
    stream channel ``k``, "stacked", "shared", "res:r" residual ``r``, "cot:k" cotangent channel ``k``);
    ``stacked_f[j][s]`` / ``stacked_b[j][s]``: the value stage ``s`` reads there. ``act_out[k]``: the forward
    output position of stream channel ``k``; ``cot_out[k]``: the backward output position of cotangent
    channel ``k``; ``residuals[r]``: chunk 0's tensor kept for the backward (a forward output or input).
    ``acc_out``: the backward output positions that are accumulated (the chunk's weight gradients);
    ``f_state``: the forward output positions that are state of the chunk's own the step returns, the same for
    every microbatch (an nnx ``Dropout``'s RNG counter, one more a call): kept, not summed."""

    num_stages: int
    blocks: tuple[str, ...]
    pre: Group
    head_f: Group
    head_b: Group
    tail_f: Group
    tail_b: Group
    chunk_f: tuple[Group, ...]
    chunk_b: tuple[Group, ...]
    update: Group
    post: Group  # sums of gradients made on two stages, run after the loop on their means
    accumulated: frozenset[int]  # what the loop sums over microbatches (``partition``'s, less ``post``'s)
    f_kinds: tuple[str, ...]
    b_kinds: tuple[str, ...]
    act_out: tuple[int, ...]
    cot_out: tuple[int, ...]
    residuals: tuple[int, ...]
    acc_out: tuple[int, ...]
    head_act: tuple[int, ...]  # per stream channel: the head's tensor that chunk 0 reads
    tail_cot: tuple[int, ...]  # per cotangent channel: the tail's tensor that the last chunk reads
    head_res: tuple[int, ...]  # head forward values its backward reads
    side: Group = Group((), (), ())  # head ops every stage runs on its microbatch: side inputs (a mask)
    template_b: Group | None = None  # the backward every stage runs: ``chunk_b[0]``, or ``chunk_b[1]``'s ops
    # where the first block reads the batch (``_first_chunk_aligned``)
    # constants the chunks read at the same place with values of their own (flax's dropout folds each module's
    # path into its key: a literal per block): chunk inputs, stacked per stage like the weights
    stage_constants: frozenset[int] = frozenset()
    f_state: tuple[int, ...] = ()

    @property
    def backward(self) -> Group:
        """The chunk backward the program runs at every stage (its ops, and the ids they read and make)."""
        return self.template_b if self.template_b is not None else self.chunk_b[0]

    def from_last_block(self) -> set[int]:
        """What the tail may read of the last chunk: its outputs and its stream inputs."""
        return _last_block_values(self.chunk_f[-1], self.f_kinds)


def _last_block_values(last: Group, f_kinds: Sequence[str]) -> set[int]:
    return set(last.outputs) | {last.inputs[j] for j, k in enumerate(f_kinds) if k.startswith("act")}


def _block_order(graph: Graph, parts: StepParts) -> list[str]:
    """The blocks (``trace.structure``: ``Op.layer``) in forward order."""
    seen: list[str] = []
    for i in parts.ops(FORWARD):
        tag = graph.ops[i].layer
        if tag and tag not in seen:
            seen.append(tag)
    return seen


def _one_run(graph: Graph, parts: StepParts, blocks: Sequence[str]) -> None:
    """Refuse a step whose blocks are of several kinds (an encoder stack and a decoder stack: two runs of
    ``trace.structure``), told apart by their forward ops' count: the program stacks one kind per stage."""
    size: dict[str, int] = dict.fromkeys(blocks, 0)
    for i in parts.ops(FORWARD):
        if graph.ops[i].layer in size:
            size[graph.ops[i].layer] += 1
    kinds = sorted(set(size.values()))
    if len(kinds) > 1:
        runs = " and ".join(f"{sum(1 for b in blocks if size[b] == n)} of {n} forward ops" for n in kinds)
        raise cannot_run(f"its blocks are of {len(kinds)} kinds ({runs}: an encoder and a decoder, say), and the "
                         "program stacks one kind of block per stage; run it with runtime='mpmd' (one process), "
                         "which places any layers on any stage")


def uniform_stages(graph: Graph, num_stages: int, parts: StepParts | None = None,
                   per_microbatch: Collection[int] = ()) -> UniformStages:
    """Cut ``graph`` (a step traced at microbatch size) into ``num_stages`` uniform stages, or raise a
    ``PipelineError`` that says why it cannot be (and what to change). ``per_microbatch``: ops that read no
    batch value yet make one of their own per microbatch (random draws over the batch's rows,
    ``pipeline.draws``): cut as if they read the batch, never into ``pre``."""
    parts = parts or split_step(graph)
    S = num_stages
    if S < 2:
        raise cannot_run("it needs at least 2 stages")
    blocks = _block_order(graph, parts)
    K = len(blocks)
    fwd_flops = sum(graph.ops[i].flops for i in parts.ops(FORWARD)) or 1.0
    stack = [graph.ops[i] for i in parts.ops(FORWARD) if graph.ops[i].primitive == "scan"
             and (graph.ops[i].trip_count or 0) >= 2 and graph.ops[i].flops > 0.5 * fwd_flops]
    if stack:
        raise cannot_run(f"its layers are one scan ({stack[0].where()}, {stack[0].trip_count} iterations), which the "
                    "SPMD pipeline cuts only unrolled: trace the step with pipeline.trace_microbatch (it unrolls a "
                    "scan that slices parameters per iteration), or write the blocks unrolled")
    if K == 0:
        raise cannot_run("no repeated blocks were found in the model's forward pass (a run of layers that compute "
                         "the same thing on weights of their own, each reading the one before): the program stacks "
                         "identical blocks per stage; run it with runtime='mpmd' (one process)")
    _one_run(graph, parts, blocks)
    if K < S or K % S:
        raise cannot_run(f"the model has {K} repeated blocks ({', '.join(blocks[:3])}{', ...' if K > 3 else ''}), which "
                    f"{S} stages cannot share evenly; use a stage count dividing {K} (max_stages=, stage_shape=)")
    block_of = {tag: k for k, tag in enumerate(blocks)}
    n_ops = len(graph.ops)
    # which ops read the batch (directly or through other ops), and which read a block's output
    batchy = [False] * n_ops
    after_block = [False] * n_ops
    batch_in = {t for t in graph.inputs if graph.tensors[t].role is Role.BATCH}
    own = set(per_microbatch)
    for op in graph.ops:
        ins = [graph.tensors[t] for t in op.inputs]
        batchy[op.id] = op.id in own or any(t.id in batch_in or (t.producer is not None and batchy[t.producer])
                                            for t in ins)
        after_block[op.id] = op.layer in block_of or any(
            t.producer is not None and after_block[t.producer] for t in ins)
    fwd = parts.ops(FORWARD)
    # the head: forward ops the blocks read, directly or through other such ops (the embedding; not the
    # labels, which only the loss reads)
    feeds_block = [False] * n_ops
    fwd_set = set(fwd)
    for i in reversed(fwd):
        op = graph.ops[i]
        feeds_block[i] = op.layer in block_of or any(
            c in fwd_set and feeds_block[c] for t in op.outputs for c in graph.tensors[t].consumers)
    fwd_layer = []
    pre: list[int] = []
    for i in fwd:
        op = graph.ops[i]
        if op.layer in block_of:
            fwd_layer.append(block_of[op.layer] + 1)
        elif after_block[i] or (batchy[i] and not feeds_block[i]):
            fwd_layer.append(K + 1)
        elif batchy[i]:
            fwd_layer.append(0)
        else:  # pre: above every layer, so that the min rule never pulls a backward op towards it
            fwd_layer.append(K + 2)
            pre.append(i)
    layer = list(propagate_layers(graph, fwd, fwd_layer))
    # a backward op runs with the block ``trace.structure`` assigns it by dataflow; one outside the blocks
    # with the tail if it runs before the last block's backward begins, with the head if after the first
    # block's has ended (jax emits the backward pass in reverse: the tail's, the blocks' last to first, the
    # head's)
    bwd_span: dict[str, list[int]] = {}
    for op in graph.ops:
        if parts.kind[op.id] == BACKWARD and op.layer in block_of:
            bwd_span.setdefault(op.layer, [op.id, op.id])[1] = op.id
    tail_before = bwd_span[blocks[-1]][0] if blocks[-1] in bwd_span else -1
    head_after = bwd_span[blocks[0]][1] if blocks[0] in bwd_span else len(graph.ops)
    for op in graph.ops:
        if parts.kind[op.id] != BACKWARD:
            continue
        own = block_of.get(op.layer)
        if own is not None:
            layer[op.id] = own + 1
        elif 1 <= layer[op.id] <= K:
            if op.id < tail_before:
                layer[op.id] = K + 1
            elif op.id > head_after:
                layer[op.id] = 0
    pre_set = set(pre)
    for op in reversed(graph.ops):  # an op that reads only pre values runs with its first reader
        if layer[op.id] > K + 1 and op.id not in pre_set and parts.kind[op.id] != UPDATE:
            users = [layer[c] for t in op.outputs for c in graph.tensors[t].consumers if layer[c] <= K + 1]
            layer[op.id] = min(users) if users else 0
    for op in graph.ops:
        if parts.kind[op.id] == BACKWARD and op.layer not in block_of and 1 <= layer[op.id] <= K:
            raise cannot_run(f"{op.where()} belongs to no block but runs amid the blocks' backward pass, reading "
                             f"block {layer[op.id] - 1}'s gradients; run it with runtime='mpmd' (one process)")
    by: dict[tuple[str, int], list[int]] = {}
    for op in graph.ops:
        kind = parts.kind[op.id]
        if kind == UPDATE or op.id in pre_set:
            continue
        by.setdefault((kind, layer[op.id]), []).append(op.id)
    n = K // S

    lifted: frozenset[int] = frozenset()

    def chunk(kind: str, s: int) -> Group:
        return Group.of(graph, [i for b in range(s * n + 1, (s + 1) * n + 1) for i in by.get((kind, b), [])], lifted)

    # a gradient summed from two places (tied input and output embeddings: the head's and the tail's parts)
    # is summed after the loop instead: the mean over microbatches of a sum is the sum of the means
    accumulated = set(parts.accumulated)
    post: list[int] = []
    for key in ((BACKWARD, 0), (BACKWARD, K + 1)):
        for i in list(by.get(key, [])):
            op = graph.ops[i]
            srcs = {layer[graph.tensors[t].producer] for t in op.inputs if graph.tensors[t].producer is not None}
            if op.primitive == "add_any" and len(srcs) > 1 and all(t in accumulated for t in op.outputs):
                by[key].remove(i)
                post.append(i)
                accumulated -= set(op.outputs)
                accumulated |= {t for t in op.inputs if graph.tensors[t].producer is not None}
    chunk_f = tuple(chunk(FORWARD, s) for s in range(S))
    chunk_b = tuple(chunk(BACKWARD, s) for s in range(S))
    lifted = frozenset(_stage_constants(graph, chunk_f) | _stage_constants(graph, chunk_b[1:]))
    if lifted:
        chunk_f = tuple(chunk(FORWARD, s) for s in range(S))
        chunk_b = tuple(chunk(BACKWARD, s) for s in range(S))
    head_f, head_b = Group.of(graph, by.get((FORWARD, 0), [])), Group.of(graph, by.get((BACKWARD, 0), []))
    tail_f, tail_b = Group.of(graph, by.get((FORWARD, K + 1), [])), Group.of(graph, by.get((BACKWARD, K + 1), []))
    template_b = chunk_b[0]
    if len(_exports(graph, chunk_b[0])) < len(_exports(graph, chunk_b[1])):  # the first block reads the batch
        if lifted:
            raise cannot_run("its first block reads the batch (no layer with parameters before it) and every block "
                             "reads constants of its own (a dropout key folded with the block's name): add a layer "
                             "with parameters before the blocks (an input projection), or run with runtime='mpmd' "
                             "on one process")
        chunk_f, chunk_b = _first_chunk_aligned(graph, chunk_f, chunk_b, accumulated)
        template_b = chunk_b[1]
    for s in range(1, S):
        _same_as_template(graph, chunk_f[0], chunk_f[s], s, "forward")
        _same_as_template(graph, template_b, chunk_b[s], s, "backward")
    producer_group: dict[int, tuple[str, int]] = {}
    for name, groups in (("f", chunk_f), ("b", chunk_b)):
        for s, g in enumerate(groups):
            for i in g.ops:
                producer_group[i] = (name, s)
    for name, g in (("head_f", head_f), ("head_b", head_b), ("tail_f", tail_f), ("tail_b", tail_b)):
        for i in g.ops:
            producer_group[i] = (name, -1)
    per_mb = set(producer_group)

    def made_by(t: int) -> tuple[str, int] | None:
        p = graph.tensors[t].producer
        return producer_group.get(p) if p is not None else None

    def outside(t: int) -> bool:  # a value the loop receives from outside: step input, constant, pre output
        p = graph.tensors[t].producer
        return p is None or p not in per_mb

    head_f_set = set(head_f.ops)
    side: set[int] = set()

    def side_input(t: int) -> bool:
        """Whether ``t`` is a side input every stage can make from its microbatch: made by the head's forward
        from the batch, constants and values made before the loop alone, no parameter among them (so no
        gradient flows back through it): a padding mask, position ids. Its ops join ``side``."""
        todo, seen = [t], set()
        while todo:
            x = todo.pop()
            p = graph.tensors[x].producer
            if p is None:
                if graph.tensors[x].role is Role.PARAM:
                    return False
                continue
            if p not in per_mb or p in seen:
                continue
            if p not in head_f_set:
                return False
            seen.add(p)
            todo.extend(graph.ops[p].inputs)
        side.update(seen)
        return True

    # chunk forward outputs: the stream (read by the next chunk) and residuals (read by its own backward)
    act_out: list[int] = []
    for k, t in enumerate(chunk_f[0].outputs):
        readers = {producer_group.get(c) for c in graph.tensors[t].consumers}
        if ("f", 1) in readers:
            act_out.append(k)
    if not act_out:
        raise cannot_run("no value flows from one block to the next")
    f_kinds: list[str] = []
    stacked_f: list[list[int]] = []
    res_tensors: list[int] = []  # chunk 0's residual tensors, in order
    for j, t0 in enumerate(chunk_f[0].inputs):
        col = [chunk_f[s].inputs[j] for s in range(S)]
        src = made_by(col[1])
        if src == ("f", 0):
            k = chunk_f[0].outputs.index(col[1])
            if k not in act_out or any(col[s] != chunk_f[s - 1].outputs[k] for s in range(2, S)) \
                    or (made_by(t0) != ("head_f", -1) and t0 not in batch_in):
                raise cannot_run(f"block input {graph.tensors[t0].name!r} does not come from the block before")
            f_kinds.append(f"act:{act_out.index(k)}")
        elif all(c == t0 for c in col):
            if not outside(t0) and not side_input(t0):
                raise cannot_run(f"every block reads {graph.tensors[t0].name!r}, which is computed per microbatch "
                            "outside the blocks from the model's weights; only the residual stream passes between "
                            "stages (compute it inside each block, or from the batch and constants only)")
            f_kinds.append("shared")
        elif all(outside(c) for c in col):
            f_kinds.append("stacked")
        else:
            raise cannot_run(f"block input {graph.tensors[t0].name!r} is neither a weight nor the residual stream")
        stacked_f.append(col)
    head_act = []
    for k in act_out:
        pos = [j for j, kind in enumerate(f_kinds) if kind == f"act:{act_out.index(k)}"]
        head_act.append(chunk_f[0].inputs[pos[0]])
    b_kinds: list[str] = []
    stacked_b: list[list[int]] = []
    cot_out: list[int] = []
    for k, t in enumerate(chunk_b[1].outputs):
        if any(producer_group.get(c) == ("b", 0) for c in graph.tensors[t].consumers):
            cot_out.append(k)
    for j, t0 in enumerate(chunk_b[0].inputs):
        col = [chunk_b[s].inputs[j] for s in range(S)]
        src = made_by(t0)
        f_in = chunk_f[0].inputs.index(t0) if t0 in chunk_f[0].inputs else None
        if src == ("f", 0) or (f_in is not None and f_kinds[f_in].startswith("act")):
            # a forward value of the chunk, or its stream input: the same position at every stage
            same = [chunk_f[s].outputs[chunk_f[0].outputs.index(t0)] if f_in is None else chunk_f[s].inputs[f_in]
                    for s in range(S)]
            if same != col:
                raise cannot_run(f"stage backwards read their forwards' values differently ({graph.tensors[t0].name!r})")
            if t0 not in res_tensors:
                res_tensors.append(t0)
            b_kinds.append(f"res:{res_tensors.index(t0)}")
        elif made_by(col[0]) == ("b", 1):
            k = chunk_b[1].outputs.index(col[0])
            if k not in cot_out or any(chunk_b[s + 1].outputs[k] != col[s] for s in range(S - 1)):
                raise cannot_run(f"a block's backward reads {graph.tensors[t0].name!r} from the block after it in "
                            "different ways at different stages")
            b_kinds.append(f"cot:{cot_out.index(k)}")
        elif all(c == t0 for c in col) and (outside(t0) or side_input(t0)):
            b_kinds.append("shared")
        elif all(outside(c) for c in col):
            b_kinds.append("stacked")
        else:
            raise cannot_run(f"a block's backward reads {graph.tensors[t0].name!r}, which is none of its weights, "
                        "its forward's values or the cotangent from the block after")
        stacked_b.append(col)
    tail_cot = []
    last = chunk_b[S - 1]
    for k in range(len(cot_out)):
        j = b_kinds.index(f"cot:{k}")
        t = last.inputs[j]
        if made_by(t) not in (("tail_b", -1), ("tail_f", -1)):
            raise cannot_run(f"the last block's cotangent {graph.tensors[t].name!r} does not come from the layers "
                        "after the blocks")
        tail_cot.append(t)
    acc_out = tuple(k for k, t in enumerate(chunk_b[0].outputs) if t in accumulated)
    for k, t in enumerate(chunk_b[0].outputs):
        if k not in acc_out and k not in cot_out:
            raise cannot_run(f"a block's backward hands {graph.tensors[t].name!r} to something other than the "
                        "optimizer or the block before")
    # a block's own integer state made from its weights and state alone (an nnx Dropout's RNG counter, one more
    # a call) is the same for every microbatch: each chunk keeps its forward's value (``f_state``); one made from
    # the microbatch (a count of its tokens) or a float one (an auxiliary loss) is refused
    kept = _from_stacked(graph, chunk_f[0], f_kinds, per_microbatch)
    f_state = tuple(k for k, t in enumerate(chunk_f[0].outputs) if t in accumulated and not graph.tensors[t].inexact
                    and t in kept)
    for t in chunk_f[0].outputs:
        if t in accumulated and not graph.tensors[t].inexact and t not in kept:
            raise cannot_run(f"a block's forward returns {graph.tensors[t].name!r} ({graph.tensors[t].dtype}) from "
                             "the gradient computation, made from each microbatch (a count of its tokens), which "
                             "the program does not sum over microbatches yet; run with runtime='mpmd' on one process")
        if t in accumulated and graph.tensors[t].inexact:
            raise cannot_run(f"a block's forward returns {graph.tensors[t].name!r} ({graph.tensors[t].dtype}) from the "
                             "gradient computation, a value of its own per microbatch (an auxiliary loss, a batch "
                             "norm's running statistics) that the program does not average yet; run with "
                             "runtime='mpmd' on one process")
    head_res = tuple(t for t in head_f.outputs if any(producer_group.get(c) == ("head_b", -1)
                                                        for c in graph.tensors[t].consumers))
    for t in head_f.outputs:
        if t in accumulated:
            raise cannot_run(f"the layers before the blocks return {graph.tensors[t].name!r} from the gradient "
                        "computation (not supported yet)")
    # what each group outside the blocks may read inside the loop
    batch_ok = {t for t in graph.inputs if graph.tensors[t].role is Role.BATCH}
    last_f = _last_block_values(chunk_f[S - 1], f_kinds)
    allowed = {
        "the layers before the blocks (forward)": (head_f, set()),
        "the layers before the blocks (backward)": (head_b, set(head_f.outputs)
                                                    | {chunk_b[0].outputs[k] for k in cot_out}),
        "the layers after the blocks (forward)": (tail_f, last_f),
        "the layers after the blocks (backward)": (tail_b, last_f | set(tail_f.outputs)),
    }
    for what, (grp, ok) in allowed.items():
        for t in grp.inputs:
            if not (t in ok or t in batch_ok or outside(t)):
                raise cannot_run(f"{what} read {graph.tensors[t].name!r}, made per microbatch on another stage "
                            "(tied input and output embeddings are not supported yet)")
    return UniformStages(
        num_stages=S, blocks=tuple(blocks), pre=Group.of(graph, pre), head_f=head_f, head_b=head_b,
        tail_f=tail_f, tail_b=tail_b, chunk_f=chunk_f, chunk_b=chunk_b,
        update=Group.of(graph, parts.ops(UPDATE)), post=Group.of(graph, post), accumulated=frozenset(accumulated),
        f_kinds=tuple(f_kinds), b_kinds=tuple(b_kinds),
        act_out=tuple(act_out), cot_out=tuple(cot_out), residuals=tuple(res_tensors), acc_out=acc_out,
        head_act=tuple(head_act), tail_cot=tuple(tail_cot), head_res=head_res, side=Group.of(graph, side),
        template_b=template_b, stage_constants=lifted, f_state=f_state)


def _from_stacked(graph: Graph, group: Group, kinds: Sequence[str], per_microbatch: Collection[int]) -> set[int]:
    """The tensors of ``group`` (a chunk's forward) made from its "stacked" inputs (its weights and state) and
    constants alone: the same for every microbatch. ``per_microbatch``: ops that make values of their own per
    microbatch whatever they read (``uniform_stages``)."""
    made = {t for t, kind in zip(group.inputs, kinds, strict=True) if kind == "stacked"}
    inputs = set(group.inputs)
    for i in group.ops:
        op = graph.ops[i]
        if i not in per_microbatch and all(t in made or (t not in inputs and graph.tensors[t].producer is None)
                                           for t in op.inputs):
            made.update(op.outputs)
    return made


def _stage_constants(graph: Graph, groups: Sequence[Group]) -> set[int]:
    """The constants that groups of the same ops (a chunk per stage) read at the same operand of the same op
    with values that differ between groups: Flax's dropout folds a hash of each module's path into the key
    (``random_fold_in`` on a literal), so each block computes the same thing on a constant of its own. The
    SPMD program feeds them per stage, as it does the weights (``UniformStages.stage_constants``); groups
    that differ otherwise are left to ``_same_as_template``'s error."""
    if len(groups) < 2 or len({len(g.ops) for g in groups}) != 1:
        return set()

    def const_value(op: Op, i: int) -> bytes | None:
        val = graph.constant_value(op, i) if graph.tensors[op.inputs[i]].role is Role.CONST else None
        return None if val is None else np.asarray(val).tobytes()

    out: set[int] = set()
    for k in range(len(groups[0].ops)):
        ops = [graph.ops[g.ops[k]] for g in groups]
        if len({(op.primitive, len(op.inputs)) for op in ops}) != 1:
            continue
        for i in range(len(ops[0].inputs)):
            vals = [const_value(op, i) for op in ops]
            if None not in vals and len(set(vals)) > 1:
                out.update(op.inputs[i] for op in ops)
    return out


# ---- a weight pass (ZB-H1) ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WeightPass:
    """Each chunk's backward split for a zero-bubble schedule: ``input_b[u]`` (``B``: the ops the cotangent
    to the chunk before waits for, ``partition.input_gradient_ops``) and ``weight[u]`` (``W``: the rest, the
    weight gradients), each the same computation at every chunk. ``b_from[i]``: the backward's input
    position (``UniformStages.b_kinds``) of ``B``'s input ``i``; ``w_from[i]``: ``("b", j)``, the backward's
    input ``j`` (a residual, the cotangent, a weight), or ``("g", k)``, ``B``'s output ``g_out[k]`` kept for
    ``W`` (the gradients of the block's inner values). ``acc_in_b``: the accumulated backward outputs
    (``acc_out`` positions) ``B`` makes; ``W`` makes the others."""

    input_b: tuple[Group, ...]
    weight: tuple[Group, ...]
    b_from: tuple[int, ...]
    w_from: tuple[tuple[str, int], ...]
    g_out: tuple[int, ...]
    acc_in_b: frozenset[int]


def weight_pass(graph: Graph, cut: UniformStages, parts: StepParts) -> WeightPass:
    """``cut``'s chunk backwards split into ``B`` and ``W`` (``WeightPass``), or a ``PipelineError``."""
    V = cut.num_stages
    ib: list[Group] = []
    w: list[Group] = []
    for u in range(V):
        ops = (cut.backward if u == 0 else cut.chunk_b[u]).ops
        need = input_gradient_ops(graph, parts, ops)
        ib.append(Group.of(graph, [i for i in ops if i in need], cut.stage_constants))
        w.append(Group.of(graph, [i for i in ops if i not in need], cut.stage_constants))
    if not w[0].ops:
        raise cannot_run("the blocks' backward has no weight-gradient part to run apart (ZB-H1); use 1f1b")
    for u in range(1, V):
        _same_as_template(graph, ib[0], ib[u], u, "input-gradient backward")
        _same_as_template(graph, w[0], w[u], u, "weight-gradient backward")
    b_from: list[int] = []
    w_from: list[tuple[str, int]] = []
    g_out: list[int] = []
    for u in range(V):
        b_in = (cut.backward if u == 0 else cut.chunk_b[u]).inputs
        got_b = [b_in.index(t) if t in b_in else -1 for t in ib[u].inputs]
        got_w: list[tuple[str, int]] = []
        for t in w[u].inputs:
            if t in b_in:
                got_w.append(("b", b_in.index(t)))
            elif t in ib[u].outputs:
                k = ib[u].outputs.index(t)
                if u == 0 and k not in g_out:
                    g_out.append(k)
                got_w.append(("g", g_out.index(k) if k in g_out else -1))
            else:
                raise cannot_run(f"the weight-gradient part reads {graph.tensors[t].name!r}, which is neither the "
                                 "backward's input nor its input-gradient part's output")
        if u == 0:
            b_from, w_from = got_b, got_w
        elif got_b != b_from or got_w != w_from:
            raise cannot_run(f"stage {u}'s backward splits into its input- and weight-gradient parts differently "
                             "from stage 0's")
    if -1 in b_from:
        raise cannot_run("the input-gradient part reads a value its backward does not receive")
    b0 = cut.backward.outputs
    acc_in_b = frozenset(p for p in cut.acc_out if b0[p] in ib[0].outputs)
    for p in cut.cot_out:
        if b0[p] not in ib[0].outputs:
            raise cannot_run(f"the cotangent {graph.tensors[b0[p]].name!r} is not made by the input-gradient part")
    return WeightPass(input_b=tuple(ib), weight=tuple(w), b_from=tuple(b_from), w_from=tuple(w_from),
                      g_out=tuple(g_out), acc_in_b=acc_in_b)


# ---- a layer stack's rows (``trace.unroll``) --------------------------------------------------------------


def row_of(graph: Graph, tid: int) -> tuple[int, int] | None:
    """``(x, j)`` when tensor ``tid`` is row ``j`` of step input ``x`` along dimension 0 (a one-row ``slice``
    then a ``squeeze`` of that dimension: ``index_in_dim``, as ``trace.unroll`` cuts a layer stack's weights
    per block), else None."""
    p = graph.tensors[tid].producer
    if p is None or graph.ops[p].primitive != "squeeze" or tuple(graph.ops[p].eqn.params.get("dimensions", ())) != (0,):
        return None
    q = graph.tensors[graph.ops[p].inputs[0]].producer
    if q is None or graph.ops[q].primitive != "slice":
        return None
    sl = graph.ops[q]
    x = graph.tensors[sl.inputs[0]]
    start, limit = sl.eqn.params["start_indices"], sl.eqn.params["limit_indices"]
    strides = sl.eqn.params.get("strides") or (1,) * len(start)
    if (x.producer is not None or any(k != 1 for k in strides) or limit[0] - start[0] != 1
            or tuple(start[1:]) != (0,) * (len(start) - 1) or tuple(limit[1:]) != tuple(x.shape[1:])):
        return None
    return x.id, int(start[0])


def strided_rows(graph: Graph, tids: Sequence[int]) -> tuple[int, int, int] | None:
    """``(x, first, step)`` when ``tids[u]`` is row ``first + u·step`` of one step input ``x`` whose rows are
    exactly ``len(tids)·step`` (each chunk reads its ``first``-th block's row of a layer stack), else None."""
    rows = [row_of(graph, t) for t in tids]
    if any(r is None for r in rows) or len({r[0] for r in rows}) != 1:
        return None
    x, first = rows[0]
    step = graph.tensors[x].shape[0] // len(tids)
    if step * len(tids) != graph.tensors[x].shape[0] or any(r[1] != first + u * step for u, r in enumerate(rows)):
        return None
    return x, first, step


def stacked_rows(graph: Graph, op_id: int) -> list[int] | None:
    """The values op ``op_id`` stacks along a new dimension 0, in order (a ``stack`` on axis 0, or a
    ``concatenate`` on dimension 0 of values each given a leading dimension of 1), else None: how
    ``trace.unroll`` hands a layer stack's per-block gradients to the optimizer."""
    op = graph.ops[op_id]
    if op.primitive == "stack" and int(op.eqn.params.get("axis", -1)) == 0:
        return list(op.inputs)
    if op.primitive != "concatenate" or int(op.eqn.params.get("dimension", -1)) != 0:
        return None
    rows = []
    for t in op.inputs:
        p = graph.tensors[t].producer
        if p is None or graph.ops[p].primitive not in ("broadcast_in_dim", "reshape") \
                or graph.tensors[t].shape[:1] != (1,) or graph.tensors[t].consumers != (op_id,):
            return None
        src = graph.tensors[graph.ops[p].inputs[0]]
        if src.shape != graph.tensors[t].shape[1:]:
            return None
        rows.append(src.id)
    return rows


def _first_chunk_aligned(graph: Graph, chunk_f: tuple[Group, ...], chunk_b: tuple[Group, ...],
                         accumulated: set[int]) -> tuple[tuple[Group, ...], tuple[Group, ...]]:
    """``chunk_f`` and ``chunk_b`` with chunk 0's groups replaced by stage 0's values at chunk 1's positions,
    where the first block reads the batch (no embedding before it): nothing asks for the gradient of its
    input, so jax leaves the transposes that make it out of chunk 0's backward, and chunk 0 is not the same
    computation as the others. The program then runs chunk 1's backward at every stage (``template_b``);
    at stage 0 the cotangent it makes for the input goes nowhere. This holds when chunk 0's forward is chunk
    1's (the same ops, ``_signature``) and its backward is chunk 1's pruned to what the weight gradients
    need: its returned ``Group`` for the forward has chunk 0's ops, inputs, and as outputs chunk 0's values
    made where chunk 1's outputs are made (exported or not); the one for the backward keeps chunk 0's ops
    (what runs with stage 0) but reads and makes, position by position as ``chunk_b[1]``, stage 0's
    values: its weights, residuals and cotangent; a weight read only to make the input's cotangent is chunk
    1's own (its value changes nothing kept), and the input's cotangent position holds chunk 1's."""
    f0, f1, b0, b1 = chunk_f[0], chunk_f[1], chunk_b[0], chunk_b[1]
    if _signature(graph, f0) != _signature(graph, f1):
        raise cannot_run("the first block's forward differs from the second's (it reads the batch, with no layer "
                         "with parameters before it); add one (an input projection), or run with runtime='mpmd' "
                         "on one process")
    at = {op_id: k for k, op_id in enumerate(f1.ops)}
    twin = {t: graph.ops[f0.ops[at[p]]].outputs[graph.ops[p].outputs.index(t)]
            for p in f1.ops for t in graph.ops[p].outputs}  # chunk 1's forward value -> chunk 0's
    twin.update(zip(f1.inputs, f0.inputs, strict=True))
    f0 = Group(f0.ops, f0.inputs, tuple(twin[t] for t in f1.outputs))
    # chunk 1's backward pruned to its weight gradients, op by op against chunk 0's
    inside = set(b1.ops)
    need = {graph.tensors[t].producer for t in b1.outputs if t in accumulated}
    for op_id in reversed(b1.ops):
        if op_id in need:
            need.update(p for t in graph.ops[op_id].inputs if (p := graph.tensors[t].producer) in inside)
    pruned = Group.of(graph, [i for i in b1.ops if i in need])
    if _signature(graph, pruned) != _signature(graph, b0):
        raise cannot_run("stage 0's blocks compute no gradient of their input, since nothing before them has "
                         "parameters (the first block reads the batch), and their backward is not the others' "
                         "less that gradient; add a layer with parameters before them (an input projection), or "
                         "run with runtime='mpmd' on one process")
    at = {op_id: k for k, op_id in enumerate(pruned.ops)}
    for p in pruned.ops:
        for t in graph.ops[p].outputs:
            twin[t] = graph.ops[b0.ops[at[p]]].outputs[graph.ops[p].outputs.index(t)]
    twin.update(zip(pruned.inputs, b0.inputs, strict=True))
    kept = [twin.get(t, t) for t in b1.outputs if t in accumulated]
    if sorted(kept) != sorted(t for t in b0.outputs if t in accumulated):
        raise cannot_run("stage 0's blocks' weight gradients do not match the other stages' position by position")
    b0 = Group(b0.ops, tuple(twin.get(t, t) for t in b1.inputs), tuple(twin.get(t, t) for t in b1.outputs))
    return (f0, *chunk_f[1:]), (b0, *chunk_b[1:])


def _signature(graph: Graph, group: Group) -> list[tuple[Any, ...]]:
    """What makes a group the computation it is, up to which outside values it reads: per op its
    primitive, params, shapes, where each operand comes from (an op of the group, a boundary input's
    position, or a constant's value)."""
    pos = {op_id: k for k, op_id in enumerate(group.ops)}
    ins = {t: j for j, t in enumerate(group.inputs)}
    out = []
    for op_id in group.ops:
        op = graph.ops[op_id]
        src = []
        for i, t in enumerate(op.inputs):
            ten = graph.tensors[t]
            if ten.producer is not None and ten.producer in pos:
                src.append(("op", pos[ten.producer], graph.ops[ten.producer].outputs.index(t)))
            elif t in ins:
                src.append(("in", ins[t]))
            else:
                val = graph.constant_value(op, i)
                src.append(("const", ten.shape, ten.dtype, None if val is None else np.asarray(val).tobytes()))
        shapes = tuple((graph.tensors[t].shape, graph.tensors[t].dtype) for t in op.outputs)
        out.append((op.primitive, op.params, shapes, tuple(src)))
    return out


def _exports(graph: Graph, group: Group) -> list[tuple[int, int]]:
    pos = {op_id: k for k, op_id in enumerate(group.ops)}
    return [(pos[graph.tensors[t].producer], graph.ops[graph.tensors[t].producer].outputs.index(t))
            for t in group.outputs]


def _same_as_template(graph: Graph, template: Group, other: Group, stage: int, what: str) -> None:
    mine, theirs = _exports(graph, template), _exports(graph, other)
    if mine != theirs:
        raise cannot_run(f"stage {stage}'s blocks hand {len(theirs)} values to the rest of the step ({what}) where "
                         f"stage 0's hand {len(mine)}: the stages are not the same computation; run it with "
                         "runtime='mpmd' (one process)")
    a, b = _signature(graph, template), _signature(graph, other)
    if len(a) != len(b):
        raise cannot_run(f"stage {stage}'s blocks have {len(b)} {what} ops where stage 0's have {len(a)}: the stages "
                    "are not the same computation")
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            op = graph.ops[other.ops[k]]
            raise cannot_run(f"stage {stage}'s {what} differs from stage 0's at {op.where()} ({x[0]} against "
                        f"{y[0]}): every stage must run the same blocks with only their weights different")


def tail_spreadable(graph: Graph, parts: StepParts | None = None) -> int:
    """The microbatch's rows when the SPMD program can spread the tail (the layers after the blocks) over
    stages by rows (``spmd_program.Spread``): the step cuts into uniform stages and every value the tail
    reads from the last block or the batch has the rows as its first dimension; else 0."""
    parts = parts or split_step(graph)
    K = len(_block_order(graph, parts))
    S = next((d for d in range(2, K + 1) if K % d == 0), 0)
    rows = {graph.tensors[graph.inputs[i]].shape[0] for i in parts.batch_inputs if graph.tensors[graph.inputs[i]].shape}
    if not S or len(rows) != 1:
        return 0
    R = next(iter(rows))
    try:
        cut = uniform_stages(graph, S, parts, row_shaped(graph))
    except PipelineError:
        return 0
    from_blocks = cut.from_last_block()
    batch = {graph.inputs[i] for i in parts.batch_inputs}
    reads = {*cut.tail_f.inputs, *cut.tail_b.inputs}
    if any((graph.tensors[t].shape or (0,))[0] != R for t in reads if t in from_blocks or t in batch):
        return 0
    return R if R > 1 else 0
