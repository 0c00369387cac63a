"""Progress bars for long work (prewarm, registering many shards): a tqdm bar on stderr, handed out
as the ``advance(nbytes)`` callback that ``MappedShards.populate`` and ``RegisteredMapping`` take."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from tqdm import tqdm


@contextlib.contextmanager
def progress(
    total: int, desc: str, *, min_bytes: int = 1 << 30, disable: bool | None = None
) -> Iterator[Callable[[int], None]]:
    """A tqdm bar over ``total`` bytes (to stderr), given as ``advance(nbytes)``: the callback
    ``MappedShards.populate(progress=)`` and ``RegisteredMapping(progress=)`` take. Shown when
    ``total >= min_bytes`` unless ``disable`` says otherwise."""
    off = total < min_bytes if disable is None else disable
    with tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=off, leave=not off
    ) as bar:
        yield bar.update
