"""The model's structure from its graph: its repeated blocks, found by what they compute.

Everything the planner does at scale rests on the step's repeated blocks (recompute per block and per stage,
the layer clustering, the SPMD program's uniform stages, interleaving, the summaries). This module alone says
what a block is; every other pass reads ``Op.layer``, which ``tag_blocks`` sets from it. Scope names only
label blocks and break ties: ``block_0``, ``Block_0``, ``layers/0``, ``h/0``, an nnx list, an unrolled
``nn.scan`` and blocks with no number in their names at all give the same blocks.

**Runs of blocks.** Let ``f_0 … f_{n-1}`` be the step's forward ops in schedule order (the jaxpr's order, which
is the order the model's Python ran them) and ``σ(f)`` an op's signature: its primitive, its parameters, and
the shapes and dtypes of its operands and results. A *run* of period ``p`` is ``c >= 2`` consecutive windows
``W_k = f_{s+kp} … f_{s+kp+p-1}`` with ``σ`` equal position by position (a tandem repeat of the signature
string), that are moreover *isomorphic as dataflow*: operand ``i`` of the ``j``-th op of ``W_k`` is, in every
window alike,

- made inside the window, by its ``r``-th op (``("in", r)``); or
- made by the ``r``-th op of the window ``d`` before (``("back", d, r)``; ``d = 1`` is the residual stream).
  The first window reads the value the run's predecessor made there instead (the embedding's output); or
- made outside the run, or a step input (``ext``): a parameter (a different one per window), or a *side
  input* that every window reads alike (a padding mask from the batch, RoPE tables, positions, an encoder's
  output read by every cross-attention).

Each window must read weights of its own (an operand from outside that differs between windows), do work (flops > 0) and, past the first, read the window before
(``back 1``): a stack along the stream, not repeated independent branches.

**Finding them.** With signatures as integers ``a``, for each period ``p`` the positions where
``a[i] = a[i+p]`` form runs; a run ``[i0, i1]`` spans ``L = i1 − i0 + 1 + p`` periodic ops. The run covering
the most ops is taken first (ties: the smaller period, so that four equal layers are four blocks of one,
not two of two; a period of two layers wins only where one layer does not repeat: alternating dense and MoE
layers). Its *phase* (which op starts a block) is the rotation that keeps the most windows and, among those,
cuts the fewest values live across window boundaries (a transformer block's boundary is after the
residual add, where the stream alone crosses), then the one whose boundaries change scope most often. Its
windows are checked for dataflow isomorphism against the second window (the first one against it with its
``back`` operands read from outside); the run ends before the first that fails. The ops taken are masked and
the search repeats, for an encoder stack and a decoder stack, as long as a run of at least ``2%`` of the
forward flops is found.

**Backward ops**, assigned by dataflow, never by name (HF's ``Conv1D`` weights read transposed, tied
embeddings and the optimizer's masks need no convention). The forward ops are cut into *segments* in
schedule order (what precedes the first block, each block, what lies between runs, what follows the last).
A forward value's *owner* is the last segment among its producer's and its forward readers' (the stream
``x_k`` made by block ``k−1`` and read by block ``k`` belongs to ``k``); a value read by several blocks (a side
input, a shared weight) has none. A backward op belongs to the last owner among what it reads. Of those
that read none of the forward pass, a weight gradient's own ops (read by no other backward op: a bias's gradient, the cotangent summed over the
batch) join the block whose backward runs next in the schedule (jax emits each block's backward as one
stretch, the transposes of its forward ops in reverse); an op read only by a block's replay barriers
(``trace.remat``'s anchor) joins that block; the rest take the first segment among their operands'
producers (the min rule of ``pipeline.partition``: the op summing the stream's cotangent into ``dx_k`` reads
block ``k+1``'s output cotangent and block ``k``'s). Where that leaves a block with ops beyond what every other
block of its run has (by signature), those are no part of it and go to the head or tail (the position table's
gradient; the final norm's cast of its input cotangent). Ops made from constants alone take their first
reader's segment. ``Op.layer`` is the segment's block tag, or None outside the blocks.

**Tags** (``Op.layer``): a block's ops' common scope prefix where that differs between the run's blocks
(``GPT/block_3``, ``LM/layers/3``), else ``<the run's common scope>/#k`` (``#r.k`` with several runs).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Sequence

import numpy as np

from autoshard.trace.graph import Graph, Op, Role, Tensor

log = logging.getLogger("autoshard")

MIN_RUN_FLOPS = 0.02  # a run must do at least this share of the forward flops
_MAX_SEARCHES = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """``c`` isomorphic blocks along the stream: ``blocks[k]`` the op ids of block ``k``'s forward ops."""

    blocks: tuple[tuple[int, ...], ...]
    tags: tuple[str, ...]
    side_inputs: tuple[int, ...]  # tensor ids every block reads alike, made outside the run (or step inputs)

    @property
    def period(self) -> int:
        return len(self.blocks[0])


@dataclasses.dataclass(frozen=True, slots=True)
class Structure:
    """The step's runs of blocks in forward order and, per op id, its block tag (None outside blocks) and
    its segment: the forward ops' stretches in order (what precedes the first block, each block, what lies
    between runs, what follows the last), a backward op its forward's (module docstring); -1 for the ops of
    neither pass."""

    runs: tuple[Run, ...]
    layer: tuple[str | None, ...]
    segment: tuple[int, ...] = ()

    def segment_of_block(self, tag: str) -> int:
        return self.segment[next(b[0] for r in self.runs for b, t in zip(r.blocks, r.tags, strict=True)
                                 if t == tag)]

    @property
    def tags(self) -> list[str]:
        return [t for r in self.runs for t in r.tags]

    def describe(self) -> str:
        if not self.runs:
            return "no repeated blocks"
        parts = []
        for r in self.runs:
            parts.append(f"{len(r.blocks)} blocks of {r.period} forward ops ({r.tags[0]} .. {r.tags[-1]}"
                         f"{f'; {len(r.side_inputs)} side inputs' if r.side_inputs else ''})")
        return ", ".join(parts)


def structure(graph: Graph) -> Structure:
    """The runs of repeated blocks of ``graph`` and every op's block tag (the module docstring)."""
    memo = graph.memo("trace.structure")
    if "s" not in memo:
        memo["s"] = _find(graph)
    return memo["s"]


def block_labels(graph: Graph) -> frozenset[str]:
    """The names that tell a run's blocks apart where they carry no number (``self.first = Block()``,
    ``self.second = Block()``: ``first``, ``second``): the last component of each block's tag, for the runs
    whose tags differ only there and in no digit. Summaries fold them (``planner.summary``); a numbered
    name (``block_3``, ``layers/3``) folds by its number alone."""
    out: set[str] = set()
    for run in structure(graph).runs:
        heads = {t.rpartition("/")[0] for t in run.tags}
        lasts = [t.rpartition("/")[2] for t in run.tags]
        if len(heads) == 1 and len(set(lasts)) == len(lasts) and not any(c.isdigit() for x in lasts for c in x):
            out.update(lasts)
    return frozenset(out)


def tag_blocks(graph: Graph) -> Graph:
    """``graph`` with every op's ``layer`` set to its block tag (``structure``); ``graph`` itself when
    nothing changes."""
    s = structure(graph)
    if all(op.layer == s.layer[op.id] for op in graph.ops):
        return graph
    ops = tuple(dataclasses.replace(op, layer=s.layer[op.id]) for op in graph.ops)
    out = dataclasses.replace(graph, ops=ops)
    out.memo("trace.structure")["s"] = s
    return out


# ---- finding runs ----------------------------------------------------------------------------------------


def _signature(graph: Graph, op: Op) -> tuple:
    t = graph.tensors
    return (op.primitive, op.params, op.trip_count,
            tuple((t[i].shape, t[i].dtype) for i in op.inputs),
            tuple((t[i].shape, t[i].dtype) for i in op.outputs))


def _find(graph: Graph) -> Structure:
    fwd = [op.id for op in graph.ops if op.phase == "forward"]
    n = len(fwd)
    layer: list[str | None] = [None] * len(graph.ops)
    if n < 2:
        return Structure((), tuple(layer), tuple([-1] * len(graph.ops)))
    pos = {op_id: k for k, op_id in enumerate(fwd)}
    ids: dict[tuple, int] = {}
    a = np.array([ids.setdefault(_signature(graph, graph.ops[i]), len(ids)) for i in fwd], dtype=np.int64)
    flops = np.array([graph.ops[i].flops for i in fwd])
    total = float(flops.sum()) or 1.0
    cross = crossing(graph, fwd)
    scope_change = np.zeros(n + 1, dtype=bool)
    for k in range(1, n):
        scope_change[k] = graph.ops[fwd[k - 1]].scope != graph.ops[fwd[k]].scope
    free = [(0, n)]  # stretches of positions no run has taken
    found: list[tuple[int, int, int]] = []  # (start position, period, count)
    for _ in range(_MAX_SEARCHES):
        cands = [b for lo, hi in free if (b := _best_repeat(a[lo:hi], lo)) is not None]
        if not cands:
            break
        _, s, e, p = max(cands, key=lambda c: (c[0], -c[3]))  # periodic over positions [s, e)
        start, count = _phase(s, e, p, cross, scope_change)
        count = _isomorphic_prefix(graph, fwd, pos, start, p, count)
        if count >= 2 and flops[start:start + count * p].sum() >= MIN_RUN_FLOPS * total:
            found.append((start, p, count))
            cut = (start, start + count * p)
        else:  # nothing usable starts here: break the repeat at its first op and look again
            cut = (s, s + 1)
        free = [piece for lo, hi in free for piece in ((lo, min(hi, cut[0])), (max(lo, cut[1]), hi))
                if piece[1] - piece[0] >= 2]
    found.sort()
    runs = []
    for r, (start, p, count) in enumerate(found):
        blocks = tuple(tuple(fwd[start + k * p + j] for j in range(p)) for k in range(count))
        runs.append(Run(blocks, _tags(graph, blocks, r, len(found)), _side_inputs(graph, blocks)))
    for run in runs:
        for tag, block in zip(run.tags, run.blocks, strict=True):
            for i in block:
                layer[i] = tag
    segment = _assign_backward(graph, fwd, pos, runs, layer)
    return Structure(tuple(runs), tuple(layer), tuple(segment))


def _best_repeat(a: np.ndarray, offset: int = 0) -> tuple[int, int, int, int] | None:
    """The tandem repeat of ``a`` covering the most positions in whole periods (ties: the smaller period),
    as ``(coverage, start, end, period)`` (positions plus ``offset``) with ``a`` ``period``-periodic over ``[start, end)``; None if
    nothing repeats."""
    n = a.shape[0]
    best: tuple[int, int, int, int] | None = None  # (coverage, -period, start, end)
    for p in range(1, n // 2 + 1):
        eq = a[:-p] == a[p:]
        if not eq.any():
            continue
        d = np.diff(np.concatenate(([0], eq.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)  # eq over [starts, ends)
        span = ends - starts + p
        cover = (span // p) * p
        k = int(np.argmax(cover))
        if cover[k] < 2 * p:
            continue
        key = (int(cover[k]), -p, int(starts[k]), int(ends[k] + p))
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else (best[0], offset + best[2], offset + best[3], -best[1])


def crossing(graph: Graph, seq: Sequence[int], weight: Callable[[Tensor], float] | None = None) -> np.ndarray:
    """``cross[b]`` for ``b`` in ``0..len(seq)``: what the values an op of ``seq`` before position ``b`` makes
    and one at ``b`` or after reads weigh (what a cut between positions ``b − 1`` and ``b`` carries; ``weight``
    of a value, one each by default). One sweep: a value adds its weight from its maker to its last reader."""
    pos = {op_id: k for k, op_id in enumerate(seq)}
    n = len(seq)
    delta = np.zeros(n + 2, dtype=np.int64 if weight is None else np.float64)
    for k, op_id in enumerate(seq):
        for t in graph.ops[op_id].outputs:
            last = max((pos[c] for c in graph.tensors[t].consumers if c in pos), default=-1)
            if last > k:
                w = 1 if weight is None else weight(graph.tensors[t])
                delta[k + 1] += w
                delta[last + 1] -= w
    return np.cumsum(delta)[: n + 1]


def _phase(s: int, e: int, p: int, cross: np.ndarray, scope_change: np.ndarray) -> tuple[int, int]:
    """Where the blocks of a ``p``-periodic stretch ``[s, e)`` start, and how many whole ones it holds."""
    best = None
    for phi in range(p):
        start = s + phi
        count = (e - start) // p
        if count < 2:
            continue
        bounds = start + p * np.arange(count + 1)
        key = (count, -int(cross[bounds].sum()), int(scope_change[bounds].sum()), -phi)
        if best is None or key > best[0]:
            best = (key, start, count)
    assert best is not None
    return best[1], best[2]


def _isomorphic_prefix(graph: Graph, fwd: Sequence[int], pos: dict[int, int], start: int, p: int,
                       count: int) -> int:
    """How many of the ``count`` windows from ``start`` are isomorphic as dataflow (module docstring)."""
    def operands(k: int) -> list[tuple] | None:
        """Operand classes of window ``k``; None if it does no work."""
        base = start + k * p
        out: list[tuple] = []
        work = 0.0
        for j in range(p):
            op = graph.ops[fwd[base + j]]
            work += op.flops
            for t in op.inputs:
                q = pos.get(graph.tensors[t].producer) if graph.tensors[t].producer is not None else None
                if q is not None and base <= q < base + p:
                    out.append(("in", q - base))
                elif q is not None and start <= q < base:
                    d, r = divmod(q - start, p)
                    out.append(("back", k - d, r))
                else:
                    out.append(("ext", t))
        return out if work > 0 else None

    ref = operands(1)
    if ref is None or not any(c[0] == "back" and c[1] == 1 for c in ref):
        return 0
    first = operands(0)
    if first is None or len(first) != len(ref) or any(
            x != y and not (y[0] == "back" and x[0] == "ext") and not (x[0] == y[0] == "ext")
            for x, y in zip(first, ref, strict=True)):
        return 0
    # its own weights: an operand from outside that differs between windows (not only side inputs)
    if not any(x[0] == y[0] == "ext" and x[1] != y[1] and graph.tensors[x[1]].role is not Role.CONST
               for x, y in zip(first, ref, strict=True)):
        return 0
    for k in range(2, count):
        got = operands(k)
        if got is None or any(x != y and not (x[0] == y[0] == "ext") for x, y in zip(got, ref, strict=True)):
            return k
    return count


def _side_inputs(graph: Graph, blocks: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Values made outside the run (or step inputs other than parameters) that every block reads."""
    inside = {i for b in blocks for i in b}
    reads = []
    for b in blocks:
        reads.append({t for i in b for t in graph.ops[i].inputs
                      if graph.tensors[t].producer not in inside and graph.tensors[t].role is not Role.CONST})
    common = set.intersection(*reads)
    return tuple(sorted(t for t in common if graph.tensors[t].role is not Role.PARAM))


def _tags(graph: Graph, blocks: Sequence[Sequence[int]], r: int, runs: int) -> tuple[str, ...]:
    """Each block's label: its ops' common scope prefix where those differ between blocks, else
    ``<common scope>/#k`` (``#r.k`` with several runs)."""
    def common(scopes: list[list[str]]) -> list[str]:
        out = scopes[0]
        for s in scopes[1:]:
            m = 0
            while m < min(len(out), len(s)) and out[m] == s[m]:
                m += 1
            out = out[:m]
        return out

    prefixes = ["/".join(common([graph.ops[i].scope.split("/") for i in b])) for b in blocks]
    if all(prefixes) and len(set(prefixes)) == len(prefixes):
        return tuple(prefixes)
    run_prefix = "/".join(common([graph.ops[i].scope.split("/") for b in blocks for i in b]))
    name = f"#{r}." if runs > 1 else "#"
    return tuple(f"{run_prefix}/{name}{k}" if run_prefix else f"{name}{k}" for k in range(len(blocks)))


# ---- backward ops by dataflow ----------------------------------------------------------------------------


def _assign_backward(graph: Graph, fwd: Sequence[int], pos: dict[int, int], runs: Sequence[Run],
                     layer: list[str | None]) -> list[int]:
    """Tag the backward ops of each block by what they read (module docstring); every op's segment."""
    n_ops = len(graph.ops)
    seg = [-1] * n_ops  # forward op -> its segment
    tag_of_seg: dict[int, str] = {}
    block_of = {i: tag for r in runs for b, tag in zip(r.blocks, r.tags, strict=True) for i in b}
    s = 0
    current: str | None = None
    for op_id in fwd:
        tag = block_of.get(op_id)
        if tag != current:
            s += 1
            current = tag
            if tag is not None:
                tag_of_seg[s] = tag
        seg[op_id] = s
    # a forward value's owner: the last segment among its producer's and its forward readers'; a value
    # read by two blocks or more besides its producer's (a side input, a shared weight) has none
    owner: dict[int, int] = {}
    for t in graph.tensors:
        made = seg[t.producer] if t.producer is not None else None
        segs = {seg[c] for c in t.consumers if seg[c] >= 0}
        if made is not None and made < 0:  # made outside the forward pass (a weight sliced from a stack)
            made = None
        if made is None and t.role is not Role.PARAM and len(segs) != 1:
            continue
        if len({x for x in segs if x in tag_of_seg and x != made}) > 1:
            continue
        if made is not None:
            segs.add(made)
        if segs:
            owner[t.id] = max(segs)
    bseg = [-1] * n_ops
    backward = [op for op in graph.ops if op.phase == "backward"]
    for op in backward:  # what it reads of the forward pass
        read = [owner[t] for t in op.inputs if t in owner]
        if read:
            bseg[op.id] = max(read)
    # a weight gradient's own ops (a bias's: the cotangent summed over the batch, read by no other backward
    # op): the block whose backward runs next in the schedule (jax emits each block's backward in one
    # stretch, the transposes of its forward ops in reverse)
    ahead = -1  # the segment of the next op in the schedule that reads the forward pass
    chain: dict[int, int] = {}
    for op in reversed(backward):
        if bseg[op.id] >= 0:
            ahead = bseg[op.id]
            continue
        readers = [c for t in op.outputs for c in graph.tensors[t].consumers if graph.ops[c].phase == "backward"]
        if ahead >= 0 and all(c in chain for c in readers):
            chain[op.id] = ahead
    for op_id, s_ in chain.items():
        bseg[op_id] = s_
    weak: dict[int, list[Op]] = {}
    for op in backward:  # the rest: the first segment among its operands' producers ...
        if bseg[op.id] < 0:
            prods = [bseg[q] for t in op.inputs if (q := graph.tensors[t].producer) is not None and bseg[q] >= 0]
            if prods:
                bseg[op.id] = min(prods)
                readers = [c for t in op.outputs for c in graph.tensors[t].consumers]
                if readers and all(graph.ops[c].primitive == "optimization_barrier" for c in readers):
                    # ... or, read only by a block's replay barriers (``trace.remat``'s anchor: the cotangent
                    # the block receives, reduced to a scalar), that block's
                    users = {bseg[c] for c in readers if bseg[c] >= 0}
                    if len(users) == 1 and (u := users.pop()) in tag_of_seg:
                        bseg[op.id] = u
                weak.setdefault(bseg[op.id], []).append(op)
    _even_out(graph, bseg, weak, [[seg[b[0]] for b in r.blocks] for r in runs])
    for op in reversed(backward):  # made from constants alone (zeros, a mask made again): its first reader's
        if bseg[op.id] < 0:
            users = [bseg[c] for t in op.outputs for c in graph.tensors[t].consumers if bseg[c] >= 0]
            if users:
                bseg[op.id] = min(users)
    for op in backward:
        layer[op.id] = tag_of_seg.get(bseg[op.id])
    return [seg[i] if seg[i] >= 0 else bseg[i] for i in range(n_ops)]


def _even_out(graph: Graph, bseg: list[int], weak: dict[int, list[Op]], runs: Sequence[Sequence[int]]) -> None:
    """Where the dataflow leaves a tie (an op reading only the cotangent a block's backward hands on), keep
    the blocks of a run alike: an op a block has beyond what every other block of its run has (by
    signature) is no part of it: the position table's gradient, summed over the batch from the first block's
    input cotangent, is the head's, and runs with its readers; the cast of the final norm's input cotangent,
    read by the last block, is the tail's, and runs with what made its operand."""
    blocks = {s for r in runs for s in r}
    for segs in runs:
        counts = {s: collections.Counter(_signature(graph, op) for op in weak.get(s, [])) for s in segs}
        common = functools.reduce(operator.and_, counts.values())
        for s in segs:
            extra = counts[s] - common
            for op in reversed(weak.get(s, [])):
                sig = _signature(graph, op)
                if not extra[sig]:
                    continue
                users = [bseg[c] for t in op.outputs for c in graph.tensors[t].consumers if bseg[c] >= 0]
                makers = [bseg[q] for t in op.inputs if (q := graph.tensors[t].producer) is not None and bseg[q] >= 0]
                if users and not blocks.intersection(users):
                    bseg[op.id] = min(users)
                elif makers and not blocks.intersection(makers):
                    bseg[op.id] = min(makers)
                else:
                    continue
                extra[sig] -= 1
