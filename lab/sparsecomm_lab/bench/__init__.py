"""Benchmarks: one module per `sparsecomm bench NAME`."""
