"""What a GPU is, in numbers: one definition shared by notebook 00 and the simulator.

Two views of the same machines:

* `GPU` — the hardware record of the cost model of notebook 06 (Erdil & Schneider-Joseph,
  *Data movement limits to frontier model training*, 2024; docs/cost_model.md §1): the fields
  the simulator's matmul and network times are computed from. `PRESETS` holds the paper's GPUs
  and network variants, and the GTX 580 of Epoch AI's simulator announcement.
* `HIERARCHY` — the memory and network hierarchy a reader should keep in mind (notebook 00):
  per level, capacity, bandwidth per direction and latency, with the source of each number.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from helpers.units import KiB, MiB



@dataclass(frozen=True)
class NetworkLevel:
    """One level of the network, innermost first.

    `bandwidth_Bps` counts both directions per GPU (the NVLink datasheet convention: one
    byte sent per second each way is 2 B/s). `size` is how many GPUs share the level;
    the outermost level has `size=None` (unbounded).
    """

    bandwidth_Bps: float
    latency_s: float
    size: int | None = None


@dataclass(frozen=True)
class GPU:
    """The hardware record of the cost model, per GPU (docs/cost_model.md §1)."""

    name: str
    bitwidth: int
    flop_per_clock_per_thread: dict[int, float]
    register_bytes_per_processing_block: float
    num_sms: int
    l2_Bps: float
    l2_bytes: float
    hbm_Bps: float
    hbm_bytes: float
    max_clock_Hz: float
    effective_utilization: float
    distributed_shared_memory: bool
    latency_per_matmul_s: float
    network_levels: tuple[NetworkLevel, ...] = field(default_factory=tuple)

    # Derived quantities, named as in the paper's reference code.
    @property
    def bytes_per_word(self) -> float:
        return self.bitwidth / 8

    @property
    def clock_Hz(self) -> float:
        return self.max_clock_Hz * self.effective_utilization

    @property
    def threads(self) -> int:
        return 128 * self.num_sms

    @property
    def peak_flops(self) -> float:
        return self.flop_per_clock_per_thread[self.bitwidth] * self.threads * self.max_clock_Hz

    @property
    def sustained_flops(self) -> float:
        return self.flop_per_clock_per_thread[self.bitwidth] * self.threads * self.clock_Hz

    @property
    def shared_Bps(self) -> float:
        return 32 * 4 * self.num_sms * self.clock_Hz

    @property
    def ridge_flop_per_byte(self) -> float:
        """Arithmetic intensity where the roofline turns: peak FLOP/s over HBM bytes/s."""
        return self.peak_flops / self.hbm_Bps


def _two_levels(node_Bps: float, beyond_Bps: float, latency_s: float = 1.125e-6,
                node_size: int = 8) -> tuple[NetworkLevel, ...]:
    return (NetworkLevel(node_Bps, latency_s, node_size), NetworkLevel(beyond_Bps, latency_s))


def _spec_gpu(name, fpct, sms, clock_MHz, eff, hbm_Bps, l2_Bps, l2_MiB, hbm_bytes, net, dsmem):
    return GPU(
        name=name, bitwidth=16, flop_per_clock_per_thread={16: fpct},
        register_bytes_per_processing_block=64 * KiB, num_sms=sms,
        l2_Bps=l2_Bps, l2_bytes=l2_MiB * MiB, hbm_Bps=hbm_Bps, hbm_bytes=hbm_bytes,
        max_clock_Hz=clock_MHz * 1e6, effective_utilization=eff,
        distributed_shared_memory=dsmem, latency_per_matmul_s=4.5e-6,
        network_levels=_two_levels(*net),
    )


V100_SXM = _spec_gpu("V100 SXM", 8, 80, 1533, 0.90, 900e9, 2155e9, 6, 32e9, (3e11, 1.25e10), False)
A100_SXM = _spec_gpu("A100 SXM", 16, 108, 1410, 0.85, 1555e9, 5603e9, 40, 40e9, (6e11, 5e10), False)
H100_SXM = _spec_gpu("H100 SXM", 32, 132, 1830, 0.70, 3352e9, 6441e9, 50, 80e9, (9e11, 1e11), True)
H100_PCIE = _spec_gpu("H100 PCIe", 32, 114, 1620, 0.55, 2039e9, 5563e9, 50, 80e9, (9e11, 1e11), True)

# Two parts of published training runs (notebook 10), kept out of the simulator's PRESETS so
# notebook 06's menus stay the paper's. A100 SXM 80 GB: the 40 GB record with the 80 GB part's
# HBM2e, 2,039 GB/s and 80 GB (NVIDIA A100 datasheet, 2021). H800 SXM: the H100 SXM's compute
# and memory with its NVLink cut to 400 GB/s counting both directions (NVIDIA H800 datasheet);
# DeepSeek-V3's report (arXiv:2412.19437, §3.2.2) quotes 160 GB/s NVLink and 50 GB/s InfiniBand
# per GPU achieved, one direction: the InfiniBand level is the H100's 400 Gb/s NIC, 1e11 both ways.
A100_SXM_80GB = _spec_gpu("A100 SXM 80 GB", 16, 108, 1410, 0.85, 2039e9, 5603e9, 40, 80e9,
                          (6e11, 5e10), False)
H800_SXM = _spec_gpu("H800 SXM", 32, 132, 1830, 0.70, 3352e9, 6441e9, 50, 80e9, (4e11, 1e11), True)

# 2012's consumer card (AlexNet's), as Epoch AI's simulator announcement (2024) gives it. The
# authors marked three kinds of value as their guesses: the effective utilization (0.85), the
# fixed latency per matmul (22.5 µs) and the network latencies (5 µs per level). The links are
# PCIe-class: 8 GB/s inside a node of 8, 1 GB/s beyond, counted in both directions.
# helpers.simulator.gtx580 varies each of these (notebook 06, section 7).
GTX_580 = GPU(
    name="GTX 580", bitwidth=32, flop_per_clock_per_thread={32: 1 / 2, 64: 1 / 16},
    register_bytes_per_processing_block=128 * KiB, num_sms=16,
    l2_Bps=384.8e9, l2_bytes=786_432, hbm_Bps=192.4e9, hbm_bytes=3.0e9,
    max_clock_Hz=1.544e9, effective_utilization=0.85, distributed_shared_memory=False,
    latency_per_matmul_s=2.25e-5,
    network_levels=(NetworkLevel(8e9, 5e-6, 8), NetworkLevel(1e9, 5e-6)),
)


def _low_latency(gpu: GPU, name: str) -> GPU:
    levels = tuple(replace(lv, latency_s=lv.latency_s / 10) for lv in gpu.network_levels)
    return replace(gpu, name=name, latency_per_matmul_s=gpu.latency_per_matmul_s / 10,
                   network_levels=levels)


H100_LOW_LATENCY = _low_latency(H100_SXM, "H100 SXM Low Latency")
H100_GLOBAL_NVLINK = replace(H100_SXM, name="H100 SXM Global NVLink",
                             network_levels=(NetworkLevel(9e11, 1.125e-6),))
H100_GLOBAL_NVLINK_LL = _low_latency(H100_GLOBAL_NVLINK, "H100 SXM Global NVLink + LL")
H100_INFINITE_NETWORK_LL = replace(
    H100_LOW_LATENCY, name="H100 SXM Infinite network + LL",
    network_levels=(NetworkLevel(float("inf"), 1.125e-7),))
H100_SUPERPOD = replace(H100_SXM, name="H100 SXM Superpod", network_levels=(
    NetworkLevel(9e11, 1.125e-6, 8), NetworkLevel(4.5e11, 1.125e-6, 32),
    NetworkLevel(1e11, 1.125e-6)))

PRESETS: dict[str, GPU] = {g.name: g for g in (
    V100_SXM, A100_SXM, H100_SXM, H100_PCIE, GTX_580, H100_LOW_LATENCY, H100_GLOBAL_NVLINK,
    H100_GLOBAL_NVLINK_LL, H100_INFINITE_NETWORK_LL, H100_SUPERPOD)}

# The GPUs of the published runs notebook 10 holds its planner against (nodes of 8).
RUN_GPUS: dict[str, GPU] = {g.name: g for g in (A100_SXM, A100_SXM_80GB, H100_SXM, H800_SXM)}


# ---------------------------------------------------------------------------------------
# The hierarchy of notebook 00: small-and-fast to large-and-slow.
# Bandwidth is per direction (what one GPU can send), in bytes/s; latency is a typical
# order of magnitude for one access or one small message. `None` where a level does not
# exist on that GPU. Sources are given per row so every number in the notebook is cited.
# ---------------------------------------------------------------------------------------

EPOCH_MODEL = ("Erdil & Schneider-Joseph 2024, 'Data movement limits to frontier model training', "
               "arXiv:2411.01137")
EPOCH_SIMULATOR = ("Epoch AI 2024, 'Introducing the Distributed Training Interactive Simulator' "
                   "(epoch.ai/blog/introducing-the-distributed-training-interactive-simulator)")


@dataclass(frozen=True)
class Level:
    name: str
    capacity_bytes: float | None
    bandwidth_Bps: float | None  # per direction
    latency_s: float | None
    source: str


# The GTX 580's two links are the simulator's record (GTX_580 above, both directions counted),
# halved to one direction, so notebooks 00 and 06 show the same machine.
_GTX_NODE, _GTX_BEYOND = GTX_580.network_levels

HIERARCHY: dict[str, tuple[Level, ...]] = {
    "H100 SXM": (
        Level("L1 / shared memory (per SM)", 256 * KiB, 33e12, 30e-9,
              "NVIDIA H100 whitepaper (256 KB L1/SMEM per SM); bandwidth = 132 SMs x 128 B/clk "
              "x 1.98 GHz; latency: Luo et al. 2024, 'Benchmarking and Dissecting the Nvidia "
              "Hopper GPU Architecture'"),
        Level("L2 cache", 50 * MiB, 6441e9, 200e-9,
              f"L2 size and bandwidth: {EPOCH_MODEL} (H100 record); latency: Luo et al. 2024"),
        Level("HBM3", 80e9, 3.35e12, 500e-9,
              "NVIDIA H100 SXM datasheet (80 GB, 3.35 TB/s); latency: Luo et al. 2024"),
        Level("NVLink 4 (in node, via NVSwitch)", None, 450e9, 1.125e-6,
              "NVIDIA H100 datasheet: 18 links, 900 GB/s bidirectional; latency as in "
              f"{EPOCH_MODEL}"),
        Level("PCIe Gen5 x16 (to CPU)", None, 64e9, 2e-6,
              "PCI-SIG Gen5 spec: 32 GT/s x 16 lanes ~ 64 GB/s per direction"),
        Level("InfiniBand NDR (between nodes)", None, 50e9, 5e-6,
              "NVIDIA DGX H100 User Guide: one 400 Gb/s NDR ConnectX-7 port per GPU = 50 GB/s "
              "per direction"),
        Level("Ethernet 100 GbE (datacenter)", None, 12.5e9, 20e-6,
              "IEEE 802.3 100 GbE line rate; latency of a kernel TCP round trip, order of magnitude"),
    ),
    "A100 SXM": (
        Level("L1 / shared memory (per SM)", 192 * KiB, 19.5e12, 30e-9,
              "NVIDIA A100 whitepaper (192 KB L1/SMEM per SM); 108 SMs x 128 B/clk x 1.41 GHz"),
        Level("L2 cache", 40 * MiB, 5603e9, 200e-9,
              f"{EPOCH_MODEL} (A100 record); NVIDIA A100 whitepaper (40 MB)"),
        Level("HBM2", 40e9, 1.555e12, 500e-9,
              "NVIDIA A100 datasheet: the 40 GB SXM part has HBM2 at 1,555 GB/s "
              "(the 80 GB part has HBM2e at 2,039 GB/s)"),
        Level("NVLink 3 (in node, via NVSwitch)", None, 300e9, 1.125e-6,
              "NVIDIA A100 datasheet: 12 links, 600 GB/s bidirectional"),
        Level("PCIe Gen4 x16 (to CPU)", None, 32e9, 2e-6, "PCI-SIG Gen4: 16 GT/s x 16 lanes"),
        Level("InfiniBand HDR (between nodes)", None, 25e9, 5e-6,
              "DGX A100: one 200 Gb/s HDR adapter per GPU"),
        Level("Ethernet 100 GbE (datacenter)", None, 12.5e9, 20e-6, "IEEE 802.3 100 GbE"),
    ),
    "GTX 580": (
        Level("L1 / shared memory (per SM)", 64 * KiB, 1.58e12, 30e-9,
              "NVIDIA Fermi whitepaper (64 KB per SM); 16 SMs x 64 B/clk x 1.544 GHz"),
        Level("L2 cache", 768 * KiB, 384.8e9, 300e-9, f"{EPOCH_SIMULATOR} (GTX 580 record)"),
        Level("GDDR5 global memory", 3.0e9, 192.4e9, 600e-9,
              f"{EPOCH_SIMULATOR} (GTX 580 3 GB record)"),
        Level("NVLink", None, None, None, "did not exist in 2012 (first in Pascal, 2016)"),
        Level("PCIe Gen2 x16 (in node of 8)", None, _GTX_NODE.bandwidth_Bps / 2,
              _GTX_NODE.latency_s,
              f"the simulator's GTX 580 record ({EPOCH_SIMULATOR}, a guess there): "
              f"{_GTX_NODE.bandwidth_Bps / 1e9:g} GB/s counting both directions, 5 µs. "
              "PCIe Gen2 x16's line rate is 8 GB/s each way (5 GT/s x 16 lanes, 8b/10b), "
              "so the record allows half of what the bus could carry"),
        Level("InfiniBand (between nodes)", None, _GTX_BEYOND.bandwidth_Bps / 2,
              _GTX_BEYOND.latency_s,
              f"the simulator's GTX 580 record ({EPOCH_SIMULATOR}): "
              f"{_GTX_BEYOND.bandwidth_Bps / 1e9:g} GB/s counting both directions beyond the node"),
        Level("Ethernet 1 GbE (2012 commodity)", None, 0.125e9, 50e-6, "IEEE 802.3 1 GbE"),
    ),
}

class RooflinePeaks(NamedTuple):
    """A GPU's two roofs: dense matmul FLOP/s (in the precision a model trains in) and
    memory bytes/s, with where the numbers come from."""

    peak_flops: float
    memory_Bps: float
    source: str


ROOFLINE_PEAKS: dict[str, RooflinePeaks] = {
    "H100 SXM": RooflinePeaks(989e12, 3.35e12,
                              "H100 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3"),
    "A100 SXM": RooflinePeaks(312e12, 1.555e12,
                              "A100 40 GB datasheet: 312 TFLOP/s dense bf16, 1,555 GB/s HBM2"),
    "GTX 580": RooflinePeaks(1.581e12, 192.4e9,
                             f"{EPOCH_SIMULATOR} (GTX 580 record): 1.581 TFLOP/s fp32, 192.4 GB/s"),
}


# ---------------------------------------------------------------------------------------
# What `nvidia-smi topo -m` prints on an 8-GPU H100 node (notebook 00), abridged from the
# output an NCCL user posted for their 8x H100 SXM server in NVIDIA/nccl issue #1453
# (https://github.com/NVIDIA/nccl/issues/1453, comment of 2024-09-19). Its NIC0 (no GPU
# near it, likely a storage or management port) is left out; NIC1..NIC8 are kept.
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TopoSample:
    source: str
    gpus: int
    gpu_link: str                     # what every GPU pair shows (NV18: 18 bonded NVLinks)
    nic_links: tuple[tuple[str, ...], ...]   # per GPU, its link to NIC1..NIC8
    cpu_affinity: tuple[str, ...]
    numa_affinity: tuple[int, ...]
    legend: tuple[tuple[str, str], ...]


TOPO_H100 = TopoSample(
    source="nvidia-smi topo -m on an 8x H100 SXM node, posted in NVIDIA/nccl issue #1453 "
           "(github.com/NVIDIA/nccl/issues/1453, 2024-09-19); abridged: its NIC0 column dropped",
    gpus=8, gpu_link="NV18",
    nic_links=(
        ("SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "NODE", "PIX"),
        ("SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "PIX", "NODE"),
        ("SYS", "SYS", "SYS", "SYS", "NODE", "PIX", "NODE", "NODE"),
        ("SYS", "SYS", "SYS", "SYS", "PIX", "NODE", "NODE", "NODE"),
        ("NODE", "NODE", "NODE", "PIX", "SYS", "SYS", "SYS", "SYS"),
        ("NODE", "NODE", "PIX", "NODE", "SYS", "SYS", "SYS", "SYS"),
        ("NODE", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"),
        ("PIX", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"),
    ),
    cpu_affinity=("0-79",) * 4 + ("80-159",) * 4,
    numa_affinity=(0,) * 4 + (1,) * 4,
    legend=(
        ("X", "Self"),
        ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes "
                "(e.g., QPI/UPI)"),
        ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host "
                 "Bridges within a NUMA node"),
        ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
        ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host "
                "Bridge)"),
        ("PIX", "Connection traversing at most a single PCIe bridge"),
        ("NV#", "Connection traversing a bonded set of # NVLinks"),
    ),
)
