"""The user-facing choices of ``parallel.*`` that the config schema names (no jax import: ``conf.schema`` reads
them)."""

from __future__ import annotations

import enum


class Compression(enum.StrEnum):
    """``parallel.grad_compression``: none, or int8 (``parallel.compress``: quantised all-to-all, int32 sum, int8
    all-gather, with error feedback; the residual is mode-owned state, ``parallel.feedback``)."""

    none = "none"
    int8 = "int8"


COMPRESSIONS = tuple(c.value for c in Compression)

# the variant of ``sweeps.comm_optimisations`` for each compression (with error feedback): name -> override
COMPRESSION_VARIANTS = {f"{c}_ef": f"parallel.grad_compression={c}" for c in COMPRESSIONS if c != "none"}
