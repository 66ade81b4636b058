"""The application layer: the local launcher and network emulation, training, models and data,
benchmarks, reports and the ``sparsecomm`` command line."""
