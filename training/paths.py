"""User paths resolved against the folder the command was started in, whatever Hydra's working directory is.

With ``hydra.job.chdir=true`` Hydra runs each job inside its own timestamped folder, so a relative
``checkpoint.dir=ckpt/x`` would land in (and be looked for in) every job's folder, and a relative
``TFDS_DATA_DIR`` would not be found. ``absolute_paths`` makes every path the user gives absolute against
``hydra.utils.get_original_cwd()`` once, before anything reads them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

from conf.schema import Config


def absolute(path: Optional[str], base: Path) -> Optional[str]:
    """``path`` with ``~`` expanded and, when relative, joined to ``base``; None/empty stay as they are."""
    if not path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else Path(base) / p)


def absolute_paths(cfg: Config, base: Path, environ=os.environ) -> Config:
    """A copy of ``cfg`` whose ``checkpoint.dir``, ``checkpoint.resume`` (a path), ``data.data_dir``,
    ``data.cache_dir``, ``data.tokenizer_file`` and ``runtime.compilation_cache_dir`` are absolute against ``base``
    (the launch folder); a relative ``TFDS_DATA_DIR`` in ``environ`` is made absolute there too (in place)."""
    ck, d = cfg.checkpoint, cfg.data
    resume = ck.resume if ck.resume in ("auto", "never") else absolute(ck.resume, base)
    tfds_dir = environ.get("TFDS_DATA_DIR")
    if tfds_dir:
        environ["TFDS_DATA_DIR"] = absolute(tfds_dir, base)
    return dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(ck, dir=absolute(ck.dir, base), resume=resume),
        data=dataclasses.replace(
            d,
            data_dir=absolute(d.data_dir, base),
            cache_dir=absolute(d.cache_dir, base),
            tokenizer_file=absolute(d.tokenizer_file, base),
        ),
        runtime=dataclasses.replace(
            cfg.runtime, compilation_cache_dir=absolute(cfg.runtime.compilation_cache_dir, base)
        ),
    )
