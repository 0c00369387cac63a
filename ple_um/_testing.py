"""Test hooks: environment variables with which the test suite makes ple-um fail on purpose.

They are not knobs: no user sets them, and ``ple-um knobs`` and docs/OPERATING.md do not list them.
Each is declared here as a ``Knob`` (so that a value it does not take is refused, named) and read
only at the one place it hooks into. docs/DESIGN.md ("Test hooks") lists them for contributors.
"""

from __future__ import annotations

from ple_um import knob_values as v
from ple_um.knob_values import Knob

# What a test can make the first-read child do instead of passing (tests/access/test_first_read.py).
FIRST_READ_FAULTS = ("segv", "abort", "hang", "exit", "error", "corrupt")

HOOKS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "PLE_UM_FIRST_READ_FAULT",
            v.choice(*FIRST_READ_FAULTS),
            None,
            "the first-read child crashes (segv, abort), hangs, exits at once (exit), fails with a "
            "CUDA-like error (error) or corrupts the rows it compares (corrupt)",
        ),
    )
}


def first_read_fault() -> str | None:
    """The fault the first-read child injects (one of ``FIRST_READ_FAULTS``), or None."""
    return HOOKS["PLE_UM_FIRST_READ_FAULT"].value()
