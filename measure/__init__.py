"""Measurement of a compiled step and of a run: communication accounting (``collectives``, ``hlo_text``,
``stablehlo``), memory/FLOPs/hardware tables (``compiled``), rates such as MFU (``rates``), the profiler
(``profiler``), per-run throughput statistics (``throughput``) and hardware profiles (``hardware``). Imports
``core`` and libraries only."""
