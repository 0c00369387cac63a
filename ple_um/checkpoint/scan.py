"""The directory scan: which files may hold a table's tensors (those the index names, else every
``*.safetensors``), their headers, and the table tensors found in them, per layer. A matcher of
``naming`` says which tensors those are: ``ple_match`` (a PLE table, the default) or
``engram_match`` (an Engram table: its rows as shard 0, its E8M0 scales as shard 0's block scales).

Every check of the checkpoint reports to a ``Problems``. Only headers are read. With an index, only
the files it names for table tensors are opened, so a broken file that holds none of them does not
stop the table; every index entry is still checked to stay inside the checkpoint directory.
"""

from __future__ import annotations

import glob
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ple_um.checkpoint.files import read_json_file
from ple_um.checkpoint.naming import ple_match
from ple_um.checkpoint.safetensors import MAX_HEADER_BYTES, SafetensorsHeader, TensorEntry, read_header
from ple_um.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def refusal(entry: TensorEntry, message: str) -> CheckpointError:
    """A CheckpointError of ``message`` naming ``entry``'s file and tensor."""
    return CheckpointError(message, path=entry.path, tensor=entry.name)


class Problems:
    """Where the checkpoint's checks report. A strict one raises each problem as it is reported
    (``read_layout`` stops at the first); a lenient one keeps them in ``found`` (``validate``, for
    ``ple-um inspect``, lists every one, found by the very same checks in the same order)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.found: list[CheckpointError] = []

    def add(self, error: CheckpointError) -> None:
        if self.strict:
            raise error
        self.found.append(error)

    def report(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        self.add(CheckpointError(message, path=path, tensor=tensor))

    def about(self, entry: TensorEntry, message: str) -> bool:
        """Report ``message`` naming ``entry``'s file and tensor; False, the verdict of the check."""
        self.add(refusal(entry, message))
        return False

    def first(self, entries: list[TensorEntry], what: str) -> TensorEntry:
        """The first of ``entries`` (tensors found for one place, by file then name); every further
        one is reported as ``what``, naming the first."""
        first, *others = sorted(entries, key=lambda e: (e.path, e.name))
        for other in others:
            self.about(other, f"{what}: also tensor {first.name} in {first.path}")
        return first


# A tensor's name -> (layer, kind, shard index or None) when it is a table tensor, else None.
Match = Callable[[str], tuple[int, str, int | None] | None]


@dataclass
class LayerTensors:
    """The table tensors of one layer, as found in the headers (duplicates kept, to be reported)."""

    shards: dict[int, list[TensorEntry]] = field(default_factory=dict)  # an Engram table's rows: 0
    scales: list[TensorEntry] = field(default_factory=list)  # ...ngram_embedding.weight_scale
    # NVFP4 shard_<i>.weight_scale; an Engram table's E8M0 scales: 0
    block_scales: dict[int, list[TensorEntry]] = field(default_factory=dict)
    global_scales: list[TensorEntry] = field(default_factory=list)  # NVFP4 ...weight_scale_2


@dataclass
class Scan:
    directory: str
    layers: set[int]  # every layer seen with at least one shard tensor
    tensors: dict[int, LayerTensors]  # per layer (only the requested one when a layer is given)
    # Table tensors that cannot be read because of a problem already reported (a broken or missing
    # file, an index entry pointing elsewhere), as (layer, kind, shard index or None): their
    # absence from the table is not reported again.
    lost: set[tuple[int, str, int | None]] = field(default_factory=set)
    # A file refused with no index to say what it holds: it may hold any table tensor, so that none is
    # reported missing.
    blind: bool = False
    match: Match = ple_match

    def lose(self, name: str | None) -> None:
        match = self.match(name) if name else None
        if match is not None:
            self.lost.add(match)

    def wanted(self, name: str, layer: int | None) -> tuple[int, str, int | None] | None:
        """``name``'s (layer, kind, shard index) when it is a table tensor of ``layer`` (of any layer
        when None), else None; adds the layer of every shard tensor seen, wanted or not, to ``layers``."""
        match = self.match(name)
        if match is None:
            return None
        if match[1] == "shard":
            self.layers.add(match[0])
        return match if layer is None or match[0] == layer else None


def layer_number(layer: object) -> int | None:
    """``layer`` as a table's layer number (an int, or None: the only one there is), or TypeError
    naming it: a bool is no layer (``True`` would read layer 1), nor a float or a str."""
    if layer is None:
        return None
    try:
        if isinstance(layer, bool):
            raise TypeError
        return operator.index(layer)
    except TypeError:
        raise TypeError(
            f"layer={layer!r} ({type(layer).__name__}): expected a layer number (an int), or None for "
            "the only layer"
        ) from None


def why_no_directory(path: str) -> str:
    """Why ``path``, which is no directory, is none: what is there instead."""
    if os.path.exists(path):
        return "is not a directory"
    if os.path.islink(path):
        return "is a symbolic link that leads nowhere (its target is missing, or a loop)"
    return "does not exist"


def scan(directory: str, layer: int | None, problems: Problems, match: Match = ple_match) -> Scan | None:
    """Read the headers of the files that may hold the table tensors ``match`` finds (of ``layer``
    when given); None when the directory or its index cannot be read (reported)."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        problems.report(f"checkpoint directory {directory} {why_no_directory(directory)}")
        return None

    index_path = os.path.join(directory, INDEX_FILE)
    claims: dict[str, str] = {}  # table tensor name -> absolute file path, per the index
    found = Scan(directory=directory, layers=set(), tensors={}, match=match)
    if os.path.lexists(index_path):
        files = _files_from_index(directory, index_path, layer, problems, claims, found)
        if files is None:
            return None
    else:
        files = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))
    files, aliases = _one_name_per_file(files)
    for name, claimed in claims.items():
        claims[name] = aliases.get(claimed, claimed)

    for path in files:
        try:
            header = read_header(path)
        except CheckpointError as e:
            problems.add(e)
            found.blind = found.blind or not os.path.lexists(index_path)
            for name, claimed in claims.items():
                if claimed == path:
                    found.lose(name)
            continue
        _collect(header, layer, found)
        _check_claims(header, claims, problems, found)
    return found


def _one_name_per_file(paths: list[str]) -> tuple[list[str], dict[str, str]]:
    """``paths`` with each file once, under the first of its names (a symlink beside its target, or
    two hard links: one file, its tensors read once, never refused as their own duplicates), and
    each other name's kept one. A name that cannot be stat'ed is kept: reading it reports it."""
    kept: dict[tuple[int, int], str] = {}
    out, aliases = [], {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(path)
            continue
        first = kept.setdefault((st.st_dev, st.st_ino), path)
        if first == path:
            out.append(path)
        else:
            aliases[path] = first
    return out, aliases


def _collect(header: SafetensorsHeader, layer: int | None, found: Scan) -> None:
    """Add the table tensors of one header to ``found``."""
    for name, entry in header.tensors.items():
        match = found.wanted(name, layer)
        if match is None:
            continue
        at, kind, index = match
        tensors = found.tensors.setdefault(at, LayerTensors())
        if kind == "shard":
            tensors.shards.setdefault(index, []).append(entry)
        elif kind == "block_scale":
            tensors.block_scales.setdefault(index, []).append(entry)
        elif kind == "scale":
            tensors.scales.append(entry)
        else:
            tensors.global_scales.append(entry)


def _check_claims(header: SafetensorsHeader, claims: dict[str, str], problems: Problems, found: Scan) -> None:
    """Report each tensor the index maps to this file that the file does not hold, and mark it lost
    in ``found``."""
    for name, claimed in claims.items():
        if claimed == header.path and name not in header.tensors:
            problems.report(
                f"{INDEX_FILE} maps this tensor to {os.path.basename(header.path)}, which does not hold it",
                path=header.path,
                tensor=name,
            )
            found.lose(name)


def _files_from_index(
    directory: str,
    index_path: str,
    layer: int | None,
    problems: Problems,
    claims: dict[str, str],
    found: Scan,
) -> list[str] | None:
    """The files the index says hold table tensors (of ``layer`` when given); fills ``claims``, and
    ``found``'s layers and lost tensors (those the index maps to a missing file, reported once per
    file)."""
    try:
        index = read_json_file(index_path, what="index", limit=MAX_HEADER_BYTES)
    except CheckpointError as e:
        problems.add(e)
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        problems.report("index has no weight_map object", path=index_path)
        return None
    files: set[str] = set()
    missing: set[str] = set()
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name or "\0" in file_name:
            problems.report(
                f"index entry names file {file_name!r}, expected a file name", path=index_path, tensor=name
            )
            continue
        normal = os.path.normpath(file_name)
        if os.path.isabs(file_name) or normal == ".." or normal.startswith(".." + os.sep):
            problems.report(
                f"index entry names {file_name!r}, outside the checkpoint directory",
                path=index_path,
                tensor=name,
            )
            continue
        if found.wanted(name, layer) is None:
            continue
        path = os.path.join(directory, normal)
        if not os.path.exists(path):
            if path not in missing:
                missing.add(path)
                what = "a symlink to a missing file" if os.path.islink(path) else "a missing file"
                problems.report(f"index entry names {file_name!r}, {what}", path=index_path, tensor=name)
            found.lose(name)
            continue
        claims[name] = path
        files.add(path)
    return sorted(files)
