"""Planning work run beside the caller in a forked process (``autoshard.planner.beside``)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from autoshard.planner import beside
from autoshard.planner.beside import Beside
from autoshard.planner.plan import DoesNotFit, PlanError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the planner forks on Linux only")


def _in_child() -> tuple[int, list[int]]:
    return os.getpid(), list(range(100_000))  # a result larger than a pipe's buffer


def test_the_work_runs_in_another_process_and_its_result_comes_back() -> None:
    job = Beside(_in_child, fork=True, what="test")
    child = job.pid
    assert child is not None and child != os.getpid()
    pid, values = job.result()
    assert pid == child and values == list(range(100_000))
    assert job.pid is None  # reaped once its result came back
    assert job.result() == (pid, values)  # asked again: the same outcome
    inline = Beside(_in_child, fork=False)
    assert inline.pid is None and inline.result()[0] == os.getpid()


def test_an_error_comes_back_whole_and_is_raised_again() -> None:
    def fails() -> None:
        raise DoesNotFit("no layout fits", needed=5e9, as_traced=7e9)

    for fork in (True, False):
        job = Beside(fails, fork=fork)
        for _ in range(2):
            with pytest.raises(DoesNotFit, match="no layout fits") as e:
                job.result()
            assert (e.value.needed, e.value.as_traced) == (5e9, 7e9)


def test_a_child_that_dies_or_sends_what_cannot_be_pickled_is_a_plan_error() -> None:
    job = Beside(lambda: os._exit(3), fork=True, what="intra-operator plan")
    with pytest.raises(PlanError, match=r"intra-operator plan, planned in a forked process, ended without a "
                       r"result.*AUTOSHARD_BESIDE=0"):
        job.result()
    job = Beside(lambda: (lambda: 0), fork=True, what="intra-operator plan")  # a lambda does not pickle
    with pytest.raises(PlanError, match="could not be sent back"):
        job.result()


def test_cancel_stops_the_child() -> None:
    job = Beside(lambda: time.sleep(60), fork=True)
    pid = job.pid
    assert pid is not None
    t0 = time.perf_counter()
    job.cancel()
    assert job.pid is None and time.perf_counter() - t0 < 5
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, gone


def test_a_child_that_sends_nothing_in_time_is_stopped_and_the_work_runs_here(caplog) -> None:
    def work() -> int:
        if os.getpid() != parent:
            time.sleep(60)  # stuck, as on a lock another thread held at the fork
        return os.getpid()

    parent = os.getpid()
    job = Beside(work, fork=True, what="intra-operator plan", patience=0.5)
    child = job.pid
    with caplog.at_level("WARNING", logger="autoshard"):
        assert job.result() == parent
    assert "sent nothing in the time it was given" in caplog.text and job.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    slow = Beside(lambda: (time.sleep(1.0), os.getpid())[1], fork=True, patience=30)
    assert slow.result() != parent  # in time: the child's


def test_forking_follows_the_setting_and_the_idle_cores(monkeypatch) -> None:
    monkeypatch.setenv("AUTOSHARD_BESIDE", "0")
    assert not beside.can_fork()
    monkeypatch.setenv("AUTOSHARD_BESIDE", "1")
    monkeypatch.setattr(beside, "spare_cores", lambda: 0.0)
    assert beside.can_fork()  # on whatever the load
    monkeypatch.delenv("AUTOSHARD_BESIDE")
    assert not beside.can_fork()
    monkeypatch.setattr(beside, "spare_cores", lambda: 1.0)  # a 2-core machine running only this planner
    assert beside.can_fork()
    monkeypatch.setattr(beside, "spare_cores", lambda: 0.2)  # the other core busy
    assert not beside.can_fork()
    assert 1 <= beside.cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize(("share", "seconds", "microbatches"), [
    pytest.param(0.75, None, None, marks=pytest.mark.slow), (0.5, None, None), (0.5, 60.0, None),
    pytest.param(2.0, None, 4, marks=pytest.mark.slow)])  # 30 s, 4 s, 4 s, 10 s
def test_the_intra_operator_plan_made_beside_the_pipeline_search_is_the_one_made_in_process(
        share: float, seconds: float | None, microbatches: int | None, monkeypatch, caplog) -> None:
    """Both plans certain: the step cannot fit as traced (``share`` of its least need as the memory budget),
    or a pipeline is asked for with the intra-operator plan kept if faster (``microbatches``). The
    intra-operator plan is made in a forked process while the pipelines are planned (with or without the
    user's time budget). What comes back (a tiny GPT on 2 devices, solved to optimality either way) is
    what this process makes: the same plan, or, at a memory budget no intra-operator plan meets, the same
    error beside the pipeline; and the graph returned is the plan's recompute's rewrite."""
    from pathlib import Path

    import autoshard
    import autoshard.api as api
    import autoshard.choose as choose
    from autoshard._examples import load_module
    from autoshard.pipeline import PipelinePlan
    from autoshard.planner.plan import Plan
    from autoshard.target import PipelineOptions, Target
    from autoshard.trace.recompute import estimate

    mod = load_module(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    fn, args = mod.train_step, mod.make("tiny", abstract=True, layers=2, batch=16, seq_len=64)
    graph = autoshard.trace(fn, *args)
    target = Target.of((2,), "h100", memory_budget=share * estimate(graph, "none").peak_bytes / 2)
    monkeypatch.setattr(choose, "BESIDE_MIN_OPS", 0)
    real = choose.plan_recomputing  # the same budget both ways (made beside, it gets the pipeline search's), and
    # one long enough that no search in it stops at the clock (a solve proven optimal returns early)
    monkeypatch.setattr(choose, "plan_recomputing", lambda *a, **kw: real(*a, **{**kw, "time_budget_s": 60.0}))
    made = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("AUTOSHARD_BESIDE", setting)
        with caplog.at_level("INFO", logger="autoshard"):
            caplog.clear()
            made[setting] = api.plan_for(fn, args, target, PipelineOptions(microbatches=microbatches),
                                         time_budget_s=seconds, traced=graph)
        assert ("beside the pipeline search" in caplog.text) == (setting == "1")
    (inline, inline_graph, _), (forked, forked_graph, _) = made["0"], made["1"]
    assert type(forked) is type(inline) and forked.predicted_step_time == inline.predicted_step_time
    if isinstance(inline, Plan):
        assert forked.recompute == inline.recompute and bool(forked.recompute) == (share < 1)  # layouts may
        # differ among ties
        assert forked.solver.pipeline_step_time == inline.solver.pipeline_step_time
        forked.verify(forked_graph)
        assert [op.primitive for op in forked_graph.ops] == [op.primitive for op in inline_graph.ops]
    else:
        assert isinstance(inline, PipelinePlan)
        assert forked.solver.intra_op_step_time == inline.solver.intra_op_step_time
        if share == 0.5:
            assert str(forked.solver.intra_op_step_time).startswith("no plan: the step does not fit")
