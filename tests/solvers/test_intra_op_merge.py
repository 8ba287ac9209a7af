"""Solution merging (``merge``): the exact best recombination of a few points, within its deadline."""

import itertools
import time

import numpy as np
import pytest

from solvers.intra_op import merge, watchdog
from solvers.intra_op.ilp import highs_available
from solvers.intra_op.local_search import LocalSearch
from solvers.intra_op.merge import Merger
from solvers.intra_op.presolve import Core, presolve
from tests.solvers.test_intra_op_budget import _large_problem

pytestmark = pytest.mark.skipif(not highs_available(), reason="highspy is not installed")


def _fits(core: Core, choice: np.ndarray) -> bool:
    return bool((core.usage(choice) <= core.slack + 1e-9 * max(1.0, np.abs(core.slack).max(initial=1.0))).all())


@pytest.mark.parametrize("seed", range(4))
def test_the_merge_is_the_best_assignment_over_the_points_strategies(seed: int) -> None:
    # brute force over the product of the strategies the points use, node by node
    core = presolve(_large_problem(9, 3, seed=seed), deadline=0.0).core
    every = [np.array(x) for x in itertools.product(*(range(c.shape[0]) for c in core.costs))]
    fitting = [x for x in every if _fits(core, x) and np.isfinite(core.objective(x))]
    rng = np.random.default_rng(seed)
    points = [fitting[i] for i in rng.choice(len(fitting), size=min(3, len(fitting)), replace=False)]
    keep = [sorted({int(p[a]) for p in points}) for a in range(core.num_nodes)]
    exact = min(core.objective(np.array(x)) for x in itertools.product(*keep)
                if _fits(core, np.array(x)) and np.isfinite(core.objective(np.array(x))))
    out = Merger(core).merge(points, time.perf_counter() + 5.0)
    assert _fits(core, out)
    assert all(int(out[a]) in keep[a] for a in range(core.num_nodes))
    assert core.objective(out) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("child", [False, True])
def test_a_merge_fits_is_never_worse_than_its_best_point_and_keeps_its_deadline(
        child: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if child:  # every merge ILP in a watchdog child: its start and the model's memory rows count
        monkeypatch.setattr(watchdog, "IN_PROCESS_COLUMNS", 1)
        monkeypatch.setattr(merge, "IN_PROCESS_COLUMNS", 1)
    core = presolve(_large_problem(3_000, 8, seed=1)).core
    assert core.num_nodes > 500 and core.slack.size
    points = []
    for order in range(3):
        ls = LocalSearch(core)
        ls.start_min_memory()
        nodes = np.random.default_rng(order).permutation(core.num_nodes)
        ls.improve(time.perf_counter() + 1.0, nodes=nodes)
        assert ls.feasible()
        points.append(ls.choice.copy())
    merger = Merger(core)
    for seconds in (0.05, 0.5, 3.0):
        t = time.perf_counter()
        out = merger.merge(points, t + seconds)
        assert time.perf_counter() - t < seconds + 0.5
        assert _fits(core, out)
        assert core.objective(out) <= min(core.objective(p) for p in points)
