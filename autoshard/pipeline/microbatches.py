"""The microbatch count as a planner decision, when the user gives none.

A pipeline of ``S`` stages running ``B`` microbatches under 1F1B idles a fraction
``(S − 1) / (B + S − 1)`` of its step (the bubble). Across ``H`` hosts joined by slow links the stage DP
cuts at the hosts (``S ≈ H``), so the first candidate is the smallest power of two ``B`` dividing the
batch with ``(S − 1) / (B + S − 1) <= β`` (``β = bubble``, 10%), i.e. ``B >= (S − 1)(1 − β) / β``, with
``S = max(2, H)``. When the step's memory is known (``activations``: the bytes per device the step as
traced needs unpipelined, over the budget), the first candidate also holds what a stage would: a stage of
``1/S`` of the layers on ``D/S`` devices with up to ``S`` microbatches in flight keeps about ``S/B`` of
that per device, and should fill at most half the budget (``HEADROOM``: the rest holds the stage's
parameters, gradients and optimizer state, and lets it take the faster layouts, which keep more live;
GPT-39B bf16 on 8x8, 429 GB as traced: 64 microbatches fill 54 of 72 GB and its stages plan 2-4x slower
than their layers' prices, 128 plan as priced), so ``B >= S · activations / (HEADROOM · budget)``. Larger counts are tried after it, doubling: a smaller microbatch keeps less activation
memory per microbatch in flight, which lets a stage take faster layouts, while every microbatch pays
its fixed per-microbatch costs (and the microbatch's matmuls get thinner). Which wins depends on the
model and the mesh, so each candidate is planned for real: the layer prices at microbatch size
are not linear in the count (layouts change with the memory a microbatch leaves), so the step is traced
again at each microbatch size rather than scaled. ``search`` keeps the best plan, stops once a larger
count is slower than the best so far, and leaves the rest of the time budget unspent.

The best plan found has the stages the DP cut, one model chunk each. Where they are uniform, a stage can
hold two chunks instead (``interleaving``): stages twice as large over half as many microbatches twice as
large, run by the interleaved schedule. ``choose.try_interleaving`` plans that one too and keeps the faster:
GPT-1T on 384x8 A100 goes from 128 stages of 3x8 over 1024 microbatches (ZB-H1, 115.79 s a step, its
last stage, a block and the head, 1.17x a block) to 64 stages of 6x8 over 512 (Megatron's own layout,
110.25 s).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.pipeline.ticks import lockstep_tables, price, spread_times
from autoshard.trace.remat import REMAT_MODES

BUBBLE = 0.1  # the bubble fraction the first candidate keeps under
HEADROOM = 0.5  # of the budget, for a stage's share of the step's activations (the first candidate)
MAX_CANDIDATES = 3
INTERLEAVE_CHUNKS = 2  # model chunks per stage of the interleaved pipeline priced beside a uniform one


def candidates(batch: int, hosts: int, *, bubble: float = BUBBLE, limit: int = MAX_CANDIDATES,
               activations: float | None = None, budget: float | None = None) -> list[int]:
    """Microbatch counts to try for a batch of ``batch`` rows on ``hosts`` hosts, in order (see the module
    docstring): powers of two dividing ``batch``, from the smallest that keeps the 1F1B bubble of
    ``max(2, hosts)`` stages under ``bubble`` (and, given ``activations`` and ``budget`` in bytes per
    device, holds a stage's share of them), at most ``limit`` of them. If the batch is too small for
    that bound, its largest power-of-two divisor (> 1) alone."""
    if batch < 2:
        return []
    stages = max(2, hosts)
    least = math.ceil((stages - 1) * (1 - bubble) / bubble)
    if activations is not None and budget:
        least = max(least, math.ceil(stages * activations / (HEADROOM * budget)))
    powers = [1 << k for k in range(1, batch.bit_length()) if batch % (1 << k) == 0]
    if not powers:
        return []
    above = [b for b in powers if b >= least]
    return above[:limit] if above else powers[-1:]


def first_recompute(need: Callable[[str], float | None], hosts: int, count: int, budget: float | None) -> str:
    """The recompute mode an automatic pipeline of ``count`` microbatches on ``hosts`` hosts is planned with
    first (``pipeline.recompute``): the least of ``none``, ``selective`` whose stage share of the step's
    activations, ``S/B · need(mode)`` with ``S = min(max(2, hosts), B)`` stages each holding up to ``S``
    microbatches of ``1/S`` of the layers on ``1/S`` of the devices (``need(mode)``: bytes per device the
    unpipelined step needs with that mode, perfectly sharded), fills at most ``HEADROOM`` of the budget, as
    ``candidates`` sizes the count; else ``full``. A mode whose need is unknown, or no budget, stops there."""
    if budget is None:
        return "none"
    stages = min(max(2, hosts), count)
    for mode in ("none", "selective"):
        bytes_ = need(mode)
        if bytes_ is None or stages / count * bytes_ <= HEADROOM * budget:
            return mode
    return "full"


_NO_LINK = types.SimpleNamespace(latency=0.0, bandwidth=math.inf)  # ``ticks.price``'s exchanges left out


def interleaved_lockstep(plan: Any, count: int, batch: int, chunks: int = INTERLEAVE_CHUNKS,
                         schedule: str = "interleaved-1f1b") -> tuple[float, float]:
    """The tick loops, in seconds, of ``plan`` (an SPMD plan of ``S`` stages, ``plan.spmd``) and of the
    interleaved SPMD pipeline ``interleaving`` derives from it (``count`` microbatches of a ``batch``-row
    batch on ``S / chunks`` stages of ``chunks`` chunks, run by ``schedule``: interleaved 1F1B, or ZB-V's
    two chunks in a V, virtual stage ``u`` holding the blocks of ``plan``'s stage ``u`` either way), both
    priced from ``plan``'s own stage times before the derived one is traced or planned:

        T = ticks.price(t, ticks of the schedule).loop            (exchanges left out of both)

    with ``t_u`` (virtual stage ``u`` of the derived pipeline) the time of ``plan``'s stage ``u``, which
    holds the same blocks (on ``chunks`` times the devices, microbatches ``chunks`` times as large: about the
    same time, GPT-1T's block 66.4 ms on 3x8, 67.9 ms on 6x8), and the tail, when ``plan`` spreads it,
    spread over the largest divisor of the larger microbatch's rows up to ``S / chunks``. Each stage's
    update is its base's (the same parameters a device) and each tick's exchange costs what the base's
    does (the stream's bytes a device are the same). Lockstep unit ticks make a forward wait for a backward
    on another stage, which interleaved 1F1B's steady state does on every tick (``ticks.price``: up to
    ``4/3`` of the work), where ZB-H1's and ZB-V's ``F``, ``B`` and ``W`` are each about a forward long (and
    ZB-V idles about ``2S'`` of its ticks, ZB-H1 ``2S``: GPT-1T's 128 stages of 3x8 over 1024 microbatches
    under ZB-H1 take 79.98 s of ticks, as interleaved 1F1B on 64 stages of 6x8 over 512 96.19 s, as ZB-V
    76.76 s, which its memory then does not allow: ``choose.try_interleaving``)."""
    G = plan.tail_split
    base = lockstep_tables(plan.schedule, len(plan.stages), plan.num_microbatches, fused=plan.fused_ticks,
                           tail_split=G)
    ours = _loop([st.micro_time for st in plan.stages], base, plan.tail_time if G > 1 else 0.0, G)
    return ours, derived_lockstep(plan, count, batch, schedule, chunks)


def derived_lockstep(plan: Any, count: int, batch: int, schedule: str, chunks: int = INTERLEAVE_CHUNKS) -> float:
    """The derived pipeline's tick loop alone, as ``interleaved_lockstep`` prices it (a second schedule for
    the same derived stages, without pricing the base again)."""
    S = len(plan.stages)
    S2, rows = S // chunks, batch // count
    G2 = max((g for g in range(2, S2 + 1) if rows % g == 0), default=1) if plan.tail_split > 1 else 1
    derived = lockstep_tables(schedule, S2, count, chunks, tail_split=G2)
    return _loop([st.micro_time for st in plan.stages], derived, plan.tail_time if G2 > 1 else 0.0, G2)


def _loop(times: Sequence[float], table: Any, tail: float, tail_split: int) -> float:
    """``ticks.price``'s tick loop of ``table`` on ``times`` (the last one holding the tail's ``tail`` seconds,
    which ``tail_split > 1`` spreads), without its exchanges."""
    S = table.f_micro.shape[1]
    return price(spread_times(times, tail, tail_split), [0.0] * S, table, stream_bytes=0.0, link=_NO_LINK, inner=1, dispatch=0.0, tail=tail).loop


def derived_recompute(modes: Mapping[str, str]) -> str:
    """The recompute mode the pipeline that ``interleaving`` derives from a plan is planned with
    (``choose.try_interleaving``), ``modes`` being that plan's per block (``PipelinePlan.recompute``; empty:
    as traced): the least of ``REMAT_MODES`` any of its blocks uses.

    Per device the derived pipeline holds what its base does and more: a stage ``c`` times as large over
    microbatches ``c`` times as large keeps the base stage's parameters and a chunk-microbatch of the
    base's activations per device, and interleaved 1F1B keeps about ``3S/2`` of those in flight where 1F1B
    keeps ``S`` (``S`` the base's stages, ``c = 2``), so a lesser mode than the base's cannot fit where the
    base needed its own. The rule ``first_recompute`` applies to a count (``S/B`` of the step's
    activations, ``B`` halved) starts GPT-1T's 64 stages of 6x8 over 512 microbatches at full recompute
    (119.7 s a step), where selective fits an 80 GB budget (80.4 s)."""
    used = set(modes.values())
    return next((m for m in REMAT_MODES if m in used), "none")


def interleaving(stages: Sequence[tuple[int, int]], count: int, batch: int, cluster: tuple[int, int],
                 layers: int, chunks: int = INTERLEAVE_CHUNKS) -> tuple[int, tuple[int, int]] | None:
    """The interleaved pipeline to price beside a plan of ``count`` microbatches on ``stages`` (their
    submesh shapes), or None: stages ``chunks`` times larger (``(1, c·d)`` inside a host, ``(c·h, D)`` across
    hosts) holding ``chunks`` model chunks each, over ``count / chunks`` microbatches ``chunks`` times as
    large. Each device keeps the rows it had; a stage holds ``chunks`` layers' worth of work, so one slow
    layer (a head, an embedding) paces the pipeline ``chunks`` times less; the interleaved bubble
    ``(S' − 1)/(chunks · B')`` with ``S' = S / chunks``, ``B' = B / chunks`` is about half of 1F1B's
    ``(S − 1)/B`` (Narayanan et al. 2021 §2.2: Megatron's layout for GPT-1T). Only for uniform stages
    (one shape, at least two), and where the counts divide: the batch by ``B'``, ``B'`` by ``S'`` (the
    schedule's rule), a larger stage's rows by its hosts, and ``layers >= chunks · S'``."""
    if len(stages) < 2 or len(set(stages)) != 1 or count % chunks:
        return None
    (h, d), (hosts, per_host) = stages[0], cluster
    if h == 1 and d * chunks <= per_host:
        shape = (1, d * chunks)
    elif d == per_host and hosts % (h * chunks) == 0:
        shape = (h * chunks, per_host)
    else:
        return None
    num_stages = hosts * per_host // (shape[0] * shape[1])
    fewer = count // chunks
    if (num_stages < 2 or layers < chunks * num_stages or batch % fewer or fewer % num_stages
            or (batch // fewer) % shape[0]):
        return None
    return fewer, shape


def search(counts: list[int], plan_one: Callable[[int, float | None], Any], seconds: float | None,
           clock: Callable[[], float]) -> tuple[Any, list[tuple[int, Any]]]:
    """Plan each count in ``counts`` with ``plan_one(count, seconds)`` (which returns an object with
    ``predicted_step_time`` or raises an AutoshardError), splitting ``seconds`` (None: each plan scales its own) between the
    counts left; stop at the first count slower than the best so far, and before a count (after the first)
    when ``seconds`` are spent or what is left of them is under half of what the last count took (a
    pipeline plan's floors, tracing at the microbatch size and a least time per solve, make a count cost about as much whatever its share:
    GPT-39B's second count took 39 s of a 4 s share). Returns the best plan (None if none planned) and
    every (count, plan or exception) tried."""
    best, tried = None, []
    start = clock()
    took = 0.0
    for n, count in enumerate(counts):
        share = None
        if seconds is not None:
            left = seconds - (clock() - start)
            share = max(left / (len(counts) - n), 0.0)
            if tried and (share <= 0 or left < 0.5 * took):
                break  # the first count is always planned: a search that ends with nothing returns no plan
        began = clock()
        try:
            plan = plan_one(count, share)
        except AutoshardError as e:  # recorded; the caller reports it when nothing planned
            tried.append((count, e))
            took = clock() - began
            continue
        took = clock() - began
        tried.append((count, plan))
        if best is not None and plan.predicted_step_time >= best.predicted_step_time:
            break
        if best is None or plan.predicted_step_time < best.predicted_step_time:
            best = plan
    return best, tried
