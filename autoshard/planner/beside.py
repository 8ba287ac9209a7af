"""Planning work run beside the caller on a second core, in a forked process.

A plan of a large step has independent parts: the intra-operator plan and the pipeline search both start
from the traced step and meet only at the end, where the faster wins. Each is Python and single-threaded
HiGHS, so threads would share one core (the GIL); a forked child runs one of them on another core with
the traced graph already in its memory (copy-on-write: nothing is pickled on the way in). What comes back
is pickled: a ``Plan`` (its layouts, no graph), or the error the work raised.

The child is forked from a process with JAX loaded, which JAX warns against (its runtime's threads do not
survive a fork). The work run here touches no JAX runtime: the planner's passes read the traced graph,
rewrite it (``trace.remat``, pure; its barrier equations come from ``jax.make_jaxpr`` on abstract values,
which traces and runs nothing) and call HiGHS, single-threaded (``threads=1``). Should a child still hang
(a lock another thread held at the fork), the caller stops it once its patience runs out and does the
work itself (``Beside(patience=...)``). A fork that fails, a platform other than Linux, or a machine whose
cores are busy runs the work in the caller instead, when its result is asked for: on a busy machine the
child would take the caller's time slice and both halves, budgeted in wall-clock seconds, would search
less.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from autoshard.planner.plan import PlanError

log = logging.getLogger("autoshard")

T = TypeVar("T")

SPARE_CORES = 0.5  # a child is forked only when this many cores are idle, this process's own counted as busy
# (one-minute load average: a 2-core machine forks at a load up to 1.5, which this planner's own core and
# what is left of a plan made the minute before reach; two busy test workers, 2 and more, do not)


def cores() -> float:
    """The cores this process may use: those it may run on (affinity), capped by its control group's CPU
    quota where one is set (a container given 2 CPUs of a 64-core host)."""
    try:
        n: float = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return min(n, _quota() or n)


def _quota() -> float | None:
    """CPUs of the cgroup's quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" else None
    except (OSError, ValueError):
        pass
    try:
        quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text()
        period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text()
        return int(quota) / int(period) if int(quota) > 0 and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def spare_cores() -> float:
    """``cores()`` less the machine's one-minute load average (this process's own work is part of it)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return cores() - load


def can_fork() -> bool:
    """Whether work may run beside the caller now: on Linux, when ``SPARE_CORES`` cores are idle.
    ``AUTOSHARD_BESIDE=0`` in the environment turns it off, ``AUTOSHARD_BESIDE=1`` on whatever the load."""
    setting = os.environ.get("AUTOSHARD_BESIDE", "")
    if setting == "0" or not sys.platform.startswith("linux"):
        return False  # macOS: system libraries (Accelerate, which numpy uses) are not safe in a forked child
    return setting == "1" or spare_cores() >= SPARE_CORES


class Beside(Generic[T]):
    """``work()`` running in a forked child (``fork=True``) or, with ``fork=False`` or when forking fails, in
    the caller when ``result()`` is first called. ``result()`` returns its value or raises its error;
    ``cancel()`` stops a child whose result is no longer wanted. ``patience``: seconds from the fork after
    which a child that has sent nothing is taken for stuck (a lock some other thread held when it was
    forked), stopped, and the work run in the caller instead, with a warning (None: wait for it)."""

    def __init__(self, work: Callable[[], T], *, fork: bool, what: str = "work",
                 patience: float | None = None) -> None:
        self._work: Callable[[], T] | None = work
        self._what = what
        self._deadline = None if patience is None else time.monotonic() + patience
        self._pid: int | None = None
        self._fd: int | None = None
        self._done: tuple[bool, Any] | None = None
        if fork:
            self._start()

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs (None: the work runs, or ran, in the caller)."""
        return self._pid

    def _start(self) -> None:
        assert self._work is not None
        try:
            read, write = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # JAX's warning that forking a process with JAX is unsafe
                pid = os.fork()
        except OSError as e:
            log.info("could not fork to plan the %s beside the rest (%s): planning it after", self._what, e)
            return
        if pid == 0:  # the child: run, send the outcome, leave without running the parent's exit handlers
            os.close(read)
            code = 0
            try:
                try:
                    outcome: tuple[bool, Any] = (True, self._work())
                except BaseException as e:  # every error goes back to the caller
                    outcome = (False, e)
                try:
                    data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as e:
                    data = pickle.dumps((False, PlanError(
                        f"the {self._what}, planned in a forked process, could not be sent back "
                        f"({type(e).__name__}: {e}); set AUTOSHARD_BESIDE=0 to plan it in this process")))
                with os.fdopen(write, "wb") as f:
                    f.write(data)
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(write)
        self._pid, self._fd = pid, read

    def result(self) -> T:
        if self._done is None:
            if self._pid is not None:
                self._done = self._collect()
            if self._done is None:  # never forked, or the child was stopped: the work runs here
                work, self._work = self._work, None
                assert work is not None, "result() of a cancelled Beside"
                try:
                    self._done = (True, work())
                except Exception as e:  # kept, to raise again on every call
                    self._done = (False, e)
            self._work = None
        ok, value = self._done
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def _collect(self) -> tuple[bool, Any] | None:
        """The child's outcome, or None when it sent nothing before the deadline (it is stopped)."""
        assert self._pid is not None and self._fd is not None
        chunks: list[bytes] = []
        while True:
            wait = None if self._deadline is None or chunks else max(self._deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self._fd], [], [], wait)
            if not ready:
                log.warning("the %s, planned in process %d, sent nothing in the time it was given: "
                            "stopped, and planned in this process instead", self._what, self._pid)
                self.cancel(keep_work=True)
                return None
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks)
        os.close(self._fd)
        _, status = os.waitpid(self._pid, 0)
        self._pid = self._fd = None
        if not data:
            return False, PlanError(f"the {self._what}, planned in a forked process, ended without a result "
                                    f"(exit status {status}); set AUTOSHARD_BESIDE=0 to plan it in this process")
        return pickle.loads(data)  # type: ignore[no-any-return]

    def __del__(self) -> None:  # a child nobody will ask for is stopped, not left blocked on its pipe
        self.cancel()

    def cancel(self, keep_work: bool = False) -> None:
        """Stop the child, if one runs (its result is dropped; ``keep_work``: to run the work here)."""
        if self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
            except OSError:
                pass
            if self._fd is not None:
                os.close(self._fd)
            self._pid = self._fd = None
        if not keep_work:
            self._work = None
