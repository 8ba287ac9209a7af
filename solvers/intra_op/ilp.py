r"""The intra-operator ILP (Alpa, Zheng et al. 2022, §4.1 "Intra-operator parallelism", eq. (1); and XLA's
auto-sharding pass, ``xla/hlo/experimental/auto_sharding``), built as a sparse matrix and solved by HiGHS.

It is solved on the :class:`~solvers.intra_op.presolve.Core` that presolve leaves. Symbols:

* nodes ``a = 1..N`` with strategies ``s = 1..k_a`` costing ``c_{a,s}`` (finite after presolve);
* edges ``e = (a, b)`` with matrices ``R^e`` (``k_a × k_b``); ``F_e = {(i, j) : R^e_{ij} < ∞}``;
* memory terms ``j`` of node ``a_j`` adding ``m_{j,s}`` on rows ``lo_j <= r < hi_j``; row ``r`` has
  slack ``S_r`` (the limit minus the usage already fixed, see presolve's docstring).

Variables: ``x_{a,s} ∈ {0, 1}`` (node ``a`` picks ``s``), ``y_{e,i,j} ∈ [0, 1]`` for ``(i, j) ∈ F_e`` only,
``U_r ∈ (-∞, S_r]`` (usage at row ``r``).

.. math::

    \min \; Σ_a Σ_s c_{a,s} x_{a,s} + Σ_e Σ_{(i,j) ∈ F_e} R^e_{ij} y_{e,i,j}

    Σ_s x_{a,s} = 1                                  ∀a             (one-hot)
    Σ_{j : (i,j) ∈ F_e} y_{e,i,j} = x_{a,i}          ∀e=(a,b), ∀i   (edge linearisation, rows)
    Σ_{i : (i,j) ∈ F_e} y_{e,i,j} = x_{b,j}          ∀e=(a,b), ∀j   (edge linearisation, columns)
    U_r − U_{r−1} = Σ_{j : lo_j = r} Σ_s m_{j,s} x_{a_j,s} − Σ_{j : hi_j = r} Σ_s m_{j,s} x_{a_j,s}
                                                     ∀r, U_{−1} = 0  (memory)

With integral ``x`` the marginal rows force ``y_{e,i,j} = x_{a,i} x_{b,j}``, so ``y`` may stay
continuous; this is Alpa's ``e_{uv} ∈ {0,1}^{k_u k_v}, Σ e = 1, e ≤ x_u ⊗ 1, e ≤ 1 ⊗ x_v`` written as
the tighter local-marginal polytope. Forbidden pairs (``R_{ij} = +∞``) get no variable at all, which
forbids them exactly. The memory rows telescope to Alpa's ``Σ_{a live at r} m_a^T x_a <= S_r`` (one row
per distinct liveness point; presolve has already dropped rows that cannot bind) with ``2 × Σ_j k_{a_j}``
nonzeros instead of one copy of every long-lived node per row. Functions: ``build_ilp`` writes the rows
above in that order; ``solve_ilp`` runs HiGHS through ``highspy`` (or CBC through pulp as the fallback).

The objective HiGHS gets is scaled (``IlpModel.scale``) so that its largest coefficient is at least
``OBJECTIVE_SCALE``: the planner's costs are seconds (a GPT-1T layer's largest is 0.64, its smallest 2e-19),
and at that scale HiGHS 1.16 declared optimal answers its own warm start beats. GPT-1T's block on 3x8
(127-node core, 6,475 columns; core objectives): "optimal" at 177.015 ms unscaled, 176.694 ms (truly
optimal: the windowed local search had found it) with the costs multiplied by anything from 3 to 1e6; over the 36 layer cores
of that plan with at most 80k columns, scaled runs reached the same or a better answer, and proved the
large ones faster (a 161-node, 59k-column core: optimal in 13.9 s scaled, 321.5 ms at a 20 s limit
unscaled, against 191.0). Costs already that large (IOPDDL's) are passed as they are.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from solvers.intra_op.presolve import Core

__all__ = [
    "IlpModel", "IlpResult", "build_ilp", "highs_available", "ilp_columns", "ilp_fits", "interrupt_at_deadline",
    "solve_ilp",
]

# HiGHS spends about 1 s per 40k columns (presolve, symmetry detection) before its first LP iteration and
# does not stop for its time limit meanwhile: GPT-6.7B's tied core on 8x8 (200k columns) given 4 s took
# 12 s without reaching the root LP; a 54k-column window given 1.5 s took 7.6 s (this 2-core machine).
ILP_COLUMNS_PER_SECOND = 40_000
ILP_SETUP_SHARE = 0.25  # of the time a solve may take, at most, for HiGHS's set-up
# the least largest objective coefficient HiGHS is given (the module docstring): smaller costs are scaled up
OBJECTIVE_SCALE = 1e3


def ilp_columns(core: Core) -> int:
    """Columns of ``core``'s ILP: one per strategy, one per finite edge entry."""
    return sum(c.shape[0] for c in core.costs) + sum(int(np.isfinite(m).sum()) for m in core.edge_costs)


def ilp_fits(columns: int, seconds: float) -> bool:
    """Whether HiGHS can set up an ILP of ``columns`` columns within ``ILP_SETUP_SHARE`` of ``seconds``."""
    return columns <= ILP_COLUMNS_PER_SECOND * ILP_SETUP_SHARE * max(0.0, seconds)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class IlpModel:
    """``min cost·z  s.t.  row_lower <= A z <= row_upper,  col_lower <= z <= col_upper`` (A column-wise)."""

    cost: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integer: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    a_start: np.ndarray
    a_index: np.ndarray
    a_value: np.ndarray
    x_offset: np.ndarray  # first x column of each core node
    edge_cols: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # per edge: (i, j, column)
    u_offset: int
    scale: float = 1.0  # ``cost`` is the core's costs times this (the module docstring)

    def full_solution(self, core: Core, choice: np.ndarray) -> np.ndarray:
        """Every column's value for a core assignment (None-safe warm start)."""
        z = np.zeros(self.cost.shape[0])
        z[self.x_offset + choice] = 1.0
        for (a, b), (ii, jj, cols) in zip(core.edge_nodes.tolist(), self.edge_cols, strict=True):
            hit = (ii == choice[a]) & (jj == choice[b])
            z[cols[hit]] = 1.0
        if core.slack.size:
            z[self.u_offset : self.u_offset + core.slack.shape[0]] = core.usage(choice)
        return z


@dataclass(frozen=True, kw_only=True, slots=True)
class IlpResult:
    choice: np.ndarray | None  # compressed core strategies, None when no solution was found
    objective: float | None
    bound: float | None
    status: str  # "optimal", "time limit", "infeasible", or the solver's word
    seconds: float


def build_ilp(core: Core) -> IlpModel:
    """The sparse ILP of the module docstring for ``core``."""
    k = np.array([c.shape[0] for c in core.costs], dtype=np.int64)
    n_x = int(k.sum())
    x_off = np.concatenate([[0], np.cumsum(k)[:-1]]).astype(np.int64)
    row_off = 0
    rows, cols, vals = [], [], []
    # one-hot
    rows.append(np.repeat(np.arange(k.shape[0]), k))
    cols.append(np.arange(n_x))
    vals.append(np.ones(n_x))
    row_off = k.shape[0]
    costs = [np.concatenate(core.costs) if core.costs else np.zeros(0)]
    col = n_x
    edge_cols = []
    for (a, b), m in zip(core.edge_nodes.tolist(), core.edge_costs, strict=True):
        ii, jj = np.nonzero(np.isfinite(m))
        c = np.arange(col, col + ii.shape[0])
        edge_cols.append((ii, jj, c))
        costs.append(m[ii, jj])
        ka, kb = m.shape
        rows += [row_off + ii, row_off + ka + jj, row_off + np.arange(ka), row_off + ka + np.arange(kb)]
        cols += [c, c, x_off[a] + np.arange(ka), x_off[b] + np.arange(kb)]
        vals += [np.ones(c.shape[0]), np.ones(c.shape[0]), -np.ones(ka), -np.ones(kb)]
        row_off += ka + kb
        col += c.shape[0]
    n_rows_edges = row_off
    n_r = core.slack.shape[0]
    u_off = col
    if n_r:
        costs.append(np.zeros(n_r))
        r = np.arange(n_r)
        rows += [row_off + r, row_off + r[1:]]
        cols += [u_off + r, u_off + r[:-1]]
        vals += [np.ones(n_r), -np.ones(n_r - 1)]
        for a, lo, hi, use in zip(core.mem_node.tolist(), core.mem_lo.tolist(), core.mem_hi.tolist(),
                                  core.mem_usage, strict=True):
            xs = x_off[a] + np.arange(use.shape[0])
            rows.append(np.full(use.shape[0], row_off + lo))
            cols.append(xs)
            vals.append(-use)
            if hi < n_r:
                rows.append(np.full(use.shape[0], row_off + hi))
                cols.append(xs)
                vals.append(use)
        row_off += n_r
    n_cols = u_off + n_r
    rows_a, cols_a, vals_a = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    # HiGHS wants each (row, column) once and no explicit zeros: sum duplicates, drop zeros
    n_rows = row_off
    key = cols_a.astype(np.int64) * n_rows + rows_a
    uniq, inv = np.unique(key, return_inverse=True)
    summed = np.bincount(inv, weights=vals_a, minlength=uniq.shape[0])
    keep = summed != 0
    uniq, vals_a = uniq[keep], summed[keep]
    cols_a, rows_a = uniq // n_rows, uniq % n_rows
    order = np.arange(uniq.shape[0])
    a_start = np.searchsorted(cols_a, np.arange(n_cols + 1)).astype(np.int32)
    row_lower = np.concatenate([np.ones(k.shape[0]), np.zeros(n_rows_edges - k.shape[0]), np.zeros(n_r)])
    col_upper = np.concatenate([np.ones(u_off), core.slack])
    col_lower = np.concatenate([np.zeros(u_off), np.full(n_r, -np.inf)])
    integer = np.zeros(n_cols, dtype=np.int32)
    integer[:n_x] = 1
    cost = np.concatenate(costs)
    largest = float(np.abs(cost).max(initial=0.0))
    scale = OBJECTIVE_SCALE / largest if 0.0 < largest < OBJECTIVE_SCALE else 1.0
    return IlpModel(
        cost=cost * scale,
        col_lower=col_lower,
        col_upper=col_upper,
        integer=integer,
        row_lower=row_lower,
        row_upper=row_lower.copy(),
        a_start=a_start,
        a_index=rows_a[order].astype(np.int32),
        a_value=vals_a[order],
        x_offset=x_off,
        edge_cols=tuple(edge_cols),
        u_offset=u_off,
        scale=scale,
    )


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def _decode(core: Core, model: IlpModel, z: np.ndarray) -> np.ndarray:
    return np.array(
        [int(np.argmax(z[o : o + c.shape[0]])) for o, c in zip(model.x_offset.tolist(), core.costs, strict=True)],
        dtype=np.int64,
    )


def solve_ilp(
    core: Core,
    *,
    time_limit_s: float,
    warm_start: np.ndarray | None = None,
    mip_rel_gap: float = 1e-6,
    backend: str = "highs",
) -> IlpResult:
    """Solve the core ILP within ``time_limit_s``; never raises on timeout."""
    start = time.perf_counter()
    model = build_ilp(core)
    remaining = max(0.05, time_limit_s - (time.perf_counter() - start))
    if backend == "highs" and highs_available():
        from solvers.intra_op.watchdog import run_guarded

        res = run_guarded(_solve_highs, (core, model, remaining, warm_start, mip_rel_gap), {},
                          deadline=time.perf_counter() + remaining, columns=int(model.cost.shape[0]),
                          on_timeout=(None, None, None, "time limit"))
    else:
        res = _solve_pulp(core, model, remaining, mip_rel_gap)
    return IlpResult(choice=res[0], objective=res[1], bound=res[2], status=res[3],
                     seconds=time.perf_counter() - start)


def interrupt_at_deadline(h: object, deadline: float) -> None:
    """Stop HiGHS (simplex, IPM, branch and bound) once ``time.perf_counter()`` passes ``deadline``: its own
    ``time_limit`` is not checked everywhere (a window given 5 s ran for minutes on IOPDDL M)."""

    def stop(event: object) -> None:
        if time.perf_counter() > deadline:
            event.interrupt()  # type: ignore[attr-defined]

    for cb in (h.cbSimplexInterrupt, h.cbIpmInterrupt, h.cbMipInterrupt):  # type: ignore[attr-defined]
        cb.subscribe(stop)


_BANNER_SHOWN = False


def quiet_highs() -> Any:
    """A new ``highspy.Highs`` with its output off. highspy 1.16 prints its banner ("Running HiGHS ...") on
    the process's first construction, before any option can be set; that first construction runs with file
    descriptor 1 pointed at ``/dev/null``, so a user's terminal shows autoshard's plan and not the solver's
    name."""
    global _BANNER_SHOWN
    import highspy

    if _BANNER_SHOWN:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _BANNER_SHOWN = True
    h.setOptionValue("output_flag", False)
    return h


def _solve_highs(core: Core, model: IlpModel, time_limit: float, warm: np.ndarray | None, gap: float) -> tuple:
    import highspy

    h = quiet_highs()
    deadline = time.perf_counter() + float(time_limit)
    interrupt_at_deadline(h, deadline)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("threads", 1)
    inf = h.getInfinity()
    n_cols, n_rows = model.cost.shape[0], model.row_lower.shape[0]
    h.passModel(
        n_cols, n_rows, model.a_index.shape[0], 1, 1, 0.0,
        model.cost, np.maximum(model.col_lower, -inf), model.col_upper,
        model.row_lower, model.row_upper, model.a_start, model.a_index, model.a_value, model.integer,
    )
    if warm is not None:
        z = model.full_solution(core, warm)
        h.setSolution(z.shape[0], np.arange(z.shape[0], dtype=np.int32), z)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    word = h.modelStatusToString(status).lower()
    if status == highspy.HighsModelStatus.kOptimal:
        word = "optimal"
    elif status in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt):
        word = "time limit"  # an interrupt is ours: the deadline (``interrupt_at_deadline``)
    elif status == highspy.HighsModelStatus.kInfeasible:
        return None, None, None, "infeasible"
    choice = obj = None
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        choice = _decode(core, model, np.asarray(h.getSolution().col_value))
        obj = core.objective(choice)
    bound = info.mip_dual_bound
    bound = float(bound) / model.scale if np.isfinite(bound) and abs(bound) < 1e300 else None
    if word == "optimal" and obj is not None:
        bound = obj if bound is None else min(bound, obj)
    return choice, obj, bound, word


def _solve_pulp(core: Core, model: IlpModel, time_limit: float, gap: float) -> tuple:
    import pulp

    n_cols = model.cost.shape[0]
    prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
    make = getattr(prob, "add_variable", None)
    z = []
    for i, (lb, ub, integer) in enumerate(zip(model.col_lower, model.col_upper, model.integer, strict=True)):
        low, cat = (None if not np.isfinite(lb) else float(lb)), (pulp.LpBinary if integer else pulp.LpContinuous)
        z.append(make(f"z{i}", low, float(ub), cat=cat) if make else pulp.LpVariable(f"z{i}", low, float(ub), cat))
    prob += pulp.lpSum(float(c) * z[i] for i, c in enumerate(model.cost) if c != 0)
    terms: list[list[tuple[int, float]]] = [[] for _ in model.row_lower]
    for c in range(n_cols):
        for p in range(model.a_start[c], model.a_start[c + 1]):
            terms[model.a_index[p]].append((c, float(model.a_value[p])))
    for r, t in enumerate(terms):
        prob += pulp.lpSum(v * z[c] for c, v in t) == float(model.row_lower[r])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PULP_CBC_CMD (bundled CBC) is deprecated in 3.x
        coin = pulp.COIN_CMD(msg=False, timeLimit=max(1, int(time_limit)), gapRel=gap)
        solver = coin if coin.available() else pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(time_limit)),
                                                                 gapRel=gap)
        prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        return None, None, None, "infeasible"
    vals = np.array([v.value() if v.value() is not None else 0.0 for v in z])
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, None, None, status.lower()
    choice = _decode(core, model, vals)
    obj = core.objective(choice)
    word = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time limit"
    return choice, obj, (obj if word == "optimal" else None), word
