"""Byte counts as people write them: ``parse_size("16GiB")`` and ``format_bytes(16 << 30)``.

The one parser and the one formatter of the package: knobs, CLI options, log lines, reasons and
reports all write sizes the same way.
"""

from __future__ import annotations

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# The largest size taken: what a signed 64-bit byte count or file offset holds, where every size
# ends up (C's int64_t and off_t, torch's sizes); 8 EiB, past any machine's memory or disk.
MAX_SIZE = (1 << 63) - 1


def parse_size(text: str) -> int:
    """Bytes, with an optional binary suffix: 4096, 512MiB, 1.5GiB, 1T (= TiB); never negative, at
    most ``MAX_SIZE``. A size with a suffix may have a fraction (rounded down to whole bytes); one
    without is a whole number of bytes, exact however many digits it has. ValueError saying what is
    accepted."""
    low = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(low[-1:], 1)
    digits = low[:-1] if scale > 1 else low
    try:
        number = float(digits)  # inf and nan: OverflowError or ValueError below
        value = int(digits) * scale if digits.isdecimal() else int(number * scale)
    except (ValueError, OverflowError):
        raise ValueError(
            f"expected a byte count with an optional binary suffix (4096, 512MiB, 48GiB, 1T), got {text!r}"
        ) from None
    if value < 0 or number < 0:
        raise ValueError(f"expected a byte count >= 0, got {text!r}")
    if value > MAX_SIZE:
        raise ValueError(f"expected a byte count of at most 8 EiB (2**63 - 1 bytes), got {text!r}")
    if scale == 1 and not number.is_integer():
        raise ValueError(f"expected a whole number of bytes or a suffix (1536, 1.5KiB), got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit up to TiB that keeps them at 1 or more: 512 B, 1.50 KiB,
    47.68 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
