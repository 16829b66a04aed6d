"""Input pipeline: TFDS / synthetic sources, one global permutation per epoch, per-process slices."""
