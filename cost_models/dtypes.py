"""Dtypes as strings (cost_models knows no JAX): element sizes and the matmul-rate class of each dtype.

Names follow numpy/JAX spelling (``str(jnp.dtype(x))``): ``"float32"``, ``"bfloat16"``, ``"float16"``,
``"float8_e4m3fn"``, ``"int8"``, ``"int32"``, ... An integer given where a dtype is expected means "this many
bytes per element" and prices like a float32 of that size.
"""

from __future__ import annotations

from cost_models.errors import CostModelError

_BYTES: dict[str, float] = {
    "bool": 1,
    "int4": 0.5,
    "uint4": 0.5,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3b11fnuz": 1,
    "float8_e3m4": 1,
    "float8_e4m3": 1,
    "float8_e8m0fnu": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    # typed PRNG keys (jax.random.key): the key data of each implementation, in uint32 words
    "key<fry>": 8,  # threefry2x32: 2 words
    "key<rbg>": 16,  # 4 words
    "key<unsafe_rbg>": 16,
}

DtypeLike = str | int


def dtype_bytes(dtype: DtypeLike) -> float:
    """Bytes per element of ``dtype`` (0.5 for 4-bit types). An int is returned as is (bytes per element)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype <= 0:
            raise CostModelError(f"bytes per element must be positive, got {dtype}")
        return float(dtype)
    name = str(dtype)
    try:
        return _BYTES[name]
    except KeyError:
        raise CostModelError(
            f"unknown dtype {name!r}; known dtypes: {', '.join(sorted(_BYTES))} "
            "(or pass the element size in bytes as an int)"
        ) from None


def rate_class(dtype: DtypeLike) -> str:
    """The class of peak matmul rate a dtype runs at: ``fp64``, ``fp32``, ``fp16``, ``bf16``, ``fp8``,
    ``int8`` or ``int`` (wider integers, vector rate). An int (bytes per element) maps to ``fp32``."""
    if isinstance(dtype, int):
        return "fp32"
    name = str(dtype)
    dtype_bytes(name)  # validates
    if name.startswith("float8"):
        return "fp8"
    if name in ("int8", "uint8", "int4", "uint4"):
        return "int8"
    return {
        "float64": "fp64",
        "complex128": "fp64",
        "float32": "fp32",
        "complex64": "fp32",
        "bfloat16": "bf16",
        "float16": "fp16",
    }.get(name, "int")


def known_dtypes() -> tuple[str, ...]:
    """Every dtype name this module knows."""
    return tuple(sorted(_BYTES))
