"""The ``autoshard`` command line: help, trace, and errors that name what to fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_console_script_help() -> None:
    script = Path(sys.executable).parent / "autoshard"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "autoshard.cli"]
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "trace" in out.stdout


def test_trace_prints_a_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    rc = main(["trace", str(ROOT / "examples" / "mlp.py"), "--json", str(stats)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "ops by primitive" in out and "dot_general" in out and "state.params" in out
    data = json.loads(stats.read_text())
    assert data["ops"] > 0 and data["param_count"] > 0 and data["trace_seconds"] > 0


def test_trace_with_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["trace", str(ROOT / "examples" / "gpt.py"), "--set", "scan_layers=true", "--set", "layers=3"])
    assert rc == 0
    assert "scan" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "examples/nope.py"], "does not exist"),
        (["trace", "examples/gpt.py", "--preset", "huge"], "no preset 'huge'; presets are tiny"),
        (["trace", "examples/gpt.py", "--set", "hiddn=3"], "no such config field"),
        (["trace", "examples/gpt.py", "--set", "scan_layers=maybe"], "expected true or false"),
        (["trace", "examples/gpt.py", "--set", "layers"], "expected KEY=VALUE"),
        (["trace", "tests/conftest.py"], "lacks PRESETS, make, train_step"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_command_writes_a_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    rc = main(["plan", str(ROOT / "examples" / "mlp.py"), "--preset", "wide", "--mesh", "8", "--axes", "model",
               "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted step time" in text and "R·S(model)" in text and "S(model)·R" in text
    data = json.loads(out.read_text())
    assert data["mesh"]["shape"] == [8] and data["mesh"]["axis_names"] == ["model"]


def test_plan_command_names_what_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(ROOT / "examples" / "mlp.py"), "--preset", "wide", "--memory-budget", "1e6"])
    assert rc == 2
    err = capsys.readouterr().err
    # the bound needs no solve (the step's peak spread over 8 devices), and the message names what is large
    assert "does not fit in 0.001 GB per device" in err and "at least 0.0841 GB" in err
    assert "mlp.py" in err and "--memory-budget none" in err
