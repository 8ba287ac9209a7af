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

from autoshard.trace import costs
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
    """3x the forward matmul and convolution flops of ``graph`` (module docstring; kernels registered with
    ``matmul=True`` count as matmuls), with their peak."""
    flops, ideal = _count(graph, device)
    return ModelFlops(flops, flops / ideal if ideal > 0 else 0.0)


def _count(g: Graph, device: Device) -> tuple[float, float]:
    """(model flops, seconds they take at peak on one device) of ``g``, its loop and branch bodies included:
    a scan body runs ``trip_count`` times (a while loop without a known count, once); of a cond's branches,
    the one with the most model flops counts."""
    flops, ideal = 0.0, 0.0
    for op in g.ops:
        if op.primitive == "cond" and op.bodies:
            f, i = max((_count(b, device) for b in op.bodies), key=lambda fi: fi[0])
        elif op.primitive == "custom_partitioning" and op.phase != "forward":
            continue  # a backward kernel's body replays the forward (its ops read as forward): not model flops
        elif op.bodies:
            each = float(op.trip_count or 1)
            f, i = (sum(x) * each for x in zip(*(_count(b, device) for b in op.bodies), strict=True))
        elif op.phase == "forward" and op.flops > 0 and (
                op.primitive in MATMULS or costs.on_matmul_units(op)):
            # a product runs in its operands' dtype (a bf16 dot may accumulate into fp32)
            dtype = g.tensors[(op.inputs or op.outputs)[0]].dtype
            f = 3.0 * op.flops
            i = f / device.peak_flops(dtype)
        else:
            continue
        flops, ideal = flops + f, ideal + i
    return flops, ideal
