"""``python -m indices`` = ``evospec-index``."""

import sys

from indices.cli import main

sys.exit(main())
