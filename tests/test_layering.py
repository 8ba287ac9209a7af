"""`solvers` (the pipeline program in `solvers.pipeline` included) and `cost_models` stay pure: neither imports
JAX or autoshard, directly or transitively, nor the other."""

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
    assert not bad, f"{package} imports {bad}; it must stay free of JAX and autoshard"
    for other in {"solvers", "cost_models"} - {package}:
        assert not any(m.split(".")[0] == other for m in loaded), f"{package} must not import {other}"


# The passes inside autoshard/, lowest first: a module may import its own pass and the ones before it,
# never a later one, and the imports of the whole package form no cycle (function-local imports
# included: a cycle hidden in a function body is still a cycle). A module's pass is the longest entry
# that is a prefix of its name; the package ``__init__`` files come last within their pass.
PASSES = (
    "autoshard._version",
    "autoshard.errors",
    "autoshard.target",
    "autoshard.trace",
    "autoshard.strategies",
    "autoshard.planner.build",
    "autoshard.planner.utilization",
    "autoshard.planner.plan",
    "autoshard.planner.summary",
    "autoshard.planner.readback",
    "autoshard.planner.pins",
    "autoshard.planner.layouts",
    "autoshard.planner.shares",
    "autoshard.planner.seeds",
    "autoshard.planner.planning",
    "autoshard.planner.recompute",
    "autoshard.planner.explain",
    "autoshard.planner.compare",
    "autoshard.planner",
    "autoshard.emit",
    "autoshard.pipeline.partition",
    "autoshard.pipeline.draws",
    "autoshard.pipeline.schedules",
    "autoshard.pipeline.ticks",
    "autoshard.pipeline.host",
    "autoshard.pipeline.uniform",
    "autoshard.pipeline.pipeline_plan",
    "autoshard.pipeline.layer_prices",
    "autoshard.pipeline.stages",
    "autoshard.pipeline.report",
    "autoshard.pipeline.unreduced",
    "autoshard.pipeline.runtime",
    "autoshard.pipeline.spmd_program",
    "autoshard.pipeline.spmd",
    "autoshard.pipeline",
    "autoshard.profiler",
    "autoshard._examples",
    "autoshard.distributed",
    "autoshard.nnx_steps",
    "autoshard.cache",
    "autoshard.checkpoint",
    "autoshard.options",
    "autoshard.choose",
    "autoshard.api",
    "autoshard.megatron",
    "autoshard.cli",
    "autoshard",
)


def _imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The autoshard modules ``path`` imports anywhere in its body (``from autoshard.p import m`` names
    module ``autoshard.p.m`` when there is one); imports under ``if TYPE_CHECKING:`` are for annotations
    and never run, so they are left out."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] == "autoshard" and n != module}
    return out


def _pass_of(module: str) -> int:
    best = max((p for p in PASSES if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} is in no pass: add it to PASSES in {__file__}"
    return PASSES.index(best)


def test_autoshard_passes_import_only_earlier_passes_and_form_no_cycle() -> None:
    import networkx as nx

    modules = {m: ROOT / (m.replace(".", "/") + ".py") for m in _modules_of("autoshard")}
    for m in list(modules):
        if not modules[m].exists():
            modules[m] = ROOT / m.replace(".", "/") / "__init__.py"
    known = set(modules)
    graph = nx.DiGraph()
    upward = []
    for m, path in modules.items():
        graph.add_node(m)
        for target in _imports_of(path, m, known):
            graph.add_edge(m, target)
            is_init = path.name == "__init__.py" and target.startswith(m + ".")
            if not is_init and _pass_of(target) > _pass_of(m):
                upward.append(f"{m} imports {target}")
    assert not upward, "a pass imports a later one:\n" + "\n".join(sorted(upward))
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])
