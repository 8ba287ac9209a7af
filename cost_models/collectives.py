"""Alpha-beta cost of collectives over one mesh axis or a group of axes.

Byte convention (that of nccl-tests): ``nbytes`` is the **larger per-device buffer** of the collective,
i.e. the tensor as one device sees it when it is *not* split over the collective's axes:

=============== ============================================ ==========================================
kind            ``nbytes`` is                                 bytes each device sends, ring (``p`` devs)
=============== ============================================ ==========================================
all_reduce      the per-device input (= output) buffer       ``2 (p-1)/p · n``
all_gather      the per-device *output* (gathered) buffer    ``(p-1)/p · n``
reduce_scatter  the per-device *input* (unscattered) buffer  ``(p-1)/p · n``
all_to_all      the per-device input (= output) buffer       ``(p-1)/p · n``
send_recv       the message each device sends                ``n``
=============== ============================================ ==========================================

Time on one axis of ``p`` devices with link latency ``α`` and bandwidth ``B`` (per device and direction,
all devices communicating; see ``cost_models.mesh``), after Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH" (IJHPCA 2005) and Chan et al. (2007)::

    ring all_reduce      2(p-1)·α + 2(p-1)/p · n/B      (reduce-scatter then all-gather)
    tree all_reduce      2⌈log2 p⌉·α + 2 · n/B          (pipelined double binary tree, as in NCCL)
    all_gather           (p-1)·α + (p-1)/p · n/B
    reduce_scatter       (p-1)·α + (p-1)/p · n/B
    all_to_all           (p-1)·α + (p-1)/p · n/B        (pairwise exchange, full bisection assumed)
    send_recv            α + n/B

``all_reduce`` takes the faster of ring and tree (what NCCL's tuner does); on large messages that is ring.

Several axes (hierarchical, after Alpa §4 / NCCL's 2-level rings), with the axes ordered fastest link first
(inner) and ``p_i`` the size of the inner axis::

    all_reduce(n; inner, rest)     = reduce_scatter(n; inner) + all_reduce(n/p_i; rest) + all_gather(n; inner)
    all_gather(n; inner, rest)     = all_gather(n/p_i; rest) + all_gather(n; inner)
    reduce_scatter(n; inner, rest) = reduce_scatter(n; inner) + reduce_scatter(n/p_i; rest)
    all_to_all(n; axes)            = Σ_axis (p_a - 1)·α_a + (p_a-1)/p_a · n/B_a   (one exchange per axis)
    send_recv(n; axes)             = max α + n / min B                            (crosses the slowest hop)

and the result is compared with a flat ring over all ``p`` devices at the slowest link; the cheaper wins.
With equal links the hierarchical all-reduce moves exactly ``2(p-1)/p · n`` per device, like the flat ring.

An all-reduce is never priced above its own ring decomposition (``bounded``; ``CostModel.collective_time``
applies it to every price, analytic or measured)::

    all_reduce(n) <= reduce_scatter(n) + all_gather(n)

the two halves the ring all-reduce runs (NCCL's, gloo's), each paying its own latency: an all-reduce
measured slower than its halves is measurement noise, not a slower algorithm. The analytic formulas meet it already (the ring all-reduce is
the sum, the tree one is taken only when cheaper); measured curves may not on small messages, where a
collective costs its latency and the noise on a shared machine is of the same size. The shipped 8-device
CPU profile prices a 4-device all-reduce of 32 kB at 951 us and the reduce-scatter and all-gather of the
same buffer at 135 and 194 us (timed again on that machine, all three cost ~100-200 us over an empty
program). Priced so, a planner avoids every all-reduce: tensor-parallel layers that gather their input
forward and reduce-scatter its gradient backward (two collectives per layer) beat Megatron's column/row
pairs (an all-reduce per pair and pass) and data parallelism. The other way round (an all-gather or a
reduce-scatter as an all-reduce of a padded buffer) is not a bound: XLA issues the collective the layout
asks for, and on the GPU that is a ring all-gather or reduce-scatter however a tree all-reduce is priced.

Combined all-reduces (``combined``). XLA's all-reduce combiner (CPU and GPU) issues independent all-reduces
over the same devices as one instruction of all their buffers: the gradients of a data-parallel step, reduced
as the backward pass ends, pay the latency once (the 6-layer MLP of ``tests/test_small_tensors.py`` issues
its 12 gradients and its loss as one all-reduce of 13 values). A linear price of one of ``k`` such
all-reduces, each with its own time ``t_i`` and the latency ``α`` of that collective on that group::

    combined(t_i; α, k) = t_i - (1 - 1/k) · min(α, t_i)

whose sum over the ``k`` is ``Σ t_i - (k-1)·α``: exactly ``t(Σ n_i)`` when ``t`` is affine
(``α + n/B``) and all ``k`` are reduced together. When only ``m < k`` of them are reduced on that group, the
sum charges ``m/k`` latencies instead of one (an underestimate of ``(1 - m/k)·α``); when XLA's size threshold
cuts a large step's gradients into several instructions, it charges one latency where it issues several (an
underestimate of a latency per extra instruction, small beside the bytes of buffers that large).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from cost_models.errors import CostModelError
from cost_models.mesh import Link

KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise CostModelError(f"unknown collective {kind!r}; known collectives are {', '.join(KINDS)}")
    return kind


def ring_bytes_sent(kind: str, nbytes: float, p: int) -> float:
    """Bytes each device sends in the bandwidth-optimal (ring / pairwise) algorithm; see the table above."""
    check_kind(kind)
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (p - 1) / p * nbytes
    if kind == "send_recv":
        return float(nbytes)
    return (p - 1) / p * nbytes


def _steps(kind: str, p: int) -> int:
    """Latency steps of the ring/pairwise algorithm."""
    if kind == "all_reduce":
        return 2 * (p - 1)
    if kind == "send_recv":
        return 1
    return p - 1


def single_axis_time(kind: str, nbytes: float, p: int, link: Link, *, algorithm: str = "auto") -> float:
    """Seconds for ``kind`` over ``p`` devices joined by ``link``; ``algorithm`` is ``"auto"``, ``"ring"``
    or ``"tree"`` (tree applies to all_reduce only)."""
    check_kind(kind)
    if nbytes < 0:
        raise CostModelError(f"nbytes must be >= 0, got {nbytes}")
    if p <= 1 or nbytes == 0:
        return 0.0
    ring = _steps(kind, p) * link.latency + ring_bytes_sent(kind, nbytes, p) / link.bandwidth
    if kind != "all_reduce" or algorithm == "ring":
        return ring
    tree = 2 * math.ceil(math.log2(p)) * link.latency + 2.0 * nbytes / link.bandwidth
    if algorithm == "tree":
        return tree
    if algorithm != "auto":
        raise CostModelError(f"unknown algorithm {algorithm!r}; use 'auto', 'ring' or 'tree'")
    return min(ring, tree)


def _hierarchical(kind: str, nbytes: float, groups: Sequence[tuple[int, Link]]) -> float:
    """Hierarchical cost over ``groups`` = [(size, link)], fastest link first."""
    if len(groups) == 1:
        return single_axis_time(kind, nbytes, groups[0][0], groups[0][1])
    (p_in, link_in), rest = groups[0], groups[1:]
    if kind == "all_reduce":
        return (
            single_axis_time("reduce_scatter", nbytes, p_in, link_in)
            + _hierarchical("all_reduce", nbytes / p_in, rest)
            + single_axis_time("all_gather", nbytes, p_in, link_in)
        )
    if kind in ("all_gather", "reduce_scatter"):
        return single_axis_time(kind, nbytes, p_in, link_in) + _hierarchical(kind, nbytes / p_in, rest)
    if kind == "all_to_all":
        return sum(single_axis_time("all_to_all", nbytes, p, lk) for p, lk in groups)
    # send_recv
    return max(lk.latency for _, lk in groups) + nbytes / min(lk.bandwidth for _, lk in groups)


def collective_time(kind: str, nbytes: float, groups: Sequence[tuple[int, Link]]) -> float:
    """Seconds for ``kind`` over the device group spanned by ``groups`` = [(axis size, axis link), ...]
    (one entry per mesh axis). Uses the hierarchical formula or a flat ring, whichever is cheaper."""
    check_kind(kind)
    groups = [(int(p), lk) for p, lk in groups if int(p) > 1]
    if not groups or nbytes == 0:
        return 0.0
    if len(groups) == 1:
        return single_axis_time(kind, nbytes, *groups[0])
    ordered = sorted(groups, key=lambda g: (-g[1].bandwidth, g[1].latency))
    hier = _hierarchical(kind, nbytes, ordered)
    if kind == "send_recv":
        return hier
    p = math.prod(g[0] for g in groups)
    slowest = Link(
        name="flat",
        bandwidth=min(lk.bandwidth for _, lk in groups),
        latency=max(lk.latency for _, lk in groups),
    )
    return min(hier, single_axis_time(kind, nbytes, p, slowest))


def combined(time: float, latency: float, k: int) -> float:
    """The price of one of ``k`` all-reduces that XLA issues as one instruction (module docstring): its own
    ``time`` less ``(1 - 1/k)`` of the ``latency`` they share, never below ``time / k``."""
    if k <= 1:
        return time
    return time - (1.0 - 1.0 / k) * min(latency, time)


def bounded(kind: str, own: Callable[[str], float]) -> float:
    """The price of ``kind`` on one buffer, an all-reduce's at most its reduce-scatter's plus its
    all-gather's (module docstring); ``own(k)``: the unbounded price of collective ``k`` on the same buffer
    and device group."""
    check_kind(kind)
    t = own(kind)
    if kind == "all_reduce":
        return min(t, own("reduce_scatter") + own("all_gather"))
    return t
