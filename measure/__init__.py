"""Measurement of a compiled step and of a run: communication accounting (``collectives``, ``hlo_text``,
``stablehlo``), memory/FLOPs/hardware tables (``compiled``), rates such as MFU (``rates``) and the profiler
(``profiler``). Imports ``core`` and libraries only."""
