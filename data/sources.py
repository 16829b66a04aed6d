"""Dataset sources: TFDS (read with ``tfds.data_source``, decoded once and cached) and synthetic.

MNIST: Y. LeCun, C. Cortes, C. J. C. Burges, "The MNIST database of handwritten digits" (CC BY-SA 3.0),
read from TFDS ``mnist`` 3.0.1 (array_record; no TensorFlow needed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np

from core.errors import DataError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostDataset:
    """A whole split in host memory.

    images: uint8 ``[N, H, W, C]``; labels: int32 ``[N]``.
    """

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def resolve_data_dir(data_dir: Optional[str]) -> Optional[str]:
    """``data.data_dir``, else the ``TFDS_DATA_DIR`` environment variable, else None (TFDS's default)."""
    return data_dir or os.environ.get("TFDS_DATA_DIR") or None


def load_tfds_split(tfds_name: str, split: str, data_dir: Optional[str], cache_dir: str) -> HostDataset:
    """Reads one TFDS split into host arrays, through a cache of decoded arrays.

    The first read decodes every PNG (~17 s for MNIST's 60,000 training images on 2 cores) and writes
    ``<cache_dir>/<name>-<version>-<split>.npz``; later reads load that file (well under 2 s). The cache is
    never written inside the TFDS folder, which may be read-only.

    Raises:
      DataError: the dataset is not prepared under ``data_dir`` and cannot be downloaded.
    """
    data_dir = resolve_data_dir(data_dir)
    version = _prepared_version(tfds_name, data_dir)
    cache = Path(cache_dir) / f"{tfds_name}-{version or 'unknown'}-{split}.npz"
    if version is not None and cache.exists():
        with np.load(cache) as f:
            return HostDataset(images=f["images"], labels=f["labels"])
    try:
        import tensorflow_datasets as tfds

        source = tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # TFDS raises several kinds (AssertionError, NotImplementedError, FileNotFoundError)
        where = data_dir or "TFDS's default folder (~/tensorflow_datasets)"
        raise DataError(
            f"dataset {tfds_name!r} ({split}) is not prepared in {where} and cannot be downloaded here "
            f"({type(e).__name__}); point TFDS_DATA_DIR (or data.data_dir) at a prepared copy, "
            f"or run with data=synthetic") from None
    t0 = time.perf_counter()
    images, labels = _decode_all(source)
    log.info("decoded %s/%s (%d examples) in %.1f s; caching to %s", tfds_name, split, len(labels),
             time.perf_counter() - t0, cache)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}.npz")
        np.savez(tmp, images=images, labels=labels)
        os.replace(tmp, cache)  # atomic: concurrent jobs never read a half-written cache
    except OSError as e:
        log.warning("could not write the data cache %s (%s); the next run decodes again", cache, e)
    return HostDataset(images=images, labels=labels)


def _prepared_version(tfds_name: str, data_dir: Optional[str]) -> Optional[str]:
    """Newest prepared version folder of ``tfds_name`` under ``data_dir`` (None when not found)."""
    root = Path(data_dir or Path.home() / "tensorflow_datasets") / tfds_name
    if not root.is_dir():
        return None
    versions = sorted((p.name for p in root.iterdir() if (p / "dataset_info.json").exists()),
                      key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))
    return versions[-1] if versions else None


def _decode_all(source, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    n = len(source)
    images, labels = [], []
    for start in range(0, n, chunk):
        records = source.__getitems__(list(range(start, min(n, start + chunk))))
        images.append(np.stack([r["image"] for r in records]))
        labels.append(np.asarray([r["label"] for r in records], dtype=np.int32))
    return np.concatenate(images).astype(np.uint8), np.concatenate(labels)
