"""Dataset sources: TFDS (read with ``tfds.data_source``, decoded once and cached) and synthetic.

MNIST: Y. LeCun, C. Cortes, C. J. C. Burges, "The MNIST database of handwritten digits" (CC BY-SA 3.0),
read from TFDS ``mnist`` 3.0.1 (array_record; no TensorFlow needed), downloaded and prepared on first use
(``prepare_tfds``) unless ``data.download=false``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import resource
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from core.errors import DataError, error_text, first_line

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


# The shared data folder beside the repository (../shared/tensorflow_datasets), used when nothing else is named.
SHARED_TFDS = Path(__file__).resolve().parents[2] / "shared" / "tensorflow_datasets"


def resolve_data_dir(data_dir: Optional[str], shared: Path = SHARED_TFDS) -> Optional[str]:
    """``data.data_dir``, else the ``TFDS_DATA_DIR`` environment variable, else ``shared``
    (``../shared/tensorflow_datasets`` beside the repository) when that folder exists, else None (TFDS's
    default, ``~/tensorflow_datasets``)."""
    return data_dir or os.environ.get("TFDS_DATA_DIR") or (str(shared) if shared.is_dir() else None)


def load_tfds_split(
    tfds_name: str, split: str, data_dir: Optional[str], cache_dir: str, download: bool = True
) -> HostDataset:
    """Reads one TFDS split into host arrays, through a cache of decoded arrays.

    The first read decodes every PNG (slow: seconds for MNIST) and writes
    ``<cache_dir>/<name>-<version>-<split>.npz``; later reads load that file. The cache is
    never written inside the TFDS folder, which may be read-only.

    A dataset that is not prepared under ``data_dir`` is downloaded and prepared there first
    (``prepare_tfds``) unless ``download`` is False (``data.download=false``).

    A cache file that cannot be read (cut short, damaged) is named in a warning and made again.

    Raises:
      DataError: the dataset is not prepared and ``download`` is False, or its download/preparation failed, or
        a prepared split cannot be read (its files and the error named).
    """
    data_dir = resolve_data_dir(data_dir)
    version = prepared_version(tfds_name, data_dir)
    cache = Path(cache_dir).expanduser() / f"{tfds_name}-{version or 'unknown'}-{split}.npz"
    if version is not None and cache.exists():
        try:
            with np.load(cache) as f:
                return HostDataset(images=f["images"], labels=f["labels"])
        except Exception as e:  # a cut or damaged cache (zipfile, numpy and OS errors): derived data, made again
            log.warning(
                "the data cache %s cannot be read (%s); decoding %s/%s again", cache, error_text(e), tfds_name, split
            )
    try:
        source = _data_source(tfds_name, split, data_dir)
    except Exception as e:  # TFDS raises several kinds (AssertionError, NotImplementedError, FileNotFoundError)
        where = data_dir or "TFDS's default folder (~/tensorflow_datasets)"
        if version is not None:  # prepared, yet unreadable: name it rather than call it missing
            raise unreadable(tfds_name, split, data_dir, version, e) from None
        if not download:
            raise DataError(
                f"dataset {tfds_name!r} ({split}) is not prepared in {where} and data.download=false "
                f"({type(e).__name__}); point TFDS_DATA_DIR (or data.data_dir) at a prepared copy, set "
                f"data.download=true, or run with data=synthetic"
            ) from None
        prepare_tfds(tfds_name, data_dir)
        version = prepared_version(tfds_name, data_dir)
        try:
            source = _data_source(tfds_name, split, data_dir)
        except Exception as e:
            raise unreadable(tfds_name, split, data_dir, version, e) from None
    t0 = time.perf_counter()
    try:
        with small_thread_stacks():
            images, labels = _decode_all(source)
    except Exception as e:  # a damaged record file (e.g. "Corrupted Riegeli/records file"), an undecodable image
        raise unreadable(tfds_name, split, data_dir, version, e) from None
    log.info(
        "decoded %s/%s (%d examples) in %.1f s; caching to %s",
        tfds_name,
        split,
        len(labels),
        time.perf_counter() - t0,
        cache,
    )
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}.npz")
        np.savez(tmp, images=images, labels=labels)
        os.replace(tmp, cache)  # atomic: concurrent jobs never read a half-written cache
    except OSError as e:
        log.warning("could not write the data cache %s (%s); the next run decodes again", cache, e)
    return HostDataset(images=images, labels=labels)


# an allocation that failed while reading (under ulimit -v a library's import fails to map its code): not damage
OUT_OF_MEMORY_WORDS = ("failed to map segment", "Cannot allocate memory", "can't start new thread")


def unreadable(tfds_name: str, split: str, data_dir: Optional[str], version: Optional[str], error: Exception):
    """The one-line ``DataError`` for a prepared split that cannot be read: its files (or folder) and the error; an
    allocation that failed while reading says so, not that the files are damaged."""
    if isinstance(error, MemoryError) or any(word in str(error) for word in OUT_OF_MEMORY_WORDS):
        return DataError(
            f"out of memory while reading dataset {tfds_name!r} ({split}) ({error_text(error)}): the files are not "
            f"known to be damaged; run with more memory (a larger ulimit -v or memory limit)"
        )
    folder = Path(data_dir or Path.home() / "tensorflow_datasets") / tfds_name.partition(":")[0] / (version or "")
    files = sorted(folder.glob(f"*-{split}.*")) if folder.is_dir() else []
    where = ", ".join(map(str, files[:2])) + (f" (+{len(files) - 2} more)" if len(files) > 2 else "") or str(folder)
    return DataError(
        f"dataset {tfds_name!r} ({split}) cannot be read from {where} ({error_text(error)}); prepare it again (move "
        f"{folder} away and run with data.download=true), or point data.data_dir (unset: TFDS_DATA_DIR) at a good copy"
    )


POOL_STACK_BYTES = 1 << 20  # a thread's stack in small_thread_stacks: a reader's, not a compiler's


@contextlib.contextmanager
def small_thread_stacks(stack: int = POOL_STACK_BYTES) -> Iterator[None]:
    """Under ``RLIMIT_AS``, threads started inside (without a stack size of their own) get ``stack`` bytes of stack
    (glibc's ``pthread_setattr_default_np``; the default is restored after): array_record's reader, which TFDS's
    ``data_source`` opens, starts a pool of 64 threads that lives as long as the process, 512 MiB of 8 MiB stacks
    that the limit counts (the ViT's first run under ``ulimit -v`` 1.5 GB, decoding MNIST: ``std::bad_alloc``, exit
    134). Elsewhere, or without glibc, nothing changes."""
    libc = ctypes.CDLL(None) if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY else None
    if libc is None or not hasattr(libc, "pthread_setattr_default_np"):
        yield
        return
    old, new = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)  # pthread_attr_t: 56 bytes
    libc.pthread_attr_init(new)
    libc.pthread_attr_setstacksize(new, ctypes.c_size_t(stack))
    if libc.pthread_getattr_default_np(old) != 0 or libc.pthread_setattr_default_np(new) != 0:
        yield
        return
    try:
        yield
    finally:
        libc.pthread_setattr_default_np(old)


def _data_source(tfds_name: str, split: str, data_dir: Optional[str]):
    import tensorflow_datasets as tfds

    with small_thread_stacks():  # its reader's pool of 64 threads, under ulimit -v
        return tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False)


def prepare_tfds(tfds_name: str, data_dir: Optional[str], probe_timeout_s: float = 10.0) -> None:
    """Downloads and prepares ``tfds_name`` under ``data_dir`` as array_record (TFDS's progress bars show it).

    No TensorFlow is needed for image data sets such as MNIST: TFDS's ``GeneratorBasedBuilder`` with
    ``file_format='array_record'`` encodes the images with Pillow and writes array_record files; TFDS needs the
    ``importlib_resources`` package to load the builder (requirements.txt). Raw files already on disk are
    taken from TFDS's manual folder, ``<data_dir>/downloads/manual/<file name of the URL>`` (e.g.
    ``train-images-idx3-ubyte.gz``), with their checksums verified, and nothing is downloaded. Before
    downloading, the download host is probed once (``probe_timeout_s``): without a network the run stops in
    seconds rather than after TFDS's retries.

    Raises:
      DataError: one line, when the download or the preparation fails.
    """
    import socket
    import urllib.parse

    try:
        import tensorflow_datasets as tfds

        root = Path(data_dir or Path.home() / "tensorflow_datasets")
        builder = _builder(tfds_name, root)
        manual = root / "downloads" / "manual"
        missing = (
            [u for u, info in builder.url_infos.items() if not (info.filename and (manual / info.filename).exists())]
            if builder.url_infos
            else []
        )
        for host in sorted({urllib.parse.urlparse(u).hostname for u in missing}):
            try:
                socket.create_connection((host, 443), timeout=probe_timeout_s).close()
            except OSError as e:
                raise DataError(
                    f"dataset {tfds_name!r} is not prepared in {root} and {host} cannot be reached "
                    f"({type(e).__name__}: {e}); connect to the internet, put the raw files in "
                    f"{manual}, point TFDS_DATA_DIR at a prepared copy, or run with data=synthetic"
                )
        log.warning(
            "preparing %s in %s (first use only): %s",
            tfds_name,
            root,
            "downloading its files" if missing else f"from the raw files in {manual}",
        )
        _patch_download_manager(builder, manual)
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(manual)))
    except DataError:
        raise
    except Exception as e:
        line = first_line(e, 300)
        raise DataError(
            f"dataset {tfds_name!r} could not be downloaded and prepared in "
            f"{data_dir or '~/tensorflow_datasets'} ({type(e).__name__}: {line}); point TFDS_DATA_DIR "
            f"at a prepared copy, or run with data=synthetic"
        ) from None


def _builder(tfds_name: str, root: Path):
    """The TFDS builder that prepares ``tfds_name`` under ``root`` as array_record, without TensorFlow where
    this module knows how (``NUMPY_BUILDERS``), else TFDS's own (which may need TensorFlow)."""
    import tensorflow_datasets as tfds

    name, _, version = tfds_name.partition(":")
    if name in ("mnist", "fashion_mnist") and version in ("", "3.0.1"):
        return _numpy_idx_builder(name)(data_dir=str(root), file_format="array_record")
    return tfds.builder(tfds_name, data_dir=str(root), file_format="array_record")


def _numpy_idx_builder(name: str):
    """TFDS's ``mnist`` / ``fashion_mnist`` builder with a TensorFlow-free ``_generate_examples``.

    TFDS 4.9.10 reads the idx files with ``tf.io.gfile`` and encodes images with ``tf.image.encode_png``, so
    stock TFDS cannot prepare MNIST without TensorFlow. This subclass (same name, version, features and splits;
    not registered, so TFDS's own stays the registered one) reads the extracted idx files with numpy (header:
    16 bytes for images, 8 for labels; big-endian sizes, uint8 data, LeCun et al.) and encodes each 28x28x1
    image as PNG with Pillow. PNG is lossless: the decoded pixels equal those of a copy prepared by TFDS with
    TensorFlow (tests/test_datasets.py compares all 70,000 MNIST examples).
    """
    import io

    from PIL import Image
    from tensorflow_datasets.image_classification import mnist

    base = {"mnist": mnist.MNIST, "fashion_mnist": mnist.FashionMNIST}[name]

    class NumpyIdx(base, skip_registration=True):
        def _generate_examples(self, num_examples, data_path, label_path):
            images = np.frombuffer(Path(data_path).read_bytes(), np.uint8, offset=16).reshape(num_examples, 28, 28, 1)
            labels = np.frombuffer(Path(label_path).read_bytes(), np.uint8, offset=8).astype(np.int64)
            for i in range(num_examples):
                buf = io.BytesIO()
                Image.fromarray(images[i, :, :, 0]).save(buf, format="PNG")
                yield i, {"image": buf.getvalue(), "label": labels[i]}

    NumpyIdx.name = base.name
    NumpyIdx._checksums_path = base._checksums_path  # TFDS's registered checksums of the raw files
    return NumpyIdx


def _extract_without_tf(path: Path, extract_root: Path) -> Path:
    """Extracts one downloaded archive with Python's own modules (TFDS's extractor copies through
    ``tf.io.gfile`` and needs TensorFlow): ``x.gz`` -> a file, ``.tar[.gz]``/``.tgz``/``.zip`` -> a folder;
    anything else is returned as it is. Already extracted outputs are reused."""
    import gzip
    import shutil

    path = Path(path)
    name = path.name
    if name.endswith((".tar.gz", ".tgz", ".tar", ".zip")):
        out = extract_root / f"ARCHIVE.{name}"
        if not out.exists():
            tmp = extract_root / f"{out.name}.tmp{os.getpid()}"
            shutil.unpack_archive(str(path), str(tmp))
            os.replace(tmp, out)
        return out
    if name.endswith(".gz"):
        out = extract_root / f"GZIP.{name[:-3]}"
        if not out.exists():
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            with gzip.open(path, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, out)
        return out
    return path


def _patch_download_manager(builder, manual: Path) -> None:
    """Makes TFDS's download manager of ``builder`` work without TensorFlow and with re-compressed raw files.

    1. Raw files in the manual folder: TFDS checks a manual file against the SHA-256 of the file it would
       download; a genuine copy compressed again (another gzip header, as in ``../shared/data/mnist``) fails
       that check although its content is the same. For the files present in ``manual`` the expected
       checksum becomes the file's own, so they are used as given; the builder still checks what it reads
       (MNIST: 60,000 + 10,000 examples of 28x28x1). Downloaded files keep TFDS's registered checksums.
    2. ``download_and_extract`` downloads with TFDS, then extracts with ``_extract_without_tf``.

    Uses TFDS internals (``_make_download_manager``, ``_url_infos``; tensorflow-datasets 4.9.10).
    """
    import jax  # only for its tree utilities (already imported by the training code)
    from tensorflow_datasets.core.download import checksums

    make = builder._make_download_manager

    def make_patched(*args, **kwargs):
        manager = make(*args, **kwargs)
        infos = dict(manager._url_infos or {})
        for url, info in infos.items():
            path = manual / (info.filename or "")
            if info.filename and path.exists():
                infos[url] = dataclasses.replace(checksums.compute_url_info(path), filename=info.filename)
        manager._url_infos = infos
        extract_root = Path(manager.download_dir) / "extracted"

        def download_and_extract(url_or_urls):
            extract_root.mkdir(parents=True, exist_ok=True)
            downloaded = manager.download(url_or_urls)
            return jax.tree.map(
                lambda p: _extract_without_tf(Path(p), extract_root),
                downloaded,
                is_leaf=lambda x: not isinstance(x, (dict, list, tuple)),
            )

        manager.download_and_extract = download_and_extract
        return manager

    builder._make_download_manager = make_patched


def tfds_fingerprint(tfds_name: str, data_dir: Optional[str], split: str, examples: int) -> dict:
    """What a run trained on, recorded with its checkpoints: ``{"kind": "tfds", "dataset", "version" (the
    prepared one read, None when unknown), "split", "examples"}``."""
    version = prepared_version(tfds_name, resolve_data_dir(data_dir))
    return {"kind": "tfds", "dataset": tfds_name, "version": version, "split": split, "examples": examples}


def prepared_version(tfds_name: str, data_dir: Optional[str]) -> Optional[str]:
    """Newest prepared version folder of ``tfds_name`` under ``data_dir`` (None when not found)."""
    root = Path(data_dir or Path.home() / "tensorflow_datasets") / tfds_name
    if not root.is_dir():
        return None
    versions = sorted(
        (p.name for p in root.iterdir() if (p / "dataset_info.json").exists()),
        key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()),
    )
    return versions[-1] if versions else None


def _decode_all(source, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    n = len(source)
    images, labels = [], []
    for start in range(0, n, chunk):
        records = source.__getitems__(list(range(start, min(n, start + chunk))))
        images.append(np.stack([r["image"] for r in records]))
        labels.append(np.asarray([r["label"] for r in records], dtype=np.int32))
    return np.concatenate(images).astype(np.uint8), np.concatenate(labels)
