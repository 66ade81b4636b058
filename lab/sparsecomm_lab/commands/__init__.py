"""The experiments' commands: one module per `sparsecomm NAME` (the library's own are in :mod:`sparsecomm.cli`)."""
