"""Rules for FFTs: an FFT transforms its last ``len(fft_lengths)`` dimensions whole (XLA's GPU FFT runs on
one device's buffer; splitting a transformed dimension would need a distributed FFT), so those stay
unsplit and the batch dimensions may be split as for an elementwise op. (Host callbacks, whose operands
are gathered on purpose, are in ``registry.FALLBACK``.)
"""

from __future__ import annotations

from autoshard.strategies.registry import Candidate, RuleContext, passthrough, register
from autoshard.trace.graph import Op


@register("fft")
def fft(op: Op, ctx: RuleContext) -> list[Candidate]:
    rank = len(ctx.out_shapes(op)[0])
    transformed = len(tuple(op.eqn.params.get("fft_lengths", ()))) or 1
    return passthrough(op, ctx, set(range(rank - transformed, rank)))
