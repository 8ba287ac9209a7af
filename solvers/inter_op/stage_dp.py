"""Alpa's stage/submesh DP (arXiv 2201.12023 §5.2), exact, with a bisection over t_max.

Notation as in ``problem.py``: layers ``0..L-1``, submeshes ``m`` with ``n_m`` devices, ``N`` devices,
tables ``t, σ, α``, in-flight counts ``inflight[r]``, ``B`` microbatches. A stage ``(k..i, m)`` is
*allowed with r stages after it* at threshold ``τ`` when

    t_{k,i,m} <= τ   and   σ_{k,i,m} + inflight[r] · α_{k,i,m} <= memory_limit.

**Recurrence** (Alpa §5.2). ``F_τ(s, k, d)`` = least ``Σ t`` over slicings of layers ``k..L-1`` into
exactly ``s`` stages on exactly ``d`` devices, every stage allowed at ``τ``:

    F_τ(0, L, 0) = 0,   F_τ(0, k, d) = +inf otherwise,
    F_τ(s, k, d) = min_{k <= i < L, m : n_m <= d, (k..i, m) allowed with s-1 stages after it}
                       t_{k,i,m} + F_τ(s - 1, i + 1, d - n_m),
    Φ(τ) = min_s F_τ(s, 0, N),      T* = min_τ Φ(τ) + (B - 1)·τ,

where ``τ`` ranges over the distinct finite stage times (Alpa's t_max enumeration) and ``s <= max_stages``.

**Collapsing s.** ``s`` matters only through ``inflight[s - 1]`` and ``max_stages``. Let ``R*`` be the
least ``R`` such that every stage is allowed with ``r`` stages after it iff it is with ``R``, for all
``r >= R`` (``R* = 0`` without a memory limit, ``<= B - 1`` for 1F1B, ``0`` for GPipe). Without a binding
``max_stages``, ``s = 1..R*`` are kept exactly and ``s > R*`` merge into one class ``∞`` (with one,
every ``s <= max_stages`` is kept):

    F_τ(∞, k, d) = min_{(k..i, m) allowed with R* after} t_{k,i,m}
                   + min(F_τ(∞, i + 1, d - n_m), F_τ(R*, i + 1, d - n_m)),

solved in order of decreasing ``k``. The exact layers ``s`` are vectorised over all ``(k, d)`` at once.

**t_max search (exact).** ``Φ`` is non-increasing in ``τ``. A DP run at ``τ`` returns an optimal slicing
whose largest stage time is ``t* <= τ``; then ``Φ`` is constant on ``[t*, τ]`` and the best step time there
is ``Φ(τ) + (B - 1)·t*``, so one run settles the whole interval. Over a range of candidates
``[c_lo, c_hi]`` lying below a run with value ``Φ_up``, every step time is ``>= Φ_up + (B - 1)·c_lo``;
ranges whose bound is ``>= best`` are pruned (Alpa's early stop ``(B - 1)·t_max >= best`` is the case
``Φ_up = 0``). Ranges are explored best-bound first: a range below a feasible run is bisected (which
also finds the least feasible ``τ`` in ``O(log K)`` runs); a range above one is probed at its top first,
which gives its exact ``Φ`` lower bound at once. A few tens of DPs replace one DP per candidate.
``tolerance > 0`` prunes ranges that cannot improve ``best`` by more than that relative amount (in the
spirit of Alpa's ``gap``); the default 0 is exact.

**Cost.** One run is ``O((R* + 1) · L² · M · N)`` additions in the worst case, done as numpy band
operations; ``benchmarks/inter_op_dp.py`` times whole solves (L = 96 on 16x16 devices: about 1 s without
a memory limit, a few seconds with a binding one under 1F1B).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from solvers.inter_op.placement import place_submeshes
from solvers.inter_op.problem import InterOpInfeasibleError, InterOpProblem
from solvers.inter_op.solution import InterOpSolution, InterOpStats, Stage, pipeline_cost

__all__ = ["solve_inter_op"]


class _DP:
    """The allowed stages of a problem as triples ``(k, i, m, t)`` sorted by ``k``, their stage-count
    classes, and the DP run for one threshold ``τ``."""

    def __init__(self, p: InterOpProblem) -> None:
        self.p = p
        self.L, self.N, self.n = p.num_layers, p.num_devices, p.submesh_sizes
        k, i, m = np.nonzero(np.isfinite(p.stage_time) & np.triu(np.ones((self.L, self.L), bool))[:, :, None])
        cap = p.stage_limit
        natural = min(self.L, self.N // int(self.n.min()))
        fits = self._fits(k, i, m, cap)
        last = fits[-1]
        r_star = cap - 1
        while r_star > 0 and np.array_equal(fits[r_star - 1], last):
            r_star -= 1
        if cap < natural:  # max_stages binds: count every stage
            self.exact, self.sat = [fits[s] for s in range(cap)], None
        else:
            self.exact, self.sat = [fits[s] for s in range(r_star)], fits[r_star]
        keep = np.logical_or.reduce([*self.exact, *([] if self.sat is None else [self.sat])])
        self.tk, self.ti, self.tm = k[keep], i[keep], m[keep]
        self.tt = p.stage_time[self.tk, self.ti, self.tm]
        self.exact = [e[keep] for e in self.exact]
        self.sat = None if self.sat is None else self.sat[keep]
        self.states = 0

    def _fits(self, k: np.ndarray, i: np.ndarray, m: np.ndarray, cap: int) -> list[np.ndarray]:
        """``fits[r]``: which triples are allowed in memory with ``r`` stages after them, ``r < cap``."""
        p = self.p
        if p.memory_limit is None:
            return [np.ones(k.shape, bool)] * cap
        static, act = p.static_memory[k, i, m], p.activation_memory[k, i, m]
        by_value: dict[int, np.ndarray] = {}
        for v in set(p.inflight[:cap]):
            by_value[v] = static + v * act <= p.memory_limit
        return [by_value[p.inflight[r]] for r in range(cap)]

    # ---------------------------------------------------------------- one DP run
    def _shift(self, x: np.ndarray) -> np.ndarray:
        """``out[row, m, d] = x[row, d - n_m]`` (``+inf`` when ``d < n_m``), shape ``(rows, M, N + 1)``."""
        n_cols = self.N + 1
        pad = np.full((x.shape[0], self.N + n_cols), np.inf)
        pad[:, self.N:] = x
        return sliding_window_view(pad, n_cols, axis=1)[:, self.N - self.n, :]

    def _exact_layer(self, prev: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """``F(s)`` from ``F(s - 1)`` for all ``(k, d)``: per submesh, a band of stage lengths at once."""
        out = np.full_like(prev, np.inf)
        rows, cols = np.isfinite(prev).any(1), np.flatnonzero(np.isfinite(prev).any(0))
        idx = np.flatnonzero(allowed)
        idx = idx[rows[self.ti[idx] + 1]]
        if not idx.size:
            return out
        L, c0, c1 = self.L, int(cols[0]), int(cols[-1])
        table = np.full((L, L, self.n.size), np.inf)
        table[self.tk[idx], self.ti[idx], self.tm[idx]] = self.tt[idx]
        for m in np.unique(self.tm[idx]).tolist():
            n_m = int(self.n[m])
            hi = min(c1, self.N - n_m)
            if hi < c0:
                continue
            sel = idx[self.tm[idx] == m]
            k0, k1 = int(self.tk[sel].min()), int(self.tk[sel].max())
            e = self.ti[sel] - self.tk[sel]
            e0, e1 = int(e.min()), int(e.max())
            ks, es = np.arange(k0, k1 + 1)[:, None], np.arange(e0, e1 + 1)[None, :]
            band = table[ks, np.minimum(ks + es, L - 1), m]  # [k, e] = t of layers k..k+e
            band[ks + es >= L] = np.inf
            src = np.full((L + 1 + e1 - e0, hi - c0 + 1), np.inf)
            src[: L + 1] = prev[:, c0:hi + 1]
            win = sliding_window_view(src, e1 - e0 + 1, axis=0)  # [r, d, j] = src[r + j, d]
            win = win[k0 + e0 + 1:k1 + e0 + 2].transpose(0, 2, 1)  # [k, e - e0, d] = F(s-1)[k + e + 1, d]
            best = (band[:, :, None] + win).min(axis=1)
            dst = out[k0:k1 + 1, c0 + n_m:hi + n_m + 1]
            np.minimum(dst, best, out=dst)
        return out

    def _inf_layer(self, top: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``F(∞)`` and ``H = min(F(∞), F(R*))`` row by row, from ``k = L - 1`` down to 0."""
        idx = np.flatnonzero(allowed)
        ends = np.searchsorted(self.tk[idx], np.arange(self.L + 1))
        f_inf = np.full_like(top, np.inf)
        h = top.copy()
        shifted = np.empty((self.L + 1, self.n.size, self.N + 1))
        shifted[self.L] = self._shift(h[self.L:])[0]
        for k in range(self.L - 1, -1, -1):
            g = idx[ends[k]:ends[k + 1]]
            if g.size:
                vals = shifted[self.ti[g] + 1, self.tm[g]] + self.tt[g][:, None]
                f_inf[k] = vals.min(0)
                np.minimum(f_inf[k], top[k], out=h[k])
            shifted[k] = self._shift(h[k:k + 1])[0]
        return f_inf, h

    def run(self, tau: float) -> tuple[float, list[tuple[int, int, int]]] | None:
        """``(Φ(τ), [(k, i, m), …])`` for an optimal slicing at threshold ``τ``, or None if none exists."""
        ok = self.tt <= tau
        base = np.full((self.L + 1, self.N + 1), np.inf)
        base[self.L, 0] = 0.0
        layers = [base]
        for allowed in self.exact:
            layers.append(self._exact_layer(layers[-1], ok & allowed))
        f_inf = h = None
        if self.sat is not None:
            f_inf, h = self._inf_layer(layers[-1], ok & self.sat)
        self.states += (len(layers) - 1 + (f_inf is not None)) * (self.L + 1) * (self.N + 1)
        finals = [f[0, self.N] for f in layers[1:]] + ([f_inf[0, self.N]] if f_inf is not None else [])
        if not finals or not np.isfinite(min(finals)):
            return None
        cls = int(np.argmin(finals)) + 1  # == len(layers) means the class ∞
        return float(min(finals)), self._path(ok, layers, f_inf, h, cls)

    def _path(self, ok: np.ndarray, layers: list[np.ndarray], f_inf: np.ndarray | None,
              h: np.ndarray | None, cls: int) -> list[tuple[int, int, int]]:
        inf_cls, top = len(layers), len(layers) - 1
        k, d, path = 0, self.N, []
        while k < self.L:
            g = np.flatnonzero((self.tk == k) & ok & (self.sat if cls == inf_cls else self.exact[cls - 1]))
            src = h if cls == inf_cls else layers[cls - 1]
            rest = d - self.n[self.tm[g]]
            vals = np.where(rest >= 0, self.tt[g] + src[self.ti[g] + 1, np.maximum(rest, 0)], np.inf)
            j = g[int(np.argmin(vals))]
            path.append((k, int(self.ti[j]), int(self.tm[j])))
            k, d = int(self.ti[j]) + 1, int(d - self.n[self.tm[j]])
            if cls == inf_cls:
                cls = inf_cls if f_inf[k, d] <= layers[top][k, d] else top
            else:
                cls -= 1
        return path


def _stages(p: InterOpProblem, path: list[tuple[int, int, int]]) -> tuple[Stage, ...]:
    s = len(path)
    return tuple(Stage(first_layer=k, last_layer=i, submesh=m, time=float(p.stage_time[k, i, m]),
                       memory=p.stage_memory(k, i, m, s - 1 - pos)) for pos, (k, i, m) in enumerate(path))


def solve_inter_op(problem: InterOpProblem, *, tolerance: float = 0.0) -> InterOpSolution:
    """The stages and submeshes minimising ``Σ t_s + (B - 1)·max t_s`` (see the module docstring).

    Exact when ``tolerance == 0``; otherwise the cost is within ``tolerance`` (relative) of the optimum.
    Raises :class:`InterOpInfeasibleError` naming the binding constraint when no plan exists.
    """
    problem.verify()
    start = time.perf_counter()
    dp = _DP(problem)
    cands = np.unique(dp.tt)
    b1 = problem.num_microbatches - 1
    runs = settled = pruned = 0

    def run(j: int) -> tuple[float, tuple[Stage, ...], int] | None:
        nonlocal runs
        runs += 1
        res = dp.run(float(cands[j]))
        if res is None:
            return None
        stages = _stages(problem, res[1])
        t_star = max(s.time for s in stages)
        return res[0], stages, int(np.searchsorted(cands, t_star))

    top = run(cands.size - 1) if cands.size else None
    if top is None:
        raise _diagnose(problem)
    phi, best_stages, j_star = top
    best = pipeline_cost([s.time for s in best_stages], problem.num_microbatches)
    settled = cands.size - j_star
    # (bound, lo, hi, Φ(c_{hi+1}), probe the top first?)
    heap = [(phi + b1 * float(cands[0]), 0, j_star - 1, phi, False)] if j_star > 0 else []
    while heap:
        bound, lo, hi, lb, top_first = heapq.heappop(heap)
        if bound >= best - tolerance * abs(best):
            pruned += hi - lo + 1 + sum(e[2] - e[1] + 1 for e in heap)
            break
        mid = hi if top_first else (lo + hi) // 2
        res = run(mid)
        if res is None:  # infeasible at c_mid, hence at every smaller threshold
            settled += mid - lo + 1
            if mid < hi:
                heapq.heappush(heap, (lb + b1 * float(cands[mid + 1]), mid + 1, hi, lb, False))
            continue
        phi, stages, j = res
        cost = pipeline_cost([s.time for s in stages], problem.num_microbatches)
        if cost < best:
            best, best_stages = cost, stages
        settled += mid - max(j, lo) + 1  # t* may lie below this range: Φ is flat across it
        if mid < hi:
            heapq.heappush(heap, (lb + b1 * float(cands[mid + 1]), mid + 1, hi, lb, True))
        if lo < j:
            heapq.heappush(heap, (phi + b1 * float(cands[lo]), lo, j - 1, phi, False))
    try:
        placement = tuple(place_submeshes(problem.cluster, [problem.submeshes[s.submesh] for s in best_stages]))
    except ValueError:
        placement = None
    stats = InterOpStats(candidates=int(cands.size), dp_runs=runs, settled=settled, pruned=pruned,
                         dp_states=dp.states, seconds=time.perf_counter() - start)
    return InterOpSolution(stages=best_stages, cost=best, stats=stats, placement=placement)


def _brief(values: tuple[int, ...], head: int = 8) -> str:
    """A long tuple as its first entries and how many more, e.g. ``(1, 2, 3, …, +41 more)``."""
    if len(values) <= head:
        return str(tuple(values))
    return "(" + ", ".join(map(str, values[:head])) + f", … +{len(values) - head} more)"


def _diagnose(p: InterOpProblem) -> InterOpInfeasibleError:
    """Name why no plan exists: a layer with no finite stage, a layer that fits no stage in memory, device
    counts that cannot add up to the cluster, or memory once the in-flight microbatches are counted."""
    L, cap = p.num_layers, p.stage_limit
    t = np.where(np.triu(np.ones((L, L), bool))[:, :, None], p.stage_time, np.inf)
    least = min(p.inflight[:cap]) if cap else 0
    mem = p.static_memory + least * p.activation_memory
    fits = np.isfinite(t) & (True if p.memory_limit is None else mem <= p.memory_limit)
    for layer in range(L):
        holds = np.zeros((L, L), bool)
        holds[: layer + 1, layer:] = True
        if not (np.isfinite(t) & holds[:, :, None]).any():
            return InterOpInfeasibleError(
                f"layer {layer} has no finite stage time: stage_time[i, j, m] is +inf for every layer range "
                f"i <= {layer} <= j and every submesh; give it a finite time on some submesh", layer=layer)
        if not (fits & holds[:, :, None]).any():
            cand = np.where(np.isfinite(t) & holds[:, :, None], mem, np.inf)
            i, j, m = np.unravel_index(int(np.argmin(cand)), cand.shape)
            need = float(cand[i, j, m])
            return InterOpInfeasibleError(
                f"layer {layer} fits in no stage: the least memory a stage holding it needs is {need:.6g} bytes "
                f"per device (layers {i}..{j} on {p.submesh_label(int(m))} with {least} microbatch(es) in "
                f"flight), over the limit {p.memory_limit:.6g} by {need - p.memory_limit:.6g}. Try a larger "
                "memory limit, larger submeshes, rematerialisation, or a schedule with fewer microbatches in "
                "flight (1F1B rather than GPipe)",
                layer=layer, limit=p.memory_limit, closest=(int(i), int(j), int(m), need))
    sizes = sorted({int(x) for x in p.submesh_sizes})
    reach = {0}
    for _ in range(cap):
        reach |= {r + s for r in reach for s in sizes if r + s <= p.num_devices}
    if p.num_devices not in reach:
        return InterOpInfeasibleError(
            f"no {cap} or fewer submeshes of sizes {sizes} add up to the cluster's {p.num_devices} devices "
            f"(at most {cap} stages: min(layers, max_stages)); allow more stages or add smaller submeshes")
    if p.memory_limit is not None:
        try:
            loose = solve_inter_op(replace(p, memory_limit=None))
        except InterOpInfeasibleError:
            loose = None
        if loose is not None:
            worst = max(loose.stages, key=lambda s: s.memory)
            return InterOpInfeasibleError(
                f"no plan fits the memory limit {p.memory_limit:.6g} once the in-flight microbatches are "
                f"counted (by stages after a stage: {_brief(p.inflight[:cap])}); the fastest plan ignoring "
                f"memory has {loose.num_stages} "
                f"stages and stage layers {worst.first_layer}..{worst.last_layer} needs {worst.memory:.6g} "
                "bytes per device. Try a larger memory limit, rematerialisation, or fewer microbatches in flight",
                limit=p.memory_limit,
                closest=(worst.first_layer, worst.last_layer, worst.submesh, worst.memory))
    return InterOpInfeasibleError(
        f"no slicing of the {L} layers into at most {cap} stages uses exactly {p.num_devices} devices with "
        "finite stage times; check the +inf entries of stage_time")
