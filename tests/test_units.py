"""The one size parser and formatter: what people write, what they get, and what is refused."""

from __future__ import annotations

import re

import pytest

from ple_um import units


@pytest.mark.parametrize(
    "text, expect",
    [
        ("0", 0),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("1e3", 1000),
        ("512MiB", 512 << 20),
        ("512mb", 512 << 20),
        ("512M", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("1.5KiB", 1536),
        ("0.1KiB", 102),  # a fraction with a suffix rounds down to whole bytes
        ("1T", 1 << 40),
        ("2tib", 2 << 40),
        ("9007199254740993", (1 << 53) + 1),  # exact past a float's 53 bits
        ("9223372036854775807", units.MAX_SIZE),
        ("8388607T", 8388607 << 40),
    ],
)
def test_sizes_as_people_write_them(text, expect):
    assert units.parse_size(text) == expect


@pytest.mark.parametrize(
    "text", ["", "abc", "GiB", "1.5", "0.5", "-1", "-1GiB", "-0.5KiB", "inf", "nan", "4GB,"]
)
def test_sizes_that_are_not_byte_counts_are_refused(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        units.parse_size(text)


@pytest.mark.parametrize("text", ["1e30", "1e19", "9223372036854775808", "8388608T", "1e10T", "9" * 400])
def test_sizes_past_a_64_bit_byte_count_are_refused(text):
    """A size a signed 64-bit count cannot hold (C's int64_t and off_t, where sizes end up) is
    refused, not taken as an absurd count."""
    message = f"expected a byte count of at most 8 EiB (2**63 - 1 bytes), got {text!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        units.parse_size(text)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (3 << 29, "1.50 GiB"), (5 << 40, "5.00 TiB")],
)
def test_sizes_written_in_the_largest_unit_that_keeps_them_at_one_or_more(n, text):
    assert units.format_bytes(n) == text
