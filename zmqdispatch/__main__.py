"""``python -m zmqdispatch`` runs the command line (:mod:`zmqdispatch.cli`)."""

import sys

from .cli import main

sys.exit(main())
