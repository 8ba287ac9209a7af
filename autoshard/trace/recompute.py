"""What recomputation would save: the peak memory and the extra work of a step if its repeated blocks
were rematerialised, estimated from the step traced *without* recompute (``trace.buffers`` rules).

A *block* is a layer tag of the graph (``Op.layer``, e.g. ``GPT.loss/GPT/block_3``): the ops of one repeated
module, forward and backward. A block's *stash* is what its forward pass leaves for its backward pass:
the held buffers (``buffers``) made by a forward op of the block and read after the backward pass begins.
Per block, three settings (``MODES``), as ``jax.checkpoint`` policies would apply them:

- ``none``: the stash is held from the forward pass to its last backward reader (the traced step);
- ``full`` (``jax.checkpoint`` with no policy, ``nn.remat``): only the block's inputs stay; every stashed
  value is dropped after its last forward reader and made again when the block's backward starts, living
  from there to its last backward reader. Extra work: the block's forward ops once more;
- ``selective`` (Korthikanti et al. 2022; ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``):
  the outputs of the products with a weight (convolutions, and matmuls without batch dimensions: the
  linear layers) stay; everything else is recomputed as in ``full``: the attention core (``QKᵀ`` and
  ``softmax · V``, matmuls with batch dimensions whose ``s²`` scores are the largest values a
  transformer block holds, for few flops) and the elementwise results (norms, activations). Extra work:
  the block's forward ops other than the weight products. (Keeping *every* matmul output, as
  ``dots_saveable`` does, keeps the ``s²`` scores and saves less than holding nothing back: GPT-39B at
  batch 1024 needed more memory that way than as traced.)

Peak: the same sweep as ``Buffers.peak`` over the changed intervals, so that one block's recomputed
values are live at a time, during its own backward pass. Checked against XLA: GPT-1.3B bf16 batch 8
traced without remat, estimated with ``full``, against the compiled step with ``nn.remat`` on one H100
(``tests/data/h100_fidelity.json``; see ``tests/test_recompute.py``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping

from autoshard.trace.buffers import Buffers, buffers
from autoshard.trace.graph import Graph, Op, Tensor

MODES = ("none", "selective", "full")


def saved_by_selective(op: Op) -> bool:
    """Whether selective recompute keeps ``op``'s output: a convolution, or a matmul without batch
    dimensions (a product with a weight; the module docstring)."""
    if op.primitive == "conv_general_dilated":
        return True
    if op.primitive != "dot_general":
        return False
    if op.eqn is not None:
        (_, (lhs_batch, _)) = op.eqn.params["dimension_numbers"]
        return not tuple(lhs_batch)
    dims = op.param("dimension_numbers")
    return dims is not None and dims.replace(" ", "").endswith("((),()))")


@dataclasses.dataclass(frozen=True, slots=True)
class RecomputeEstimate:
    """A setting (one mode on every block, or a mode per block): the step's peak bytes and the extra
    forward work."""

    mode: str | Mapping[str, str]  # as ``estimate`` was given it
    peak_bytes: float
    extra_flops: float
    extra_bytes: float  # bytes the recomputed ops read and write
    extra_seconds: float  # the recomputed ops priced by ``seconds`` (0 without it)
    blocks: int


def stashes(graph: Graph, buf: Buffers | None = None) -> dict[str, list[int]]:
    """Block tag -> the tensor ids of its stash (see the module docstring)."""
    buf = buf or buffers(graph)
    first_bwd = next((op.id for op in graph.ops if op.phase == "backward"), None)
    out: dict[str, list[int]] = defaultdict(list)
    if first_bwd is None:
        return {}
    for t in graph.tensors:
        if t.producer is None or not buf.held[t.id]:
            continue
        op = graph.ops[t.producer]
        if op.layer and op.phase == "forward" and buf.live[t.id][1] > first_bwd:
            out[op.layer].append(t.id)
    return dict(out)


def estimate(graph: Graph, mode: str | Mapping[str, str], nbytes: Callable[[Tensor], float] | None = None,
             seconds: Callable[[Op], float] | None = None) -> RecomputeEstimate:
    """The step's peak memory and extra work with ``mode`` applied to every block, or with each block's
    own mode (``mode`` a mapping block tag -> mode, ``none`` for a block it leaves out); unsharded bytes
    unless ``nbytes`` gives a tensor's bytes per device; ``seconds`` prices one recomputed op, e.g. with
    the planner's cost model."""
    for m in ((mode,) if isinstance(mode, str) else mode.values()):
        if m not in MODES:
            raise ValueError(f"recompute mode {m!r}: expected one of {', '.join(MODES)}")
    size = nbytes or (lambda t: float(t.nbytes))
    buf = buffers(graph)
    live = list(buf.live)
    extra: list[float] = []  # bytes of the recomputed copies, whose intervals follow the tensors' in live
    extra_flops = extra_bytes = extra_seconds = 0.0
    stash = stashes(graph, buf)
    mode_of = {b: (mode if isinstance(mode, str) else mode.get(b, "none")) for b in stash}
    blocks = {b: tids for b, tids in stash.items() if mode_of[b] != "none"}
    if blocks:
        bwd_start: dict[str, int] = {}
        for op in graph.ops:
            if op.phase == "backward" and op.layer and op.layer not in bwd_start:
                bwd_start[op.layer] = op.id
        for layer, tids in blocks.items():
            again = bwd_start.get(layer)
            if again is None:
                continue
            for tid in tids:
                t = graph.tensors[tid]
                if mode_of[layer] == "selective" and saved_by_selective(graph.ops[t.producer]):  # type: ignore[index]
                    continue
                start, end = live[tid]
                fwd_end = max([c + 1 for c in t.consumers if graph.ops[c].phase == "forward"] + [start + 1])
                live[tid] = (start, min(fwd_end, end))
                if end > again:  # the recomputed copy
                    live.append((again, end))
                    extra.append(size(t))
        for op in graph.ops:
            if op.phase != "forward" or op.layer not in blocks:
                continue
            if mode_of[op.layer] == "selective" and saved_by_selective(op):
                continue
            extra_flops += op.flops
            extra_bytes += op.bytes_in + op.bytes_out
            extra_seconds += seconds(op) if seconds is not None else 0.0
    sizes = [size(t) if h else 0.0 for t, h in zip(graph.tensors, buf.held, strict=True)] + extra
    return RecomputeEstimate(mode=mode, peak_bytes=_peak(live, sizes), extra_flops=extra_flops,
                             extra_bytes=extra_bytes, extra_seconds=extra_seconds, blocks=len(stash))


def peak_holders(graph: Graph, k: int = 3) -> list[tuple[str, float]]:
    """The ``k`` largest values live at the step's peak as traced (no recompute), unsharded: (what it is,
    bytes), for messages that say what does not fit: an input by its name, a result by the op making it."""
    buf = buffers(graph)
    live = list(buf.live)
    sizes = [float(t.nbytes) if h else 0.0 for t, h in zip(graph.tensors, buf.held, strict=True)]
    _, when = _peak_at(live, sizes)
    held = sorted((t for t in graph.tensors if sizes[t.id] and live[t.id][0] <= when < live[t.id][1]),
                  key=lambda t: -sizes[t.id])[:k]

    def what(t: Tensor) -> str:
        if t.producer is not None:
            return f"{t.shape} made by {graph.ops[t.producer].where()}"
        reader = f", read by {graph.ops[t.consumers[0]].where()}" if t.consumers else ""
        return f"{t.name or t.shape}{reader}"

    return [(what(t), sizes[t.id]) for t in held]


def _peak(live: list[tuple[int, int]], sizes: list[float]) -> float:
    return _peak_at(live, sizes)[0]


def _peak_at(live: list[tuple[int, int]], sizes: list[float]) -> tuple[float, int]:
    """(the largest sum of ``sizes`` live at once over the ``[start, end)`` intervals ``live``, the first
    time step it is reached; (0.0, 0) when nothing is live)."""
    events: dict[int, float] = defaultdict(float)
    for (s, e), b in zip(live, sizes, strict=True):
        if e > s and b:
            events[s] += b
            events[e] -= b
    cur = best = 0.0
    when = 0
    for t in sorted(events):
        cur += events[t]
        if cur > best:
            best, when = cur, t
    return best, when


def advice(graph: Graph, needed: float, limit: float, seconds: Callable[[Op], float] | None = None) -> str:
    """A sentence for an error saying a step needs ``needed`` bytes per device of ``limit``: which recompute
    setting of its blocks would fit. Each setting's need is ``needed`` scaled by its estimated peak over
    the traced step's (``estimate``; sharding divides both alike), with its extra time when ``seconds``
    prices ops."""
    base = estimate(graph, "none")
    if not base.blocks or base.peak_bytes <= 0:
        return "the step has no repeated blocks to recompute"
    parts, fits = [], []
    for mode in MODES[1:]:
        e = estimate(graph, mode, seconds=seconds)
        need = needed * e.peak_bytes / base.peak_bytes
        more = f", +{e.extra_seconds * 1e3:.3g} ms a step" if seconds is not None else ""
        parts.append(f"{mode} recompute of its {e.blocks} blocks needs about {need / 1e9:.3g} GB{more}")
        if need <= limit:
            fits.append(mode)
    head = (f"recompute would fit ({' or '.join(fits)})" if fits
            else "recompute alone would not fit: add devices or microbatches too")
    return f"{head}: " + "; ".join(parts)
