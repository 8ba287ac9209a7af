"""One deadline for a whole planning call: ``time_budget_s`` is wall clock for everything ``autoshard.plan``
does (tracing, building, solving, the pipeline search), so every phase reads the same clock against the
same end instead of each taking a share and running its own floors past it.

``api.plan_for`` makes one ``Deadline`` per call and hands it down; a phase asks ``left()`` for what it may
spend and ``spent()`` before optional work (another microbatch count, an interleaved or SPMD variant, the
intra-operator plan beside a pipeline that must be planned anyway, more submesh shapes to price). Once the
budget is spent a phase skips what it can and takes the quickest way to a plan that runs; each such skip is
recorded with ``cut`` and ends up in the log (at once) and in the plan's summary (``note``: what was cut
short and what to raise), so a user who gave too short a budget learns it from the plan, not from a
planner that ran five times over.

The clock is injectable (``clock``): tests drive a fake clock that advances per reading, so that "the
budget ran out in the middle of the search" is tested without timing anything on a shared machine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

log = logging.getLogger("autoshard")


@dataclasses.dataclass(slots=True)
class Deadline:
    """``seconds`` from ``start`` (read from ``clock`` when made); ``seconds=None``: no budget, never spent.
    ``cuts``: what was cut short because it was spent, in order (``cut``)."""

    seconds: float | None
    clock: Callable[[], float] = dataclasses.field(default=lambda: time.perf_counter())  # looked up per reading
    start: float | None = None
    cuts: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.clock()

    def elapsed(self) -> float:
        assert self.start is not None
        return self.clock() - self.start

    def left(self) -> float | None:
        """Seconds left (negative once past the end), or None without a budget."""
        return None if self.seconds is None else self.seconds - self.elapsed()

    def spent(self, reserve: float = 0.0) -> bool:
        """Whether at most ``reserve`` seconds are left (never, without a budget)."""
        left = self.left()
        return left is not None and left <= reserve

    def share(self, fraction: float, floor: float = 0.0) -> float | None:
        """``fraction`` of what is left, at least ``floor`` (None without a budget)."""
        left = self.left()
        return None if left is None else max(fraction * left, floor)

    def cut(self, what: str) -> None:
        """Record (and log) that ``what`` was cut short or skipped because the budget was spent."""
        if what in self.cuts:
            return
        self.cuts.append(what)
        log.warning("cut short by the %.3g s time budget (%.1f s in): %s", self.seconds or 0.0, self.elapsed(), what)

    def note(self) -> str | None:
        """The sentence a plan's summary carries when something was cut short (None when nothing was)."""
        if not self.cuts:
            return None
        return (f"the {self.seconds:.3g} s time budget ran out ({self.elapsed():.1f} s in all): "
                + "; ".join(self.cuts) + ". The plan is the best found by then; give planning more time "
                "(time_budget_s=..., --time-budget) or leave the budget out to have it scaled to the step")
