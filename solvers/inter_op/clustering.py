"""Operator clustering (Alpa §5.2, arXiv 2201.12023): group a chain of ops into ``L`` layers with cheap cuts.

Ops ``0..n-1`` come in topological order with flops ``f_q`` (prefix sums ``P_q = Σ_{q' < q} f_{q'}``,
total ``F = P_n``). Boundary ``p`` (``0 <= p <= n-2``) cuts between op ``p`` and op ``p + 1``; ``c_p`` is the
bytes of the tensors live across it. A clustering is ``L - 1`` boundaries ``p_1 < … < p_{L-1}`` (set
``p_0 = -1``, ``p_L = n - 1``); layer ``l`` holds ops ``p_{l-1}+1 .. p_l`` and has flops
``w_l = P_{p_l + 1} - P_{p_{l-1} + 1}``. With balance ``δ`` and cap ``κ = (1 + δ)·F / L``:

    minimise   Σ_{l < L} c_{p_l}                      (communication between layers)
    subject to w_l <= κ for every layer,  every p_l allowed,  every forced boundary among the p_l,
    tie-break  the smallest max_l w_l among the minimisers (to relative ``rtol``).

Forced boundaries count as allowed. More than ``L - 1`` of them is an error (they would make more than
``L`` layers); exactly ``L - 1`` fixes the answer. If no clustering meets ``κ``, ``δ`` is doubled (from
1/8 when it is 0) until one does, at the latest when ``δ >= L - 1`` (``κ >= F``); ``balance_used``
reports the ``δ`` that worked.

**DP.** ``G_j(e)`` = least cut cost of ``j`` layers covering ops ``0..e`` with layer ``j`` ending at ``e``:

    G_1(e) = c_e                                   if P_{e+1} <= κ and no forced boundary lies below e,
    G_j(e) = c_e + min_{a(e) <= p <= e-1} G_{j-1}(p),
    a(e)   = max(min{p : P_{e+1} - P_{p+1} <= κ},  the largest forced boundary below e),

with ``c_{n-1} = 0``, ``G_j(e) = +inf`` at disallowed ``e``, and answer ``G_L(n - 1)``. Both ends of the
window grow with ``e``; the window minimum is a sparse-table range-minimum query, vectorised over all
``e`` of a layer, so one DP costs ``O(L · n log n)`` numpy work on the reachable band of ``e``. The
tie-break bisects ``κ' <= κ`` for the least cap whose DP still reaches the minimal cut cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Clustering", "ClusteringProblem", "cluster_layers"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ClusteringProblem:
    """Per-op flops ``[n]``, per-boundary cut bytes ``[n - 1]``, the layer count and the constraints.

    ``allowed[p]`` (default all True) says whether a boundary may go between ops ``p`` and ``p + 1``;
    ``forced`` lists boundaries that must be used (user markers); they count as allowed.
    """

    flops: np.ndarray
    cut_bytes: np.ndarray
    num_layers: int
    balance: float = 0.25
    forced: Sequence[int] = ()
    allowed: np.ndarray | None = None

    def __post_init__(self) -> None:
        flops = np.array(self.flops, dtype=np.float64).reshape(-1)
        cuts = np.array(self.cut_bytes, dtype=np.float64).reshape(-1)
        allowed = (np.ones(max(flops.size - 1, 0), dtype=bool) if self.allowed is None
                   else np.array(self.allowed, dtype=bool).reshape(-1))
        object.__setattr__(self, "flops", _frozen(flops))
        object.__setattr__(self, "cut_bytes", _frozen(cuts))
        object.__setattr__(self, "allowed", _frozen(allowed))
        object.__setattr__(self, "forced", tuple(sorted({int(p) for p in self.forced})))
        object.__setattr__(self, "num_layers", int(self.num_layers))
        object.__setattr__(self, "balance", float(self.balance))

    @property
    def num_ops(self) -> int:
        return int(self.flops.size)

    def candidate_mask(self) -> np.ndarray:
        """``allowed`` with the forced boundaries switched on."""
        mask = self.allowed.copy()
        mask[list(self.forced)] = True
        return mask

    def verify(self) -> None:
        """Raise a ValueError naming the first malformed field."""
        n, L = self.num_ops, self.num_layers
        if n < 1:
            raise ValueError("a clustering problem needs at least one op")
        if not (np.isfinite(self.flops).all() and (self.flops >= 0).all()):
            q = int(np.flatnonzero(~np.isfinite(self.flops) | (self.flops < 0))[0])
            raise ValueError(f"flops[{q}] = {self.flops[q]!r}; flops must be finite and >= 0")
        if self.cut_bytes.shape != (n - 1,):
            raise ValueError(f"cut_bytes has {self.cut_bytes.size} entries; {n} ops have {n - 1} boundaries")
        if not (np.isfinite(self.cut_bytes).all() and (self.cut_bytes >= 0).all()):
            raise ValueError("cut_bytes must be finite and >= 0")
        if self.allowed.shape != (n - 1,):
            raise ValueError(f"allowed has {self.allowed.size} entries; {n} ops have {n - 1} boundaries")
        if not 1 <= L <= n:
            raise ValueError(f"num_layers must be between 1 and the op count {n}, got {L}")
        if not (np.isfinite(self.balance) and self.balance >= 0):
            raise ValueError(f"balance must be finite and >= 0, got {self.balance}")
        bad = [p for p in self.forced if not 0 <= p <= n - 2]
        if bad:
            raise ValueError(f"forced boundaries {bad} are outside 0..{n - 2}")
        if len(self.forced) > L - 1:
            raise ValueError(f"{len(self.forced)} forced boundaries make {len(self.forced) + 1} layers, more than "
                             f"num_layers={L}; raise num_layers to at least {len(self.forced) + 1} or drop markers")
        free = int(self.candidate_mask().sum())
        if free < L - 1:
            raise ValueError(f"only {free} boundary positions are allowed; {L} layers need {L - 1}. Allow more "
                             "positions or ask for fewer layers")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Clustering:
    """Boundaries ``p`` (layer ends after op ``p``), per-layer flops, summed cut bytes, the ``δ`` used."""

    boundaries: tuple[int, ...]
    layer_flops: np.ndarray
    cut_cost: float
    balance_used: float

    @property
    def num_layers(self) -> int:
        return len(self.boundaries) + 1

    def layer_of(self, n: int) -> np.ndarray:
        """``[n]`` array: the layer index of each op."""
        marks = np.zeros(n, dtype=np.int64)
        marks[np.array(self.boundaries, dtype=np.int64) + 1] = 1
        return np.cumsum(marks)

    def layer_ranges(self, n: int) -> list[tuple[int, int]]:
        """``(first_op, last_op)`` of each layer, inclusive."""
        ends = [*self.boundaries, n - 1]
        return [(a + 1, b) for a, b in zip([-1, *self.boundaries], ends, strict=True)]

    def verify(self, problem: ClusteringProblem, *, rtol: float = 1e-9) -> None:
        """Raise ValueError unless the boundaries are valid and the recorded numbers match them."""
        b, n, L = list(self.boundaries), problem.num_ops, problem.num_layers
        if len(b) != L - 1 or b != sorted(set(b)) or (b and not 0 <= b[0] <= b[-1] <= n - 2):
            raise ValueError(f"boundaries {b} must be {L - 1} distinct sorted positions in 0..{n - 2}")
        if not problem.candidate_mask()[b].all():
            raise ValueError(f"boundaries {[p for p in b if not problem.candidate_mask()[p]]} are not allowed")
        missing = sorted(set(problem.forced) - set(b))
        if missing:
            raise ValueError(f"forced boundaries {missing} are not used")
        w = _layer_sums(_prefix(problem.flops), b)
        if not np.allclose(w, self.layer_flops, rtol=rtol, atol=0.0):
            raise ValueError(f"recorded layer flops {self.layer_flops} differ from {w}")
        cap = _cap(_prefix(problem.flops)[-1], L, self.balance_used)
        if (w > cap).any():
            raise ValueError(f"layer {int(np.argmax(w))} has {w.max():.6g} flops > cap {cap:.6g} "
                             f"(balance {self.balance_used})")
        cost = float(problem.cut_bytes[b].sum())
        if not np.isclose(cost, self.cut_cost, rtol=rtol, atol=1e-12):
            raise ValueError(f"recorded cut cost {self.cut_cost!r} differs from {cost!r}")


def _prefix(flops: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(flops)])


def _layer_sums(prefix: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    ends = np.array([*boundaries, prefix.size - 2], dtype=np.int64) + 1
    return np.diff(prefix[np.concatenate([[0], ends])])


def _cap(total: float, num_layers: int, delta: float) -> float:
    """``κ = (1 + δ)·F / L``, with a hair of slack so that rounding never rejects an exact split."""
    return (1 + delta) * total / num_layers * (1 + 1e-12)


def _balances(delta: float, num_layers: int) -> Iterator[float]:
    """``δ, 2δ, 4δ, …`` (from 1/8 when ``δ = 0``) up to the first value ``>= L - 1`` (cap ``>= F``)."""
    while True:
        yield delta
        if delta >= num_layers - 1:
            return
        delta = 2 * delta if delta > 0 else 0.125


def _range_min(vals: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(vals[lo[e] .. hi[e]])`` for every ``e`` (``+inf`` when ``lo > hi``), by a sparse table whose
    levels stop at the longest window."""
    empty = lo > hi
    length = np.where(empty, 1, hi - lo + 1)
    k = np.frexp(length.astype(np.float64))[1] - 1  # floor(log2(length))
    top = int(k.max()) if k.size else 0
    table = np.empty((top + 1, vals.size))
    table[0] = vals
    width = 1
    for level in range(1, top + 1):  # table[l, i] = min(vals[i .. i + 2^l - 1]) where that fits
        span = vals.size - 2 * width + 1
        np.minimum(table[level - 1, :span], table[level - 1, width:width + span], out=table[level, :span])
        width *= 2
    flat, row = table.reshape(-1), k * vals.size
    out = np.minimum(flat.take(row + np.where(empty, 0, lo)), flat.take(row + np.where(empty, 0, hi) - (1 << k) + 1))
    out[empty] = np.inf
    return out


class _Chain:
    """The DP of the module docstring for one problem; ``solve(cap)`` runs it at one cap."""

    def __init__(self, p: ClusteringProblem) -> None:
        self.n, self.L = p.num_ops, p.num_layers
        self.prefix = _prefix(p.flops)
        self.cut = np.concatenate([p.cut_bytes, [0.0]])
        self.end_ok = np.concatenate([p.candidate_mask(), [False]])  # layer j < L may not end at n - 1
        fa = np.array(p.forced, dtype=np.int64)
        last_forced = np.full(self.n, -1, dtype=np.int64)
        last_forced[fa + 1] = fa
        self.last_forced = np.maximum.accumulate(last_forced)  # largest forced f < e, or -1

    def solve(self, cap: float) -> tuple[float, list[int]] | None:
        """``(cut cost, boundaries)`` of a cheapest clustering whose layers all have ``<= cap`` flops."""
        n, L, P = self.n, self.L, self.prefix
        if L == 1:
            return (0.0, []) if P[n] <= cap else None
        e = np.arange(n)
        window_lo = np.maximum(np.searchsorted(P, P[1:] - cap, side="left") - 1, self.last_forced)
        rest = P[n] - P[1:]  # flops after op e; the L - j layers after layer j need rest <= (L - j)·cap
        room = cap * (1 + 1e-9)
        first = np.where((P[1:] <= cap) & (self.last_forced < 0) & self.end_ok
                         & (rest <= (L - 1) * room) & (e <= n - L), self.cut, np.inf)
        layers = [(0, first)]  # (first e, G_j on e = first e ..): the reachable band of each layer
        for j in range(2, L + 1):
            start, prev = layers[-1]
            fin = np.flatnonzero(np.isfinite(prev))
            if not fin.size:
                return None
            f0, f1 = start + int(fin[0]), start + int(fin[-1])
            if j == L:
                e_lo = e_hi = n - 1
            else:
                e_lo = max(f0 + 1, int(np.searchsorted(P, P[n] - (L - j) * room, side="left")) - 1)
                e_hi = min(int(np.searchsorted(P, P[f1 + 1] + cap, side="right")) - 2, n - 1 - (L - j))
            if e_hi < e_lo:
                return None
            es = e[e_lo:e_hi + 1]
            best = _range_min(prev[f0 - start:f1 - start + 1], np.maximum(window_lo[es], f0) - f0,
                              np.minimum(es - 1, f1) - f0)
            ok = self.end_ok[es] | (es == n - 1)
            layers.append((e_lo, np.where(ok, self.cut[es] + best, np.inf)))
        if not np.isfinite(layers[-1][1][-1]):
            return None
        return self._backtrack(layers, window_lo)

    def _backtrack(self, layers: list[tuple[int, np.ndarray]], window_lo: np.ndarray) -> tuple[float, list[int]]:
        end, bounds = self.n - 1, []
        for j in range(self.L - 1, 0, -1):  # layer j + 1 ends at `end`; pick where layer j ends
            start, vals = layers[j - 1]
            lo = max(int(window_lo[end]), start)
            end = lo + int(np.argmin(vals[lo - start:end - start]))
            bounds.append(end)
        bounds.reverse()
        return float(self.cut[bounds].sum()), bounds


def cluster_layers(problem: ClusteringProblem, *, rtol: float = 1e-6) -> Clustering:
    """Group the ops into ``num_layers`` layers: least summed cut bytes within the balance cap, then the
    least maximum layer flops (see the module docstring). ``rtol`` bounds the tie-break's bisection."""
    problem.verify()
    chain = _Chain(problem)
    total = float(chain.prefix[-1])
    found = None
    for delta in _balances(problem.balance, problem.num_layers):
        found = chain.solve(_cap(total, problem.num_layers, delta))
        if found is not None:
            break
    if found is None:  # unreachable after verify(): kept as a guard
        raise ValueError("no clustering satisfies the forced and allowed boundaries")
    cost, bounds = found
    slack = 1e-9 * max(1.0, abs(cost))
    hi = float(_layer_sums(chain.prefix, bounds).max())
    lo = max(total / problem.num_layers, float(problem.flops.max()))  # no clustering has a smaller maximum
    first = True
    while hi - lo > rtol * hi:
        mid = lo if first else lo + (hi - lo) / 2  # the lower bound itself is often reachable: try it first
        first = False
        res = chain.solve(mid * (1 + 1e-12))
        if res is not None and res[0] <= cost + slack:
            bounds, hi = res[1], float(_layer_sums(chain.prefix, res[1]).max())
        else:
            lo = mid
    w = _layer_sums(chain.prefix, bounds)
    return Clustering(boundaries=tuple(int(b) for b in bounds), layer_flops=_frozen(w),
                      cut_cost=float(problem.cut_bytes[bounds].sum()), balance_used=delta)

