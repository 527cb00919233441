"""`python -m tidal.router ...` is `tidal router ...`."""

import sys

from tidal.router.cli import main

sys.exit(main())
