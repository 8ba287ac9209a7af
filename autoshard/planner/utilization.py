"""Model FLOP utilization (MFU): how much of the devices' peak a plan's predicted step would use.

The convention is Megatron's and PaLM's: *model* flops count the work the model needs, not the work a
plan does, so recompute, redundant replicated compute and communication all lower MFU instead of
raising it. For a train step

    model_flops = 3 · Σ_{forward matmuls and convolutions} flops

(the backward pass does twice the forward's matmul work: one product for the input gradient, one for
the weight gradient), summed over the whole step (every microbatch; loop bodies times their trip
count). Elementwise work, softmax and the optimizer are not counted, as in the papers.

The peak is the matmul unit each product runs on (``Device.peak_flops`` of its dtype: bf16 on the
tensor cores, fp32 as TF32 on Ampere and later GPUs), so a mixed-precision step is measured against
the units it uses:

    ideal_seconds = 3 · Σ_i flops_i / peak(dtype_i)          (one device doing all the model's work)
    MFU = ideal_seconds / (step_time · devices)

and ``peak_flops = model_flops / ideal_seconds`` is the step's effective per-device peak. The cost
model charges matmuls at ``matmul_efficiency`` of the peak (0.7 on the GPU presets), which bounds any
predicted MFU; Megatron-Core reports up to 47% measured on H100.
"""

from __future__ import annotations

import dataclasses

from autoshard.trace.graph import Graph
from cost_models.hardware import Device

MATMULS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFlops:
    """A step's model flops and the per-device peak they are measured against (FLOP/s)."""

    flops: float
    peak: float

    def to_dict(self) -> dict[str, float]:
        return {"flops": self.flops, "peak": self.peak}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> ModelFlops:
        return cls(float(d["flops"]), float(d["peak"]))

    def mfu(self, step_seconds: float, devices: int) -> float | None:
        """The fraction of ``devices`` peaks the step uses at ``step_seconds``; None when undefined."""
        if not (self.flops > 0 and self.peak > 0 and step_seconds > 0 and devices > 0):
            return None
        return self.flops / (step_seconds * devices * self.peak)


def model_flops(graph: Graph, device: Device) -> ModelFlops:
    """3x the forward matmul and convolution flops of ``graph`` (module docstring), with their peak."""
    flops, ideal = 0.0, 0.0

    def go(g: Graph, times: float) -> None:
        nonlocal flops, ideal
        for op in g.ops:
            if op.bodies:
                # a scan body runs trip_count times; a cond's branches are alternatives (the largest counts);
                # a while loop without a known count, once
                each = float(op.trip_count or 1)
                if op.primitive == "cond":
                    best = max(op.bodies, key=lambda b: _forward_matmul_flops(b))
                    go(best, times)
                else:
                    for b in op.bodies:
                        go(b, times * each)
                continue
            if op.primitive in MATMULS and op.phase == "forward" and op.flops > 0:
                f = 3.0 * times * op.flops
                dtype = g.tensors[op.outputs[0]].dtype if op.outputs else "float32"
                flops += f
                ideal += f / device.peak_flops(_operand_dtype(g, op) or dtype)

    go(graph, 1.0)
    return ModelFlops(flops, flops / ideal if ideal > 0 else 0.0)


def _forward_matmul_flops(g: Graph) -> float:
    return sum(op.flops for op in g.ops if op.primitive in MATMULS and op.phase == "forward")


def _operand_dtype(g: Graph, op) -> str | None:  # type: ignore[no-untyped-def]
    """The dtype a product runs in: its first operand's (a bf16 dot may accumulate into fp32)."""
    return g.tensors[op.inputs[0]].dtype if op.inputs else None
