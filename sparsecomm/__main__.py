"""``python -m sparsecomm ...`` is the ``sparsecomm`` command (useful under torchrun)."""

from .cli import run

run()
