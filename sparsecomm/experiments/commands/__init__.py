"""Top-level CLI commands: one module per `sparsecomm NAME`."""
