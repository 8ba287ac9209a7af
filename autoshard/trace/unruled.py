"""Primitives autoshard meets without a rule: one warning per primitive per process.

The tracer (no flop rule: the op counts 0 flops) and the sharding registry (no sharding rule: the op's
operands and results are replicated) both report here. Whichever meets a primitive first logs it; later
reports of the same primitive, from either pass, from nested bodies or from later planning runs (a
pipeline plan builds one problem per stage candidate), stay silent. Like Python's own ``warnings``
registry this is process-wide state, and the only such state in autoshard: a warning is for a person, who
needs it once.
"""

from __future__ import annotations

import logging

log = logging.getLogger("autoshard")

_warned: set[str] = set()


def warn_once(primitive: str, message: str, *args: object) -> bool:
    """Log ``message % args`` as a warning unless ``primitive`` was already reported; True if logged."""
    if primitive in _warned:
        return False
    _warned.add(primitive)
    log.warning(message, *args)
    return True


def forget(primitive: str | None = None) -> None:
    """Report ``primitive`` (every primitive when None) again next time; for tests."""
    if primitive is None:
        _warned.clear()
    else:
        _warned.discard(primitive)
