"""Reads an offline W&B run file (``run-<id>.wandb``) back into protobuf records, for tests.

The file is W&B's LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks
of chunks, each with a 7-byte header (crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4). Each complete
record is a serialised ``wandb.proto.wandb_internal_pb2.Record``. (Format of wandb's former
``sdk/internal/datastore.py``; wandb 0.31 writes it from its Go core and ships no Python reader.)
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from typing import Iterator

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7


def records(path: str) -> Iterator[wandb_internal_pb2.Record]:
    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def _complete_records(path: str, wait_s: float) -> list:
    """The records of ``path`` once it holds W&B's ``exit`` record (the run finished), waiting up to ``wait_s``:
    ``run.finish()`` can return before W&B's writer process has flushed the file (seen in-process, offline).
    After ``wait_s`` (a killed run never gets its ``exit`` record) the records readable so far."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            recs = list(records(path))
        except Exception:  # a chunk being written: read again
            recs = []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def read_run(run_dir: str, wait_s: float = 30.0) -> dict:
    """{'config': {...}, 'history': [{key: value}], 'summary': {...}, 'run': RunRecord} of an offline run
    (waiting up to ``wait_s`` for W&B to finish writing it)."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = {"config": {}, "history": [], "summary": {}, "run": None}
    for rec in _complete_records(path, wait_s):
        which = rec.WhichOneof("record_type")
        if which == "run":
            out["run"] = rec.run
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif which == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif which == "history":
            out["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            )
        elif which == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def offline_runs(run_folder) -> list[str]:
    """The offline W&B run folders (``wandb/offline-run-<time>-<id>``) under a training run folder, oldest first."""
    return sorted(glob.glob(os.path.join(str(run_folder), "wandb", "offline-run-*")))


def history_by_step(run_dir: str) -> list[tuple[int, dict]]:
    """(``_step``, the row's logged keys without W&B's own ``_*`` keys) for every history row, in file order."""
    return [
        (row["_step"], {k: v for k, v in row.items() if not k.startswith("_")}) for row in read_run(run_dir)["history"]
    ]


def metrics_by_step(path) -> dict[int, dict]:
    """metrics.jsonl merged per step the way the W&B history holds it: numbers only (``null``, strings, lists and
    the ``nonfinite`` map are not logged to W&B); records of one step (the final train record and the final
    evaluation) merge into one row."""
    out: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            row = out.setdefault(int(rec["step"]), {})
            row.update(
                {k: v for k, v in rec.items() if k != "step" and v is not None and not isinstance(v, (str, list, dict))}
            )
    return out


def assert_history_matches_metrics(run_dir: str, metrics_path) -> list[int]:
    """Asserts that the W&B run in ``run_dir`` holds every step of ``metrics_path`` exactly once, in order,
    with equal values (exact: both are the JSON of the same Python floats); returns the steps."""
    rows = history_by_step(run_dir)
    want = metrics_by_step(metrics_path)
    steps = [s for s, _ in rows]
    assert steps == sorted(want), (steps[:20], sorted(want)[:20])
    for s, row in rows:
        assert row == want[s], (
            s,
            {k: (row.get(k), want[s].get(k)) for k in set(row) | set(want[s]) if row.get(k) != want[s].get(k)},
        )
    return steps
