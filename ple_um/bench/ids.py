"""The ids the bench looks up: uniform over the table, Zipf-distributed n-grams hashed onto rows,
or a trace of real traffic (``trace[:FILE]``: ``bench/trace.py``).

Real PLE traffic is skewed: a few n-grams come up again and again, most rarely. The model hashes
each n-gram onto a row, so the hot rows are scattered over the whole table, not packed at its
start. ``zipf:S`` draws n-gram ranks from Zipf(S) over a large n-gram space (rank 1 the most
frequent) and sends each through a fixed multiplicative hash onto ``[0, num_rows)``; every call
draws afresh from the same distribution, so the same rows stay hot from call to call, as in a
server. ``zipf:S:NGRAMS`` draws from a space of NGRAMS n-grams instead: the smaller the space, the
less of the traffic falls in its long tail, and the more of it a cache of a given size can serve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ple_um.units import parse_size

# N-grams the ranks are drawn from: far more than any table has rows, as with real n-gram hashing
# (many n-grams share a row).
NGRAM_SPACE = 1 << 40
# Knuth's multiplicative hash constant (2^64 / golden ratio, odd): consecutive ranks land far apart.
HASH_MULTIPLIER = 0x9E3779B97F4A7C15
# numpy's Zipf sampler needs S > 1, and draws past NGRAM_SPACE are drawn again: near S = 1 that is
# most of them (over a third at 1.01), so S stays in this range.
ZIPF_RANGE = (1.01, 10.0)
# The n-gram spaces ``zipf:S:NGRAMS`` accepts: at least two n-grams, at most the default space. A
# small space with S near 1 draws many times per id (``zipf_ngrams`` draws again past the space).
SPACE_RANGE = (2, NGRAM_SPACE)


def hash_onto_rows(ngrams: np.ndarray, num_rows: int) -> np.ndarray:
    """Each n-gram id's row: the id times HASH_MULTIPLIER modulo 2^64, its high half folded into the
    low half, modulo ``num_rows`` (int64)."""
    h = ngrams.astype(np.uint64) * np.uint64(HASH_MULTIPLIER)  # wraps modulo 2^64
    h ^= h >> np.uint64(32)
    return (h % np.uint64(num_rows)).astype(np.int64)


def zipf_ngrams(rng: np.random.Generator, s: float, n: int, space: int = NGRAM_SPACE) -> np.ndarray:
    """``n`` n-gram ranks in ``[1, space]`` drawn from Zipf(s) restricted to the space."""
    out = rng.zipf(s, size=n)
    while True:
        beyond = np.flatnonzero(out > space)
        if beyond.size == 0:
            return out
        out[beyond] = rng.zipf(s, size=beyond.size)


@dataclass(frozen=True)
class IdDistribution:
    """One way to draw a lookup's ids: ``uniform``, ``zipf:S`` or ``zipf:S:NGRAMS``."""

    name: str
    s: float | None = None  # the Zipf exponent; None for uniform
    space: int = NGRAM_SPACE  # the n-grams a Zipf draw comes from

    def draw(self, rng: np.random.Generator, num_rows: int, n: int) -> np.ndarray:
        """``n`` fresh ids in ``[0, num_rows)`` (int64)."""
        if self.s is None:
            return rng.integers(0, num_rows, size=n)
        return hash_onto_rows(zipf_ngrams(rng, self.s, n, self.space), num_rows)

    def describe(self) -> dict:
        if self.s is None:
            return {"kind": "uniform"}
        return {
            "kind": "zipf",
            "s": self.s,
            "ngram_space": self.space,
            "hash": f"h = ngram * {HASH_MULTIPLIER:#x} mod 2^64; row = (h xor (h >> 32)) mod num_rows",
        }


def parse_ids(text: str) -> tuple:
    """``uniform``, ``zipf:S[:NGRAMS]``, ``trace[:FILE]`` or a comma-separated list of them; ValueError
    naming what is accepted. A trace (``trace.TraceIds``) replays the committed sample, or the
    trace file FILE; ``trace-decode[:FILE]`` and ``trace-prefill[:FILE]`` replay every lookup as a
    decode step or as a prefill chunk (``trace`` chooses by the lookup's size). A trace file's path
    cannot hold a comma."""
    accepted = (
        f"expected uniform or zipf:S[:NGRAMS] with {ZIPF_RANGE[0]} <= S <= {ZIPF_RANGE[1]:g} and "
        f"{SPACE_RANGE[0]} <= NGRAMS <= 2^{SPACE_RANGE[1].bit_length() - 1} "
        "(e.g. uniform,zipf:1.1,zipf:1.1:64M), or trace[:FILE], trace-decode[:FILE], trace-prefill[:FILE]"
    )
    found: list = []
    parts = text.split(",")
    for i, item in enumerate(part.strip() for part in parts):
        kind, _, arg = item.partition(":")
        if kind in TRACE_KINDS:
            dist = _trace_ids(kind, arg, item, parts[i:])
        elif item == "uniform":
            dist = IdDistribution("uniform")
        elif kind == "zipf":
            dist = _zipf(arg, item, accepted)
        else:
            raise ValueError(f"{item!r} is not an id distribution: {accepted}")
        if dist.name in [d.name for d in found]:
            raise ValueError(f"{item!r} is named twice in {text!r}")
        found.append(dist)
    return tuple(found)


def _zipf(arg: str, item: str, accepted: str) -> IdDistribution:
    """``zipf:S`` or ``zipf:S:NGRAMS`` (NGRAMS a count with an optional binary suffix: 64M is 2^26)."""
    exponent, colon, ngrams = arg.partition(":")
    try:
        s = float(exponent)
        space = parse_size(ngrams) if colon else NGRAM_SPACE
    except ValueError:
        raise ValueError(f"{item!r} is not an id distribution: {accepted}") from None
    if not ZIPF_RANGE[0] <= s <= ZIPF_RANGE[1]:
        raise ValueError(f"{item!r}: the Zipf exponent {exponent} is out of range: {accepted}")
    if not SPACE_RANGE[0] <= space <= SPACE_RANGE[1]:
        raise ValueError(f"{item!r}: the n-gram space {ngrams} is out of range: {accepted}")
    return IdDistribution(f"zipf:{s:g}:{ngrams.strip()}" if colon else f"zipf:{s:g}", s, space)


TRACE_KINDS = {"trace": "auto", "trace-decode": "decode", "trace-prefill": "prefill"}


def _trace_ids(kind: str, path: str, item: str, parts: list[str]):
    """``item``'s trace; ``parts``: the list's items from this one on, as split, so that a trace
    file whose path has a comma (split into two items) is named, and refused for its comma."""
    from ple_um.bench.trace import TraceError, TraceIds

    if path and not os.path.isfile(path):
        for end in range(2, len(parts) + 1):
            whole = ",".join(parts[:end]).strip().partition(":")[2]
            if os.path.isfile(whole):
                raise ValueError(
                    f"the trace file {whole} has a comma in its path, and commas separate the id "
                    "distributions: give it by a path without one (a symbolic link to it)"
                )
        raise ValueError(f"{item!r}: no trace file {path}")
    try:
        return TraceIds(path or None, TRACE_KINDS[kind])
    except TraceError as exc:
        raise ValueError(f"{item!r}: {exc}") from None
