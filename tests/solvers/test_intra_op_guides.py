"""The guided restriction (``restrict.improve_by_guides``): exact over its candidate sets, never worse than
its start, within its deadline."""

import itertools
import time

import numpy as np
import pytest

from solvers.intra_op.ilp import highs_available
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.presolve import Core, presolve
from solvers.intra_op.restrict import _guided_keep, _guides, _memory, improve_by_guides
from tests.solvers.test_intra_op_budget import _large_problem

pytestmark = pytest.mark.skipif(not highs_available(), reason="highspy is not installed")


def _fits(core: Core, choice: np.ndarray) -> bool:
    return bool((core.usage(choice) <= core.slack + 1e-9 * max(1.0, np.abs(core.slack).max(initial=1.0))).all())


def _exact(core: Core, keep: list) -> float:
    return min(core.objective(np.array(x)) for x in itertools.product(*keep)
               if _fits(core, np.array(x)) and np.isfinite(core.objective(np.array(x))))


@pytest.mark.parametrize("seed", range(4))
def test_the_answer_is_at_least_as_good_as_the_best_over_the_first_rounds_candidates(seed: int) -> None:
    # brute force: over every assignment (a lower bound) and over the first round's candidate sets (the
    # answer is at least that good: that round is solved exactly, later rounds only improve on it)
    core = presolve(_large_problem(9, 4, seed=seed), deadline=0.0).core
    ls = LocalSearch(core)
    ls.start_min_memory()
    assert ls.feasible()
    start = ls.choice.copy()
    keep = [k.tolist() for k in _guided_keep(core, ls, _guides(core), _memory(core), 0)]
    assert any(len(k) < c.shape[0] for k, c in zip(keep, core.costs, strict=True))  # a real restriction
    improve_by_guides(core, ls, time.perf_counter() + 10.0)
    out = ls.choice
    assert _fits(core, out)
    assert core.objective(out) <= _exact(core, keep) + 1e-9 * abs(_exact(core, keep))
    assert core.objective(out) <= core.objective(start)
    assert core.objective(out) >= _exact(core, [range(c.shape[0]) for c in core.costs]) - 1e-9


def test_a_large_core_keeps_its_deadline_and_never_gets_worse() -> None:
    core = presolve(_large_problem(3_000, 8, seed=2)).core
    assert core.num_nodes > 500 and core.slack.size
    for seconds in (0.05, 0.5, 3.0):
        ls = LocalSearch(core)
        ls.start_min_memory()
        ls.improve(time.perf_counter() + 0.5)
        assert ls.feasible()
        before = ls.objective()
        t = time.perf_counter()
        improve_by_guides(core, ls, t + seconds)
        assert time.perf_counter() - t < seconds + 1.5  # the watchdog's grace, and the candidates' set-up
        assert ls.feasible()
        assert ls.objective() <= before
