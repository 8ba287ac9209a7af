"""``@autoshard.parallelize`` across processes (jax.distributed on localhost, 2 processes x 4 CPU devices,
gloo): the same numbers as one process on 8 devices, one plan for all, and a dead process ends the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import jax
import multiproc
import numpy as np
import pytest

import autoshard
from autoshard import distributed
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
WORKER = "parallelize_worker.py"
TOL = 1e-5
HEARTBEAT_S = 10  # the workers' heartbeat timeout


def _launch(out: Path, mode: str, example: str = "mlp.py", budget: float = 5.0) -> list[subprocess.Popen]:
    return multiproc.start(WORKER, out, mode, example, budget)


def _single_process(example: str) -> tuple[list[float], list[np.ndarray]]:
    """The same 3 steps in this process, on its 8 devices."""
    name, _, sets = example.partition(":")
    ex = load_example(ROOT / "examples" / name, "tiny", [x for x in sets.split(",") if x], abstract=False)
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=5)
    state, batch = ex.args
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]


def _run(out: Path, mode: str, example: str = "mlp.py", budget: float = 5.0) -> list[dict]:
    """Both workers to the end; each one's report."""
    return multiproc.reports(_launch(out, mode, example, budget))


def test_parallelize_across_two_processes_matches_one_process(tmp_path: Path) -> None:
    reports = _run(tmp_path, "run")
    assert [r["devices"] for r in reports] == [8, 8]
    assert reports[0]["losses"] == reports[1]["losses"]  # one program: the same loss in both processes
    for r in reports:  # batch parts put together in a layout each process can fill alone, and in one it can't
        assert r["assembled"]["rows_split"] == {"direct": True, "same": True, "sharding_kept": True}
        assert r["assembled"]["rows_by_y"] == {"direct": False, "same": True, "sharding_kept": True}
    got = np.load(tmp_path / "result.npz")
    plan = Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
    assert plan.mesh.shape == (2, 4)
    want_losses, want_opt = _single_process("mlp.py")
    got_opt = [got[f"opt_{i}"] for i in range(len(want_opt))]
    assert global_rel_error(np.array(want_losses), got["losses"]) <= TOL
    assert global_rel_error(want_opt, got_opt) <= TOL  # Adam's count, mu and nu after 3 steps


@pytest.mark.slow  # CI: the ring in one process (test_ring) and parallelize across two processes (above)
def test_ring_attention_across_two_processes_matches_one_process(tmp_path: Path) -> None:
    """GPT with one head and ``ring_attention`` (so only the ring splits the attention) on a mesh whose
    ``x`` axis is the two processes: the three steps equal one process's. The optimal plan runs the ring
    over both axes, so its sends go between processes (a plan the budget cut short may split the batch over
    the processes instead, and run the ring within each)."""
    example = "gpt.py:ring=true,heads=1,batch=2,seq_len=64"
    reports = _run(tmp_path, "run", example, budget=20.0)
    assert reports[0]["losses"] == reports[1]["losses"]
    plan = Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["ring=true", "heads=1", "batch=2", "seq_len=64"],
                      abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    calls = [op for op in graph.ops if op.primitive == "custom_partitioning"]
    assert calls and all(plan.specs[()][op.outputs[0]].dims[1] for op in calls)  # along the sequence
    if plan.solver.optimal:
        assert all("x" in plan.specs[()][op.outputs[0]].dims[1] for op in calls)  # between processes
    got = np.load(tmp_path / "result.npz")
    want_losses, want_opt = _single_process(example)
    assert global_rel_error(np.array(want_losses), got["losses"]) <= TOL
    assert global_rel_error(want_opt, [got[f"opt_{i}"] for i in range(len(want_opt))]) <= TOL


def test_processes_that_trace_different_steps_stop_with_a_clear_error(tmp_path: Path) -> None:
    procs = _launch(tmp_path, "disagree")
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        multiproc.end(procs)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode != 0
        assert "processes [1] hold a different traced step than process 0" in err, err[-3000:]


@pytest.mark.parametrize("dead", [1, 0], ids=["worker-dies", "coordinator-dies"])
def test_a_dead_process_ends_the_others_with_a_clear_error(tmp_path: Path, dead: int) -> None:
    procs = _launch(tmp_path, f"die:{dead}")
    try:
        for line in procs[dead].stdout:  # gloo also writes here; blocks until step 1 is done (or EOF)
            if line.strip() == "step 1 done":
                break
        else:
            raise AssertionError(f"process {dead} ended before step 1:\n{procs[dead].stderr.read()[-3000:]}")
        os.killpg(procs[dead].pid, signal.SIGKILL)
        t0 = time.monotonic()
        other = procs[1 - dead]
        _, err = other.communicate(timeout=HEARTBEAT_S + 120)  # bounded: never a hang
        waited = time.monotonic() - t0
    finally:
        multiproc.end(procs)
    assert other.returncode != 0
    assert "another task died" in err or "heartbeat" in err, err[-3000:]
    print(f"process {1 - dead} ended {waited:.1f} s after process {dead} was killed")


def test_global_shapes_stack_batch_rows_over_processes() -> None:
    # one process here: a batch part is the whole batch, state keeps its shape; roles follow the tracer's
    def step(state: dict, batch: dict) -> float:
        return 0.0

    state = {"params": {"w": np.zeros((4, 3), np.float32)}}
    batch = {"x": np.zeros((6, 3), np.float32)}
    assert distributed.local_leaves(step, (state, batch)) == [False, True]
    assert distributed.local_leaves(step, (state, batch), roles={"batch.x": "state"}) == [False, False]
    shapes = jax.tree.leaves(distributed.global_shapes(step, (state, batch)))
    assert [s.shape for s in shapes] == [(4, 3), (6, 3)]
    with pytest.raises(distributed.DistributedError, match="scalar"):
        distributed.global_shapes(step, (state, {"x": np.float32(1.0)}))
    assert not distributed.multiprocess()


def test_a_saved_plan_runs_across_two_processes(tmp_path: Path) -> None:
    # planned once here, for the global batch; every process then runs the file with its own rows
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", [], abstract=True)
    path = tmp_path / "saved_plan.json"
    autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), time_budget_s=5).save(path)
    reports = _run(tmp_path, f"saved:{path}")
    assert reports[0]["losses"] == reports[1]["losses"]
    got = np.load(tmp_path / "result.npz")
    want_losses, want_opt = _single_process("mlp.py")
    assert global_rel_error(np.array(want_losses), got["losses"]) <= TOL
    assert global_rel_error(want_opt, [got[f"opt_{i}"] for i in range(len(want_opt))]) <= TOL
