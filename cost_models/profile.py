"""Measured profiles: the JSON file format, loading (presets and files alike), and the fits over samples.

A profile is a ``Cluster`` description plus optional measurements. A preset is a profile with no
measurements; a file written by ``autoshard profile`` carries the measured samples and a cluster whose
numbers were fitted from them. ``load_profile`` is the one loading path for both.

File format (JSON, ``"format": "autoshard-profile"``, ``"version": 1``)::

    {
      "format": "autoshard-profile", "version": 1,
      "name": "cpu-8dev-2025-01-01", "created": "<ISO 8601>", "notes": "...",
      "environment": {"jax": "0.10.2", "platform": "cpu", ...},      # free-form strings
      "overhead": 4.1e-05,          # s: dispatch cost of an empty program, already subtracted below
      "host": {"call": 1e-4, "arg": 5e-7, "put": 2e-4},   # s to issue (optional): a call, each further
                                    # argument, a device_put onto other devices (the MPMD pipeline's host loop)
      "cluster": {<Cluster.to_dict()>: name, device{...}, num_hosts, devices_per_host,
                  intra_link{name, bandwidth, latency}, inter_link{...}, source},
      "mesh": {<LogicalMesh.to_dict()>} | null,     # the mesh the collectives were measured on
      "matmuls":     [{"m": 1024, "n": 1024, "k": 1024, "dtype": "float32", "seconds": 0.01}, ...],
      "copies":      [{"nbytes": 4194304, "seconds": 0.0004}, ...],
      "collectives": [{"kind": "all_reduce", "axes": ["x"], "axis_sizes": [2], "links": ["cpu-shm"],
                       "nbytes": 65536, "seconds": 2.1e-05}, ...]
    }

Semantics of the samples (all times are medians over repeats, every device of the mesh running at once):

* ``matmuls``: one ``[m,k] @ [k,n]`` per device, ``2·m·n·k`` FLOPs.
* ``copies``: copying a buffer of ``nbytes`` per device (``2·nbytes`` of memory traffic).
* ``collectives``: ``nbytes`` follows ``cost_models.collectives`` (larger per-device buffer).

How a model uses them (``CostModel``):

* A matmul of a measured dtype runs at the achieved rate interpolated in log-shape space (``RateTable``:
  inverse-squared-distance weights on the 4 nearest samples in ``(log m, log n, log k)``, exact at a
  sample), floored by the memory roofline. Far from the samples this is the roofline with the rate of the
  nearest measured shapes.
* A collective is matched to samples with the same kind, group size and set of link names and interpolated
  linearly in ``nbytes`` (``Curve``); beyond the samples it continues with the slope of the alpha-beta line
  ``t = a + b·n`` least-squares fitted to them, i.e. the analytic formula with measured constants; below
  them it stays at the smallest measured time (latency-bound).
* Dtypes and collectives with no samples use the analytic formulas with the profile's (fitted) cluster.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cost_models.collectives import KINDS, ring_bytes_sent
from cost_models.errors import CostModelError
from cost_models.hardware import Cluster
from cost_models.mesh import Link, LogicalMesh

PROFILE_FORMAT = "autoshard-profile"
PROFILE_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True, kw_only=True, slots=True)
class MatmulSample:
    m: int
    n: int
    k: int
    dtype: str
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True, kw_only=True, slots=True)
class CopySample:
    nbytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveSample:
    kind: str
    axes: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    links: tuple[str, ...]
    nbytes: int
    seconds: float

    @property
    def group_size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def key(self) -> tuple[str, int, frozenset[str]]:
        return collective_key(self.kind, self.group_size, self.links)


def collective_key(kind: str, group_size: int, links: Sequence[str]) -> tuple[str, int, frozenset[str]]:
    """How samples are matched to queries: (kind, devices in the group, set of link names)."""
    return (kind, int(group_size), frozenset(links))


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """A cluster description plus measured samples; see the module docstring for the file format."""

    name: str
    cluster: Cluster
    mesh: LogicalMesh | None = None
    matmuls: tuple[MatmulSample, ...] = ()
    copies: tuple[CopySample, ...] = ()
    collectives: tuple[CollectiveSample, ...] = ()
    overhead: float = 0.0
    # host seconds to issue, not waiting for results: "call" a program call, "arg" each further argument of
    # it, "put" a device_put of a small array onto other devices; what the single-process pipeline runtime
    # pays per microbatch (empty: not measured)
    host: Mapping[str, float] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)
    created: str = ""
    notes: str = ""

    @property
    def is_measured(self) -> bool:
        return bool(self.matmuls or self.copies or self.collectives)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "created": self.created,
            "notes": self.notes,
            "environment": dict(self.environment),
            "overhead": self.overhead,
            **({"host": dict(self.host)} if self.host else {}),
            "cluster": self.cluster.to_dict(),
            "mesh": None if self.mesh is None else self.mesh.to_dict(),
            "matmuls": [
                {"m": s.m, "n": s.n, "k": s.k, "dtype": s.dtype, "seconds": s.seconds} for s in self.matmuls
            ],
            "copies": [{"nbytes": s.nbytes, "seconds": s.seconds} for s in self.copies],
            "collectives": [
                {
                    "kind": s.kind,
                    "axes": list(s.axes),
                    "axis_sizes": list(s.axis_sizes),
                    "links": list(s.links),
                    "nbytes": s.nbytes,
                    "seconds": s.seconds,
                }
                for s in self.collectives
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, origin: str = "profile") -> Profile:
        if d.get("format") != PROFILE_FORMAT:
            raise CostModelError(
                f"{origin} is not an autoshard profile (format={d.get('format')!r}, expected "
                f"{PROFILE_FORMAT!r}); write one with `autoshard profile -o FILE`"
            )
        if d.get("version") != PROFILE_VERSION:
            raise CostModelError(
                f"{origin} has profile version {d.get('version')!r}; this autoshard reads version "
                f"{PROFILE_VERSION}. Re-run `autoshard profile` to regenerate it"
            )
        try:
            return cls(
                name=str(d["name"]),
                created=str(d.get("created", "")),
                notes=str(d.get("notes", "")),
                environment={str(k): str(v) for k, v in d.get("environment", {}).items()},
                overhead=float(d.get("overhead", 0.0)),
                host={str(k): float(v) for k, v in d.get("host", {}).items()},
                cluster=Cluster.from_dict(d["cluster"]),
                mesh=None if d.get("mesh") is None else LogicalMesh.from_dict(d["mesh"]),
                matmuls=tuple(
                    MatmulSample(
                        m=int(s["m"]),
                        n=int(s["n"]),
                        k=int(s["k"]),
                        dtype=str(s["dtype"]),
                        seconds=float(s["seconds"]),
                    )
                    for s in d.get("matmuls", ())
                ),
                copies=tuple(
                    CopySample(nbytes=int(s["nbytes"]), seconds=float(s["seconds"]))
                    for s in d.get("copies", ())
                ),
                collectives=tuple(
                    CollectiveSample(
                        kind=str(s["kind"]),
                        axes=tuple(s["axes"]),
                        axis_sizes=tuple(int(x) for x in s["axis_sizes"]),
                        links=tuple(s["links"]),
                        nbytes=int(s["nbytes"]),
                        seconds=float(s["seconds"]),
                    )
                    for s in d.get("collectives", ())
                ),
            )
        except (KeyError, TypeError) as e:
            raise CostModelError(f"{origin} is malformed: missing or bad field {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def profile_from_cluster(cluster: Cluster) -> Profile:
    """A profile with no measurements: the analytic model of ``cluster``."""
    return Profile(name=cluster.name, cluster=cluster, notes="analytic preset (no measurements)")


def shipped_profiles() -> tuple[str, ...]:
    """File names of the measured profiles shipped in ``cost_models/profiles/``."""
    return tuple(sorted(p.name for p in PROFILES_DIR.glob("*.json")))


def load_profile(source: str | Path | Profile | Cluster, **preset_overrides: Any) -> Profile:
    """The one loading path: a ``Profile``, a ``Cluster``, a preset name (``"h100"``; keyword arguments go
    to ``presets.get``), a shipped profile's file name (``"cpu-8dev-....json"``), or a path to a JSON file."""
    from cost_models import presets  # presets import this module's siblings only

    if isinstance(source, Profile):
        return source
    if isinstance(source, Cluster):
        return profile_from_cluster(source)
    text = str(source)
    if text in presets.names():
        return profile_from_cluster(presets.get(text, **preset_overrides))
    path = Path(text)
    if not path.exists() and (PROFILES_DIR / text).exists():
        path = PROFILES_DIR / text
    if not path.exists():
        raise CostModelError(
            f"no preset or profile file named {text!r}; presets: {', '.join(presets.names())}; "
            f"shipped profiles: {', '.join(shipped_profiles()) or 'none'}; or give a path to a JSON profile"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CostModelError(f"profile {path} is not valid JSON: {e}") from None
    return Profile.from_dict(data, origin=f"profile {path}")


# ------------------------------------------------------------------------------------------------ fits
def fit_affine(x: Sequence[float], t: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t ≈ a + b·x`` with ``a, b >= 0`` (clamped: a negative intercept is refitted through
    the origin). Returns ``(a, b)``."""
    x_arr, t_arr = np.asarray(x, float), np.asarray(t, float)
    if len(x_arr) == 0:
        raise CostModelError("cannot fit a line to no samples")
    if len(x_arr) == 1 or np.ptp(x_arr) == 0:
        return 0.0, float(np.mean(t_arr) / max(np.mean(x_arr), 1e-300))
    b, a = np.polyfit(x_arr, t_arr, 1)
    if a < 0 or b < 0:
        a = max(a, 0.0)
        b = float(np.dot(x_arr, t_arr - a) / np.dot(x_arr, x_arr))
    return float(max(a, 0.0)), float(max(b, 1e-300))


def fit_link(samples: Sequence[CollectiveSample], name: str) -> Link:
    """Alpha-beta link that best explains ring-algorithm samples: ``t = steps·α + bytes_sent / B`` with
    ``steps`` and ``bytes_sent`` from ``cost_models.collectives`` (least squares on relative error over all
    samples, so that small, latency-bound messages count as much as large ones)."""
    from cost_models.collectives import _steps

    rows, ts = [], []
    for s in samples:
        p = s.group_size
        if p > 1 and s.kind in KINDS:
            rows.append((_steps(s.kind, p), ring_bytes_sent(s.kind, s.nbytes, p)))
            ts.append(s.seconds)
    if not rows:
        raise CostModelError(f"no collective samples to fit link {name!r}")
    a, t = np.asarray(rows, float), np.asarray(ts, float)
    w = 1.0 / np.maximum(t, 1e-12)  # relative errors: sizes span orders of magnitude
    sol, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    alpha, inv_bw = float(sol[0]), float(sol[1])
    if alpha < 0 or inv_bw <= 0:  # refit the bandwidth alone
        alpha = max(alpha, 0.0)
        aw, rw = a[:, 1] * w, (t - alpha * a[:, 0]) * w
        inv_bw = float(np.dot(aw, rw) / np.dot(aw, aw))
    return Link(name=name, bandwidth=1.0 / max(inv_bw, 1e-300), latency=alpha)


@dataclass(frozen=True, slots=True, eq=False)
class Curve:
    """Measured ``(x, y)`` with ``y`` made non-decreasing in ``x`` by a running minimum from the largest
    ``x`` down (so more work is never cheaper; a slow outlier, the usual noise on a shared machine, is
    dropped rather than propagated to larger sizes). Inside the measured range: linear interpolation. Above it: the last sample continued with the
    slope ``b`` of the least-squares line ``a + b·x``. Below it: the first sample (small messages are
    latency-bound; a fitted intercept is too noisy to go below the smallest measurement)."""

    x: np.ndarray
    y: np.ndarray
    a: float
    b: float

    @classmethod
    def of(cls, x: Sequence[float], y: Sequence[float]) -> Curve:
        xs, ys = np.asarray(x, float), np.asarray(y, float)
        ux = np.unique(xs)
        uy = np.minimum.accumulate(np.array([np.median(ys[xs == v]) for v in ux])[::-1])[::-1]
        a, b = fit_affine(ux, uy)
        return cls(ux, uy, a, b)

    def inside(self, x: float) -> bool:
        return bool(self.x[0] <= x <= self.x[-1])

    def __call__(self, x: float) -> float:
        if x > self.x[-1]:
            return float(self.y[-1] + self.b * (x - self.x[-1]))
        if x < self.x[0]:
            return float(self.y[0])
        return float(np.interp(x, self.x, self.y))


@dataclass(frozen=True, slots=True, eq=False)
class RateTable:
    """Measured matmul rates of one dtype, interpolated in ``(log2 m, log2 n, log2 k)`` space: exact at a
    sample, else the weighted geometric mean of the 4 nearest samples' rates (weights ``1/distance²``)."""

    logdims: np.ndarray  # (N, 3)
    lograte: np.ndarray  # (N,)

    @classmethod
    def of(cls, samples: Sequence[MatmulSample]) -> RateTable:
        dims = np.log2(np.array([[s.m, s.n, s.k] for s in samples], float))
        rate = np.log(np.array([s.flops / s.seconds for s in samples], float))
        return cls(dims, rate)

    def rate(self, m: float, n: float, k: float) -> float:
        """Achieved FLOP/s for one ``[m,k] @ [k,n]``."""
        q = np.log2(np.maximum(np.array([m, n, k], float), 1.0))
        d2 = ((self.logdims - q) ** 2).sum(axis=1)
        near = np.argsort(d2, kind="stable")[:4]
        if d2[near[0]] < 1e-12:
            exact = d2 < 1e-12
            return float(np.exp(np.median(self.lograte[exact])))
        w = 1.0 / d2[near]
        return float(np.exp(np.dot(w, self.lograte[near]) / w.sum()))
