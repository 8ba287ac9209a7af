"""``autoshard profile``: measure the devices JAX runs on and write a ``cost_models`` profile.

What is measured (every device of the mesh runs the same program at once, as in an SPMD step):

* matmuls ``[m,k] @ [k,n]`` per dtype, one per device: for a few sizes ``s`` the cube and three shapes
  with one side ``s/8`` (``matmul_shapes``);
* device memory copies (``x * 2`` on a per-device buffer: ``2·nbytes`` of traffic);
* each collective (``psum`` = all_reduce, ``all_gather``, ``psum_scatter`` = reduce_scatter,
  ``all_to_all``, ``ppermute`` = send_recv, a ring shift) over each mesh axis and over all axes together, at
  several sizes, with ``nbytes`` following ``cost_models.collectives`` (larger per-device buffer).

Each program is jitted, run ``warmup`` times, then timed ``repeats`` times; the median (or, with
``estimator="min"``, the least) time is kept. Timed runs of one category are interleaved (round-robin), so
that background load spreads over all sizes alike. The same statistic of an empty program on the mesh (the
dispatch overhead, which a fused step does not pay per op) is subtracted from every sample (keeping at least
a tenth of it) and stored as ``overhead``.

The profile's ``cluster`` is the preset matching the platform (``cpu``, or the GPU/TPU preset whose name
matches ``device_kind``) with its numbers replaced by fits: peak matmul rate per measured dtype = rate of
its largest measured matmul (efficiency 1), memory bandwidth = copy fit, links = alpha-beta fits of the
collectives over axes on that link (``cost_models.profile.fit_link``).

CPU devices: ``ensure_cpu_devices(n)`` asks JAX for ``n`` CPU devices (``jax_num_cpu_devices``); it must
run before JAX initialises its backends, which ``autoshard profile`` guarantees by calling it first.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cost_models import presets
from cost_models.collectives import KINDS
from cost_models.hardware import Cluster
from cost_models.mesh import LogicalMesh
from cost_models.profile import CollectiveSample, CopySample, MatmulSample, Profile, fit_affine, fit_link


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    """What to measure. ``collective_sizes`` and ``copy_sizes`` are bytes per device."""

    mesh_shape: tuple[int, ...] = (2, 4)
    axis_names: tuple[str, ...] | None = None
    matmul_sizes: tuple[int, ...] = (128, 256, 512, 1024)
    matmul_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    copy_sizes: tuple[int, ...] = (2**16, 2**20, 2**22, 2**24)
    collective_sizes: tuple[int, ...] = (2**12, 2**15, 2**18, 2**20, 2**22, 2**24)
    collectives: tuple[str, ...] = KINDS
    warmup: int = 2
    repeats: int = 9
    estimator: str = "median"  # or "min": the least time, robust to other processes' load on a shared machine
    name: str | None = None

    @classmethod
    def quick(cls, **overrides: Any) -> ProfileConfig:
        """Fewer sizes and repeats: about a minute on 8 CPU devices of a 2-core machine."""
        base = cls(
            matmul_sizes=(128, 256, 512),
            copy_sizes=(2**16, 2**20, 2**23),
            collective_sizes=(2**12, 2**16, 2**20, 2**23),
            warmup=1,
            repeats=5,
        )
        return replace(base, **overrides)


def ensure_cpu_devices(n: int) -> None:
    """Ask for ``n`` CPU devices unless ``XLA_FLAGS`` already sets a count. Must precede any JAX operation
    (JAX reads it when it initialises its backends; importing jax is fine)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    with contextlib.suppress(RuntimeError):  # backends already up: keep whatever devices exist
        jax.config.update("jax_num_cpu_devices", n)


def _median_times(
    thunks: Sequence[Callable[[], Any]], warmup: int, repeats: int, estimator: str = "median"
) -> list[float]:
    """Median (or least, ``estimator="min"``) seconds of each thunk. Runs are interleaved (each round runs every thunk once) so that load
    from other processes on the machine falls on all measurements alike."""
    import jax

    for f in thunks:
        for _ in range(max(warmup, 1)):
            jax.block_until_ready(f())
    times: list[list[float]] = [[] for _ in thunks]
    for _ in range(max(repeats, 1)):
        for i, f in enumerate(thunks):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[i].append(time.perf_counter() - t0)
    reduce = min if estimator == "min" else statistics.median
    return [reduce(t) for t in times]


HOST_ARGS = 256  # arguments of the call that ``_host_costs`` compares with a one-argument call
HOST_ISSUES = 64  # calls issued back to back per timed round (``_issue_times``)


def _issue_times(thunks: Sequence[Callable[[], Any]], rounds: int, estimator: str) -> list[float]:
    """Host seconds to issue each thunk, not waiting for its result: ``HOST_ISSUES`` calls back to back,
    then one wait, divided by the count (as the pipeline runtime issues them, asynchronously); the median
    (or least) over ``rounds`` interleaved rounds."""
    import jax

    times: list[list[float]] = [[] for _ in thunks]
    for r in range(rounds + 1):  # the first round warms up
        for i, f in enumerate(thunks):
            t0 = time.perf_counter()
            out = [f() for _ in range(HOST_ISSUES)]
            jax.block_until_ready(out)
            if r:
                times[i].append((time.perf_counter() - t0) / HOST_ISSUES)
    reduce = min if estimator == "min" else statistics.median
    return [reduce(t) for t in times]


def _host_costs(devices: Sequence[Any], rounds: int, estimator: str) -> dict[str, float]:
    """Host seconds of what the single-process pipeline runtime does per microbatch (``pipeline.host``):
    ``call``, a jitted call of one small argument on half the devices; ``arg``, each further argument (a
    call with ``HOST_ARGS`` arguments against it, divided by ``HOST_ARGS - 1``); ``put``, a
    ``jax.device_put`` of a small array onto the other half of the devices (one device: onto itself)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    half = max(len(devices) // 2, 1)
    src = NamedSharding(Mesh(np.asarray(devices[:half]), ("d",)), P("d"))
    dst = NamedSharding(Mesh(np.asarray(devices[-half:]), ("d",)), P("d"))
    xs = [jax.device_put(jnp.full((half,), float(i), jnp.float32), src) for i in range(HOST_ARGS)]
    one = jax.jit(lambda x: x + 1)
    many = jax.jit(lambda *a: a[0] + 1)
    call, call_many, put = _issue_times(
        [lambda: one(xs[0]), lambda: many(*xs), lambda: jax.device_put(xs[0], dst)], rounds, estimator)
    return {"call": call, "arg": max(call_many - call, 0.0) / (HOST_ARGS - 1), "put": put}


def matmul_shapes(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(m, n, k)`` measured for each size ``s``: the cube and three skinny shapes with one side ``s/8``
    (sharded matmuls are rarely square; CPU and GPU kernels are slower on thin operands)."""
    out = []
    for s in sizes:
        t = max(s // 8, 1)
        out += [(s, s, s), (t, s, s), (s, t, s), (s, s, t)]
    return out


def _base_cluster(device: Any, num_hosts: int, devices_per_host: int) -> Cluster:
    """The preset whose name matches this platform/device kind, sized to the devices in use."""
    kind = str(getattr(device, "device_kind", "")).lower()
    plat = device.platform
    if plat == "gpu":
        for key in ("h200", "h100", "a100", "v100"):
            if key in kind:
                return presets.get(key, num_hosts=num_hosts, devices_per_host=devices_per_host)
    if plat == "tpu":
        for key, name in (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("v4", "tpu-v4")):
            if key in kind:
                return presets.get(name, num_hosts=num_hosts, devices_per_host=devices_per_host)
    base = presets.get("cpu", num_devices=devices_per_host, num_hosts=num_hosts)
    if plat != "cpu":  # unknown accelerator: keep the structure, the fits replace the numbers
        base = replace(base, name=kind or plat)
    return base


def run_profile(config: ProfileConfig, *, log: Callable[[str], None] | None = None) -> Profile:
    """Measure the devices JAX sees on ``config.mesh_shape`` and return the profile."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    say = log or (lambda s: None)
    t_start = time.perf_counter()
    ndev = math.prod(config.mesh_shape)
    devices = jax.devices()
    if len(devices) < ndev:
        from autoshard.errors import AutoshardError

        raise AutoshardError(
            f"mesh {config.mesh_shape} needs {ndev} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); use a smaller --mesh, or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={ndev}"
        )
    local = jax.local_device_count()
    cluster0 = _base_cluster(devices[0], jax.process_count(), local)
    lmesh = cluster0.logical_mesh(config.mesh_shape, config.axis_names)
    names = lmesh.axis_names
    mesh = Mesh(np.asarray(devices[:ndev]).reshape(config.mesh_shape), names)
    all_axes = P(names)

    def sharded(per_device_shape: tuple[int, ...], dtype: Any) -> Any:
        shape = (per_device_shape[0] * ndev, *per_device_shape[1:])
        return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=NamedSharding(mesh, all_axes))()

    def spmd(body: Callable[..., Any], nargs: int = 1) -> Callable[..., Any]:
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(all_axes,) * nargs, out_specs=all_axes, check_vma=False)
        )

    w, r = config.warmup, config.repeats
    tiny = sharded((1,), jnp.float32)
    empty = spmd(lambda x: x + 1)
    (overhead,) = _median_times([lambda: empty(tiny)], w + 2, max(r, 9), config.estimator)
    say(f"dispatch overhead {overhead * 1e6:.1f} us on {ndev} {devices[0].platform} devices")

    host = _host_costs(devices[:ndev], max(r, 9), config.estimator)
    say(f"host: a call {host['call'] * 1e6:.1f} us + {host['arg'] * 1e6:.2f} us an argument, a device_put "
        f"{host['put'] * 1e6:.1f} us onto other devices")

    def net(t: float) -> float:  # keep a tenth of the raw time: a program as cheap as a dispatch is not free
        return max(t - overhead, 0.1 * t)

    def call(f: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return lambda: f(*args)

    matmuls = []
    mm = spmd(lambda a, b: a @ b, 2)
    for dtype in config.matmul_dtypes:
        shapes = matmul_shapes(config.matmul_sizes)
        thunks = [call(mm, sharded((m, k), dtype), sharded((k, n), dtype)) for m, n, k in shapes]
        for (m, n, k), t in zip(shapes, _median_times(thunks, w, r, config.estimator), strict=True):
            matmuls.append(MatmulSample(m=m, n=n, k=k, dtype=str(jnp.dtype(dtype)), seconds=net(t)))
        say(
            f"matmul {dtype}: "
            + ", ".join(f"{s.m}x{s.n}x{s.k} {s.flops / s.seconds / 1e9:.1f}" for s in matmuls[-len(shapes) :])
            + " GFLOP/s per device"
        )

    dbl = spmd(lambda x: x * 2)
    thunks = [call(dbl, sharded((nbytes // 4,), jnp.float32)) for nbytes in config.copy_sizes]
    copies = [
        CopySample(nbytes=nbytes, seconds=net(t))
        for nbytes, t in zip(config.copy_sizes, _median_times(thunks, w, r, config.estimator), strict=True)
    ]
    say("copy: " + ", ".join(f"{c.nbytes} B {2 * c.nbytes / c.seconds / 1e9:.2f} GB/s" for c in copies))

    groups: list[tuple[str, ...]] = [(a,) for a in names if lmesh.axis_size(a) > 1]
    if len(groups) > 1:
        groups.append(tuple(a for a in names if lmesh.axis_size(a) > 1))
    collectives = []
    for axes in groups:
        p = lmesh.size(axes)
        ax = axes if len(axes) > 1 else axes[0]
        perm = [(i, (i + 1) % p) for i in range(p)]
        bodies: dict[str, tuple[Callable[..., Any], bool]] = {
            "all_reduce": (lambda x, ax=ax: jax.lax.psum(x, ax), False),
            "all_gather": (lambda x, ax=ax: jax.lax.all_gather(x, ax, tiled=True), True),
            "reduce_scatter": (lambda x, ax=ax: jax.lax.psum_scatter(x, ax, tiled=True), False),
            "all_to_all": (lambda x, ax=ax: jax.lax.all_to_all(x, ax, 0, 0, tiled=True), False),
            "send_recv": (lambda x, ax=ax, perm=perm: jax.lax.ppermute(x, ax, perm), False),
        }
        for kind in config.collectives:
            body, input_is_shard = bodies[kind]
            f = spmd(body)
            elems = [max(p, nbytes // 4 // p * p) for nbytes in config.collective_sizes]
            thunks = [call(f, sharded((e // p if input_is_shard else e,), jnp.float32)) for e in elems]
            for e, t in zip(elems, _median_times(thunks, w, r, config.estimator), strict=True):
                collectives.append(
                    CollectiveSample(
                        kind=kind,
                        axes=axes,
                        axis_sizes=tuple(lmesh.axis_size(a) for a in axes),
                        links=tuple(lmesh.link(a).name for a in axes),
                        nbytes=e * 4,
                        seconds=net(t),
                    )
                )
            done = collectives[-len(elems) :]
            say(f"{kind} over {axes}: " + ", ".join(f"{c.nbytes} B {c.seconds * 1e6:.0f} us" for c in done))

    cluster = _fitted_cluster(cluster0, lmesh, matmuls, copies, collectives)
    fitted_mesh = cluster.logical_mesh(lmesh.shape, lmesh.axis_names)
    today = _dt.datetime.now(_dt.UTC)
    elapsed = time.perf_counter() - t_start
    return Profile(
        name=config.name or f"{devices[0].platform}-{ndev}dev-{today:%Y-%m-%d}",
        cluster=cluster,
        mesh=fitted_mesh,
        matmuls=tuple(matmuls),
        copies=tuple(copies),
        collectives=tuple(collectives),
        overhead=overhead,
        host=host,
        created=today.isoformat(timespec="seconds"),
        environment={
            "jax": jax.__version__,
            "platform": devices[0].platform,
            "device_kind": str(devices[0].device_kind),
            "num_devices": str(len(devices)),
            "process_count": str(jax.process_count()),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": str(os.cpu_count()),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "config": repr(config),
            "seconds": f"{elapsed:.1f}",
        },
        notes=f"measured by `autoshard profile`; times are {config.estimator}s over {r} interleaved runs "
        "with the dispatch overhead subtracted",
    )


def _fitted_cluster(
    base: Cluster,
    mesh: LogicalMesh,
    matmuls: Sequence[MatmulSample],
    copies: Sequence[CopySample],
    collectives: Sequence[CollectiveSample],
) -> Cluster:
    """``base`` with the measured rates, bandwidth and links in place of its datasheet numbers."""
    from cost_models.dtypes import rate_class

    dev = base.device
    fields: dict[str, Any] = {
        "matmul_efficiency": 1.0,
        "source": f"fitted by autoshard profile from {dev.name}",
    }
    for dtype in {s.dtype for s in matmuls}:
        largest = max((s for s in matmuls if s.dtype == dtype), key=lambda s: s.flops)
        best = largest.flops / largest.seconds  # the rate of the largest matmul: robust to one fast outlier
        cls = rate_class(dtype)
        if cls == "fp32":
            cls = dev.fp32_matmul_as
        fields[{"fp8": "flops_fp8", "int8": "flops_int8", "fp16": "flops_fp16"}.get(cls, f"flops_{cls}")] = (
            best
        )
    if copies:
        _, b = fit_affine([2 * s.nbytes for s in copies], [s.seconds for s in copies])
        fields |= {"memory_bandwidth": 1.0 / b, "memory_efficiency": 1.0}
    dev = replace(dev, **fields)
    links = {}
    for which in ("intra_link", "inter_link"):
        name = getattr(base, which).name
        samples = [s for s in collectives if set(s.links) == {name}]
        links[which] = fit_link(samples, name) if samples else getattr(base, which)
    return replace(base, device=dev, source=f"fitted from measurements on mesh {mesh}", **links)
