r"""The core ILP with its memory rows added only once an answer breaks them (row generation), under a
deadline that HiGHS obeys.

Production cores (XLA's exports) keep a few hundred nodes but tens of thousands of memory rows: the
merged nodes each carry many members with their own live intervals. With every row in (``ilp.py``'s
telescoped form) HiGHS does not finish the root LP of IOPDDL C (215 nodes, 21k rows) in 60 s; without
them the ILP is solved to optimality in 10 s. So (symbols as in ``ilp.py``):

1. ``P_0`` = the ILP with no memory row; ``R_0 = ∅``.
2. Solve ``P_i`` = ``P_0`` plus the explicit rows ``Σ_{j : lo_j <= r < hi_j} Σ_s m_{j,s} x_{a_j,s} <= S_r``
   for ``r ∈ R_i``, warm-started at the best feasible assignment known.
3. If its answer ``x^i`` fits every row, it is optimal for the core (``P_i`` is a relaxation). Otherwise
   ``R_{i+1} = R_i ∪`` {in each maximal run of rows that ``x^i`` overflows, the most overflowed row};
   ``x^i`` is repaired into a feasible assignment (``repair``) that competes with the incumbent.

Every ``P_i`` relaxes the core, so each one's dual bound is a valid lower bound. HiGHS gets the time left
as its own limit and, because its limit is not checked everywhere, an interrupt callback (simplex, IPM,
MIP) that stops it once the deadline passes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from solvers.intra_op.ilp import build_ilp, ilp_columns, interrupt_at_deadline, quiet_highs
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core
from solvers.intra_op.watchdog import run_guarded

__all__ = ["RowGenResult", "repair", "solve_by_row_generation"]

MAX_NEW_ROWS = 400  # rows added per round at most (the most overflowed first)
PER_RUN = 4  # rows added per run of overflowed rows at most


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RowGenResult:
    choice: np.ndarray | None  # best memory-feasible assignment (compressed indices), None if none found
    objective: float | None
    bound: float | None  # a lower bound on the core optimum (without ``core.constant``)
    optimal: bool
    infeasible: bool  # a relaxation was proven infeasible: so is the core
    rounds: int


def _memory_rows(core: Core, rows: np.ndarray, x_offset: np.ndarray) -> tuple[np.ndarray, ...]:
    """CSR (starts, columns, values) of the explicit memory rows ``rows`` over the x columns."""
    r_idx, c_idx, vals = [], [], []
    for a, lo, hi, use in zip(core.mem_node.tolist(), core.mem_lo.tolist(), core.mem_hi.tolist(), core.mem_usage,
                              strict=True):
        i0, i1 = np.searchsorted(rows, lo), np.searchsorted(rows, hi)
        if i1 <= i0:
            continue
        nz = np.flatnonzero(use)
        hit = np.arange(i0, i1)
        r_idx.append(np.repeat(hit, nz.shape[0]))
        c_idx.append(np.tile(x_offset[a] + nz, hit.shape[0]))
        vals.append(np.tile(use[nz], hit.shape[0]))
    if not r_idx:
        return np.zeros(rows.shape[0] + 1, np.int32), np.zeros(0, np.int32), np.zeros(0)
    r, c, v = np.concatenate(r_idx), np.concatenate(c_idx), np.concatenate(vals)
    n_cols = int(c.max()) + 1
    key, inv = np.unique(r.astype(np.int64) * n_cols + c, return_inverse=True)
    summed = np.bincount(inv, weights=v, minlength=key.shape[0])
    r, c = key // n_cols, key % n_cols
    starts = np.searchsorted(r, np.arange(rows.shape[0] + 1))
    return starts.astype(np.int32), c.astype(np.int32), summed


def repair(core: Core, ls: LocalSearch, choice: np.ndarray, deadline: float) -> np.ndarray | None:
    """Make ``choice`` fit memory by greedy moves, then polish with ICM; None if it still overflows at
    ``deadline``. Each move is, among the nodes live at the most overflowed row, the one with the least
    extra cost per unit of total overflow ``Σ_r max(0, usage_r − S_r)`` removed."""
    ch = choice.copy()
    tol = 1e-9 * max(1.0, float(np.abs(core.slack).max(initial=1.0)))
    terms: list[list[int]] = [[] for _ in range(core.num_nodes)]
    for j, a in enumerate(core.mem_node.tolist()):
        terms[a].append(j)
    ls.start_from(ch)
    usage = core.usage(ch)
    for _ in range(4 * core.num_nodes + 10):
        over = usage - core.slack
        r = int(np.argmax(over)) if over.size else 0
        if over.size == 0 or over[r] <= tol:
            ls.start_from(ch)
            ls.improve(deadline)
            return ls.choice.copy()
        if time.perf_counter() > deadline:
            return None
        best, best_score, best_delta = None, np.inf, None
        for a in np.unique(core.mem_node[(core.mem_lo <= r) & (r < core.mem_hi)]).tolist():
            js = terms[a]
            lo, hi = int(core.mem_lo[js].min()), int(core.mem_hi[js].max())
            delta = np.zeros((core.costs[a].shape[0], hi - lo + 1))
            for j in js:
                d = core.mem_usage[j] - core.mem_usage[j][ch[a]]
                delta[:, core.mem_lo[j] - lo] += d
                delta[:, core.mem_hi[j] - lo] -= d
            delta = np.cumsum(delta, 1)[:, :-1]
            seg = over[lo:hi]
            removed = np.maximum(seg, 0.0).sum() - np.maximum(seg[None, :] + delta, 0.0).sum(1)
            local = ls._local_cost(a)
            extra = np.maximum(local - local[ch[a]], 0.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                score = np.where(removed > tol, extra / removed, np.inf)
            s = int(np.argmin(score))
            if score[s] < best_score:
                best, best_score, best_delta = (a, s, lo, hi), float(score[s]), delta[s]
        if best is None:
            return None
        a, s, lo, hi = best
        ch[a] = s
        ls.choice[a] = s
        usage[lo:hi] += best_delta
    return None


def _new_rows(over: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Rows to add: in each maximal run of overflowed rows (``over > 0``), the most overflowed one and up
    to ``PER_RUN - 1`` more spread evenly over the run; none already in ``known``."""
    bad = over > 0
    bad[known] = False
    if not bad.any():
        return np.zeros(0, np.int64)
    idx = np.flatnonzero(bad)
    cut = np.flatnonzero(np.diff(idx) > 1) + 1
    picks = []
    for run in np.split(idx, cut):
        picks.append(run[int(np.argmax(over[run]))])
        if run.shape[0] > 1:
            picks.extend(run[np.linspace(0, run.shape[0] - 1, min(PER_RUN - 1, run.shape[0])).astype(np.int64)])
    best = np.unique(np.array(picks, dtype=np.int64))
    best = best[np.argsort(-over[best], kind="stable")][:MAX_NEW_ROWS]
    return np.sort(best)


def solve_by_row_generation(
    core: Core,
    deadline: float,
    *,
    incumbent: np.ndarray | None = None,
    guess: np.ndarray | None = None,
    mip_rel_gap: float = 1e-6,
) -> RowGenResult:
    """The loop of the module docstring until an answer fits memory (optimal) or ``deadline`` passes.

    ``guess``: an assignment that need not fit (e.g. the forest DP's without memory); the rows it
    overflows are in ``R_0``, which saves the first round when the optimum overflows them too (IOPDDL D:
    about 10 s of 60). Runs under ``watchdog.run_guarded``: if HiGHS overruns the deadline the loop is
    killed and the answer is ``incumbent``."""
    fallback = RowGenResult(choice=incumbent, objective=None if incumbent is None else core.objective(incumbent),
                            bound=None, optimal=False, infeasible=False, rounds=0)
    return run_guarded(_row_generation, (core, deadline),
                       dict(incumbent=incumbent, guess=guess, mip_rel_gap=mip_rel_gap),
                       deadline=deadline, columns=ilp_columns(core), on_timeout=fallback)


def _row_generation(
    core: Core,
    deadline: float,
    *,
    incumbent: np.ndarray | None,
    guess: np.ndarray | None,
    mip_rel_gap: float,
) -> RowGenResult:
    import highspy

    free = dataclasses.replace(core, mem_node=core.mem_node[:0], mem_lo=core.mem_lo[:0], mem_hi=core.mem_hi[:0],
                               mem_usage=(), slack=core.slack[:0])
    model = build_ilp(free)
    h = quiet_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.setOptionValue("mip_detect_symmetry", False)
    interrupt_at_deadline(h, deadline)
    inf = h.getInfinity()
    n_cols = model.cost.shape[0]
    h.passModel(n_cols, model.row_lower.shape[0], model.a_index.shape[0], 1, 1, 0.0, model.cost,
                np.maximum(model.col_lower, -inf), model.col_upper, model.row_lower, model.row_upper,
                model.a_start, model.a_index, model.a_value, model.integer)
    ls = LocalSearch(core)
    tol = 1e-9 * max(1.0, float(np.abs(core.slack).max(initial=1.0)))
    best = incumbent.copy() if incumbent is not None else None
    best_obj = core.objective(best) if best is not None else np.inf
    bound: float | None = None
    known = np.zeros(0, np.int64)
    if guess is not None and core.slack.size:
        over = core.usage(guess) - core.slack
        known = _new_rows(np.where(over > tol, over, 0.0), known)
        if known.size:
            starts, cols, vals = _memory_rows(core, known, model.x_offset)
            h.addRows(known.shape[0], np.full(known.shape[0], -inf), core.slack[known], vals.shape[0], starts, cols,
                      vals)
    rounds = 0
    while True:
        left = deadline - time.perf_counter()
        if left <= 0.01:
            break
        h.setOptionValue("time_limit", float(left))
        if best is not None:
            z = model.full_solution(free, best)
            h.setSolution(z.shape[0], np.arange(z.shape[0], dtype=np.int32), z)
        h.run()
        rounds += 1
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return RowGenResult(choice=None, objective=None, bound=None, optimal=False, infeasible=True,
                                rounds=rounds)
        info = h.getInfo()
        dual = float(info.mip_dual_bound) / model.scale
        if np.isfinite(dual) and abs(dual) < 1e300:
            bound = dual if bound is None else max(bound, dual)
        if info.primal_solution_status != 2:
            break
        z = np.asarray(h.getSolution().col_value)
        ch = np.array([int(np.argmax(z[o : o + c.shape[0]])) for o, c in zip(model.x_offset.tolist(), core.costs,
                                                                              strict=True)], dtype=np.int64)
        over = core.usage(ch) - core.slack if core.slack.size else np.zeros(0)
        proven = status == highspy.HighsModelStatus.kOptimal
        if not (over > tol).any():
            obj = core.objective(ch)
            if obj < best_obj:
                best, best_obj = ch, obj
            if proven:
                bound = best_obj if bound is None else min(max(bound, dual), best_obj)
                return RowGenResult(choice=best, objective=best_obj, bound=bound, optimal=True, infeasible=False,
                                    rounds=rounds)
            break
        fixed = repair(core, ls, ch, min(deadline, time.perf_counter() + 0.1 * max(0.0, left)))
        if fixed is not None and core.objective(fixed) < best_obj:
            best, best_obj = fixed, core.objective(fixed)
        if not proven:
            break  # time ran out inside this round
        add = _new_rows(np.where(over > tol, over, 0.0), known)
        if add.size == 0:
            break
        known = np.union1d(known, add)
        starts, cols, vals = _memory_rows(core, add, model.x_offset)
        h.addRows(add.shape[0], np.full(add.shape[0], -inf), core.slack[add], vals.shape[0], starts, cols, vals)
    return RowGenResult(choice=best, objective=best_obj if best is not None else None, bound=bound,
                        optimal=False, infeasible=False, rounds=rounds)
