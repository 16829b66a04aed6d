"""Published, measured data-parallel scaling vs the projection of sweeps/projection.py (README table).

    python -m benchmarks.projection_vs_published

Every input is a number found in the cited source, or an assumption marked as such in SETTINGS.
Published efficiencies: Horovod's "scaling efficiency" = throughput(N) / (N * single-GPU throughput);
Goyal et al. quote the efficiency of 256 GPUs relative to 8 GPUs (one server), so the projection is
divided by its own value at 8 for that row.
"""

from __future__ import annotations

from sweeps.projection import Hardware, collectives_for, project

# Horovod docs (docs/benchmarks.rst): servers of 4 Pascal GPUs on a RoCE-capable 25 Gbit/s network, one NIC
# per server -> 25e9 / 8 / 4 bytes/s per GPU. The GPU-GPU link inside a server is not stated: ASSUMED PCIe
# 3.0 x16, 15.75e9 bytes/s per direction. Latency ASSUMED 10 us per step (NCCL tuning.cc ring/Simple NET 9.6 us).
HOROVOD = Hardware(
    "horovod_pascal_25GbE",
    devices_per_node=4,
    intra_node_bytes_per_s=15.75e9,
    inter_node_bytes_per_s=25e9 / 8 / 4,
    latency_s=10e-6,
)
# Goyal et al. 2017 (arXiv 1706.02677): Big Basin servers, 8 P100 with NVLink (P100: 160 GB/s bidirectional =
# 80e9 per direction, NVIDIA Tesla P100 technical overview), one 50 Gbit/s Ethernet NIC per server
# -> 50e9 / 8 / 8 bytes/s per GPU. Latency ASSUMED 10 us.
GOYAL = Hardware(
    "big_basin_p100_50GbE",
    devices_per_node=8,
    intra_node_bytes_per_s=80e9,
    inter_node_bytes_per_s=50e9 / 8 / 8,
    latency_s=10e-6,
)

# (study, model, params, per-device batch, compute_s, hardware, devices, baseline devices, published efficiency)
SETTINGS = [
    # Inception V3: 23.9M params (Keras Applications table); one P100 at batch 64: 142 img/s (TensorFlow
    # benchmarks page, DGX-1 P100 synthetic) -> 64 / 142 s per step. Batch 64: the docs' benchmark command.
    ("Horovod", "Inception V3", 23.9e6, 64, 64 / 142, HOROVOD, 128, 1, 0.90),
    ("Horovod", "Inception V3", 23.9e6, 64, 64 / 142, HOROVOD, 512, 1, 0.90),
    # VGG-16: 138.4M params (Keras); one P100 at batch 64: 132 img/s (same TensorFlow page).
    ("Horovod", "VGG-16", 138.4e6, 64, 64 / 132, HOROVOD, 128, 1, 0.79),
    ("Horovod", "VGG-16", 138.4e6, 64, 64 / 132, HOROVOD, 512, 1, 0.68),
    # ResNet-50: ~25M params / ~100 MB (the paper); per-GPU batch 32 (8192 on 256 GPUs); backprop on one P100
    # takes 120 ms (the paper's bandwidth estimate) -> compute_s = 0.12 (forward not included).
    ("Goyal et al.", "ResNet-50", 25e6, 32, 0.12, GOYAL, 256, 8, 0.90),
]


def _efficiency(params, batch, compute, hw, n, base, overlap, algorithm) -> float:
    proj = project(collectives_for("allreduce", params, 4), compute, batch, [base, n], hw, overlap, algorithm)
    return proj[1]["efficiency"] / proj[0]["efficiency"]


def fitted_overlap(params, batch, compute, hw, n, base, published, algorithm="hierarchical"):
    """The overlap in [0, 1] at which the projected efficiency equals the published one (bisection), or None
    when even overlap 0 projects a higher efficiency."""
    lo, hi = 0.0, 1.0
    if _efficiency(params, batch, compute, hw, n, base, lo, algorithm) > published:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        if _efficiency(params, batch, compute, hw, n, base, mid, algorithm) < published:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rows(overlaps=(0.0, 1.0), algorithm: str = "hierarchical"):
    """One dict per setting: published and projected efficiency at each overlap, and the relative error."""
    out = []
    for study, model, params, batch, compute, hw, n, base, published in SETTINGS:
        row = {
            "study": study,
            "model": model,
            "devices": n,
            "baseline": base,
            "published": published,
            "compute_s": compute,
            "hardware": hw.name,
        }
        for overlap in overlaps:
            proj = project(collectives_for("allreduce", params, 4), compute, batch, [base, n], hw, overlap, algorithm)
            eff = proj[1]["efficiency"] / proj[0]["efficiency"]
            row[f"projected@{overlap:g}"] = eff
            row[f"comm_s@{overlap:g}"] = proj[1]["comm_s"]
            row[f"error@{overlap:g}"] = (eff - published) / published
        row["fitted_overlap"] = fitted_overlap(params, batch, compute, hw, n, base, published, algorithm)
        out.append(row)
    return out


if __name__ == "__main__":
    for algorithm in ("hierarchical", "nccl"):
        print(f"## {algorithm}")
        print(
            "| study | model | GPUs (baseline) | published | compute_s | comm_s | projected, overlap 0 (error) "
            "| projected, overlap 1 (error) | overlap that fits |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows(algorithm=algorithm):
            print(
                f"| {r['study']} | {r['model']} | {r['devices']} ({r['baseline']}) | {r['published']:.2f} | "
                f"{r['compute_s']:.3f} | {r['comm_s@0']:.3f} | {r['projected@0']:.2f} ({r['error@0']:+.0%}) | "
                f"{r['projected@1']:.2f} ({r['error@1']:+.0%}) | {r['fitted_overlap']:.2f} |"
            )
