"""ple_um.checkpoint.header_json: the nesting scan that runs before a header or an index is parsed.

The scan gives the verdicts the regular expression it replaces gave (kept here as the reference, on
short texts: its memory grew 120 bytes a character of a string), and a 90 MB string, under the
100 MB header cap, is read in a child process whose address space is bounded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.hand_checkpoints import INDEX, ple, shard
from helpers.reference import write_safetensors
from hypothesis import given, settings
from hypothesis import strategies as st

from ple_um.checkpoint.header_json import _nesting

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def regex_nesting(raw: bytes) -> int:
    """The reference: strings cut out by a regular expression, then the running bracket count."""
    bare = np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)
    step = np.isin(bare, list(b"[{")).astype(np.int64) - np.isin(bare, list(b"]}")).astype(np.int64)
    return int(np.cumsum(step).max(initial=0))


TEXT = st.binary(max_size=300).map(lambda b: bytes(b'[]{}"\\ax'[x % 8] for x in b))


@settings(max_examples=400, deadline=None, database=None)
@given(TEXT, st.sampled_from([1, 2, 3, 7, 64, 1 << 20]))
def test_same_verdict_as_the_regular_expression(text, window):
    """Any text over the bytes that matter (brackets, quotes, backslashes), cut into windows of any
    size, so that a run of backslashes or a string crosses a window's edge."""
    assert _nesting(text, window) == regex_nesting(text)


@pytest.mark.parametrize(
    "text, depth",
    [
        (b'{"a": [1, {"b": "]]]"}]}', 3),
        (b'["\\"[[[", [[]]]', 3),  # an escaped quote does not close the string
        (b'["\\\\", [[]]]', 3),  # an escaped backslash does not escape the quote after it
        (b'["\\\\\\"[[["]', 1),
        (b'["abc [[[', 4),  # a string that never closes is not a string
        (b'\\"[[[" [', 1),  # a quote outside a string opens one, backslash or not
        (b"[" * 100_000, 100_000),
    ],
)
def test_strings_and_escapes(text, depth):
    for window in (1, 2, 5, 1 << 20):
        assert _nesting(text, window) == depth == regex_nesting(text), window


# A child that bounds its own address space to what it maps after its imports plus BUDGET, then
# reads the layout; the regular expression took 10.7 GiB (and 22 s) for a 90 MB string.
BUDGET = 1 << 30
_CHILD = textwrap.dedent(
    """
    import resource, sys
    from ple_um.checkpoint import read_layout
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[2]), resource.RLIM_INFINITY))
    print(read_layout(sys.argv[1]).num_rows)
    """
)
LONG = 90_000_000


def _read_bounded(directory) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(directory), str(BUDGET)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_a_90_mb_metadata_string_is_read_in_bounded_memory(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", ple(), metadata={"note": "x" * LONG})
    assert os.path.getsize(tmp_path / "model.safetensors") > LONG
    assert _read_bounded(tmp_path) == "9"


def test_a_90_mb_string_in_the_index_is_read_in_bounded_memory(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", ple())
    weight_map = {name: "model.safetensors" for name in ple()}
    assert shard(0) in weight_map
    index = {"metadata": {"total_size": 0, "note": "\n" * (LONG // 2)}, "weight_map": weight_map}
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert os.path.getsize(tmp_path / INDEX) > LONG
    assert _read_bounded(tmp_path) == "9"
