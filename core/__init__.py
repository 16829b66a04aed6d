"""The bottom layer: the pure training step and what it needs (precision, optimizer, batch layout, augmentation,
errors). Imports only libraries; ``parallel/``, ``data/``, ``measure/`` and ``training/`` build on it."""
