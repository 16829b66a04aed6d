"""``benchmarks/overhead.py``: the order of the processes in its interleaved rounds."""

from __future__ import annotations

import pytest

from benchmarks.overhead import round_order

pytestmark = pytest.mark.unit


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
