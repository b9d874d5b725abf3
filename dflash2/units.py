"""Human-readable sizes: '8MiB', '20GiB', '512KB', or a plain number of bytes."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | str | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use e.g. 8MiB, 20GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
