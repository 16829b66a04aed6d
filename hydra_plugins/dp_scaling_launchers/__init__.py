"""Hydra launcher plugins of this repository (found by Hydra's plugin scan of the ``hydra_plugins`` namespace)."""
