"""A trace of real PLE traffic: the token ids of real requests and the table rows vLLM's n-gram hash
gives each token, and its replay as a server's lookups.

File format (``FORMAT``): one ``.npz`` (numpy's zip of arrays, read with ``allow_pickle=False``;
``tools/make_trace.py`` compresses its members with LZMA, which Python's ``zipfile`` reads):

- ``tokens``: uint32 [T], the token ids of every request, request after request;
- ``rows``: uint32 or int64 [T, H], the H table rows of each token, in the order of vLLM's
  ``compute_ngram_ids`` (the bigram heads, then the trigram heads);
- ``offsets``: int64 [Q + 1], request q is ``tokens[offsets[q]:offsets[q + 1]]`` (0 first, T last);
- ``context``: int64 [Q, N - 1], the N - 1 tokens before each request's first token, as vLLM's
  ``ngram_context`` holds them (the eos id where the request starts at its beginning), so that
  ``compute_ngram_ids(tokens of q, [0, len], context[q])`` gives ``rows`` of q again;
- ``description``: a JSON string: ``format``, ``total_rows`` (the table's rows: every row id is
  below it), ``config`` (the hash's configuration, each value with where it comes from),
  ``tokenizer``, ``sources`` (the texts), ``requests`` (each request's source and name), and the
  figures ``describe`` computes.

A trace replays as the lookups a server makes (``DecodeReplay``, ``PrefillReplay``); ``TraceIds``
is the bench's id distribution over it (``--ids trace[:FILE]``). ``tools/make_trace.py`` writes
traces.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from ple_um.errors import PleUmError

FORMAT = "ple-um-trace/1"
# The committed sample: windows of the full trace, shipped as package data.
SAMPLE_NAME = "trace_sample.npz"
# A lookup of at most this many tokens replays as one decode step (one token from each of that many
# requests); a bigger one as a prefill chunk. vLLM 0.33's default max_num_seqs for its API server on
# a GPU of 70 GiB or more, the largest decode batch it schedules there.
DECODE_MAX_TOKENS = 1024
REPLAYS = ("auto", "decode", "prefill")
ARRAYS = ("tokens", "rows", "offsets", "context", "description")


class TraceError(PleUmError, ValueError):
    """A trace file cannot be read: the message names the file and the array."""

    def __init__(self, message: str, *, path: str, array: str | None = None) -> None:
        where = f"file {path}" + (f", array {array}" if array else "")
        super().__init__(f"{message} ({where})")
        self.path = path
        self.array = array


def sample_path() -> str:
    """Where the committed sample trace lies (package data of ple_um.bench)."""
    return str(resources.files("ple_um.bench").joinpath("data").joinpath(SAMPLE_NAME))


@dataclass
class Trace:
    tokens: np.ndarray
    rows: np.ndarray
    offsets: np.ndarray
    context: np.ndarray
    description: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def rows_per_token(self) -> int:
        return int(self.rows.shape[1])

    @property
    def total_rows(self) -> int:
        return int(self.description["total_rows"])

    def request_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def figures(self) -> dict:
        """Tokens, requests, lookups, distinct rows: the figures a description carries."""
        lookups = self.rows.size
        distinct = int(np.unique(self.rows).size)
        return {
            "tokens": self.num_tokens,
            "requests": self.num_requests,
            "rows_per_token": self.rows_per_token,
            "lookups": int(lookups),
            "distinct_rows": distinct,
            "distinct_fraction": distinct / lookups if lookups else 0.0,
        }


def read_trace(path: str) -> Trace:
    """The trace in ``path``, every array checked (TraceError naming the file and the array)."""
    path = os.fspath(path)
    # np.load reads other files too: one array (.npy, no context manager), or any other bytes as a
    # pickle (refused, with advice to load it unsafely).
    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        raise TraceError("not a readable .npz trace: not a zip of numpy arrays", path=path)
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise TraceError(f"not a readable .npz trace: {exc}", path=path) from None
    with archive:
        missing = [name for name in ARRAYS if name not in archive.files]
        if missing:
            raise TraceError(f"missing arrays {missing}; a trace holds {list(ARRAYS)}", path=path)
        try:
            arrays = {name: archive[name] for name in ARRAYS}
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a Python without lzma
            raise TraceError(f"an array cannot be read: {exc}", path=path) from None
    try:
        description = json.loads(str(arrays["description"]))
    except json.JSONDecodeError as exc:
        raise TraceError(f"not JSON: {exc}", path=path, array="description") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        found = description.get("format") if isinstance(description, dict) else None
        raise TraceError(f"format {found!r}, expected {FORMAT!r}", path=path, array="description")
    trace = Trace(arrays["tokens"], arrays["rows"], arrays["offsets"], arrays["context"], description)
    _check(trace, path)
    return trace


def _check(trace: Trace, path: str) -> None:
    def fail(message: str, array: str) -> None:
        raise TraceError(message, path=path, array=array)

    tokens, rows, offsets, context = trace.tokens, trace.rows, trace.offsets, trace.context
    if tokens.ndim != 1 or tokens.dtype != np.uint32:
        fail(f"expected uint32 [T], found {tokens.dtype} {list(tokens.shape)}", "tokens")
    if rows.ndim != 2 or rows.dtype not in (np.uint32, np.int64) or rows.shape[0] != tokens.shape[0]:
        fail(
            f"expected uint32 or int64 [{tokens.shape[0]}, H], found {rows.dtype} {list(rows.shape)}", "rows"
        )
    if rows.shape[1] == 0:
        fail("no rows per token", "rows")
    if offsets.ndim != 1 or offsets.dtype != np.int64 or offsets.size < 2:
        fail(f"expected int64 [Q + 1] with Q >= 1, found {offsets.dtype} {list(offsets.shape)}", "offsets")
    if offsets[0] != 0 or offsets[-1] != tokens.shape[0] or np.any(np.diff(offsets) <= 0):
        fail(f"must rise strictly from 0 to the token count {tokens.shape[0]}", "offsets")
    if context.ndim != 2 or context.dtype != np.int64 or context.shape[0] != offsets.size - 1:
        fail(
            f"expected int64 [{offsets.size - 1}, N - 1], found {context.dtype} {list(context.shape)}",
            "context",
        )
    total = trace.description.get("total_rows")
    if not isinstance(total, int) or total <= 0:
        fail(f"total_rows must be a positive integer, found {total!r}", "description")
    if rows.size and (int(rows.max()) >= total or (rows.dtype == np.int64 and int(rows.min()) < 0)):
        fail(f"row ids must lie in [0, total_rows = {total})", "rows")


@dataclass
class DecodeReplay:
    """Decode steps of ``batch`` requests at once, as continuous batching runs them: each of
    ``batch`` slots holds a request and a position in it, a step takes each slot's next token, and
    a slot whose request has ended takes the next request of the trace (in trace order, wrapping
    around). The slots start in steady state: on consecutive requests from a random one, each at a
    random position. A batch larger than the trace's request count holds some requests twice, at
    other positions."""

    trace: Trace
    batch: int
    rng: np.random.Generator

    def __post_init__(self) -> None:
        trace, q0 = self.trace, int(self.rng.integers(0, self.trace.num_requests))
        self.request = (q0 + np.arange(self.batch)) % trace.num_requests
        lengths = trace.request_lengths()[self.request]
        self.position = (self.rng.random(self.batch) * lengths).astype(np.int64)
        self.next_request = (q0 + self.batch) % trace.num_requests

    def step(self) -> np.ndarray:
        """The rows of one decode step: [batch, H], slot after slot."""
        trace = self.trace
        out = trace.rows[trace.offsets[self.request] + self.position]
        self.position += 1
        for slot in np.flatnonzero(
            trace.offsets[self.request] + self.position >= trace.offsets[self.request + 1]
        ):
            self.request[slot] = self.next_request
            self.position[slot] = 0
            self.next_request = (self.next_request + 1) % trace.num_requests
        return out


@dataclass
class PrefillReplay:
    """Prefill chunks: the trace's tokens in order, ``tokens`` at a time, as a server packs the
    prompts of consecutive requests into a chunked-prefill step; the first chunk starts at a random
    token, and the trace wraps around at its end."""

    trace: Trace
    tokens: int
    rng: np.random.Generator

    def __post_init__(self) -> None:
        self.cursor = int(self.rng.integers(0, self.trace.num_tokens))

    def step(self) -> np.ndarray:
        """The rows of one chunk: [tokens, H]."""
        index = (self.cursor + np.arange(self.tokens)) % self.trace.num_tokens
        self.cursor = int((self.cursor + self.tokens) % self.trace.num_tokens)
        return self.trace.rows[index]


class TraceIds:
    """The bench's ids from a trace (an IdDistribution's ``name``, ``draw`` and ``describe``).

    ``draw(rng, num_rows, n)`` gives the next lookup of n ids: ceil(n / H) tokens (H rows per
    token), as one decode step of that many requests (``replay`` "decode", or "auto" up to
    DECODE_MAX_TOKENS tokens) or as one prefill chunk ("prefill", or "auto" above), the first n of
    their rows, each row r mapped to r mod num_rows (a table smaller than the trace's maps the
    trace's rows onto it so). Successive draws of one size continue the same replay, so each draw
    is the next step of one server; each size has its replay, started from ``rng``."""

    def __init__(self, path: str | None = None, replay: str = "auto") -> None:
        if replay not in REPLAYS:
            raise ValueError(f"replay {replay!r}: expected one of {', '.join(REPLAYS)}")
        self.path = os.path.abspath(path) if path else sample_path()
        self.replay = replay
        self.name = ("trace" if replay == "auto" else f"trace-{replay}") + (f":{path}" if path else "")
        self.trace = read_trace(self.path)
        self._replays: dict[tuple[str, int], DecodeReplay | PrefillReplay] = {}

    def kind(self, tokens: int) -> str:
        if self.replay != "auto":
            return self.replay
        return "decode" if tokens <= DECODE_MAX_TOKENS else "prefill"

    def draw(self, rng: np.random.Generator, num_rows: int, n: int) -> np.ndarray:
        tokens = -(-n // self.trace.rows_per_token)
        kind = self.kind(tokens)
        replay = self._replays.get((kind, tokens))
        if replay is None:
            make = DecodeReplay if kind == "decode" else PrefillReplay
            replay = self._replays[(kind, tokens)] = make(self.trace, tokens, rng)
        rows = replay.step().reshape(-1)[:n].astype(np.int64)
        return rows % num_rows if num_rows < self.trace.total_rows else rows

    def describe(self) -> dict:
        d = self.trace.description
        return {
            "kind": "trace",
            "file": self.path,
            "replay": self.replay,
            "decode_max_tokens": DECODE_MAX_TOKENS if self.replay == "auto" else None,
            "rows_per_token": self.trace.rows_per_token,
            "trace_rows": self.trace.total_rows,
            "onto_table": "row r of the trace is row r mod num_rows of a table with fewer rows",
            "figures": d.get("figures", self.trace.figures()),
            "config": d.get("config"),
            "tokenizer": d.get("tokenizer", {}).get("name"),
            "sources": [s.get("name") for s in d.get("sources", [])],
        }
