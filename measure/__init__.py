"""Measurements and models of the machine: per-run throughput statistics (throughput.py), hardware profiles
(hardware.py)."""
