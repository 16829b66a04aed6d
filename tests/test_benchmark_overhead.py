"""``benchmarks/overhead.py``: the order of the processes in its interleaved rounds."""

from __future__ import annotations

import pytest

from benchmarks.overhead import round_order


@pytest.mark.unit
def test_rounds_alternate_the_order_of_bare_and_every_variant():
    """Round 0 runs the variants in order and then the bare script; round 1 the exact reverse. So over two rounds
    every member (the bare script, each ``--also`` variant, each ``--before`` one) runs once before and once after
    each other member."""
    members = ["bare", "train.py", "train.py wandb.mode=disabled", "before: train.py"]
    assert round_order(members, 0) == ["train.py", "train.py wandb.mode=disabled", "before: train.py", "bare"]
    assert round_order(members, 1) == ["bare", "before: train.py", "train.py wandb.mode=disabled", "train.py"]
    assert round_order(members, 2) == round_order(members, 0)
    for a in members:
        for b in members:
            if a != b:
                first = [order.index(a) < order.index(b) for order in (round_order(members, i) for i in (0, 1))]
                assert first == [True, False] or first == [False, True], (a, b)
    assert round_order(["bare", "train.py"], 0) == ["train.py", "bare"]
    assert round_order(["bare", "train.py"], 1) == ["bare", "train.py"]


def test_bare_script_with_the_split_on_the_devices_trains_the_same():
    """``bare_train.py --on-device`` (the comparison for ``data.on_device``) gathers the same batches: the same
    losses and accuracy as its host batches (1 epoch, 2 devices)."""
    import subprocess
    import sys

    from benchmarks.bare_train import default_data_dir
    from data.sources import load_tfds_split
    from utils import REPO, SHARED_TFDS

    if not SHARED_TFDS.exists():
        pytest.skip("needs the prepared MNIST copy in ../shared")
    for split in ("train", "test"):  # the decoded arrays the bare script reads (cached by the repository's loader)
        load_tfds_split("mnist", split, str(SHARED_TFDS), default_data_dir())
    cmd = [sys.executable, str(REPO / "benchmarks" / "bare_train.py"), "--devices=2", "--epochs=1"]
    outs = [subprocess.run(cmd + extra, capture_output=True, text=True, timeout=300) for extra in ([], ["--on-device"])]
    assert [o.returncode for o in outs] == [0, 0], outs[1].stderr[-2000:]
    lines = [o.stdout.splitlines() for o in outs]
    assert lines[0] == lines[1] and lines[0][-1].startswith("eval/accuracy=0.9"), lines
