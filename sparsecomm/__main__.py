"""``python -m sparsecomm ...`` is the ``sparsecomm`` command (useful under torchrun)."""

import sys

from .cli import main

sys.exit(main())
