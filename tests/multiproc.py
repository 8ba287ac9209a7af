"""Worker processes for the tests that run ``jax.distributed`` on localhost: one way to start them, end them and
read their reports, shared by every such test.

A worker is a script in ``tests/workers`` called as ``worker PORT RANK NPROC ARGS...``; it prints its report as
the last line of its output, in JSON. Each runs in a session of its own (so a hung collective is ended with
every child it started) with the parent's ``XLA_FLAGS`` less its device count (the worker sets its own)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


def without_device_count(flags: str) -> str:
    """``XLA_FLAGS`` less the simulated device count (a worker sets its own, ``jax_num_cpu_devices``); the test
    session's compile flags (``conftest``) stay."""
    return " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(worker: str | Path, *args: object, nproc: int = 2, ranks: range | None = None, port: int | None = None,
          env: Mapping[str, str] | None = None) -> list[subprocess.Popen]:
    """Processes ``ranks`` (all ``nproc`` by default) of ``worker`` (a path, or a file name in ``tests/workers``)
    with ``args`` after the port, rank and process count."""
    port = free_port() if port is None else port
    path = Path(worker) if Path(worker).is_absolute() else WORKERS / worker
    environ = dict(os.environ) | {"XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", ""))} | dict(env or {})
    return [subprocess.Popen([sys.executable, "-u", str(path), str(port), str(r), str(nproc), *map(str, args)],
                             env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
            for r in (range(nproc) if ranks is None else ranks)]


def end(procs: list[subprocess.Popen]) -> None:
    """Kill what is still running (with its children) and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


@contextmanager
def running(worker: str | Path, *args: object, **kwargs) -> Iterator[list[subprocess.Popen]]:
    """``start``'s processes, ended whatever the test does with them."""
    procs = start(worker, *args, **kwargs)
    try:
        yield procs
    finally:
        end(procs)


def reports(procs: list[subprocess.Popen], timeout: float = 400) -> list[dict]:
    """Every process to its end (each must succeed); each one's report."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        end(procs)
    for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {r}:\n{err[-3000:]}"
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def run(worker: str | Path, *args: object, timeout: float = 400, **kwargs) -> list[dict]:
    """Start ``worker``'s processes and return their reports."""
    return reports(start(worker, *args, **kwargs), timeout)
