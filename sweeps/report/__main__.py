"""``python -m sweeps.report``: a signal stops it with one line (``training.process.run_tool``)."""

from training import process


def main() -> int:
    from sweeps.report.cli import main as report  # imported under the stop handlers: a Ctrl-C in it is one line

    return report()


process.run_tool(main, imports_jax=False)
