"""The simulated clusters' hardware figures (DESIGN.md §10 and public specs), apart from the
simulator so that a sim plan's knob space (its channel bounds) loads without numpy."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """One simulated node type's figures (every node has 8 GPUs)."""

    name: str
    device: str
    sms: int
    hbm: float  # bytes/s
    tflops: float  # dense bf16, achievable
    link: float  # intra-node bytes/s per direction (bus bandwidth ceiling)
    per_channel: float  # bytes/s one channel moves before the link saturates
    l2: int  # bytes
    default_channels: int
    max_channels: int = 64


CLUSTERS = {
    "a40-pcie": Cluster("a40-pcie", "A40", 84, 696 * GB, 150e12 * 0.7, 22 * GB, 8 * GB, 6 << 20, 8, 32),
    "a40-nvlink": Cluster("a40-nvlink", "A40", 84, 696 * GB, 150e12 * 0.7, 48 * GB, 9 * GB, 6 << 20, 8, 64),
    "a100-nvlink": Cluster("a100-nvlink", "A100-SXM4-80GB", 108, 2.0e12, 312e12 * 0.75, 230 * GB, 24 * GB, 40 << 20, 16),
    "h100-nvlink": Cluster("h100-nvlink", "H100-SXM", 132, 3.35e12, 989e12 * 0.72, 360 * GB, 48 * GB, 50 << 20, 16),
    "h200-nvlink": Cluster("h200-nvlink", "H200", 132, 4.8e12, 989e12 * 0.8, 360 * GB, 48 * GB, 50 << 20, 16),
}
DEFAULT_CLUSTER = "h100-nvlink"  # --hardware left out: said in the fingerprint and the profile's output
