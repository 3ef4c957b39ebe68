"""``python -m lowprec compare ...``: the same as the ``lowprec`` console script."""

import sys

from .compare.cli import main

sys.exit(main())
