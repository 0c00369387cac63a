"""Byte counts as people write them: ``parse_size("16GiB")`` and ``format_bytes(16 << 30)``.

The one parser and the one formatter of the package: knobs, CLI options, log lines, reasons and
reports all write sizes the same way.
"""

from __future__ import annotations

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes, with an optional binary suffix: 4096, 512MiB, 1.5GiB, 1T (= TiB); never negative.
    A size with a suffix may have a fraction (rounded down to whole bytes); one without is a whole
    number of bytes. ValueError saying what is accepted."""
    low = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(low[-1:], 1)
    try:
        number = float(low[:-1] if scale > 1 else low)
        value = int(number * scale)
    except (ValueError, OverflowError):
        raise ValueError(
            f"expected a byte count with an optional binary suffix (4096, 512MiB, 48GiB, 1T), got {text!r}"
        ) from None
    if value < 0 or number < 0:
        raise ValueError(f"expected a byte count >= 0, got {text!r}")
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
