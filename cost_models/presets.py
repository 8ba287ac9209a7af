"""Hardware presets, each a function returning a ``Cluster`` whose docstring cites the numbers it uses.

``get(name, **overrides)`` builds one (``num_hosts=``, ``devices_per_host=``, and for ``cpu``
``num_devices=`` may be overridden); ``names()`` lists them. A preset is the analytic model; measured
profiles (``autoshard profile``) refine it and load through the same ``CostModel.load`` path.

Conventions for every preset (see ``cost_models.mesh`` and ``cost_models.hardware``):

* FLOP/s are **dense** peak rates (datasheets quote 2x "with sparsity" for tensor cores; halved here).
* Link bandwidth is bytes/s **per device per direction** with every device communicating. NVLink's
  "900 GB/s" is the bidirectional total per GPU, so 450e9 per direction. A host NIC shared by all devices of
  a host is divided by the devices per host.
* Latencies and efficiencies are **assumptions** (no datasheet gives them): NVLink 3 us, InfiniBand 8 us,
  TCP Ethernet 30 us, TPU ICI 1.5 us, DCN 20 us; matmul efficiency 0.7-0.8 of peak, HBM efficiency 0.8-0.9.
  Measure with ``autoshard profile`` to replace them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from cost_models.errors import CostModelError
from cost_models.hardware import Cluster, Device
from cost_models.mesh import Link

GB = 1e9
GiB = 2**30
T = 1e12


def _nvlink(per_direction: float) -> Link:
    return Link(name="nvlink", bandwidth=per_direction, latency=3e-6)


def h100(*, num_hosts: int = 8, devices_per_host: int = 8) -> Cluster:
    """NVIDIA H100 SXM5 80GB in DGX H100 nodes.

    Source: NVIDIA H100 Tensor Core GPU datasheet (SXM column): FP32 67 TFLOPS, TF32 989 / BF16 1,979 /
    FP8 3,958 / INT8 3,958 "with sparsity" (dense: 494.7, 989.4, 1,978.9, 1,978.9); 80 GB HBM3 at 3.35 TB/s;
    NVLink 900 GB/s. DGX H100 user guide: 8 x ConnectX-7 400 Gb/s (one per GPU) = 50 GB/s per GPU.
    XLA runs fp32 dots as TF32 by default on Ampere and later.

    ``conv_efficiency`` 0.57: Wide-ResNet-250M (fp32, batch 32) ran 56.6 ms a step on one H100 with steps
    back to back (the GPU's time; 60.2 ms waiting on each step; jax 0.11.2, tests/data/h100_back_to_back.json).
    The rest of the step is priced at 17.5 ms since a fused value's operands are read by every kernel that
    recomputes it (``strategies.registry.fusion_kernels``; 10.7 ms before, when 0.5 was derived the same
    way from the synchronised time), which leaves 39.1 ms for its 7.7 TFLOP of convolutions: 0.57x of the
    matmul rate (cuDNN's NHWC kernels, which XLA picks for every float conv on Hopper; not layout copies).
    One model measured: recheck with more.
    """
    dev = Device(
        name="h100-sxm",
        flops_fp32=67 * T,
        flops_tf32=494.7 * T,
        flops_bf16=989.4 * T,
        flops_fp8=1978.9 * T,
        flops_int8=1978.9 * T,
        fp32_matmul_as="tf32",
        matmul_efficiency=0.7,
        conv_efficiency=0.57,
        memory_bandwidth=3.35e12,
        memory_efficiency=0.85,
        memory_capacity=80 * GB,
        source="NVIDIA H100 datasheet (SXM)",
    )
    return Cluster(
        name="h100",
        device=dev,
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        intra_link=_nvlink(450 * GB),
        inter_link=Link(name="ib", bandwidth=50 * GB, latency=8e-6),
        source="DGX H100: NVLink 4 / NVSwitch inside a node, 8x400 Gb/s InfiniBand between nodes",
    )


def h200(*, num_hosts: int = 8, devices_per_host: int = 8) -> Cluster:
    """NVIDIA H200 SXM 141GB in DGX H200 nodes.

    Source: NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM (FP32 67, TF32 989,
    BF16 1,979, FP8 3,958 TFLOPS with sparsity; halved for dense); 141 GB HBM3e at 4.8 TB/s; NVLink
    900 GB/s. DGX H200: 8 x ConnectX-7 400 Gb/s = 50 GB/s per GPU.

    ``memory_efficiency`` 0.78 (the H100's 0.85 would be 4.08 TB/s): measured on one H200 (jax 0.11.2,
    2026-11-26, tests/data/h200_fidelity.json), six training steps timed back to back on both cards (GPT-125M
    to 760M, MoE-380M, Wide-ResNet-250M) ran in 0.86-0.93x of their H100 time, where 4.08 TB/s makes the
    GPT and MoE steps 0.79-0.84x: their memory-bound kernels see about 3.2-3.4 TB/s of the 4.3 a plain
    device copy moves. The same 132 SMs must keep 43% more bytes in flight to use the wider memory, which
    short fusion kernels do not. 0.78 is fitted to the nine back-to-back times of that file, the value
    whose worst over- and under-prediction are equal (0.75 before the softmax's and LayerNorm's re-reads of
    their operands were priced, ``strategies.registry.fusion_kernels``, which moved GPT-6.7B to +10.5%): one
    number cannot hold both ends, large streaming kernels (the Adam update of GPT-6.7B, predicted about +8%)
    go faster than this, small ones (MoE-380M, about -8%) slower.
    """
    base = h100(num_hosts=num_hosts, devices_per_host=devices_per_host)
    from dataclasses import replace

    dev = replace(
        base.device,
        name="h200-sxm",
        memory_bandwidth=4.8e12,
        memory_efficiency=0.78,
        memory_capacity=141 * GB,
        source="NVIDIA H200 datasheet (SXM)",
    )
    return replace(
        base,
        name="h200",
        device=dev,
        source="DGX H200: NVLink 4 / NVSwitch inside a node, 8x400 Gb/s InfiniBand between nodes",
    )


def a100(*, num_hosts: int = 8, devices_per_host: int = 8) -> Cluster:
    """NVIDIA A100 SXM4 80GB in DGX A100 nodes.

    Source: NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TFLOPS, TF32 156, BF16/FP16 312,
    INT8 624 TOPS (dense); 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s (300 per direction). No FP8 unit
    (fp8 runs at the fp16 rate). DGX A100: 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    """
    dev = Device(
        name="a100-sxm-80gb",
        flops_fp32=19.5 * T,
        flops_tf32=156 * T,
        flops_bf16=312 * T,
        flops_int8=624 * T,
        fp32_matmul_as="tf32",
        matmul_efficiency=0.8,
        memory_bandwidth=2039 * GB,
        memory_efficiency=0.85,
        memory_capacity=80 * GB,
        source="NVIDIA A100 datasheet (80GB SXM)",
    )
    return Cluster(
        name="a100",
        device=dev,
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        intra_link=_nvlink(300 * GB),
        inter_link=Link(name="ib", bandwidth=25 * GB, latency=8e-6),
        source="DGX A100: NVLink 3 / NVSwitch inside a node, 8x200 Gb/s HDR InfiniBand between nodes",
    )


def v100(*, num_hosts: int = 8, devices_per_host: int = 8) -> Cluster:
    """AWS p3.16xlarge: 8 x NVIDIA V100 SXM2 16GB per node; Alpa's evaluation cluster (8 nodes).

    Source: NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TFLOPS, FP16 tensor 125 TFLOPS (no bf16 or fp8
    units: bf16 runs at the fp32 rate here); 16 GB HBM2 at 900 GB/s; NVLink 300 GB/s (150 per direction;
    p3's hybrid cube-mesh, taken as uniform). AWS p3 page and Alpa (Zheng et al., OSDI 2022, §8):
    25 Gbit/s between nodes, i.e. 3.125 GB/s per node shared by 8 GPUs = 0.39 GB/s per GPU.
    """
    dev = Device(
        name="v100-sxm2-16gb",
        flops_fp32=15.7 * T,
        flops_bf16=15.7 * T,
        flops_fp16=125 * T,
        matmul_efficiency=0.75,
        memory_bandwidth=900 * GB,
        memory_efficiency=0.8,
        memory_capacity=16 * GB,
        source="NVIDIA Tesla V100 datasheet (SXM2 16GB)",
    )
    return Cluster(
        name="v100",
        device=dev,
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        intra_link=_nvlink(150 * GB),
        inter_link=Link(name="ethernet", bandwidth=25e9 / 8 / devices_per_host, latency=30e-6),
        source="AWS p3.16xlarge (Alpa's evaluation cluster): NVLink in a node, 25 Gbit/s between nodes",
    )


def _tpu(
    name: str,
    bf16: float,
    fp8: float | None,
    hbm_bw: float,
    hbm: float,
    ici_axis: float,
    dcn: float,
    pod: int,
    num_hosts: int,
    devices_per_host: int | None,
    source: str,
) -> Cluster:
    dev = Device(
        name=name,
        flops_fp32=bf16 / 6,  # assumed: an exact fp32 dot costs 6 bf16 passes; vector work rarely binds
        flops_bf16=bf16,
        flops_fp8=fp8,
        fp32_matmul_as="bf16",  # XLA TPU default precision: one bf16 pass
        matmul_efficiency=0.8,
        memory_bandwidth=hbm_bw,
        memory_efficiency=0.9,
        memory_capacity=hbm,
        source=source,
    )
    return Cluster(
        name=name,
        device=dev,
        num_hosts=num_hosts,
        devices_per_host=devices_per_host or pod,
        intra_link=Link(name="ici", bandwidth=ici_axis, latency=1.5e-6),
        inter_link=Link(name="dcn", bandwidth=dcn, latency=20e-6),
        source=f"{source}; a 'host' here is one ICI slice (up to a pod), hosts talk over DCN",
    )


def tpu_v4(*, num_hosts: int = 1, devices_per_host: int | None = None) -> Cluster:
    """Google Cloud TPU v4 (per chip; a "host" is an ICI slice, default one full pod of 4,096 chips).

    Source: Cloud TPU v4 docs: 275 TFLOPS bf16/int8 per chip; 32 GiB HBM2 at 1,200 GBps; 3D torus.
    ICI: 45 GB/s one way per link (JAX scaling book, "How to think about TPUs"); a torus axis has two links,
    so 90 GB/s per mesh axis. DCN per chip not published for v4: assumed 50 Gbps (v5p's figure).
    """
    return _tpu(
        "tpu-v4",
        275 * T,
        None,
        1200 * GB,
        32 * GiB,
        90 * GB,
        50e9 / 8,
        4096,
        num_hosts,
        devices_per_host,
        "Cloud TPU v4 docs",
    )


def tpu_v5e(*, num_hosts: int = 1, devices_per_host: int | None = None) -> Cluster:
    """Google Cloud TPU v5e (per chip; a "host" is an ICI slice, default one pod of 256 chips).

    Source: Cloud TPU v5e docs: 197 TFLOPS bf16, 394 TOPS int8; 16 GB HBM at 819 GBps; 2D torus with
    400 GBps bidirectional ICI per chip over 4 ports = 50 GB/s one way per port, two ports per mesh axis =
    100 GB/s per axis. DCN: 2 x 100 Gbps NICs per 8-chip host = 25 Gbps = 3.125 GB/s per chip.
    """
    c = _tpu(
        "tpu-v5e",
        197 * T,
        None,
        819 * GB,
        16 * GB,
        100 * GB,
        25e9 / 8,
        256,
        num_hosts,
        devices_per_host,
        "Cloud TPU v5e docs",
    )
    from dataclasses import replace

    return replace(c, device=replace(c.device, flops_int8=394 * T))


def tpu_v5p(*, num_hosts: int = 1, devices_per_host: int | None = None) -> Cluster:
    """Google Cloud TPU v5p (per chip; a "host" is an ICI slice, default one pod of 8,960 chips).

    Source: Cloud TPU v5p docs: 459 TFLOPS bf16 and 459 fp8 per chip; 95 GB HBM2e at 2,765 GBps;
    1,200 GBps bidirectional ICI per chip over 6 ports (3D torus) = 100 GB/s one way per port, two per mesh
    axis = 200 GB/s per axis; DCN 50 Gbps = 6.25 GB/s per chip.
    """
    return _tpu(
        "tpu-v5p",
        459 * T,
        459 * T,
        2765 * GB,
        95 * GB,
        200 * GB,
        50e9 / 8,
        8960,
        num_hosts,
        devices_per_host,
        "Cloud TPU v5p docs",
    )


def cpu(*, num_devices: int = 8, num_hosts: int = 1) -> Cluster:
    """This session's machine: 2 vCPUs of an Intel Xeon @ 2.50 GHz (family 6 model 85 stepping 7, Cascade
    Lake; AVX-512 with FMA, no AVX512-BF16), 24 GB RAM, split into ``num_devices`` XLA CPU devices
    (``--xla_force_host_platform_device_count``) that share the cores, memory and bandwidth.

    Source: ``lscpu`` and Intel's Cascade Lake spec (2 AVX-512 FMA units per core assumed: 2 x 16 lanes x 2
    = 64 fp32 FLOP/cycle/core, 160 GFLOP/s per core, 320 for the machine). bf16 has no native unit (converted
    to fp32): same rate. Memory bandwidth 20 GB/s for the VM (assumed). Collectives between CPU devices are
    memory copies through shared memory: bandwidth assumed to be the memory bandwidth split over the devices
    and halved (read + write), latency 10 us (thread rendezvous; assumed). Per-device figures divide the
    machine by ``num_devices``, since SPMD programs run on all devices at once.
    """
    share = 1.0 / num_devices
    mem_bw = 20 * GB
    dev = Device(
        name="cpu-xeon-2.5ghz-2vcpu",
        flops_fp32=320e9 * share,
        flops_bf16=320e9 * share,
        matmul_efficiency=0.5,
        memory_bandwidth=mem_bw * share,
        memory_efficiency=0.8,
        memory_capacity=24 * GB * share,
        source="lscpu on this machine; Cascade Lake AVX-512 FMA throughput",
    )
    shm = Link(name="cpu-shm", bandwidth=mem_bw * share / 2, latency=10e-6)
    return Cluster(
        name="cpu",
        device=dev,
        num_hosts=num_hosts,
        devices_per_host=num_devices,
        intra_link=shm,
        inter_link=Link(name="ethernet", bandwidth=1.25 * GB / num_devices, latency=50e-6),
        source="XLA CPU devices on one machine (intra: shared memory); inter: assumed 10 Gbit/s",
    )


_PRESETS: Mapping[str, Callable[..., Cluster]] = MappingProxyType(
    {
        "h100": h100,
        "h200": h200,
        "a100": a100,
        "v100": v100,
        "tpu-v4": tpu_v4,
        "tpu-v5e": tpu_v5e,
        "tpu-v5p": tpu_v5p,
        "cpu": cpu,
    }
)


def names() -> tuple[str, ...]:
    """The preset names ``get`` accepts."""
    return tuple(_PRESETS)


def get(name: str, **overrides: Any) -> Cluster:
    """The preset cluster called ``name`` (see ``names()``); keywords override its size."""
    try:
        factory = _PRESETS[name]
    except KeyError:
        raise CostModelError(
            f"unknown hardware preset {name!r}; presets are: {', '.join(_PRESETS)}"
        ) from None
    try:
        return factory(**overrides)
    except TypeError as e:
        raise CostModelError(f"preset {name!r} does not accept {sorted(overrides)}: {e}") from None
