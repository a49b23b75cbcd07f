"""``python -m pipeline.cli``: the ``sat`` command (what a Ray Job runs)."""

import sys

from pipeline.cli.main import main

sys.exit(main())
