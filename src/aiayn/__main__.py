"""``python -m aiayn``: the same command line as the ``aiayn`` script."""

import sys

from aiayn.cli import main

sys.exit(main())
