"""The plan cache (``autoshard.cache``): a second launch finds the plan and does not plan; a step changed in
one shape, one dtype or one option misses; a corrupt or stale entry is planned again with a warning; the CLI
fills it and lists or clears it; two processes share it through process 0. Every test points the cache at
its own ``tmp_path`` (``tests/conftest.py`` turns it off everywhere else)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import multiproc
import numpy as np
import pytest

import autoshard
from autoshard import cache
from autoshard.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "plans"
    monkeypatch.setenv(cache.ENV, str(root))
    return root


def step(params: dict, batch: dict) -> tuple[dict, jax.Array]:
    def loss(p: dict) -> jax.Array:
        h = jnp.tanh(batch["x"].astype(jnp.float32) @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def args(rows: int = 16, x_dtype: str = "float32") -> tuple[dict, dict]:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (32, 64)), "w2": jax.random.normal(k2, (64, 8))}
    batch = {"x": jax.random.normal(k3, (rows, 32)).astype(x_dtype), "y": jnp.zeros((rows, 8))}
    return params, batch


def _plan(caplog: pytest.LogCaptureFixture, *a: object, **kw: object) -> tuple[object, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autoshard"):
        p = autoshard.plan(step, *a, mesh=(2, 4), time_budget_s=3, **kw)
    return p, caplog.text


def test_a_second_plan_is_found_and_a_changed_step_or_option_misses(cache_dir: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    first, log1 = _plan(caplog, *args())
    assert "found the plan in the cache" not in log1 and "plan cached at" in log1
    assert len(list(cache_dir.glob("*.json"))) == 1
    again, log2 = _plan(caplog, *args())
    assert "found the plan in the cache" in log2 and "planned" not in log2  # no solve ran
    assert again.to_dict() == first.to_dict()
    # one shape, one dtype, one option: each its own entry, planned afresh
    for a, kw in (((*args(rows=32),), {}), ((*args(x_dtype="bfloat16"),), {}), ((*args(),), {"recompute": "none"}),
                  ((*args(),), {"memory_budget": "1GiB"})):
        _, text = _plan(caplog, *a, **kw)
        assert "found the plan in the cache" not in text, kw
    assert len(list(cache_dir.glob("*.json"))) == 5


def test_a_corrupt_or_stale_entry_is_planned_again_with_a_warning(cache_dir: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    _plan(caplog, *args())
    (entry,) = cache_dir.glob("*.json")
    entry.write_text("{not json")
    again, text = _plan(caplog, *args())
    assert "cannot be used (JSONDecodeError" in text and "planning again" in text
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert json.loads(entry.read_text())["plan"] == again.to_dict()  # replaced by the new plan
    # stale: an entry under this key holding another step's plan (a tampered or colliding file) fails verify
    other = autoshard.plan(step, *args(rows=32), mesh=(2, 4), time_budget_s=3)
    data = json.loads(entry.read_text())
    data["plan"] = other.to_dict()
    entry.write_text(json.dumps(data))
    _, text = _plan(caplog, *args())
    assert "cannot be used (PlanError" in text
    _, text = _plan(caplog, *args())
    assert "found the plan in the cache" in text


def test_parallelize_finds_the_plan_and_runs_it(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    params, batch = args()
    want = jax.jit(step)(params, batch)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        a = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=3)
        a(params, batch)
        caplog.clear()
        b = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=3)  # a new launch: nothing in memory
        got = b(params, batch)
    assert "found the plan in the cache" in caplog.text
    assert b.plan.to_dict() == a.plan.to_dict()
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_set_cache_dir_overrides_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.ENV, str(tmp_path / "env"))
    assert cache.cache_dir() == tmp_path / "env"
    monkeypatch.setattr(cache, "_setting", cache._UNSET)  # restored after the test
    autoshard.set_cache_dir(tmp_path / "py")
    assert cache.cache_dir() == tmp_path / "py"
    autoshard.set_cache_dir(None)
    assert cache.cache_dir() is None
    monkeypatch.setattr(cache, "_setting", cache._UNSET)
    for off in ("off", "", "0"):
        monkeypatch.setenv(cache.ENV, off)
        assert cache.cache_dir() is None
    monkeypatch.delenv(cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform not in ("darwin", "win32"):  # the user's cache directory, as XDG says
        assert cache.cache_dir() == tmp_path / "xdg" / "autoshard" / "plans"


def test_the_cli_fills_the_cache_that_a_job_reads_and_lists_and_clears_it(
        cache_dir: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    model = str(ROOT / "examples" / "mlp.py")
    assert main(["plan", model, "--mesh", "2x4", "--hardware", "h100", "--time-budget", "3", "-q"]) == 0
    from autoshard._examples import load_example

    ex = load_example(model, "tiny", [], abstract=True)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), hardware="h100", time_budget_s=3)
    assert "found the plan in the cache" in caplog.text  # planned offline, found by the job
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "1 cached plan(s)" in out and "train_step" in out and "mesh 2x4 on h100" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 cached plan(s)" in capsys.readouterr().out
    assert not list(cache_dir.glob("*.json"))


@pytest.mark.slow
def test_two_processes_share_the_cache_through_process_0(tmp_path: Path) -> None:
    """Two launches of 2 processes x 4 devices: the first plans on process 0 and writes one entry; the
    second finds it (process 0 neither plans nor writes again) and runs the same plan."""
    root = tmp_path / "plans"

    def launch(out: Path) -> list[dict]:
        out.mkdir()
        return multiproc.run("parallelize_worker.py", out, "run", "mlp.py", 5, env={cache.ENV: str(root)})

    first = launch(tmp_path / "first")
    (entry,) = root.glob("*.json")
    written = entry.stat().st_mtime_ns
    second = launch(tmp_path / "second")
    assert list(root.glob("*.json")) == [entry] and entry.stat().st_mtime_ns == written  # found, not rewritten
    plans = [json.loads((tmp_path / d / "plan.json").read_text()) for d in ("first", "second")]
    assert plans[0] == plans[1] == json.loads(entry.read_text())["plan"]
    assert first[0]["losses"] == second[0]["losses"]
