"""``python -m sweeps.report``."""

import sys

from sweeps.report.cli import main

sys.exit(main())
