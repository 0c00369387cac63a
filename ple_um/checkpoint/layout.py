"""One PLE layer's table in a checkpoint directory: find the layers, read one layer's ShardLayout,
or list every problem that keeps a checkpoint from serving; which of a layout's files were replaced
since its headers were read.

The work is done below: ``scan`` (the index, the files, their headers), ``validation`` (the checks,
in one order for both ``read_layout`` and ``validate``, a table's global scale read among them),
with the names of ``naming`` and the data model of ``shard_layout``. Only headers and the scales'
few bytes are read, never table data.
"""

from __future__ import annotations

import os

from ple_um.checkpoint.files import FileIdentity
from ple_um.checkpoint.naming import engram_match, ple_match
from ple_um.checkpoint.scan import Problems, scan
from ple_um.checkpoint.shard_layout import ShardLayout
from ple_um.checkpoint.validation import analyze
from ple_um.errors import CheckpointError


def find_layers(directory: str, *, strict: bool = True, engram: bool = False) -> list[int] | None:
    """PLE layer indices that have shard tensors in the checkpoint at ``directory`` (``engram``:
    the layers that have an Engram table's rows).

    Reads only headers; raises CheckpointError when the directory or a header cannot be read.
    ``strict=False``: the layers seen in the headers that can be read and in the index, None when
    nothing can be read (for `ple-um inspect`, whose verdict lists why).
    """
    found = scan(directory, None, Problems(strict=strict), engram_match if engram else ple_match)
    assert found is not None or not strict  # a strict Problems raises instead of returning nothing
    return None if found is None else sorted(found.layers)


def read_layout(directory: str, layer: int | None = None) -> ShardLayout:
    """Read and validate one layer's table; raise CheckpointError naming file and tensor.

    ``layer=None`` picks the only layer that has shards.
    """
    layout = analyze(directory, layer, Problems(strict=True))
    assert layout is not None  # a strict Problems raises on the first problem
    return layout


def validate(directory: str, layer: int | None = None) -> list[str]:
    """Every problem found (empty when sound), for `ple-um inspect`.

    The checks are read_layout's; where read_layout stops at the first problem, this goes on as
    far as the checkpoint allows (with ``layer=None`` and several layers, it checks each). A broken
    file counts once: its first problem (a header that cannot be read, a truncated file, a missing
    file the index names), not each of its tensors, and not the tensors that are missing from the
    table because they are in it (its shards, its scale).
    """
    problems = Problems(strict=False)
    analyze(directory, layer, problems)
    return [str(e) for e in problems.found]


def check_shape(layout: ShardLayout, prefix: str, *, row_dim: int, num_rows: int, parts: int) -> None:
    """Raise CheckpointError (naming the layer ``prefix``, the first shard's file and tensor) unless the
    table has the row width, the rows and the shard count its serving layer was built for."""
    first = layout.shards[0]
    where = {"path": first.path, "tensor": first.tensor}
    if layout.row_dim != row_dim:
        raise CheckpointError(
            f"{prefix}: the table's rows have {layout.row_dim} elements, but the layer's row width "
            f"is {row_dim} (the n-gram head_dim: ple_embed_dim / n-gram heads)",
            **where,
        )
    if layout.num_rows != num_rows:
        raise CheckpointError(
            f"{prefix}: the table has {layout.num_rows} rows, but the config gives {num_rows} "
            "(the n-gram vocabulary padded to make_ngram_vocab_size_divisible_by)",
            **where,
        )
    if layout.parts != parts:
        raise CheckpointError(
            f"{prefix}: the table is split into {layout.parts} shards, but the config has "
            f"split_ngram_parts={parts}",
            **where,
        )


def replaced_files(layout: ShardLayout) -> list[str]:
    """The files of ``layout`` (its shards', its block scales') that are no longer the ones their
    headers were read from: gone, another file renamed into the path, or rewritten (``stat`` only)."""
    changed = []
    for path, identity in {s.path: s.identity for s in (*layout.shards, *layout.block_scales)}.items():
        try:
            now = FileIdentity.of(os.stat(path))
        except OSError:
            changed.append(path)
            continue
        if identity.differs(now):
            changed.append(path)
    return sorted(changed)
