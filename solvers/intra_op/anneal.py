r"""Simulated annealing over a large core, with its inner loop compiled (numba, ``_anneal_kernel``).

A core of 4-6k nodes with tens of strategies each and memory that binds hard (IOPDDL K, M, N) is out of
reach of one ILP, and searches that only accept improving moves (ICM, block descent, windows) stop where
every cheaper layout needs memory another node holds, or where a whole region has to change layout at
once. Annealing walks through worse assignments to reach better ones.

State: an assignment ``x``; its cost ``f(x) = Σ_a c_a(x_a) + Σ_(a,b) R^ab(x_a, x_b)`` (``+inf`` replaced by
a penalty no move can pay) and its largest overflow ``o(x) = max_r (usage_r(x) − slack_r)``, kept in a
segment tree over the rows with lazy range add (``O(terms · log R)`` per node moved); and per node ``b`` its
local costs ``L_b(s) = c_b(s) + Σ_c R^bc(s, x_c)`` at its neighbours' strategies, so that a node's ``Δ`` is
``L_b(t) − L_b(x_b)`` and its best response an argmin over its ``k_b`` strategies. When ``b`` moves, each
neighbour's ``L`` changes by a row of their edge's matrix (stored from both sides, so rows are contiguous,
each distinct matrix once); a single move's change reaches ``L`` only once it is kept or something reads
it, and ``L`` is built afresh for each chunk. A move:

1. node ``a`` to a random other strategy ``t``;
2. with probability ``COMPOUND``, best responses spread from ``a`` hop by hop (up to ``2^h`` hops, ``h``
   uniform in ``0..MAX_HOPS_LOG``; at most ``MAX_MOVED`` nodes; hubs of more than ``MAX_DEG_FOLLOW``
   neighbours stay): each neighbour ``b`` of a moved node goes to ``argmin_s c_b(s) + Σ_c R^bc(s, x_c)``
   when that differs from ``x_b``: a layout change that carries its region along;
3. repair (always in hard mode, with probability ``REPAIR_PROB`` in soft and priced mode): while a row overflows,
   up to ``MAX_REPAIR`` times, a random memory term live on the worst row (terms are filed under the tree
   nodes that tile their interval) gives memory back: its node takes, of its strategies that use less
   there, the one that adds least cost.

``Δ`` is the sum of the exact cost deltas of the steps, each at the state the previous ones left, plus the
change of the memory prices ``p(x) = Σ_j w_j m_j(x_{a_j})`` (term ``j`` of node ``a_j`` takes ``m_j(s)`` bytes
on its rows). The move is kept by the Metropolis rule on the energy

* ``E = f + p`` in priced mode: memory is no constraint, only a cost (the Lagrangian relaxation of the
  memory rows, with a multiplier per term rather than per row); after each chunk of moves ``w_j`` grows by
  the factor ``1 + GAMMA`` when a row the term is live on overflows at the walk's point and shrinks by
  ``1 − GAMMA/2`` otherwise, so that the walk hovers at the edge of memory and every node whose bytes sit
  on a binding row sees their price: memory freed anywhere on those rows pays. (The contest's winners
  tune a usage weight per node by bisection on whether its interval overflows, and solve each weighting
  with a WCSP solver (toulbar2) under a time limit; "Soft Constraints, Strong Solutions", ICLR 2026
  submission.)
* ``E = f + p + λ · max(o, 0)`` in soft mode; ``λ`` adapts (strategic oscillation): every 1024 moves it
  grows by ``1 + LAM_STEP`` when the walk spent more than half of them overflowing and shrinks by as much
  otherwise. A chunk of moves that ends overflowing goes back to the best point with ``λ`` doubled.
* ``E = f + p`` with ``o <= 0`` after the move (hard mode);

otherwise the move is undone in reverse. Every walk uses the priced walk's ``w`` (zero without one). Only
points that fit memory are recorded: per walk its best, and the best of its last chunk (where it settled).

After each round the walks' points and the best point so far are merged (``merge``): the ILP over only the
strategies they use, exact, picks for each region the layout of whichever point is cheaper there, which no
walk does (two walks settle in different basins that differ in many independent pieces). IOPDDL, 75 s of
annealing, 3 rounds, one run each: K 1.031 -> 1.001 by the first round's merge; N 1.101 -> 1.076 by the
first, 1.068 -> 1.054 by the second; M 1.0756 -> 1.0735, then 1.0721 -> 1.0720. Where the round's luck is
bad the merge has less to work with: K and N end anywhere in 0.99-1.04 and 1.03-1.12 at 180 s.

Temperature falls geometrically from ``T_0`` to ``T_0 · COOLING_SPAN`` over each of ``ROUNDS`` rounds,
each restarting from the best point; ``T_0`` is the median uphill ``Δ`` of 2000 random single moves
(divided by the round number plus one), and the first ``λ`` makes a median memory change cost ``T_0``.
The clock is read between chunks of about ``CHUNK_SECONDS`` of compiled moves.

Why compiled: a move costs 0.6-6 µs in the compiled loop (a single move, a compound one) and ~50 µs as
Python; annealing needs millions. The local costs, the shared matrices and single moves undone unread
made IOPDDL N's priced walk 2.2-2.8x faster (one thread, the same 2M moves from the solve's start:
1.1-1.6e5 -> 3.1-3.6e5 moves/s; a compound move's best responses had read a column of every incident
edge's matrix, out of 48 MB); N's answer did not improve with it (benchmarks/iopddl_results.md).
The first call on a machine compiles the loop (3-10 s here; numba caches it on disk, loading takes
~0.3 s afterwards), so a solve anneals only when ``MIN_SECONDS`` are left for it. Measured (IOPDDL, 60 s
of annealing from the solve's start, 2-core machine): K 2.37 -> 1.08-1.13 of the best known, M 1.13 ->
1.07, N 1.99 -> 1.11-1.13; the same loop with hard memory and 1-hop compound moves reached K 1.18, N 1.30.
With a priced walk beside the hard one (30 s): K 1.02-1.03, N 1.11-1.13, M unchanged (1.072).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from solvers.intra_op.merge import Merger
from solvers.intra_op.presolve import Core

__all__ = ["MIN_SECONDS", "anneal", "available"]

log = logging.getLogger(__name__)

# share of moves that carry their region along (best responses spreading from the moved node)
COMPOUND = 0.3
# ... up to 2^h hops, h uniform in 0..MAX_HOPS_LOG, at most MAX_MOVED nodes; hubs with more neighbours
# than MAX_DEG_FOLLOW stay where they are. 1 hop only: K 1.13 -> 1.18 and N 1.12 -> 1.30 (60 s).
MAX_HOPS_LOG = 3
MAX_MOVED = 64
MAX_DEG_FOLLOW = 64
# memory per walk: "priced" (memory is not a constraint but a cost, each term's bytes at its own price that
# adapts, see GAMMA; only points that fit are recorded), "soft" (the walk may overflow, at a price per block
# of rows on the largest overflow, adapting by LAM_STEP every 1024 moves) or "hard" (every kept move fits).
# Every walk adds the priced walk's prices to its energy. 30 s from the solve's start, 3 seeds, load 2.5-3.9:
# priced + hard K 1.017-1.031, N 1.109-1.127; soft + hard (no prices) K 1.135-1.167, N 1.140-1.166; priced
# with prices for its own walk only K 1.020-1.035, N 1.121-1.132. Soft beat hard on IOPDDL (K 1.10, N 1.12
# against 1.20, 1.17 at 60 s), hard on a random loopy core whose rows all bind (test_intra_op_anneal).
MEMORY_MODES = ("priced", "hard")
BLOCKS = 32
LAM_STEP = 0.05
# repair steps after a move that overflows (always in hard mode, with this probability in soft mode)
MAX_REPAIR = 8
REPAIR_PROB = 0.5
# each round cools from T_0 to T_0 times this
COOLING_SPAN = 1e-4
# walks side by side (threads; the compiled loop releases the GIL), one per memory mode, the best of them
# kept each round
WALKS = 2
# restarts from the best point, each with a cooler start, the walks' points merged after each (one long
# round: K 1.145 against 1.08-1.13 before merging; with merging, 125 s of annealing, one run each: 3 rounds
# K 1.047 N 1.124, 4 rounds K 1.013 N 1.078 (every round re-heated to T_0), 5 rounds K 1.045 N 1.097:
# the first round's luck dominates)
ROUNDS = 4
# below this many seconds for annealing the solve does not anneal: compiling the loop the first time on a
# machine costs 3-10 s here (numba caches it on disk; loading it takes ~0.3 s afterwards)
MIN_SECONDS = 20.0
# the clock is read, and the priced walk's prices move, between chunks of about this many seconds of
# compiled moves. 0.25 s with the faster loop (1.5-3.5e5 moves/s on IOPDDL N; the prices then move about as
# often per move as at 0.5 s and the old rate), one run each: `anneal` alone 140 s N 1.024, 1.001 (0.5 s:
# 1.080), but solves N 1.107, 1.082, 1.141 (0.5 s: 1.089-1.118), K 1.038: not kept. At the old rate chunks
# of 0.1-0.2 s were worse (N 1.13-1.15)
CHUNK_SECONDS = 0.5
# a walk that ends this many chunks in a row outside memory goes back to the best point
STUCK_CHUNKS = 4
# the priced walk's prices: term j's bytes cost w_j each; after every chunk w_j grows by the factor 1 + GAMMA
# when a row the term is live on overflows at the walk's point, and shrinks by 1 - GAMMA / 2 otherwise
# (GAMMA 0.1: K 1.03-1.10, N 1.14-1.15); the first w_j make a median memory change cost W_INIT * T_0
GAMMA = 0.3
W_INIT = 0.1
# after each round the walks' points and the best one are merged (``merge``: the exact best recombination,
# an ILP over the strategies they use) for up to this share of the round's time, points that cost more than
# (1 + MERGE_WITHIN) times the cheapest left out
MERGE_SHARE = 0.15
MERGE_WITHIN = 0.1
# the best cost of a chunk starts from this (above every cost a point that fits can have)
UNSEEN = 1e300


def available() -> bool:
    """Whether numba imports here (the solve falls back to its uncompiled phases when it does not)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel():
    from solvers.intra_op import _anneal_kernel as k

    return k.run, k.sample_uphill


def _tiling(left: int, right: int) -> np.ndarray:
    """The tree nodes that tile leaves [left, right) (indices already offset by the tree size)."""
    out = []
    while left < right:
        if left & 1:
            out.append(left)
            left += 1
        if right & 1:
            right -= 1
            out.append(right)
        left >>= 1
        right >>= 1
    return np.array(out, dtype=np.int64)


class _Flat:
    """The core in flat arrays for the compiled loop (``+inf`` replaced by ``penalty``)."""

    def __init__(self, core: Core) -> None:
        n = core.num_nodes
        self.k = np.array([c.shape[0] for c in core.costs], dtype=np.int64)
        self.koff = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.k, out=self.koff[1:])
        finite = [c[np.isfinite(c)] for c in core.costs] + [m[np.isfinite(m)] for m in core.edge_costs]
        scale = max((float(np.abs(f).max()) for f in finite if f.size), default=1.0)
        self.penalty = 1e3 * max(scale, 1.0) * max(n, 1)
        cost = np.concatenate([c for c in core.costs]) if n else np.zeros(0)
        self.cost = np.where(np.isfinite(cost), cost, self.penalty).astype(np.float64)
        # each distinct edge matrix once as k_a x k_b and once transposed, so that the row of one node's
        # strategy is contiguous from either end: adjacency entry p of node a (neighbour b) has R^ab(s, u)
        # at omats[adj_omoff[p] + s * k_b + u]. Edges between nodes of the same kind share their matrix
        # (IOPDDL N: 1.7k distinct of 13k, 7 MB instead of 48: the moves' reads stay in cache)
        distinct: dict[tuple, int] = {}
        unique: list[np.ndarray] = []
        edge_mat = np.empty(len(core.edge_costs), dtype=np.int64)
        for e, m in enumerate(core.edge_costs):
            j = distinct.setdefault((m.shape, m.tobytes()), len(unique))
            if j == len(unique):
                unique.append(m)
            edge_mat[e] = j
        sizes = np.array([m.size for m in unique], dtype=np.int64)
        moff = np.zeros(len(unique) + 1, dtype=np.int64)
        np.cumsum(sizes, out=moff[1:])
        mats = np.concatenate([m.ravel() for m in unique] + [m.T.ravel() for m in unique]) if unique else np.zeros(0)
        self.omats = np.where(np.isfinite(mats), mats, self.penalty).astype(np.float64)
        ea = core.edge_nodes[:, 0].astype(np.int64)
        eb = core.edge_nodes[:, 1].astype(np.int64)
        m_e = ea.shape[0]
        src = np.concatenate([ea, eb])
        nbr = np.concatenate([eb, ea])
        first = np.concatenate([np.ones(m_e, dtype=np.bool_), np.zeros(m_e, dtype=np.bool_)])
        eidx = np.concatenate([np.arange(m_e), np.arange(m_e)])
        order = np.argsort(src, kind="stable")
        self.adj_nbr = nbr[order]
        self.adj_omoff = (moff[:-1][edge_mat[eidx]] + np.where(first, 0, moff[-1]))[order] if m_e else np.zeros(
            0, np.int64)
        self.adj_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(src, minlength=n), out=self.adj_off[1:])
        mem_node = core.mem_node.astype(np.int64)
        t_order = np.argsort(mem_node, kind="stable")
        self.term_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(mem_node, minlength=n), out=self.term_off[1:])
        self.term_lo = core.mem_lo.astype(np.int64)[t_order]
        self.term_hi = core.mem_hi.astype(np.int64)[t_order]
        usages = [core.mem_usage[j] for j in t_order.tolist()]
        ulen = np.array([u.shape[0] for u in usages], dtype=np.int64)
        uoff = np.zeros(len(usages) + 1, dtype=np.int64)
        np.cumsum(ulen, out=uoff[1:])
        self.term_uoff = uoff[:-1]
        self.usage = np.concatenate(usages).astype(np.float64) if usages else np.zeros(0)
        self.term_node = mem_node[t_order]
        rows = core.slack.shape[0]
        self.size = 1
        while self.size < max(rows, 1):
            self.size *= 2
        self.slack = core.slack.astype(np.float64)
        # each term filed under the tree nodes that tile [lo, hi) (for "a term live at row r")
        owners: list[np.ndarray] = []
        filed: list[np.ndarray] = []
        for j, (lo, hi) in enumerate(zip(self.term_lo.tolist(), self.term_hi.tolist(), strict=True)):
            nodes = _tiling(lo + self.size, hi + self.size)
            owners.append(nodes)
            filed.append(np.full(nodes.shape[0], j, dtype=np.int64))
        owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
        order = np.argsort(owner, kind="stable")
        self.stab_terms = (np.concatenate(filed) if filed else np.zeros(0, dtype=np.int64))[order]
        self.stab_off = np.zeros(2 * self.size + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, minlength=2 * self.size), out=self.stab_off[1:])
        self.tol = 1e-9 * max(1.0, float(np.abs(core.slack).max(initial=1.0)))
        # per usage entry: its term, and the flat index (into cost) of the strategy it belongs to
        self.entry_term = np.repeat(np.arange(ulen.shape[0]), ulen)
        self.entry_slot = self.koff[self.term_node][self.entry_term] + (
            np.arange(self.usage.shape[0]) - uoff[:-1][self.entry_term])

    def row_usage(self, x: np.ndarray) -> np.ndarray:
        """Usage per row at ``x``."""
        rows = self.slack.shape[0]
        vals = self.usage[self.term_uoff + x[self.term_node]]
        diff = np.zeros(rows + 1)
        np.add.at(diff, self.term_lo, vals)
        np.add.at(diff, self.term_hi, -vals)
        return np.cumsum(diff)[:-1]

    def term_prices(self, weight: np.ndarray, out: np.ndarray) -> None:
        """Per strategy, the memory it takes priced by per-term weights (written into ``out``)."""
        out[:] = np.bincount(self.entry_slot, weights=weight[self.entry_term] * self.usage, minlength=out.shape[0])

    def terms_over(self, g: np.ndarray, tol: float) -> np.ndarray:
        """Per term, whether a row it is live on has ``g > tol``."""
        cnt = np.concatenate([[0], np.cumsum(g > tol)])
        return cnt[self.term_hi] > cnt[self.term_lo]

    def tree(self, core: Core, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segment tree of usage − slack per row at ``x`` (padding rows at −inf)."""
        mx = np.full(2 * self.size, -np.inf)
        rows = self.slack.shape[0]
        if rows:
            mx[self.size:self.size + rows] = core.usage(x) - self.slack
        for i in range(self.size - 1, 0, -1):
            mx[i] = max(mx[2 * i], mx[2 * i + 1])
        return mx, np.zeros(2 * self.size)


def anneal(core: Core, start: np.ndarray, deadline: float, *, seed: int = 0,
           rounds: range = range(ROUNDS)) -> np.ndarray:
    """The cheapest memory-feasible assignment seen while annealing from ``start`` (which must fit
    memory) until ``deadline`` (perf_counter); never worse than ``start``. ``WALKS`` walks run side by
    side in threads (the compiled loop releases the GIL), each round every walk restarts from the best
    point any of them found. ``rounds``: which of the ``ROUNDS`` rounds to run (round ``r`` starts at
    ``T_0 / (1 + r)``), so that a solve can do something else between the first rounds and the last."""
    run, sample_uphill = _kernel()
    flat = _Flat(core)
    best_x = np.asarray(start, dtype=np.int64).copy()
    best_obj = core.objective(best_x)
    if not np.isfinite(best_obj) or core.num_nodes == 0:
        return best_x
    graph = (flat.k, flat.koff, flat.cost, flat.adj_off, flat.adj_nbr, flat.adj_omoff, flat.omats)
    memory = (flat.term_off, flat.term_lo, flat.term_hi, flat.term_uoff, flat.usage)
    moved = min(MAX_MOVED, core.num_nodes)
    repair = (flat.term_node, flat.stab_off, flat.stab_terms, MAX_REPAIR, REPAIR_PROB)
    # compile (or load from numba's disk cache) before the clock is shared out: a no-op call of each
    sample_uphill(best_x, 0, 0, *graph, flat.penalty)
    run(best_x.copy(), best_x.copy(), 0.0, 0.0, 1.0, 1.0, 0, 0, flat.tol, COMPOUND, np.full(1, -1.0), LAM_STEP,
        np.zeros(flat.cost.shape[0]), *graph, *memory, *flat.tree(core, best_x), flat.size, MAX_DEG_FOLLOW, MAX_HOPS_LOG, moved, *repair)
    du = np.concatenate([u - u.min() for u in core.mem_usage]) if core.mem_usage else np.zeros(0)
    du = du[du > 0]
    lam_per_t0 = 1.0 / float(np.median(du)) if du.size else 0.0  # a typical overflow first costs about T_0
    rng = np.random.default_rng(seed)
    # the priced walk's weight per memory term (set from the first T_0) and the prices per strategy that
    # every walk adds to its energy (zero while no walk prices memory)
    weight = np.full(flat.term_node.shape[0], -1.0)
    price = np.zeros(flat.cost.shape[0])

    def walk(x: np.ndarray, t0: float, begin: float, end: float, walk_seed: int, mode: str
             ) -> tuple[np.ndarray, np.ndarray, dict]:
        """One round of one walk from ``x``: the best point it saw (``x`` itself when nothing cheaper) and
        the best of its last chunk that fit (where the cold walk settled; ``x`` when none did)."""
        wrng = np.random.default_rng(walk_seed)
        best_w, chunk_w, last_w = x.copy(), x.copy(), x.copy()
        cur = best = core.objective(x)
        # the kernel's memory mode: a price per block of rows on the overflow (soft), none (priced: 0), or
        # every kept move fits (hard: < 0)
        lam = np.full(min(BLOCKS, flat.size), {"soft": lam_per_t0 * t0, "priced": 0.0, "hard": -1.0}[mode])
        if mode == "priced" and weight[0] < 0:
            weight[:] = W_INIT * lam_per_t0 * t0
        mx, lz = flat.tree(core, x)
        # the temperature follows the clock: a chunk of moves covers the part of the cooling that its
        # expected duration (at the rate measured so far) takes of the round
        span = max(end - begin, 1e-9)
        rate, chunks, resets, overflowing = None, 0, 0, 0
        moves, busy = 0, 0.0  # the round's moves and the seconds the compiled loop took for them
        while (now := time.perf_counter()) < end:
            iters = 20_000 if rate is None else int(max(1000, min(rate * CHUNK_SECONDS, rate * (end - now))))
            frac = (now - begin) / span
            frac_end = min(1.0, frac + (iters / rate if rate else 0.01) / span)
            # the kernel records the chunk's cheapest point that fits in chunk_w (from UNSEEN down)
            cur, chunk = run(x, chunk_w, cur, UNSEEN, t0 * COOLING_SPAN**frac, t0 * COOLING_SPAN**frac_end, iters,
                             int(wrng.integers(2**31)), flat.tol, COMPOUND, lam, LAM_STEP, price, *graph, *memory, mx,
                             lz, flat.size, MAX_DEG_FOLLOW, MAX_HOPS_LOG, moved, *repair)
            took = time.perf_counter() - now
            rate = iters / max(took, 1e-6)
            moves += iters
            busy += took
            chunks += 1
            overflow = flat.row_usage(x) - flat.slack if mode == "priced" else None
            if chunk < UNSEEN:
                last_w[:] = chunk_w
                if chunk < best:
                    best_w[:] = chunk_w
                    best = chunk
            elif (mx[1] if overflow is None else overflow.max(initial=0.0)) <= flat.tol:
                last_w[:] = x  # nothing cheaper seen in the chunk, but where the walk stands fits
            if overflow is not None:
                over = flat.terms_over(overflow, flat.tol)
                weight[over] *= 1.0 + GAMMA
                weight[~over] *= 1.0 - GAMMA / 2
                flat.term_prices(weight, price)
                continue
            overflowing = overflowing + 1 if mx[1] > flat.tol else 0
            if overflowing:
                lam *= 2.0  # the adaptation inside the chunk was too slow to bring the walk back
            if overflowing >= STUCK_CHUNKS:
                # still outside memory: go on from the best point
                x[:] = best_w
                cur = best
                mx, lz = flat.tree(core, x)
                overflowing = 0
                resets += 1
        return best_w, last_w, {"chunks": chunks, "resets": resets, "moves": moves, "rate": moves / max(busy, 1e-6),
                                "price": float(np.median(lam))}

    walks = max(1, min(WALKS, os.cpu_count() or 1))
    merger = None
    with ThreadPoolExecutor(max_workers=walks) as pool:
        for rnd in rounds:
            begin = time.perf_counter()
            if deadline - begin <= 0.05:
                break
            end = begin + (deadline - begin) / (rounds.stop - rnd)
            ups = sample_uphill(best_x, 2000, int(rng.integers(2**31)), *graph, flat.penalty)
            if ups.size == 0:
                break  # no move can make anything worse than the penalty: nothing to anneal
            t0 = float(np.median(ups)) / (1.0 + rnd)  # T_0 / 5 for one round: K 1.145, N 1.135 (no better)
            futures = [pool.submit(walk, best_x.copy(), t0, begin, end, int(rng.integers(2**31)), mode)
                       for mode in MEMORY_MODES[:walks]]
            points = [best_x]
            for fut in futures:
                x, last, stats = fut.result()
                obj = core.objective(x)
                points.append(last)
                log.debug("anneal round %d: T0 %.3g, median price %.3g, %d chunks (%d back to the best), "
                          "%.3g moves at %.3g moves/s, best %.6g", rnd, t0, stats["price"], stats["chunks"],
                          stats["resets"], stats["moves"], stats["rate"], obj)
                points.append(x)
                if obj < best_obj:
                    best_x, best_obj = x, obj
            points = [p for p in points if core.objective(p) <= (1.0 + MERGE_WITHIN) * best_obj]
            if len(points) > 1:
                merger = merger or Merger(core)
                merged = merger.merge(points, min(deadline, time.perf_counter() + MERGE_SHARE * (end - begin)))
                obj = core.objective(merged)
                log.debug("anneal round %d: merged %d points, best %.6g -> %.6g", rnd, len(points), best_obj, obj)
                if obj < best_obj:
                    best_x, best_obj = merged, obj
    return best_x
