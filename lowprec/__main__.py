"""``python -m lowprec compare ...``: the same as the ``lowprec`` console script."""

import sys

from .compare import main

sys.exit(main())
