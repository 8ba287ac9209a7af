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
memory). Between the first mode that fits, ``m``, and the one before it, the first ``k`` blocks are
then searched (``_fewer_blocks``): ``m`` on them and the earlier mode on the rest, fitting between the
two modes, with the time budget's remainder.

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
from cost_models import CostModel, LogicalMesh

log = logging.getLogger("autoshard")

RECOMPUTE_CHOICES: tuple[str, ...] = ("auto", *MODES)


def check_recompute(recompute: str) -> str:
    if recompute not in RECOMPUTE_CHOICES:
        raise PlanError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE_CHOICES)} ('auto' "
                        "recomputes only when the step does not fit without it)")
    return recompute


def recomputed(graph: Graph, modes: dict[str, str] | Any) -> Graph:
    """``graph`` with a plan's recompute applied (``Plan.recompute``), or ``graph`` itself when none."""
    return rematerialize(graph, modes) if modes else graph


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
    for mode in modes:
        if mode != "none" and names is None:
            names = blocks(graph)
        if recompute == "auto" and mode != "none" and not names:
            break  # nothing to recompute: the step as traced was the only candidate
        if recompute == "auto" and budget is not None:
            bound = estimate(graph, mode, nbytes=least_bytes(cost.mesh)).peak_bytes
            if bound > budget:
                needs[mode] = bound
                log.info("autoshard: the step %s cannot fit: at least %s per device with every value split "
                         "as far as the mesh's axes divide it", describe(mode), _gb(bound))
                continue
        config = uniform(graph, mode) if mode != "none" else {}
        target = recomputed(graph, {b: m for b, m in config.items() if m != "none"})
        if mode != "none" and target is graph:
            if recompute == "auto":
                break  # nothing to recompute: the step as traced was the only candidate
            log.warning("autoshard: recompute=%r: the step has no repeated blocks to recompute; planned as "
                        "traced", recompute)
        # what is left once the step is rewritten (1-2 s on GPT-39B, charged to the budget like the build)
        left = None if time_budget_s is None else max(time_budget_s - (time.perf_counter() - t0),
                                                      0.25 * time_budget_s)
        try:
            plan = plan_graph(target, cost, time_budget_s=left, problems=problems if target is graph else None, **kw)
        except DoesNotFit as e:
            if recompute != "auto":
                raise
            first = first or e
            needs[mode] = e.needed
            log.info("autoshard: the step does not fit with recompute %s; trying more", mode)
            continue
        if mode != "none":
            log.info("autoshard: recompute %s on %d blocks makes the step fit", mode, len(config))
        if recompute == "auto" and mode != "none" and budget is not None:
            prev = modes[modes.index(mode) - 1]
            return _fewer_blocks(graph, cost, names or [], mode, prev, (plan, target, config), budget,
                                 None if time_budget_s is None else t0 + time_budget_s, kw)
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
                  kw: dict[str, Any]) -> tuple[Plan, Graph]:
    """The fastest plan found recomputing ``mode`` on only the first ``k`` blocks and ``prev`` (the mode
    before it, with which the step did not fit) on the others; ``every``: the plan with ``mode`` on all
    ``L`` blocks, its graph and its blocks' modes.

    With ``T(k)`` the optimal step time of the step so rewritten (``+inf`` when nothing fits; ``T(L)`` is
    ``every``'s), ``k`` is searched in ``[k_0, L]``: ``k_0`` the fewest blocks whose rewrite passes the
    least-bytes bound (``estimate`` with every value split as far as the axes divide it; a proven lower
    bound on the peak, non-increasing in ``k``, so no ``k < k_0`` fits), found by bisection on that cheap
    bound. Then a descent that takes ``T`` as unimodal (fewer recomputed blocks do less work until the
    memory they hold forces slower layouts, then nothing fits): with ``[a, b]`` the interval left and
    ``b`` the best ``k`` so far, plan ``k = ⌊(a + b)/2⌋``; when it fits and is faster, ``b = k``, else
    ``a = k + 1``. Each probe starts from the best plan's input layouts and gets the time the all-blocks
    plan took, while the budget (``deadline``) has that much left; with no budget, at most
    ``⌈log2(L + 1)⌉`` probes. The first blocks in forward order recompute: every block's stash is live at
    the peak (the backward pass's start), and the first blocks' replays run last, when most stashes are
    freed. Megatron's ``--recompute-num-layers`` chooses so by hand."""
    best_plan, best_graph, best_config = every
    total = len(names)
    took = best_plan.solver.build_seconds + best_plan.solver.seed_seconds + best_plan.solver.solve_seconds
    size = least_bytes(cost.mesh)

    def config(k: int) -> dict[str, str]:
        return {b: (mode if i < k else prev) for i, b in enumerate(names)}

    def more() -> bool:
        return probes < math.ceil(math.log2(total + 1)) if deadline is None else deadline - time.perf_counter() >= took

    probes = 0
    if not more():
        return _with_recompute(best_plan, best_config), best_graph
    a, b = 0, total
    while a < b:  # k_0: the fewest blocks at ``mode`` that the least-bytes bound lets fit
        k = (a + b) // 2
        if estimate(graph, config(k), nbytes=size).peak_bytes <= budget:
            b = k
        else:
            a = k + 1
    b = total  # [a, b]: k_0 .. L, b the best so far
    while a < b and more():
        k = (a + b) // 2
        probes += 1
        modes = {n: m for n, m in config(k).items() if m != "none"}
        target = recomputed(graph, modes)
        start = {lay.name: lay.spec for lay in best_plan.inputs}
        try:
            plan = plan_graph(target, cost, **{**kw, "time_budget_s": None if deadline is None else took,
                                               "starts": (start,)})
        except DoesNotFit:
            log.info("autoshard: recompute %s on the first %d of %d blocks (%s on the rest) does not fit",
                     mode, k, total, prev)
            a = k + 1
            continue
        faster = plan.predicted_step_time < best_plan.predicted_step_time
        log.info("autoshard: recompute %s on the first %d of %d blocks (%s on the rest): %s per step, %s",
                 mode, k, total, prev, human_time(plan.predicted_step_time),
                 f"faster than {human_time(best_plan.predicted_step_time)}" if faster else "no faster")
        if faster:
            best_plan, best_graph, best_config, b = plan, target, config(k), k
        else:
            a = k + 1
    return _with_recompute(best_plan, best_config), best_graph


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
