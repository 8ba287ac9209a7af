r"""A lower bound for a large core: forests that share the nodes' costs, memory priced by Lagrange.

Core symbols as in ``ilp.py``: node costs ``c_a``, edge matrices ``R^e``, memory terms ``m_j`` of node
``a_j`` on rows ``[lo_j, hi_j)`` with slack ``S_r``. The edges are split into forests ``F_1..F_T`` (each
edge goes to the first forest it closes no cycle in). For multipliers ``λ_r >= 0`` on the memory rows,
write ``μ_a(s) = Σ_{j : a_j = a} m_{j,s} Σ_{lo_j <= r < hi_j} λ_r`` and

.. math::

    L(λ) = Σ_{t=1}^{T} \min_x \Big[ Σ_a \tfrac{1}{T} (c_a + μ_a)(x_a) + Σ_{e ∈ F_t} R^e(x_a, x_b) \Big]
           − Σ_r λ_r S_r .

Every feasible ``x`` has ``Σ_r λ_r (usage_r(x) − S_r) <= 0``, and the objective plus that term is the sum
over ``t`` of the brackets at ``x``; each bracket is at least its minimum. So ``L(λ)`` is a lower bound on
the core optimum for any ``λ >= 0``; each minimum is exact by the forest DP (``tree_dp.ForestDP``; +inf
entries become a large finite penalty there, which only lowers the bound). ``λ`` follows projected
subgradient steps (Polyak's rule towards the incumbent's objective ``U``):
``g_r = (1/T) Σ_t usage_r(x^t) − S_r``, ``λ ← max(0, λ + θ (U − L(λ)) g / ‖g‖²)``, ``θ`` halved after five
steps without a better bound.
"""

from __future__ import annotations

import time

import numpy as np

from solvers.intra_op.presolve import Core
from solvers.intra_op.tree_dp import ForestDP

__all__ = ["forest_split", "lagrangian_bound"]


def forest_split(core: Core) -> list[list[int]]:
    """The core's edges split into forests, greedily (first forest where the edge closes no cycle)."""
    forests: list[list[int]] = []
    parents: list[np.ndarray] = []

    def find(parent: np.ndarray, x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = int(parent[x])
        return x

    for e, (a, b) in enumerate(core.edge_nodes.tolist()):
        for f, parent in enumerate(parents):
            ra, rb = find(parent, a), find(parent, b)
            if ra != rb:
                parent[ra] = rb
                forests[f].append(e)
                break
        else:
            parent = np.arange(core.num_nodes)
            parent[find(parent, a)] = find(parent, b)
            parents.append(parent)
            forests.append([e])
    return forests or [[]]


def lagrangian_bound(core: Core, deadline: float, *, upper: float | None = None) -> float:
    """The best ``L(λ)`` of the module docstring found by ``deadline`` (``core.constant`` not included)."""
    forests = forest_split(core)
    t = len(forests)
    big = 1e6 * max(1.0, max((float(np.abs(c).max()) for c in core.costs), default=1.0)) * max(core.num_nodes, 1)
    mats = [np.where(np.isfinite(m), m, big) for m in core.edge_costs]
    dps = [ForestDP(core, f, mats) for f in forests]
    n_r = core.slack.shape[0]
    lam = np.zeros(n_r)
    best = -np.inf
    theta, stall = 1.0, 0
    while True:
        # μ_a(s): every term's usage times the summed multipliers over its rows
        cum = np.concatenate([[0.0], np.cumsum(lam)])
        weight = cum[core.mem_hi] - cum[core.mem_lo] if n_r else np.zeros(0)
        unary = [c.copy() for c in core.costs]
        for a, u, w in zip(core.mem_node.tolist(), core.mem_usage, weight.tolist(), strict=True):
            if w:
                unary[a] += w * u
        extra = [u / t - c for u, c in zip(unary, core.costs, strict=True)]
        value = -float(lam @ core.slack) if n_r else 0.0
        usage = np.zeros(n_r)
        for dp in dps:
            if time.perf_counter() > deadline:
                return best  # this round is incomplete: its value is no bound
            x = dp.solve(extra)
            value += sum(float(u[s]) / t for u, s in zip(unary, x.tolist(), strict=True))
            for e in _forest_edges(dp):
                a, b = core.edge_nodes[e]
                value += float(mats[e][x[a], x[b]])
            if n_r:
                usage += core.usage(x) / t
        if best == -np.inf or value > best + 1e-12 * max(1.0, abs(best)):
            best, stall = value, 0
        else:
            stall += 1
            if stall >= 5:
                theta, stall = theta / 2, 0
        if n_r == 0 or time.perf_counter() > deadline or theta < 1e-4:
            return best
        g = usage - core.slack
        g[(lam <= 0) & (g < 0)] = 0.0
        norm = float(g @ g)
        if norm == 0.0:
            return best
        target = upper if upper is not None and upper > value else value + 0.05 * max(1.0, abs(value))
        lam = np.maximum(0.0, lam + theta * (target - value) / norm * g)


def _forest_edges(dp: ForestDP) -> list[int]:
    """The forest edges of ``dp`` (one per non-root node)."""
    return [dp.up[a][1] for a in dp.order if dp.up[a][0] >= 0]
