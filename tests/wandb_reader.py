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
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
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


def read_run(run_dir: str) -> dict:
    """{'config': {...}, 'history': [{key: value}], 'summary': {...}, 'run': RunRecord} of an offline run."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    out = {"config": {}, "history": [], "summary": {}, "run": None}
    for rec in records(path):
        which = rec.WhichOneof("record_type")
        if which == "run":
            out["run"] = rec.run
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif which == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif which == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in rec.history.item})
        elif which == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
