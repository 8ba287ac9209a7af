"""The JSON plumbing both problem formats share: +inf as ``"inf"``, version headers, optional gzip."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np


def encode(a: np.ndarray) -> Any:
    """A numeric array as nested lists, +inf written ``"inf"`` (JSON has no infinity)."""
    if a.ndim > 1:
        return [encode(x) for x in a]
    return ["inf" if x == np.inf else float(x) for x in a.tolist()]


def decode(x: Any) -> np.ndarray:
    """Nested lists from ``encode`` back to a float64 array; any string but ``"inf"`` is an error."""

    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(e) for e in v]
        if v == "inf":
            return np.inf
        if isinstance(v, str):
            raise ValueError(f"unexpected string {v!r} in a numeric field (only 'inf' is allowed)")
        return float(v)

    return np.array(walk(x), dtype=np.float64)


def check_header(data: dict[str, Any], fmt: str, version: int, what: str) -> None:
    """Reject other formats and newer versions, naming what was expected."""
    if data.get("format") != fmt:
        raise ValueError(f"not {what}: format is {data.get('format')!r}, expected {fmt!r}")
    if not isinstance(data.get("version"), int) or data["version"] > version:
        raise ValueError(f"unsupported version {data.get('version')!r}; this reader knows <= {version}")


def write(data: dict[str, Any], path: str | Path) -> None:
    """``data`` as compact JSON at ``path`` (gzipped when the name ends in ``.gz``)."""
    text = json.dumps(data, separators=(",", ":"))
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def read(path: str | Path) -> Any:
    """What ``write`` wrote."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))
