"""`solvers` and `cost_models` stay pure: neither imports JAX or autoshard, directly or transitively."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("jax", "jaxlib", "flax", "optax", "autoshard")


def _modules_of(package: str) -> list[str]:
    pkg_dir = ROOT / package
    mods = []
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append(".".join(parts))
    return mods


@pytest.mark.parametrize("package", ["solvers", "cost_models"])
def test_package_imports_no_jax_or_autoshard(package: str) -> None:
    modules = _modules_of(package)
    assert modules, f"{package}/ has no modules"
    # A fresh interpreter, so that nothing this test session imported leaks in.
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    bad = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    other = "cost_models" if package == "solvers" else "solvers"
    assert not bad, f"{package} imports {bad}; it must stay free of JAX and autoshard"
    assert not any(m.split(".")[0] == other for m in loaded), f"{package} must not import {other}"
