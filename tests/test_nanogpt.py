"""``+experiment=nanogpt_char`` runs end to end on the CPU, made small by overrides: nanoGPT's split of Tiny
Shakespeare as byte tokens, the learning rate at its floor once decayed, the best evaluation kept and sampled."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from data.text import SHARED_TINY_SHAKESPEARE, split_90_10
from training import checkpoint
from utils import REPO, run_train


@pytest.mark.skipif(not SHARED_TINY_SHAKESPEARE.exists(), reason="Tiny Shakespeare not present")
def test_nanogpt_char_smoke_run_on_the_cpu(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = run_train(
        run,
        "+experiment=nanogpt_char",
        f"data.path={SHARED_TINY_SHAKESPEARE}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.depth=1",
        "model.width=64",
        "model.heads=2",
        "model.context=32",
        "train.global_batch=8",
        "train.steps=6",
        "train.eval_every=2",
        "train.log_every=2",
        "train.sample_tokens=16",
        "data.eval_windows=32",
        "optim.warmup_steps=1",
        "optim.decay_steps=3",
        f"checkpoint.dir={ckpt}",
        "checkpoint.every=2",
        "wandb.mode=disabled",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    text = SHARED_TINY_SHAKESPEARE.read_text()
    train, validation = split_90_10(text)  # nanoGPT's split: the first 90% of the characters, the last 10%
    assert (s["data/train_tokens"], s["data/validation_tokens"]) == (len(train), len(validation)) == (1003854, 111540)
    assert (s["mesh/devices"], s["precision"], s["data/tokenizer"], s["model/vocab_size"]) == (1, "bf16", "bytes", 256)
    assert s["eval/bpb"] == pytest.approx(s["eval/loss"] / math.log(2), rel=1e-12)  # byte tokens
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["optim/lr"] for r in records if "optim/lr" in r}
    # warm-up 1 step, cosine over 3: the step ending at count 5 and 6 ran at the floor, 1e-4 exactly (float32)
    assert lr[1] == 0.0 and lr[2] == np.float32(1e-3) and lr[5] == lr[6] == np.float32(1e-4)
    evals = {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}
    best = min(evals, key=lambda k: (evals[k], k))
    assert sorted(evals) == [2, 4, 6] and s["checkpoint/best_step"] == best
    assert checkpoint.complete_steps(ckpt / "best") == [best] and checkpoint.complete_steps(ckpt) == [6]
    sampled = subprocess.run(
        [sys.executable, "-m", "sample", str(ckpt), "--best", "--tokens", "8", "--prompt", "ROMEO:"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-2000:]
    assert f"sample: {ckpt / 'best' / str(best)}," in sampled.stderr
