"""Checkpoints that move between plans (``autoshard.checkpoint``, ``parallelize.save/restore``): the tiny GPT
trained 3 steps under a (2, 4) plan, saved, restored under other meshes, the SPMD pipeline program and two
processes (and back, from the pipeline to an intra-operator plan), and trained on: the losses are an
uninterrupted ``jax.jit`` run's, and the restored state is the saved one bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import jax
import multiproc
import numpy as np
import pytest

import autoshard
from autoshard import checkpoint
from autoshard._examples import load_example
from autoshard.emit import global_rel_error

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "workers" / "checkpoint_worker.py"
TOL = 1e-5


def _gpt(abstract: bool = False) -> tuple[object, dict]:
    return load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=abstract).args


def _losses(step: object, state: object, batch: dict, n: int) -> tuple[object, list[float]]:
    out = []
    for _ in range(n):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return state, out


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """Seven uninterrupted steps of ``jax.jit``."""
    state, batch = _gpt()
    return _losses(jax.jit(load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=False).train_step),
                   state, batch, 7)[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray], list[float]]:
    """Three steps under a (2, 4) plan, saved at step 3: (directory, the state's leaves on the host, losses)."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=False)
    state, batch = ex.args
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=5)
    state, losses = _losses(step, state, batch, 3)
    directory = tmp_path_factory.mktemp("ckpt")
    assert step.save(directory, state, 3) == directory / "3"
    assert checkpoint.latest_step(directory) == 3
    return directory, [np.asarray(x) for x in jax.tree.leaves(state)], losses


def _bit_equal(a: list[np.ndarray], b: object) -> bool:
    return all(np.array_equal(x, np.asarray(y)) and x.dtype == np.asarray(y).dtype
               for x, y in zip(a, jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("form", ["4x2", pytest.param("8", marks=pytest.mark.slow), "spmd-pipeline"])
def test_restored_under_another_plan_trains_on_as_if_never_stopped(
        form: str, saved: tuple[Path, list[np.ndarray], list[float]], reference: list[float], tmp_path: Path) -> None:
    directory, leaves, first = saved
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=False)
    _, batch = ex.args
    like = _gpt(abstract=True)[0]  # a fresh launch's state: shapes only, nothing allocated
    kw = {"4x2": {"mesh": (4, 2)}, "8": {"mesh": (8,)},
          "spmd-pipeline": {"mesh": (2, 4), "microbatches": 2, "pipeline": True, "stage_shape": (1, 4),
                            "runtime": "spmd"}}[form]
    step = autoshard.parallelize(ex.train_step, time_budget_s=5, **kw)
    state = step.restore(directory, like=like, args=(like, batch))  # planned first, restored in its layout
    assert _bit_equal(leaves, state)
    program = step._cache[next(iter(step._cache))].step
    want = checkpoint.state_shardings(program, like, 0)
    assert want is not None  # restored straight into the layout the program reads
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    if form == "spmd-pipeline":
        assert type(program).__name__ == "SpmdPipelineStep" and step_plan_stages(program) == 2
    state, last = _losses(step, state, batch, 3)
    assert global_rel_error(np.array(reference[:6]), np.array(first + last)) <= TOL
    if form == "spmd-pipeline":  # and back: saved by the pipeline, restored under an intra-operator plan
        step.save(tmp_path, state, 6)
        piped = [np.asarray(x) for x in jax.tree.leaves(state)]
        intra = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=5)
        back = intra.restore(tmp_path, like=like, args=(like, batch))
        assert _bit_equal(piped, back)
        _, seventh = _losses(intra, back, batch, 1)
        assert type(intra._last.step).__name__ == "EmittedStep"
        assert global_rel_error(np.array(reference), np.array(first + last + seventh)) <= TOL


def step_plan_stages(program: object) -> int:
    from autoshard.pipeline.spmd_program import STAGE_AXIS

    return program.mesh.shape[STAGE_AXIS]


def test_restore_before_any_program_splits_evenly_and_the_first_call_lays_it_out(
        saved: tuple[Path, list[np.ndarray], list[float]], reference: list[float]) -> None:
    directory, leaves, first = saved
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=False)
    _, batch = ex.args
    like = _gpt(abstract=True)[0]
    step = autoshard.parallelize(ex.train_step, mesh=(8,), time_budget_s=5)
    state = step.restore(directory, like=like)
    assert _bit_equal(leaves, state)
    wte = state.params["wte"]["embedding"]
    assert {s.data.shape for s in wte.addressable_shards} == {(wte.shape[0] // 8, wte.shape[1])}
    _, last = _losses(step, state, batch, 3)
    assert global_rel_error(np.array(reference[:6]), np.array(first + last)) <= TOL


def test_checkpoint_errors_name_the_problem(tmp_path: Path, saved: tuple[Path, list[np.ndarray], list[float]]) -> None:
    directory, _, _ = saved
    like = _gpt(abstract=True)[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    with pytest.raises(checkpoint.CheckpointError, match="no such checkpoint directory"):
        checkpoint.restore(tmp_path / "nothing", like, shardings=checkpoint.even_shardings(like, mesh))
    with pytest.raises(checkpoint.CheckpointError, match="holds no step 7; it holds \\[3\\]"):
        checkpoint.restore(directory, like, step=7, shardings=checkpoint.even_shardings(like, mesh))
    with pytest.raises(checkpoint.CheckpointError, match="already holds step 3"):
        checkpoint.save(directory, {"x": np.zeros(3)}, 3)
    other = load_example(ROOT / "examples" / "gpt.py", "tiny", ["hidden=32"], abstract=True).args[0]
    with pytest.raises(checkpoint.CheckpointError, match="params"):
        checkpoint.restore(directory, other, shardings=checkpoint.even_shardings(other, mesh))


@pytest.mark.slow
def test_restored_on_two_processes_trains_on(tmp_path: Path, saved: tuple[Path, list[np.ndarray], list[float]],
                                             reference: list[float]) -> None:
    """Saved by this process on 8 devices, restored by 2 processes x 4 devices (each reading its own parts)."""
    directory, leaves, first = saved
    reports = multiproc.run(WORKER, tmp_path, f"restore:{directory}")
    got = np.load(tmp_path / "restored.npz")
    assert _bit_equal(leaves, [got[f"leaf_{i}"] for i in range(len(leaves))])
    assert reports[0]["losses"] == reports[1]["losses"]
    assert global_rel_error(np.array(reference[:6]), np.array(first + reports[0]["losses"])) <= TOL


@pytest.mark.slow
def test_a_job_that_loses_a_process_restarts_on_the_devices_left(tmp_path: Path, reference: list[float]) -> None:
    """Two processes x 4 devices save every step; process 1 is killed after step 2; the job restarts as one
    process on 4 devices, restores the newest whole step and trains on to step 6: its losses are those of
    a 4-device ``jax.jit`` run from that checkpoint (and of the uninterrupted run)."""
    directory = tmp_path / "ckpt"
    with multiproc.running(WORKER, tmp_path, f"train:{directory}:6") as procs:
        for line in procs[1].stdout:
            if line.strip() == "step 2 saved":
                break
        else:
            raise AssertionError(f"process 1 ended before step 2:\n{procs[1].stderr.read()[-3000:]}")
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[0].communicate(timeout=200)  # ends after the heartbeat timeout: never a hang
    assert procs[0].returncode != 0, "process 0 went on without process 1"
    (report,) = multiproc.run(WORKER, tmp_path, f"train:{directory}:6", nproc=1)
    restored = report["restored"]
    assert report["devices"] == 4 and restored is not None and restored >= 2
    # the reference: that checkpoint restored on 4 devices of this process, trained on by jax.jit
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=False)
    like = _gpt(abstract=True)[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    state = checkpoint.restore(directory, like, step=restored, shardings=checkpoint.even_shardings(like, mesh))
    batch = jax.device_put(ex.args[1], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    _, want = _losses(jax.jit(ex.train_step), state, batch, 6 - restored)
    assert len(report["losses"]) == 6 - restored
    assert global_rel_error(np.array(want), np.array(report["losses"])) <= TOL
    assert global_rel_error(np.array(reference[restored:6]), np.array(report["losses"])) <= TOL
