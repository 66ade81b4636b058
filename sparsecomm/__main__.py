"""``python -m sparsecomm ...`` is the ``sparsecomm`` command (useful under torchrun)."""

import sys

from .app.cli import main

sys.exit(main())
