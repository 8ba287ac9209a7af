"""Recompute as a planning decision: which blocks rematerialise their activations, chosen with the layouts.

``plan_recomputing(graph, cost, recompute=...)`` returns a plan and the graph it was made for:

- ``"none"``: the step as traced;
- ``"selective"`` / ``"full"``: every block rewritten by ``trace.remat`` with that mode (selective keeps
  the weight products' outputs and replays the attention core and the elementwise ops, Korthikanti et
  al. 2022; full keeps only what enters
  the block), then planned like any step: the ILP sees the replayed ops' compute at every layout and the
  shorter live ranges in its memory rows, so sharding and recompute are priced by one objective;
- ``"auto"`` (the default): recompute only when the step does not fit without it. Plan the step as
  traced; when the solver proves that no layout fits (``DoesNotFit``), plan the selective rewrite, then
  the full one, and return the first that fits. Selective replays a fraction of full's work (the
  elementwise ops, no matmuls), so when both fit it is the faster, and a plan that fits as traced is
  never slowed by recompute.

A mode is not solved when it cannot fit whatever the layouts: the step's peak with that mode
(``trace.recompute.estimate``), with every value split into as many shards as the mesh's axes can split
it (``most_shards``: an axis splits a dimension its size divides, as every strategy does), already
exceeds the budget (the step as traced included). That bound is what the solver proves for the step as
traced on large meshes (GPT-39B bf16 at batch 1024 on 8x8: 428.5 GB bound, 429 GB proven); skipping saves
rewriting, building and solving a mode that cannot fit (12-20 s there; ~52 s for GPT-1T on 384x8 A100s,
whose weights no split of 384 = 3·128 divides, so they split 8 ways at most: with full recompute the step
needs 8.8 GB per device spread perfectly over the 3072 devices but at least 1,146 GB with the splits the
axes divide, and the solver's own least-memory check, after the rewrite and the build, found 1,191 GB).

Formally, with ``G_m`` the step rewritten with mode ``m`` on every block and ``T(G)`` the optimal step
time of ``G`` under the budget (``+inf`` when nothing fits), ``auto`` returns
``argmin_{m ∈ (none, selective, full)} T(G_m)`` under the order above: it stops at the first finite one,
since ``T(G_none) <= T(G_selective) <= T(G_full)`` whenever they are finite (each adds work and frees
memory). Between the first mode that fits, ``m``, and the one before it, a mix is planned: ``m`` on the
first ``k`` blocks and the earlier mode on the rest. The first ``k`` planned is the fewest whose step,
every value split its furthest, peaks at ``HEADROOM`` of the budget or less (``fewest_blocks``: the
layouts a fast plan wants hold more than the least, and the solver needs room to choose them): GPT-39B
bf16 at batch 1024 on 8x8 H100s, where selective recompute cannot fit, plans full recompute on 30 of its
48 blocks and selective on 18 (8.658 s a step, 66.9 of 67.1 GiB) where full on all of them took 9.241 s.
When that mix does not fit, ``m`` on every block is planned. Then, with the time budget's remainder,
fewer blocks are searched (``_fewer_blocks``).

The plan records the blocks and modes (``Plan.recompute``); ``parallelize`` applies the same rewrite to
its trace before emitting, so the program runs what was planned.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from autoshard.planner.plan import DoesNotFit, Plan, PlanError
from autoshard.planner.planning import ProblemCache, plan_graph
from autoshard.planner.summary import human_time
from autoshard.trace.graph import Graph, Tensor
from autoshard.trace.recompute import MODES, estimate, peak_holders
from autoshard.trace.remat import blocks, rematerialize, uniform
from autoshard.trace.unroll import unroll_layer_stacks
from cost_models import CostModel, LogicalMesh

log = logging.getLogger("autoshard")

RECOMPUTE_CHOICES: tuple[str, ...] = ("auto", *MODES)


def check_recompute(recompute: str) -> str:
    if recompute not in RECOMPUTE_CHOICES:
        raise PlanError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE_CHOICES)} ('auto' "
                        "recomputes only when the step does not fit without it)")
    return recompute


def recomputed(graph: Graph, modes: dict[str, str] | Any, level: int = logging.INFO) -> Graph:
    """``graph`` with a plan's recompute applied (``Plan.recompute``), or ``graph`` itself when none
    (``level``: of the rewrite's log line)."""
    return rematerialize(graph, modes, level=level) if modes else graph


def as_planned(graph: Graph, plan: Plan) -> Graph:
    """``graph`` (the step as traced) rewritten as ``plan`` was planned: its layer stacks written as one scan
    unrolled when the plan unrolled them (``Plan.unrolled``: ``trace.unroll``), then the plan's recompute
    applied (``recomputed``). What an intra-operator plan runs on, wherever it is read back (a saved plan, the
    plan cache, every process of a multi-process job)."""
    if plan.unrolled:
        graph = unroll_layer_stacks(graph, why="as the plan was planned")
    return recomputed(graph, plan.recompute)


def plan_recomputing(graph: Graph, cost: CostModel, *, recompute: str = "auto", time_budget_s: float | None = None,
                     problems: ProblemCache | None = None, **kw: Any) -> tuple[Plan, Graph]:
    """Plan ``graph`` with the recompute setting ``recompute`` (see the module docstring); ``kw`` go to
    ``plan_graph``, and ``problems`` (built for ``graph``) too when the step is planned as traced (a
    rewritten step builds its own). Returns the plan and the graph it is a plan of (rewritten when it
    recomputes)."""
    check_recompute(recompute)
    t0 = time.perf_counter()
    modes = ("none", "selective", "full") if recompute == "auto" else (recompute,)
    first: DoesNotFit | None = None
    needs: dict[str, float | None] = {}
    budget = kw.get("memory_budget")
    names: list[str] | None = None  # the step's blocks, found once a recompute mode is tried
    memo: dict[str, dict[int, tuple[float, Graph | None]]] = {}  # per mode: its mixes' rewrites (``fewest_blocks``)
    for mode in modes:
        if mode != "none" and names is None:
            names = blocks(graph)
        if recompute == "auto" and mode != "none" and not names:
            break  # nothing to recompute: the step as traced was the only candidate
        if recompute == "auto" and budget is not None:
            bound = estimate(graph, mode, nbytes=least_bytes(cost.mesh)).peak_bytes
            if bound > budget:
                needs[mode] = bound
                log.info("the step %s cannot fit: at least %s per device with every value split "
                         "as far as the mesh's axes divide it", describe(mode), _gb(bound))
                continue
        config = uniform(graph, mode) if mode != "none" else {}
        target: Graph | None = None
        k = len(config)
        if recompute == "auto" and mode != "none" and budget is not None and names and len(names) > 1:
            # the mode before did not fit: first plan the fewest blocks at ``mode`` that leave HEADROOM
            # (``fewest_blocks``), the rest at the mode before, then search from there (``_fewer_blocks``)
            prev = modes[modes.index(mode) - 1]
            k, target = fewest_blocks(graph, names, mode, prev, HEADROOM * budget, cost.mesh,
                                      None if time_budget_s is None else t0 + MIX_SHARE * time_budget_s,
                                      memo.setdefault(mode, {}))
            config = mix(names, mode, prev, k)
            if k < len(names):
                log.info("recompute %s on the first %d of %d blocks (%s on the rest) leaves %.0f%% of "
                         "the budget to the layouts, every value split its furthest", mode, k, len(names), prev,
                         100 * (1 - HEADROOM))
        if target is None:
            target = recomputed(graph, {b: m for b, m in config.items() if m != "none"})
        if mode != "none" and target is graph:
            if recompute == "auto":
                break  # nothing to recompute: the step as traced was the only candidate
            log.warning("recompute=%r: the step has no repeated blocks to recompute; planned as "
                        "traced", recompute)
        # what is left once the step is rewritten (1-2 s on GPT-39B, charged to the budget like the build)
        left = None if time_budget_s is None else max(time_budget_s - (time.perf_counter() - t0),
                                                      0.25 * time_budget_s)
        try:
            try:
                plan = plan_graph(target, cost, time_budget_s=left, problems=problems if target is graph else None,
                                  **kw)
            except DoesNotFit:
                if mode == "none" or k == len(names or ()):
                    raise
                log.info("recompute %s on %d of %d blocks does not fit; planning it on all of them",
                         mode, k, len(names or ()))
                config = uniform(graph, mode)
                target = recomputed(graph, config)
                left = None if time_budget_s is None else max(time_budget_s - (time.perf_counter() - t0),
                                                              0.25 * time_budget_s)
                plan = plan_graph(target, cost, time_budget_s=left, **kw)
        except DoesNotFit as e:
            if recompute != "auto":
                raise
            first = first or e
            needs[mode] = e.needed
            log.info("the step does not fit with recompute %s; trying more", mode)
            continue
        if mode != "none":
            log.info("recompute %s on %d blocks makes the step fit", mode,
                     sum(m == mode for m in config.values()))
        if recompute == "auto" and mode != "none" and budget is not None:
            prev = modes[modes.index(mode) - 1]
            return _fewer_blocks(graph, cost, names or [], mode, prev, (plan, target, config), budget,
                                 None if time_budget_s is None else t0 + time_budget_s, kw,
                                 memo.setdefault(mode, {}))
        return (plan if target is graph else _with_recompute(plan, config)), target
    if first is not None and len(needs) == 1:
        raise first
    tried = ", ".join(f"{describe(m)} at least {_gb(n)}" for m, n in needs.items())
    if first is not None:
        as_traced = f"\nAs traced: {str(first).splitlines()[0]}"
    else:  # every bound from the estimate: say what the step holds at its peak
        largest = ", ".join(f"{what} ({_gb(n)})" for what, n in peak_holders(graph))
        as_traced = (" Each bound is the step's peak with that setting, every value split over the "
                     f"{cost.mesh.num_devices} devices as far as the mesh's axes divide its dimensions; as "
                     f"traced, the largest values live there (unsharded): {largest}.")
    raise DoesNotFit(
        f"the step does not fit in {_gb(budget)} per device on mesh {cost.mesh}, recompute or not ({tried}, "
        f"of its {len(names or ())} blocks). Use more devices, microbatches (microbatches=B, --microbatches B: "
        "a pipeline holds a microbatch's activations), or a smaller batch; or plan without a memory limit "
        f"(memory_budget=None, --memory-budget none) to see what it would need.{as_traced}",
        needed=needs.get("full", first.needed if first is not None else None),
        as_traced=needs.get("none")) from None


def _fewer_blocks(graph: Graph, cost: CostModel, names: list[str], mode: str, prev: str,
                  every: tuple[Plan, Graph, dict[str, str]], budget: float, deadline: float | None,
                  kw: dict[str, Any], memo: dict[int, tuple[float, Graph | None]]) -> tuple[Plan, Graph]:
    """The fastest plan found recomputing ``mode`` on only the first ``k`` blocks and ``prev`` (the mode
    before it, with which the step did not fit) on the others; ``every``: the first plan made, with
    ``mode`` on ``k_1`` blocks (``fewest_blocks`` with headroom, or all ``L``), its graph and its blocks'
    modes.

    With ``T(k)`` the optimal step time of the step so rewritten (``+inf`` when nothing fits; ``T(k_1)``
    is ``every``'s), ``k`` is searched in ``[k_0, k_1]``: ``k_0`` a ``k`` whose rewrite passes the
    least-bytes bound (the solver's own least usage) where ``k_0 - 1``'s does not (``fewest_blocks`` with
    the budget as the limit). Then a descent that takes ``T`` as unimodal (fewer recomputed blocks do less
    work until the memory they hold forces slower layouts, then nothing fits): with ``[a, b]`` the interval
    left and ``b`` the best ``k`` so far, plan ``k = ⌊(a + b)/2⌋``; when it fits and is faster, ``b = k``,
    else ``a = k + 1``. Each probe starts from the best plan's input layouts and gets the time the all-blocks
    plan took, while the budget (``deadline``) has that much left; with no budget, at most
    ``⌈log2(L + 1)⌉`` probes. The first blocks in forward order recompute: every block's stash is live at
    the peak (the backward pass's start), and the first blocks' replays run last, when most stashes are
    freed. Megatron's ``--recompute-num-layers`` chooses so by hand."""
    best_plan, best_graph, best_config = every
    total = len(names)
    took = best_plan.solver.build_seconds + best_plan.solver.seed_seconds + best_plan.solver.solve_seconds

    def more() -> bool:
        return probes < math.ceil(math.log2(total + 1)) if deadline is None else deadline - time.perf_counter() >= took

    probes = 0
    if not more():
        return _with_recompute(best_plan, best_config), best_graph
    b = sum(m == mode for m in best_config.values())  # [a, b]: k_0 .. the best so far
    a, _ = fewest_blocks(graph, names, mode, prev, budget, cost.mesh, deadline, memo)
    while a < b and more():
        k = (a + b) // 2
        probes += 1
        modes = {n: m for n, m in mix(names, mode, prev, k).items() if m != "none"}
        target = recomputed(graph, modes)
        start = {lay.name: lay.spec for lay in best_plan.inputs}
        try:
            plan = plan_graph(target, cost, **{**kw, "time_budget_s": None if deadline is None else took,
                                               "starts": (start,)})
        except DoesNotFit:
            log.info("recompute %s on the first %d of %d blocks (%s on the rest) does not fit",
                     mode, k, total, prev)
            a = k + 1
            continue
        faster = plan.predicted_step_time < best_plan.predicted_step_time
        log.info("recompute %s on the first %d of %d blocks (%s on the rest): %s per step, %s",
                 mode, k, total, prev, human_time(plan.predicted_step_time),
                 f"faster than {human_time(best_plan.predicted_step_time)}" if faster else "no faster")
        if faster:
            best_plan, best_graph, best_config, b = plan, target, mix(names, mode, prev, k), k
        else:
            a = k + 1
    return _with_recompute(best_plan, best_config), best_graph


HEADROOM = 0.95  # a mix of recompute modes is first planned where its least peak is this share of the budget
MIX_SHARE = 0.25  # of the time budget, at most this for finding that mix (``fewest_blocks``)


def mix(names: list[str], mode: str, prev: str, k: int) -> dict[str, str]:
    """Block -> mode: ``mode`` on the first ``k`` of ``names`` (in forward order), ``prev`` on the rest."""
    return {b: (mode if i < k else prev) for i, b in enumerate(names)}


def fewest_blocks(graph: Graph, names: list[str], mode: str, prev: str, limit: float, mesh: LogicalMesh,
                  deadline: float | None = None,
                  memo: dict[int, tuple[float, Graph | None]] | None = None) -> tuple[int, Graph]:
    """The fewest blocks ``k`` that recompute ``mode`` (the first ``k`` in forward order, ``prev`` on the
    rest) for the step's least peak to be at most ``limit``, and the step so rewritten (``L``, the number
    of blocks, when even that does not meet ``limit``).

    ``f(k)`` = the least-bytes peak of the step rewritten with ``k`` blocks (``estimate`` of the rewritten
    graph, every value split as far as the axes divide it): exactly the least usage the solver's own
    memory check proves (GPT-39B on 8x8, 24 full and 24 selective: 80.92 GB both ways). It falls with
    ``k`` (each block moved to ``mode`` frees its stash) close to affinely (every stash is live at the
    backward pass's start, where the peak is), though not strictly: the last block's replay runs as the
    backward pass starts, and can raise the peak a little (the tiny GPT's, selective over none: 2.350 to
    2.380 MB), so the search finds a crossing (``f(k) <= limit < f(k - 1)``), and starts from ``f(L)``:
    when that misses the limit, ``L`` is returned. The estimate of the step as traced with the modes
    applied (``estimate(graph, config)``, no rewrite) reads lower (GPT-39B: 54.3 against 80.9 GB at 24
    blocks; it leaves out what the rewrite's barriers and replays hold), and is used only to bracket:
    ``k_lo`` = the fewest blocks it lets fit (checked when probed: below it, from no block). Then regula falsi
    on ``[k_lo, L]`` (the Illinois variant, which halves the weight of an end that stays, so a one-sided
    approach cannot stall), each probe a rewrite (~1.5 s on 48 GPT-39B blocks), until the bracket closes
    or ``deadline`` passes (then the fitting end is returned). ``memo``: ``k`` -> (``f(k)``, the rewrite),
    kept between calls with the same graph, modes and mesh (another limit reuses the rewrites)."""
    total = len(names)
    size = least_bytes(mesh)

    a, b = 0, total
    while a < b:  # the bracket's low end from the cheap estimate
        k = (a + b) // 2
        if estimate(graph, mix(names, mode, prev, k), nbytes=size).peak_bytes <= limit:
            b = k
        else:
            a = k + 1
    lo, hi = max(a - 1, 0), total  # f(lo) > limit is assumed (checked when probed), f(hi) <= limit
    seen: dict[int, tuple[float, Graph | None]] = {} if memo is None else memo

    def rewrite(k: int) -> Graph:
        return recomputed(graph, {n: m for n, m in mix(names, mode, prev, k).items() if m != "none"}, logging.DEBUG)

    def f(k: int) -> float:
        if k not in seen:
            g = rewrite(k)
            seen[k] = (estimate(g, "none", nbytes=size).peak_bytes, g)
        return seen[k][0]

    def found(k: int) -> tuple[int, Graph]:
        """``k`` and its rewrite; the other rewrites are dropped (their peaks kept): a large step's rewrite
        holds hundreds of MB."""
        g = seen[k][1] or rewrite(k)
        for j, (peak, _) in seen.items():
            seen[j] = (peak, g if j == k else None)
        return k, g

    f_hi = f(hi)
    if f_hi > limit:
        return found(total)
    f_lo = f(lo)
    if f_lo <= limit:  # the cheap estimate's bracket was not below after all: search from no block
        hi, f_hi, lo = lo, f_lo, 0
        f_lo = f(lo)
        if f_lo <= limit:
            return found(0)
    w_lo = w_hi = 1.0
    side = 0
    while hi - lo > 1 and (deadline is None or time.perf_counter() < deadline):
        d_lo, d_hi = (f_lo - limit) * w_lo, (f_hi - limit) * w_hi  # d_lo > 0 >= d_hi
        k = lo + round((hi - lo) * d_lo / (d_lo - d_hi)) if d_lo != d_hi else (lo + hi) // 2
        k = min(max(k, lo + 1), hi - 1)
        if f(k) <= limit:
            hi, f_hi, w_hi = k, seen[k][0], 1.0
            w_lo, side = (w_lo / 2, 1) if side == 1 else (1.0, 1)
        else:
            lo, f_lo, w_lo = k, seen[k][0], 1.0
            w_hi, side = (w_hi / 2, -1) if side == -1 else (1.0, -1)
    return found(hi)


def most_shards(shape: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """The most shards a value of ``shape`` splits into on a mesh with axes of ``sizes``: each axis given to
    at most one dimension, each dimension divisible by the product of its axes (every strategy splits so:
    ``strategies.registry.assignments``, which also caps the axes per dimension, so this is an upper bound
    on what they reach). A scalar, or a value no axis divides, is one shard."""
    return _most_shards(tuple(int(n) for n in shape), tuple(k for k in sizes if k > 1))


@functools.lru_cache(maxsize=4096)
def _most_shards(shape: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    best = 1
    for choice in itertools.product(range(-1, len(shape)), repeat=len(sizes)):
        per_dim = [1] * len(shape)
        for k, d in zip(sizes, choice, strict=True):
            if d >= 0:
                per_dim[d] *= k
        if all(n % f == 0 for n, f in zip(shape, per_dim, strict=True)):
            best = max(best, math.prod(per_dim))
    return best


def least_bytes(mesh: LogicalMesh) -> Callable[[Tensor], float]:
    """A value's least bytes per device on ``mesh`` (``most_shards`` of them), for ``estimate``."""
    sizes = tuple(mesh.shape)
    return lambda t: t.nbytes / most_shards(t.shape, sizes)


def describe(mode: str) -> str:
    """How messages name a recompute setting: ``as traced``, ``with selective recompute``."""
    return "as traced" if mode == "none" else f"with {mode} recompute"


def _gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.3g} GB"


def _with_recompute(plan: Plan, config: dict[str, str]) -> Plan:
    return dataclasses.replace(plan, recompute={b: m for b, m in config.items() if m != "none"})
