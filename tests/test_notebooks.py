"""The notebooks run top to bottom: each ``notebooks/*.py`` (jupytext percent format, the source of truth)
is converted to a notebook and executed in a fresh kernel on 8 simulated CPU devices; no cell may raise,
and the plotting notebook must produce its figures."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import multiproc
import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.py"))
MIN_IMAGES = {"02_plan_explorer": 5, "03_auto_vs_hand": 1}  # figures each notebook must draw


def kernel_manager(kernel_dir: Path):
    """A kernel manager for a kernel running this very interpreter (not whichever "python3" kernelspec the
    machine's Jupyter paths happen to list first)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = kernel_dir / "autoshard-notebooks"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "autoshard notebooks", "language": "python",
    }))
    return KernelManager(kernel_name="autoshard-notebooks",
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))


def run_notebook(path: Path, timeout_s: int = 300):
    """Convert ``path`` with jupytext and execute it in a fresh kernel; returns the executed notebook."""
    nb = jupytext.read(path)
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{multiproc.without_device_count(env.get('XLA_FLAGS', ''))} --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("MPLBACKEND", None)  # the kernel's inline backend renders the figures as image/png
    with tempfile.TemporaryDirectory() as kernels:
        client = nbclient.NotebookClient(nb, km=kernel_manager(Path(kernels)), timeout=timeout_s,
                                         resources={"metadata": {"path": str(ROOT)}})
        client.execute(env=env)
    return nb


def count_images(nb) -> int:
    return sum("image/png" in out.get("data", {})
               for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


def test_notebooks_are_found() -> None:
    assert [p.stem for p in NOTEBOOKS] == ["01_tour", "02_plan_explorer", "03_auto_vs_hand"]


FAST = {"01_tour"}  # the others run with the slow tests (about 70 s each on a CI core)


@pytest.mark.parametrize("path", [p if p.stem in FAST else pytest.param(p, marks=pytest.mark.slow)
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs(path: Path) -> None:
    nb = run_notebook(path)  # nbclient raises CellExecutionError naming the cell on any error
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors
    assert count_images(nb) >= MIN_IMAGES.get(path.stem, 0), f"{path.stem} drew too few figures"
