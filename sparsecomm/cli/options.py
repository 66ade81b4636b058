"""Parsing of the command line's option values shared by the commands and the benches."""

from __future__ import annotations

import re

__all__ = ["parse_count"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}


def parse_count(text: str) -> int:
    """An element count with a decimal suffix: '25M' -> 25_000_000, '1000' -> 1000, '2.5k' -> 2500.
    (Byte sizes of the network emulation are :func:`sparsecomm.launch.netemu.parse_size`.)"""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"size {text!r} must be a number with an optional k/M/G suffix, e.g. 25M")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
