"""``python -m deploy.cli ...``: the ``streamrec`` command (torchrun ranks start it so)."""

import sys

from deploy.cli import main

sys.exit(main())
