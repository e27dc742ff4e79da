"""Named machines the planner and the recipes plan for: `hf-zero3 plan --hardware p4d.24xlarge`.

Why a table: a user who rents a p4d.24xlarge knows its name, not its host RAM in bytes, and the 70b recipe
claimed to fit "8x A100-40GB" while the rented nodes of that kind have 900-1,152 GiB of host RAM, not the 1.4 TB
it needed. Each figure names its source; a figure not taken from the vendor's page says "estimate".
Sizes are per node, in bytes; GPU memory is what torch reports (`total_memory`), not the marketing number.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero3.config.presets import NVME_PLACEHOLDER
from hf_zero3.plan import calibration
from hf_zero3.plan.types import FixedTerms, Hardware, PlanError
from hf_zero3.units import GB, GIB

TB = 10**12

A100_40GB = 40_339 * 2**20
"""torch's total_memory of an A100 40GB: 40,339 MiB (a PCIe card's report; SXM4 reports about the same)."""
A100_80GB = 81_038 * 2**20
"""torch's total_memory of an A100 80GB: 81,038 MiB (estimate: nvidia-smi 81,920 MiB less the reserved part)."""
H100_80GB = 81_008 * 2**20
"""torch's total_memory of an H100 80GB SXM: about 79.1 GiB (estimate, as for the A100 80GB)."""
H200 = 140 * GIB
"""torch's total_memory of an H200: 140 GiB, as torch reported it on the H200s the benchmarks ran on."""


def _fixed_terms(row: dict) -> FixedTerms:
    return FixedTerms(cuda_context=row["cuda_context_bytes"], host_per_rank=row["host_per_rank_bytes"],
                      gpu_margin=tuple((int(s), m) for s, m in row["gpu_margin"].items()),
                      gpu_margin_near_full=tuple((int(s), m) for s, m in row["gpu_margin_near_full"].items()),
                      gpu_margin_lora=tuple((int(s), m) for s, m in row["gpu_margin_lora"].items()),
                      source=row["source"])


FIXED_TERMS: dict[str, FixedTerms] = {gpu: _fixed_terms(row) for gpu, row in calibration.fixed_terms().items()}
"""The planner's fixed terms per GPU type (measured.json's `fixed_terms`), each with the probe report that measured it
or "estimate": a new machine type is one memory probe run away (the benchmarks index says how)."""


@dataclass(frozen=True)
class Profile:
    """One node of a machine type people rent or own."""

    name: str
    gpu: str
    gpus: int
    gpu_mem: int
    host_ram: int
    nvme: int
    """Local NVMe (or local SSD) capacity per node, bytes; 0: none to plan with."""
    nvme_read_gbps: float
    nvme_write_gbps: float
    """Sequential GB/s of the node's local NVMe as one volume (RAID 0 of its drives): what ZeRO-Infinity's optimizer
    swap reads and writes every step. Estimates unless a source says measured."""
    source: str

    def hardware(self, nodes: int = 1, headroom: float = 0.0, nvme_path: str | None = None) -> Hardware:
        """The planner's `Hardware` for `nodes` of these; NVMe options are considered when the node has NVMe
        (the path is a placeholder unless given: `config new --nvme-path` or the recipe's `/local_nvme`)."""
        path = (nvme_path or NVME_PLACEHOLDER) if self.nvme else None
        return Hardware(nodes, self.gpus, self.gpu_mem, self.host_ram, path, self.nvme, (), headroom,
                        FIXED_TERMS[self.gpu])


PROFILES: dict[str, Profile] = {p.name: p for p in (
    # AWS EC2 P4 page (aws.amazon.com/ec2/instance-types/p4): 8 A100 40GB, 1,152 GiB memory, 8 x 1,000 GB NVMe
    # SSD. NVMe speed: estimate (8 NVMe drives striped; ~2 GB/s write, ~3 GB/s read each, PCIe 3 era).
    Profile("p4d.24xlarge", "A100-40GB", 8, A100_40GB, 1152 * GIB, 8 * 1000 * GB, 16.0, 8.0,
            "AWS EC2 P4 instance page; NVMe GB/s estimated"),
    # Azure docs, ND A100 v4-series (MicrosoftDocs/azure-docs articles/virtual-machines/nda100-v4-series.md):
    # Standard_ND96asr_v4, 8 A100 40GB, 900 GiB memory, 6,000 GiB temp storage (local NVMe, RAID 0 over 8 drives).
    # NVMe speed: estimate.
    Profile("nd-a100-v4", "A100-40GB", 8, A100_40GB, 900 * GIB, 6000 * GIB, 12.0, 6.0,
            "Azure ND A100 v4-series page (Standard_ND96asr_v4); NVMe GB/s estimated"),
    # GCP a2-highgpu-4g: 4 A100 40GB, 340 GiB memory (GCP machine types; SkyPilot's GCP catalog lists 85 GiB per
    # GPU). Local SSD is attached at creation in 375 GB partitions: 4 of them (1.5 TB) planned here (estimate).
    # Two of these are the "2 nodes x 4 A100-40GB" case: --hardware a2-highgpu-4g --nodes 2.
    Profile("a2-highgpu-4g", "A100-40GB", 4, A100_40GB, 340 * GIB, 4 * 375 * GB, 2.6, 1.4,
            "GCP A2 machine types; local SSD count chosen here (4 x 375 GB), GB/s estimated"),
    # NVIDIA DGX A100 user guide: 8 A100 80GB (the 640 GB system), 2 TB memory, 15 TB internal NVMe (4 x 3.84 TB,
    # RAID 0 /raid). NVMe speed: estimate.
    Profile("dgx-a100-80", "A100-80GB", 8, A100_80GB, 2 * TB, 15_360 * GB, 20.0, 10.0,
            "NVIDIA DGX A100 user guide (640 GB system); NVMe GB/s estimated"),
    # NVIDIA DGX H100 user guide: 8 H100 80GB, 2 TB memory, 30 TB internal NVMe (8 x 3.84 TB U.2, RAID 0 /raid).
    # NVMe speed: estimate.
    Profile("dgx-h100", "H100-80GB", 8, H100_80GB, 2 * TB, 30_720 * GB, 40.0, 20.0,
            "NVIDIA DGX H100 user guide; NVMe GB/s estimated"),
    # The single-H200 machine the one-GPU benchmarks ran on: 140 GiB GPU, 125 GiB host RAM, 64 GiB disk (not NVMe
    # we can rely on: planned as disk, speed unmeasured, estimate).
    Profile("h200x1", "H200", 1, H200, 125 * GIB, 64 * GIB, 2.0, 1.0,
            "a 1 x H200 machine of the benchmarks (its description); disk GB/s estimated until measured"),
    # The 2 x H200 machine the two-GPU benchmarks ran on: 256 GiB host RAM, 128 GiB disk (its description).
    Profile("h200x2", "H200", 2, H200, 256 * GIB, 128 * GIB, 2.0, 1.0,
            "a 2 x H200 machine of the benchmarks (its description); disk GB/s estimated until measured"),
)}


def nvme_seconds_per_step(nvme_bytes: int, profile: Profile) -> float:
    """Predicted NVMe time of one optimizer step with the optimizer states on NVMe: every byte the plan puts there is
    read and written back once per step (fp32 master weights, Adam m, v, fp32 gradients), at the profile's sequential
    rates (estimates unless its source says measured). The swap does not overlap the forward and backward."""
    return nvme_bytes / (profile.nvme_read_gbps * GB) + nvme_bytes / (profile.nvme_write_gbps * GB)


def get(name: str) -> Profile:
    """The profile called `name`; an unknown name is an error listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise PlanError(f"unknown hardware profile {name!r}: use one of {', '.join(PROFILES)} (or --gpus, --gpu-mem, "
                        "--host-ram and --nvme-free for another machine)") from None
