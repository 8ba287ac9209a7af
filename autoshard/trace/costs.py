"""Flop counts per primitive: a table of rules, one per primitive (or family of primitives).

Conventions follow XLA's HloCostAnalysis closely enough that totals agree with
``compiled.cost_analysis()["flops"]`` on matmul-heavy programs:

- ``dot_general``: 2 · (output elements) · (product of contracting dimension sizes); a multiply-add is 2.
- ``conv_general_dilated``: 2 per multiply-add actually performed: taps that fall on padding or on holes of
  input dilation are not counted (XLA's convention), and feature/batch grouping is covered.
- elementwise arithmetic (transcendentals included): 1 per output element.
- reductions and cumulative ops: 1 per input element.
- data movement (reshape, transpose, broadcast, slicing, gather, concatenate, convert, ...): 0.
- collectives inside a ``shard_map`` region (``psum``, ``all_gather``, ``ppermute``, ...): 0; the region's
  rule prices their time (``COLLECTIVES``).
- sort: n · log2(n) comparisons per sorted row.

Custom kernels (``pallas_call``, ``ffi_call``) count what ``autoshard.register_rule`` registered for them,
else a Pallas kernel's own ``cost_estimate``, else 0 (the sharding rule warns about an unregistered one).

Primitives with no rule count 0 flops; the tracer logs one warning per such primitive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Shape = tuple[int, ...]
FlopRule = Callable[[Sequence[Shape], Sequence[Shape], Mapping[str, Any]], float]


def _size(shape: Shape) -> int:
    return math.prod(shape)


def _dot_general(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    (lhs_contract, _rhs_contract), _batch = params["dimension_numbers"]
    k = math.prod(ins[0][d] for d in lhs_contract)
    return 2.0 * _size(outs[0]) * k


def _valid_taps(n_in: int, n_out: int, n_k: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """Number of (output position, kernel tap) pairs of one spatial dimension that land on real input
    (not padding, not a hole of lhs dilation): XLA counts only these."""
    extent = (n_in - 1) * lhs_dil + 1
    count = 0
    for k in range(n_k):
        for o in range(n_out):
            i = o * stride - pad_lo + k * rhs_dil
            if 0 <= i < extent and i % lhs_dil == 0:
                count += 1
    return count


def _conv(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    """2 · (output batch · output features) · (input features per group) · Σ valid (position, tap) pairs."""
    lhs, rhs, out = ins[0], ins[1], outs[0]
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    in_per_group = rhs[rhs_spec[1]]
    taps = 1
    for d in range(len(lhs_spec) - 2):
        taps *= _valid_taps(
            lhs[lhs_spec[2 + d]],
            out[out_spec[2 + d]],
            rhs[rhs_spec[2 + d]],
            params["window_strides"][d],
            params["padding"][d][0],
            params["lhs_dilation"][d],
            params["rhs_dilation"][d],
        )
    return 2.0 * out[out_spec[0]] * out[out_spec[1]] * in_per_group * taps


def _per_output(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    return float(sum(_size(s) for s in outs))


def _per_input(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    return float(_size(ins[0])) if ins else 0.0


def _zero(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    return 0.0


def _sort(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    shape = ins[0]
    if not shape:
        return 0.0
    n = shape[params.get("dimension", len(shape) - 1)]
    return float(_size(shape)) * max(math.log2(max(n, 1)), 1.0)


def _scatter(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    return float(_size(ins[2])) if len(ins) > 2 else 0.0  # one combine per update element


def _fft(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
    """Cooley-Tukey: about 5·n·log2(n) real flops per complex transform of length n, over the transformed
    dimensions and every batch of them (a real transform does about half)."""
    lengths = tuple(params.get("fft_lengths", ()))
    n = math.prod(lengths) if lengths else 1
    shape = max(ins[0], outs[0], key=_size)
    batches = _size(shape) / max(1, math.prod(shape[-len(lengths):]) if lengths else 1)
    real = "R" in str(params.get("fft_type", ""))  # RFFT / IRFFT
    return (0.5 if real else 1.0) * 5.0 * batches * n * max(math.log2(max(n, 2)), 1.0)


# Collectives inside a shard_map region, by the kind the cost model prices them as (``strategies.custom``
# adds their time to the region's); no flops. The rest of the region's communication primitives are free.
COLLECTIVES = {
    "psum": "all_reduce", "psum_invariant": "all_reduce", "pmax": "all_reduce", "pmin": "all_reduce",
    "all_gather": "all_gather", "all_gather_invariant": "all_gather", "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all", "ragged_all_to_all": "all_to_all", "ppermute": "send_recv",
}
COMMUNICATION = (*COLLECTIVES, "pbroadcast", "axis_index", "psend", "precv")

# Host callbacks run outside the device program: no device flops (their operands are gathered first).
CALLBACKS = "debug_callback debug_print io_callback pure_callback".split()

ELEMENTWISE = (
    "add add_any sub mul div rem pow integer_pow neg abs sign max min exp exp2 expm1 log log1p logistic "
    "tanh sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt erf erfc erf_inv "
    "lgamma digamma igamma igammac igamma_grad_a random_gamma_grad bessel_i0e bessel_i1e polygamma zeta "
    "floor ceil round nextafter is_finite square one_minus_square reciprocal clamp select_n eq ne lt le gt ge and or xor not "
    "shift_left shift_right_logical shift_right_arithmetic population_count clz imag real conj complex "
    "regularized_incomplete_beta"
).split()
REDUCTIONS = (
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin "
    "cumsum cumprod cummax cummin cumlogsumexp reduce_precision"
).split()
DATA_MOVEMENT = (
    "reshape transpose broadcast_in_dim squeeze expand_dims slice dynamic_slice dynamic_update_slice "
    "concatenate pad gather rev copy copy_p convert_element_type bitcast_convert_type iota select_and_gather_add "
    "stop_gradient optimization_barrier sharding_constraint device_put random_bits random_seed random_wrap "
    "random_unwrap random_fold_in random_split random_clone threefry2x32 split mesh_cast reshard pvary pcast "
    "empty empty2 broadcast full stack unstack"
).split()

def custom_call_name(primitive: str, params: Mapping[str, Any]) -> str:
    """The name of the kernel a custom call runs: a ``pallas_call``'s ``name`` (else its kernel function's),
    an ``ffi_call``'s target; for any other primitive its own name."""
    if primitive == "pallas_call":
        name = params.get("name") or getattr(params.get("name_and_src_info"), "name", None)
        if not name:  # jax 0.10: the kernel's jaxpr knows the function ("my_kernel at file.py:12")
            info = getattr(getattr(params.get("jaxpr"), "debug_info", None), "func_src_info", None) or ""
            name = info.split(" at ")[0].strip()
        return str(name) if name else primitive
    if primitive == "ffi_call":
        return str(params.get("target_name") or primitive)
    return primitive


KERNEL_FLOPS: dict[str, float | Callable[[list[Shape], list[Shape]], float] | None] = {}
"""Flops of registered kernels by name (``autoshard.register_rule`` fills it)."""

MATMUL_KERNELS: set[str] = set()
"""Names of registered kernels whose flops are matrix products (``register_rule(..., matmul=True)``): they
run at the matmul units' rate and count as model flops, as a ``dot_general`` does."""


def on_matmul_units(op: Any) -> bool:
    """Whether a graph op's flops are matrix products: a ``dot_general``, a custom call whose kernel was
    registered with ``matmul=True`` (its name read from the op's equation), or a ``custom_partitioning`` call
    (``autoshard.splittable``) most of whose flops are such."""
    if op.primitive == "dot_general":
        return True
    if op.primitive == "custom_partitioning":
        products = sum(o.flops for b in op.bodies for o in b.ops if on_matmul_units(o))
        return products >= 0.5 * op.flops > 0
    if not MATMUL_KERNELS or op.primitive not in ("pallas_call", "ffi_call", *MATMUL_KERNELS):
        return False
    eqn = getattr(op, "eqn", None)
    return custom_call_name(op.primitive, eqn.params if eqn is not None else {}) in MATMUL_KERNELS


def kernel_flop_rule(primitive: str) -> FlopRule:
    """The flop rule of a custom call: the flops registered for its kernel's name (else for the primitive),
    else a Pallas kernel's ``cost_estimate``, else 0."""

    def rule(ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float:
        name = custom_call_name(primitive, params)
        flops = KERNEL_FLOPS.get(name, KERNEL_FLOPS.get(primitive))
        if callable(flops):
            return float(flops([tuple(s) for s in ins], [tuple(s) for s in outs]))
        if flops is not None:
            return float(flops)
        estimate = params.get("cost_estimate")
        return float(getattr(estimate, "flops", 0) or 0)

    return rule


FLOP_RULES: dict[str, FlopRule] = {
    "pallas_call": kernel_flop_rule("pallas_call"),
    "ffi_call": kernel_flop_rule("ffi_call"),
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "sort": _sort,
    "scatter": _zero,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter_mul": _scatter,
    "scatter_min": _scatter,
    "scatter_max": _scatter,
    "reduce_window_sum": _per_output,
    "reduce_window_max": _per_output,
    "reduce_window": _per_output,
    "select_and_scatter_add": _per_input,
    "top_k": _sort,
    "fft": _fft,
    **dict.fromkeys(CALLBACKS, _zero),
    **dict.fromkeys(COMMUNICATION, _zero),
    **dict.fromkeys(ELEMENTWISE, _per_output),
    **dict.fromkeys(REDUCTIONS, _per_input),
    **dict.fromkeys(DATA_MOVEMENT, _zero),
}


def op_flops(primitive: str, ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any]) -> float | None:
    """Flops of one equation, or None when the primitive has no rule."""
    rule = FLOP_RULES.get(primitive)
    return None if rule is None else rule(ins, outs, params)
