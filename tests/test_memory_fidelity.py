"""The planner's predictions against what XLA compiled and ran on one GPU.

``tests/data/h100_fidelity.json`` holds, per case (an example model at a preset, dtype, batch and remat
setting), the compiled step's ``memory_analysis()`` and its measured step time on one H100 (jax 0.11.2,
2026-11-22; provenance in the file); the other files of ``tests/data`` named below hold the rows of later
sessions (H100 and H200, 2026-11-26). ``test_every_recorded_row...`` plans each step here, on abstract shapes,
on a 1-device mesh with the card's preset, and holds the prediction to every row: peak memory within 15% of
XLA's (temp + arguments + outputs - aliased), step time within 10% of the time the row measured.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

import autoshard
from autoshard._examples import load_example

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((Path(__file__).parent / "data" / "h100_fidelity.json").read_text())


def _name(c: dict[str, Any]) -> str:
    return f"{c['model']}-{c['preset']}-{c['dtype']}-b{c['batch']}{'-remat' if c['remat'] else ''}"


CASES = {_name(c): c for c in DATA["cases"]}
MEMORY_TOLERANCE = 0.15
TIME_TOLERANCE = 0.10


@functools.cache
def _case_plan(model: str, preset: str, dtype: str, batch: int, remat: bool, hardware: str) -> Any:
    overrides = [f"dtype={dtype}", f"batch={batch}"] + (["remat=true"] if remat else [])
    ex = load_example(ROOT / "examples" / f"{model}.py", preset, overrides, abstract=True)
    return autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=hardware, time_budget_s=10)


def _plan(name: str, cases: dict[str, dict[str, Any]] = CASES, hardware: str = "h100") -> Any:
    c = cases[name]
    return _case_plan(c["model"], c["preset"], c["dtype"], c["batch"], c["remat"], hardware)


def test_the_data_file_says_where_it_comes_from() -> None:
    prov = DATA["provenance"]
    assert prov["date"] == "2026-11-22" and prov["jax"] == "0.11.2" and "H100" in prov["device"]
    assert prov["command"]
    for c in DATA["cases"]:  # XLA's peak is temp + arguments + outputs - aliased
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])


# ---- step time with the host out of the way (2026-11-26) -----------------------------------------------
# ``tests/data/h100_back_to_back.json``: six of the cases above re-timed on one H100 with steps dispatched
# back to back (and from a profiler trace of the GPU's kernels). The plan prices the GPU's work; a loop that
# waits on every step adds 1.7-8.7 ms of host time per step (dispatch and the update of the step's CUDA
# graph) which a loop that does not wait hides.
BACK_TO_BACK = json.loads((Path(__file__).parent / "data" / "h100_back_to_back.json").read_text())
B2B = {_name(c): c for c in BACK_TO_BACK["cases"]}


def test_back_to_back_steps_are_the_synced_steps_less_host_time() -> None:
    """The data's own consistency: dispatching back to back never makes a step slower, and the host time
    it hides is a few ms, not a different program."""
    for name, c in B2B.items():
        assert name in CASES
        hidden = c["synced_median_s"] - c["back_to_back_s"]
        assert 0 < hidden < 0.15 * c["synced_median_s"], name


# ---- recompute on the GPU (2026-11-26) -------------------------------------------------------------------
# ``tests/data/h100_recompute_fidelity.json``: GPT steps with every block rewritten by autoshard's recompute
# (none / selective / full) and re-emitted for one H100, XLA's memory_analysis() and step time of each; and
# GPT-2.6B as written. Provenance in the file (benchmarks/gpu_truth.py); the selective and full rows name the
# commit whose rewrite they measured (field ``rewrite``).
RECOMPUTE = json.loads((Path(__file__).parent / "data" / "h100_recompute_fidelity.json").read_text())
RCASES = {f"{c['model']}-{c['preset']}-{'-'.join(c['overrides'])}-{c['recompute']}": c for c in RECOMPUTE["cases"]}


@functools.cache
def _recompute_plan(model: str, preset: str, overrides: tuple[str, ...], recompute: str) -> Any:
    ex = load_example(ROOT / "examples" / f"{model}.py", preset, list(overrides), abstract=True)
    return autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware="h100", time_budget_s=10,
                          recompute=recompute)


def _rplan(name: str) -> Any:
    c = RCASES[name]
    return _recompute_plan(c["model"], c["preset"], tuple(c["overrides"]), c["recompute"])


def test_the_recompute_data_says_where_it_comes_from() -> None:
    prov = RECOMPUTE["provenance"]
    assert prov["date"] == "2026-11-26" and prov["jax"] == "0.11.2" and "H100" in prov["device"]
    assert prov["rewrite"] and all(("rewrite" in c) == (c["recompute"] != "none") for c in RECOMPUTE["cases"])
    for c in RECOMPUTE["cases"]:
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])


# the default run keeps one case of each recompute mode; the rest run with the slow tests (20-36 s each)
FAST_RCASES = {"gpt-1.3b-dtype=bfloat16-batch=8-selective", "gpt-760m-dtype=bfloat16-batch=8-full",
               "gpt-350m-dtype=float32-batch=8-none"}


def test_full_recompute_plan_matches_flax_remat_on_the_gpu() -> None:
    """GPT-1.3B bf16 batch 8 traced without remat and planned with ``recompute="full"`` recomputes every
    block, and its predicted peak and time are within 15% / 10% of the same step written with ``nn.remat``
    as XLA compiled and ran it (``h100_fidelity.json``): the rewrite does what flax's remat does."""
    case = CASES["gpt-1.3b-bfloat16-b8-remat"]
    plan = _recompute_plan("gpt", "1.3b", ("dtype=bfloat16", "batch=8"), "full")
    assert len(plan.recompute) == 24 and set(plan.recompute.values()) == {"full"}
    xla, t = case["xla_peak_bytes"], case["jit_median_s"]
    assert abs(plan.peak_memory - xla) <= MEMORY_TOLERANCE * xla, (
        f"predicted {plan.peak_memory / 1e9:.2f} GB, XLA with nn.remat {xla / 1e9:.2f} GB")
    assert abs(plan.predicted_step_time - t) <= TIME_TOLERANCE * t, (
        f"predicted {plan.predicted_step_time * 1e3:.1f} ms, measured with nn.remat {t * 1e3:.1f} ms")


def test_recompute_lowers_predicted_peak_memory_and_costs_time() -> None:
    """GPT-760M bf16 b8: none > selective > full in predicted peak, the reverse in predicted time; the step
    as traced matches the GPU (above), and recompute's plans name every block."""
    plans = [_recompute_plan("gpt", "760m", ("dtype=bfloat16", "batch=8"), m) for m in ("none", "selective", "full")]
    peaks = [p.peak_memory for p in plans]
    times = [p.predicted_step_time for p in plans]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > 2 * peaks[2]
    assert times == sorted(times)
    assert not plans[0].recompute and [set(p.recompute.values()) for p in plans[1:]] == [{"selective"}, {"full"}]


# ---- a second card: one H200 (2026-11-26) ----------------------------------------------------------------
# ``tests/data/h200_fidelity.json``: eight of the cases above and GPT-6.7B bf16 b2 (117.5 GB: too large for an
# H100), compiled and timed on one H200 (141 GB HBM3e at 4.8 TB/s, the H100's compute). Planned with the
# ``h200`` preset, whose memory efficiency (0.78) is fitted to these rows' back-to-back times; the memory
# rows were not fitted.
H200 = json.loads((Path(__file__).parent / "data" / "h200_fidelity.json").read_text())
H200_CASES = {_name(c): c for c in H200["cases"]}


def test_the_h200_data_says_where_it_comes_from_and_compiles_as_the_h100_did() -> None:
    """Provenance, and the bf16 steps that were also compiled for the H100 (2026-11-22) peak within 0.1% of
    what they did there: their buffer assignment is not the card's. The two fp32 steps do not (GPT-125M
    +6%, MoE-380M +10% on the H200; TF32 GEMM workspaces or the examples' changes since 11-22: not
    established), so the planner's one prediction for both cards is held to each card's own number."""
    prov = H200["provenance"]
    assert prov["date"] == "2026-11-26" and prov["jax"] == "0.11.2" and "H200" in prov["device"]
    assert prov["command"] and prov["calibration"]
    shared = [n for n in H200_CASES if n in CASES]
    assert len(shared) == 8
    for name, c in H200_CASES.items():
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])
        assert 0 < c["synced_median_s"] - c["back_to_back_s"] < 0.15 * c["synced_median_s"], name
        if name in CASES and c["dtype"] == "bfloat16":
            assert abs(c["xla_peak_bytes"] - CASES[name]["xla_peak_bytes"]) <= 1e-3 * c["xla_peak_bytes"], name


# ---- every recorded 1-device row at once (issue 46) ----------------------------------------------------------
# The rows above come from three GPU sessions (H100 2026-11-22, H100 and H200 2026-11-26). A change fitted on one
# set moved another unseen: pricing dead code at zero (ed65ad8) was checked on the 11-26 rows and took GPT-350M
# bf16 b8 from 0.89 to 0.83 of its 11-22 time, because the softmax's re-reads of the scores were not priced and
# the dead values had stood in for them. So one test holds every row of every file, each against the time its
# session measured (11-22: a wait after every step; back-to-back rows: the GPU's time; emitted steps: their
# median), and a second checks that the files hold every 1-device row of the raw measurements.
ROW_TOLERANCE = {"time": TIME_TOLERANCE, "memory": MEMORY_TOLERANCE}


def _recorded_rows() -> dict[str, tuple[Any, ...]]:
    """id -> (plan key, measured seconds or None, XLA peak bytes or None, what the time is)."""
    rows: dict[str, tuple[Any, ...]] = {}
    for name, c in CASES.items():
        rows[f"h100-11-22-{name}"] = (("case", name, "h100"), c["jit_median_s"], c["xla_peak_bytes"], "synced")
    for name, c in B2B.items():
        rows[f"h100-11-26-{name}"] = (("case", name, "h100"), c["back_to_back_s"], None, "back to back")
    for name, c in H200_CASES.items():
        rows[f"h200-11-26-{name}"] = (("h200", name, "h200"), c["back_to_back_s"], c["xla_peak_bytes"], "back to back")
    for name, c in RCASES.items():
        rows[f"h100-11-26-{name}"] = (("recompute", name, "h100"), c["median_s"], c["xla_peak_bytes"], "emitted")
    return rows


ROWS = _recorded_rows()
SLOW_ROWS = {f"h100-11-26-{n}" for n in RCASES if n not in FAST_RCASES}


def _row_plan(key: tuple[str, str, str]) -> Any:
    kind, name, hardware = key
    if kind == "recompute":
        return _rplan(name)
    return _plan(name, H200_CASES if kind == "h200" else CASES, hardware)


@pytest.mark.parametrize("row", [pytest.param(r, marks=pytest.mark.slow) if r in SLOW_ROWS else r for r in ROWS])
def test_every_recorded_row_is_predicted_within_10_percent_in_time_and_15_in_memory(row: str) -> None:
    key, seconds, peak, what = ROWS[row]
    plan = _row_plan(key)
    if seconds is not None:
        assert abs(plan.predicted_step_time - seconds) <= ROW_TOLERANCE["time"] * seconds, (
            f"{row}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured ({what}) {seconds * 1e3:.1f} ms "
            f"({plan.predicted_step_time / seconds:.3f})")
    if peak is not None:
        assert abs(plan.peak_memory - peak) <= ROW_TOLERANCE["memory"] * peak, (
            f"{row}: predicted {plan.peak_memory / 1e9:.2f} GB, XLA {peak / 1e9:.2f} GB")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_data_files_hold_every_recorded_1_device_row() -> None:
    """Every timed 1-device row of the raw measurements (``benchmarks/data/gpu_truth_*.jsonl``, and the 11-22
    files in ``../shared/measurements`` where that checkout is beside this one) is in a test data file with the
    same numbers, so ``test_every_recorded_row...`` holds it. Recompute rows of a rewrite later fixed (no
    ``rewrite`` field; the data file names the fix) are superseded and skipped."""
    def same(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1.0)

    checked = 0
    shared = ROOT.parent / "shared" / "measurements"
    for path in sorted(shared.glob("fidelity*.jsonl")) if shared.is_dir() else []:
        for r in _jsonl(path):
            if "jit_median_s" not in r:
                continue  # a case that failed on the device
            c = CASES[_name(r)]
            assert same(c["jit_median_s"], r["jit_median_s"]) and c["xla_peak_bytes"] == r["xla_peak_bytes"], path
            checked += 1
    for path in sorted((ROOT / "benchmarks" / "data").glob("gpu_truth_*.jsonl")):
        h200 = "h200" in path.name
        for r in _jsonl(path):
            part = r.get("part")
            if part in ("overlap", "profile") and not h200:
                c = B2B[_name(_case_fields(r))]
                want = r.get("synced_median_s", r.get("jit_median_s"))
                assert same(c["synced_median_s"], want), (path, r)
                assert "back_to_back_s" not in r or same(c["back_to_back_s"], r["back_to_back_s"]), (path, r)
            elif part == "overlap":
                c = H200_CASES[_name(_case_fields(r))]
                assert same(c["back_to_back_s"], r["back_to_back_s"]) and c["xla_peak_bytes"] == r["xla_peak_bytes"]
            elif part in ("recompute", "case"):
                mode = r.get("mode", "none")
                if mode != "none" and "rewrite" not in r:
                    continue  # superseded by the fixed rewrite's rows
                c = RCASES[f"{r['model']}-{r['preset']}-{'-'.join(r['overrides'])}-{mode}"]
                assert c["xla_peak_bytes"] == r["xla_peak_bytes"], (path, r)
                timed = r.get("emit_median_s", r.get("jit_median_s"))
                assert (c["median_s"] is None) == (timed is None) and (timed is None or same(c["median_s"], timed))
            else:
                continue
            checked += 1
    assert checked >= 24 + (8 if shared.is_dir() else 0)  # H100 15 and H200 9 on 11-26, 8 on 11-22


def _case_fields(r: dict[str, Any]) -> dict[str, Any]:
    """A gpu_truth row's case in the fidelity files' fields (model, preset, dtype, batch, remat)."""
    o = dict(x.split("=", 1) for x in r["overrides"])
    return {"model": r["model"], "preset": r["preset"], "dtype": o["dtype"], "batch": int(o["batch"]),
            "remat": o.get("remat") == "true"}
