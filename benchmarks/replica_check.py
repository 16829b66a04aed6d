"""Host cost of the replica-synchronisation check (``ParallelMode.replica_divergence``), side by side with the
way it was done before: every device's copy converted to float64 and subtracted.

The tree is the MNIST MLP's parameters and Adam state as ``train.py`` builds them (``parallel=jit_sharding``,
8 simulated CPU devices by default): replicated arrays whose copies are bitwise equal, as in healthy data-parallel
training. Prints the median milliseconds per check of each, over ``--trials`` interleaved trials of ``--calls``
checks, and their ratio.

    python benchmarks/replica_check.py [--devices 8] [--trials 9] [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def float64_every_copy(tree) -> float:
    """The former check: every copy to float64, max |copy - first copy| (NaN ignored by Python's max)."""
    import jax
    import numpy as np

    worst = 0.0
    for leaf in jax.tree.leaves(tree):
        groups: dict = {}
        for shard in leaf.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index) if shard.index else ()
            groups.setdefault(key, []).append(np.asarray(shard.data, dtype=np.float64))
        for copies in groups.values():
            for other in copies[1:]:
                worst = max(worst, float(np.max(np.abs(other - copies[0]), initial=0.0)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if args.devices < 2 or args.trials < 1 or args.calls < 1:
        ap.error("--devices must be >= 2 (a replica to compare), --trials and --calls >= 1")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from conf.schema import from_dict
    from training.build import build, plan

    exp = build(plan(from_dict({"parallel": {"name": "jit_sharding"}, "mesh": {"devices": args.devices}})))
    tree = (exp.state.params, exp.state.opt_state)
    variants = {"now (bitwise first)": exp.mode.replica_divergence, "float64 every copy": float64_every_copy}
    for check in variants.values():
        assert check(tree) == 0.0
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.trials):
        for name, check in variants.items():
            t = time.perf_counter()
            for _ in range(args.calls):
                check(tree)
            times[name].append((time.perf_counter() - t) / args.calls * 1e3)
    arrays = sum(1 for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))
    print(
        f"replica check, {args.devices} devices, MNIST MLP params + Adam state ({arrays} arrays), load average "
        f"{os.getloadavg()[0]:.1f}; ms per check, median (min-max) of {args.trials} trials x {args.calls} calls:"
    )
    for name, ms in times.items():
        print(f"  {name:20s} {statistics.median(ms):7.2f} ({min(ms):.2f}-{max(ms):.2f})")
    ratio = statistics.median(times["float64 every copy"]) / statistics.median(times["now (bitwise first)"])
    print(f"  ratio float64 every copy / now: {ratio:.1f}")


if __name__ == "__main__":
    main()
