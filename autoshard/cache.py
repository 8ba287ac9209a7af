"""Plans cached on disk across launches, keyed by what the plan depends on (as JAX caches compiled programs).

A training job is launched many times (restarts, preemptions, new hardware) and planning a large step costs
a minute or more. ``api.plan_for`` (behind ``autoshard.plan``, ``@autoshard.parallelize`` and ``autoshard
plan``) looks the plan up here after tracing and before planning, and writes it after planning. An entry is
one JSON file named by the SHA-256 of its key:

- the traced step (``graph_digest``): every tensor's name, shape, dtype and role, every op's primitive,
  parameters, operands and scope, nested bodies included; a step changed in one shape, one dtype, one input
  role or one op misses;
- the target: mesh shape and axis names, the hardware's whole cost profile (a preset, or a measured
  profile's contents, not its file name) on that mesh, the memory budget in bytes;
- the planning options (``PipelineOptions``, the time budget, recompute);
- the autoshard and jax versions (a new planner or tracer plans afresh).

A hit is checked against the step as a saved plan is (``Plan.verify`` on the trace, with the plan's
recompute; a pipeline against the trace at its microbatch size); an entry that fails that check or cannot be
read is planned again with a warning and overwritten, never used. Under ``jax.distributed`` only process 0
plans, so only it reads and writes the cache (``distributed.agreed_plan`` then broadcasts the plan).

Where: ``set_cache_dir(path)`` in Python, else the ``AUTOSHARD_CACHE_DIR`` environment variable, else
``autoshard/plans`` under the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``; ``~/Library/Caches``
on macOS; ``%LOCALAPPDATA%`` on Windows). ``set_cache_dir(None)`` or ``AUTOSHARD_CACHE_DIR=off`` (or an empty
value) turns the cache off. The one setting is process-wide on purpose, as ``jax_compilation_cache_dir`` is:
a job sets it once, before its first step. ``autoshard cache list|clear`` shows and empties it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax

from autoshard._version import __version__
from autoshard.errors import AutoshardError
from autoshard.pipeline.partition import trace_microbatch
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.planner.plan import Plan, PlanError
from autoshard.planner.recompute import as_planned, recomputed
from autoshard.target import PipelineOptions, Target
from autoshard.trace import Graph

log = logging.getLogger("autoshard")

ENV = "AUTOSHARD_CACHE_DIR"
OFF = ("", "0", "off", "none", "false")  # values of ``ENV`` that turn the cache off
FORMAT = 1  # of an entry file; another format is a miss


class _Unset:
    """``set_cache_dir`` was not called: the environment variable, then the default, decide."""


_UNSET = _Unset()
_setting: Path | _Unset | None = _UNSET  # the one process-wide setting (module docstring)


def set_cache_dir(path: str | Path | None) -> None:
    """Where plans are cached from now on in this process: a directory (made when first written), or None
    to turn the cache off. Overrides ``AUTOSHARD_CACHE_DIR``."""
    global _setting
    _setting = None if path is None else Path(path).expanduser()


def cache_dir() -> Path | None:
    """The directory plans are cached in, or None when the cache is off (module docstring)."""
    if not isinstance(_setting, _Unset):
        return _setting
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in OFF else Path(env).expanduser()
    return _user_cache_dir() / "autoshard" / "plans"


def _user_cache_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg else Path.home() / ".cache"


# ---- the key ----------------------------------------------------------------------------------------------


def graph_digest(graph: Graph) -> str:
    """SHA-256 of what a plan of ``graph`` depends on: tensors (name, shape, dtype, role), ops (primitive,
    parameters, operands, results, scope, trip count, flops and bytes: a kernel's flops registered anew with
    ``register_rule`` change the key) and nested bodies, in order. Source lines are left out, so an edit
    that only moves code still hits. Not seen: a custom op's layout rule changed under the same flops
    (``autoshard cache clear`` after editing one)."""
    h = hashlib.sha256()

    def go(g: Graph) -> None:
        h.update(repr((g.inputs, g.outputs, g.output_names)).encode())
        for t in g.tensors:
            h.update(repr((t.name, t.shape, t.dtype, t.role.value)).encode())
        for op in g.ops:
            h.update(repr((op.primitive, op.params, op.inputs, op.outputs, op.scope, op.trip_count,
                           op.flops, op.bytes_in, op.bytes_out, len(op.bodies))).encode())
            for b in op.bodies:
                go(b)

    go(graph)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    """An entry's name (``digest``) and a readable account of what it was made for (``about``)."""

    digest: str
    about: Mapping[str, Any]


def key(graph: Graph, target: Target, options: PipelineOptions, *, time_budget_s: float | None,
        recompute: str, name: str = "") -> Key | None:
    """The cache key of planning ``graph`` on ``target`` with these options (module docstring), or None
    when the cache is off (nothing is digested then). ``name``: the step's name, shown by ``autoshard cache
    list`` (not part of the key)."""
    if cache_dir() is None:
        return None
    cost = target.cost
    # numbers as floats: ``time_budget_s=3`` in Python and ``--time-budget 3`` (3.0) are one option
    time_budget_s = None if time_budget_s is None else float(time_budget_s)
    parts = {
        "graph": graph_digest(graph),
        "mesh": [list(target.shape), list(target.axis_names)],
        "hardware": target.hardware,
        "profile": hashlib.sha256(json.dumps(cost.profile.to_dict(), sort_keys=True, default=repr).encode()).hexdigest(),
        "links": cost.mesh.to_dict(),
        "memory_budget": None if target.memory_budget is None else float(target.memory_budget),
        "options": dataclasses.asdict(options),
        "time_budget_s": time_budget_s,
        "recompute": recompute,
        "autoshard": __version__,
        "jax": jax.__version__,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()
    about = {"step": name, "ops": len(graph.ops), "mesh": "x".join(map(str, target.shape)),
             "axes": ",".join(target.axis_names), "hardware": target.hardware,
             "memory_budget": target.memory_budget, "time_budget_s": time_budget_s, "recompute": recompute,
             "options": {k: v for k, v in dataclasses.asdict(options).items()
                         if v != getattr(PipelineOptions(), k)},
             "autoshard": __version__, "jax": jax.__version__}
    return Key(digest, about)


# ---- entries ----------------------------------------------------------------------------------------------


Traces = tuple[Plan | PipelinePlan, Graph, Graph | None]  # as ``api.plan_for`` returns them


def lookup(k: Key | None, step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...], graph: Graph,
           roles: Mapping[str | int, Any] | None = None) -> Traces | None:
    """The cached plan for ``k`` checked against the step (``verified``) with the traces ``plan_for``
    returns, or None: no cache, no entry, or an entry that cannot be read or does not fit the step (a
    warning says which; the caller plans again and overwrites it)."""
    path = _path(k)
    if path is None or k is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != k.digest:
            raise PlanError(f"an entry of format {data.get('format')!r} for key {str(data.get('key'))[:12]}")
        plan_data = data["plan"]
        the_plan = (PipelinePlan.from_dict(plan_data) if plan_data.get("kind") == "pipeline"
                    else Plan.from_dict(plan_data))
        out = verified(the_plan, step_fn, args, graph, roles)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AutoshardError) as e:
        log.warning("the cached plan %s cannot be used (%s: %s); planning again (the entry will be "
                    "replaced)", path, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    log.info("found the plan in the cache (%s): %s on %s, %s a step predicted; not planning",
             path, "a pipeline" if isinstance(the_plan, PipelinePlan) else "an intra-operator plan",
             k.about.get("mesh"), f"{the_plan.predicted_step_time * 1e3:.3g} ms")
    return out


def verified(the_plan: Plan | PipelinePlan, step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...],
             graph: Graph, roles: Mapping[str | int, Any] | None = None) -> Traces:
    """``the_plan`` with the graphs it runs on, checked as ``api.trace_for_plan`` checks a saved plan, from
    ``graph`` (``step_fn`` traced with ``args``): an intra-operator plan against ``graph`` with its recompute;
    a pipeline against the step traced at its microbatch size (then ``graph`` itself is returned as the full
    trace). Raises ``PlanError`` when it does not fit."""
    if isinstance(the_plan, Plan):
        planned = as_planned(graph, the_plan)
        the_plan.verify(planned)
        return the_plan, planned, None
    if isinstance(step_fn, Graph):
        raise PlanError("a cached pipeline needs the step function to trace at microbatch size, not a Graph")
    micro = recomputed(trace_microbatch(step_fn, args, graph, the_plan.num_microbatches, roles=roles),
                       the_plan.recompute)
    the_plan.verify(micro)
    return the_plan, graph, micro


def store(k: Key | None, the_plan: Plan | PipelinePlan) -> Path | None:
    """Write ``the_plan`` under ``k`` (atomically: a reader never sees half a file); None when the cache is
    off. A directory that cannot be written is a warning, not an error: the plan is in hand."""
    path = _path(k)
    if path is None or k is None:
        return None
    entry = {"format": FORMAT, "key": k.digest, "about": dict(k.about),
             "saved": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "kind": "pipeline" if isinstance(the_plan, PipelinePlan) else "intra-operator",
             "predicted_step_time": the_plan.predicted_step_time, "plan": the_plan.to_dict()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write the plan to the cache at %s (%s); set AUTOSHARD_CACHE_DIR "
                    "to a writable directory, or turn the cache off with AUTOSHARD_CACHE_DIR=off", path, e)
        return None
    log.info("plan cached at %s", path)
    return path


def _path(k: Key | None) -> Path | None:
    root = cache_dir()
    return None if root is None or k is None else root / f"{k.digest[:40]}.json"


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One cached plan as ``autoshard cache list`` shows it."""

    path: Path
    about: Mapping[str, Any]
    kind: str
    predicted_step_time: float | None
    saved: str
    nbytes: int


def entries(root: Path | None = None) -> Iterator[Entry]:
    """The entries under ``root`` (default: ``cache_dir()``), newest first; unreadable files are listed as
    ``kind="unreadable"``."""
    root = cache_dir() if root is None else root
    if root is None or not root.is_dir():
        return
    files = sorted(root.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in files:
        try:
            d = json.loads(p.read_text())
            yield Entry(p, d.get("about", {}), d.get("kind", "?"), d.get("predicted_step_time"), d.get("saved", ""),
                        p.stat().st_size)
        except (OSError, ValueError, AttributeError):
            yield Entry(p, {}, "unreadable", None, "", p.stat().st_size)


def clear(root: Path | None = None) -> int:
    """Remove every cached plan under ``root`` (default: ``cache_dir()``); returns how many."""
    root = cache_dir() if root is None else root
    if root is None or not root.is_dir():
        return 0
    n = 0
    for p in [*root.glob("*.json"), *root.glob(".*.tmp")]:
        p.unlink(missing_ok=True)
        n += 1
    return n
