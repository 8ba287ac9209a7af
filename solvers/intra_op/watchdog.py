"""Run a HiGHS solve in a child process that is killed if it overruns its deadline.

HiGHS checks its ``time_limit`` and the interrupt callbacks (``ilp.interrupt_at_deadline``) in its
simplex, IPM and branch and bound loops only: IOPDDL M spent over 10 minutes in one window's root
reduced-cost fixing (``HighsRedcostFixing::addRootRedcost``) with 5 s given. A C++ call cannot be stopped
from another thread, so solves big enough to risk that run in a child process (``forkserver``: forked
from a clean server, not from a caller that may hold JAX's threads) and the caller waits at most until
the deadline plus ``GRACE_S``; then the child is killed and the call returns ``on_timeout``. Small
solves (under ``IN_PROCESS_COLUMNS`` columns) stay in-process: a child costs tens of milliseconds.

The child must not import the caller's ``__main__``: multiprocessing would run a user's script again in it
(its training loop, or its own call to the planner, which then fails in the middle of bootstrapping), so
the main module is hidden while the child starts (``_main_hidden``); ``fn`` lives in an importable module.

A process forked from one that started the forkserver (the planner's intra-operator plan, made in a forked
process beside the pipeline search) inherits multiprocessing's record of that server, which is not its child:
multiprocessing's check that it still runs waits on it and raises ``ChildProcessError``. Such a process
forgets the record and starts a server of its own (``_forget_inherited_forkserver``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["GRACE_S", "IN_PROCESS_COLUMNS", "run_guarded"]

GRACE_S = 1.0
IN_PROCESS_COLUMNS = 20_000


def _child(conn: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as err:  # handed back to the caller, who raises it
        conn.send(("error", err))
    finally:
        conn.close()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """While a child starts: ``__main__`` without the file or spec that would make the child import it."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # read by multiprocessing.spawn.get_preparation_data
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _forget_inherited_forkserver() -> None:
    """Forget a forkserver this process did not start (inherited through ``os.fork``) or that has ended, so
    that the next start launches one of its own; the server stays the parent's (its pipe is left open here:
    closing it would stop the parent's server). Reads multiprocessing's private record of its server
    (``_forkserver_pid``, ``_forkserver_address``, ``_forkserver_alive_fd``, CPython 3.11-3.13)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        ended = os.waitpid(pid, os.WNOHANG)[0] != 0  # reaped here: multiprocessing would find no child
    except ChildProcessError:  # not this process's child: inherited from the process it was forked from
        ended = True
    if ended:  # (the server's key too, on a Python that keeps one: a new server makes its own)
        for name in ("_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_authkey"):
            if hasattr(server, name):
                setattr(server, name, None)


def run_guarded(fn: Callable[..., Any], args: tuple, kwargs: dict, *, deadline: float, columns: int,
                on_timeout: Any) -> Any:
    """``fn(*args, **kwargs)``, in a child process killed at ``deadline + GRACE_S`` (``time.perf_counter``)
    when the model has ``columns >= IN_PROCESS_COLUMNS``; ``on_timeout`` if it was killed. ``fn`` must be a
    module-level function and its arguments and result picklable."""
    if columns < IN_PROCESS_COLUMNS:
        return fn(*args, **kwargs)
    ctx = multiprocessing.get_context("forkserver")
    _forget_inherited_forkserver()
    ctx.set_forkserver_preload(["numpy", "highspy", "solvers.intra_op.rowgen"])
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, kwargs), daemon=True)
    with _main_hidden():
        proc.start()
    send.close()
    try:
        if recv.poll(max(0.0, deadline + GRACE_S - time.perf_counter())):
            try:
                kind, value = recv.recv()
            except EOFError:  # the child died without an answer
                return on_timeout
            if kind == "error":
                raise value
            return value
        return on_timeout
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
