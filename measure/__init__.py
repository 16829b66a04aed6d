"""Measurements and models of the machine: hardware profiles (hardware.py)."""
