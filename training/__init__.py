from training import process  # noqa: F401  (its WarningLines: each product warning on stderr)
