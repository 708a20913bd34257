"""`python -m replaygen` runs the CLI (the same as the `replaygen` console script)."""

import sys

from replaygen.cli import main

sys.exit(main())
