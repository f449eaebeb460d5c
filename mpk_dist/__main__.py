"""``python -m mpk_dist`` runs the command line."""

import sys

from mpk_dist.cli import main

sys.exit(main())
