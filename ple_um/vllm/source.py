"""Where the table comes from: the checkpoint directory to map, and whether a delivered tensor is a
view of a file on disk.

Questions the vLLM backend asks and nothing else in ple-um does (this module imports nothing from
vLLM; it reads vLLM's config objects by attribute):

- ``resolve_table_dir``: which local directory holds the PLE shard files. ``PLE_UM_DIR`` (alias
  ``VLLM_PLE_MMAP_DIR``) first (``served.table_directory``), then the model path when it is a local
  directory, then the local Hugging Face cache snapshot when the model is a repo id. Nothing is
  downloaded here: vLLM has already fetched the snapshot by the time weights are loaded.
- ``TableSource``: one layer's answer, kept while vLLM's config and the knob stay the same, with
  the set of ``*.safetensors`` files in that directory (listed again when a file is not in it: vLLM
  downloads a Hugging Face snapshot's weights inside its weight iterator, after the snapshot folder
  was first found with only the config in it), and whether the folder is a snapshot still to be
  downloaded.
- ``file_backing``: whether a tensor handed to ``load_weights`` lies in a file mapping of this
  process (the lazy views vLLM's safetensors iterator yields), and where. Such a tensor's bytes
  have not been read, and reading them is exactly what the backend avoids.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from ple_um import envs
from ple_um.checkpoint.scan import INDEX_FILE
from ple_um.errors import CheckpointError
from ple_um.residency import file_mappings
from ple_um.served import table_directory

# Under "vllm.": vLLM configures only its own logger tree, so only there do its lines reach vLLM's log.
logger = logging.getLogger("vllm.ple_um.source")
# The reloads (table directory, model path before, model path now) already said to be pinned.
_pinned_said: set[tuple[str, str | None, str | None]] = set()


def resolve_table_dir(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """The real path of the local directory that holds the PLE table (``served.table_directory``:
    PLE_UM_DIR first), else CheckpointError saying what was tried.

    ``model``, ``revision`` and ``download_dir`` are vLLM's ``model_config.model``,
    ``model_config.revision`` and ``load_config.download_dir`` (the Hugging Face cache directory
    vLLM downloads into; None is the default cache).
    """

    def model_folder(tried: list[str]) -> str | None:
        if not model:
            tried.append("the model path: vLLM has no model config")
            return None
        if os.path.isdir(model):
            return model
        tried.append(f"the model path {model!r}: not a local directory")
        snapshot, why = _hf_snapshot(model, revision, download_dir)
        if snapshot is None:
            tried.append(
                f"the Hugging Face cache snapshot of {model!r} at revision {revision or 'main'}: {why}"
            )
        return snapshot

    return table_directory(model_folder)


class TableSource:
    """The checkpoint directory one layer maps, resolved from vLLM's config and ``PLE_UM_DIR``.

    Resolved afresh whenever the knob or vLLM's model path, revision or download directory changes,
    since a reload may point vLLM's model config at another path.
    """

    def __init__(self, vllm_config) -> None:
        self._vllm_config = vllm_config
        self._key: tuple | None = None
        self._directory: str | None = None
        self._files: frozenset[str] = frozenset()
        self._from_hub = False

    def directory(self) -> str:
        """The directory to map now (its real path), or CheckpointError saying what was tried or
        that the directory cannot be listed. With PLE_UM_DIR set it stays PLE_UM_DIR's when a
        reload moves vLLM's model path, which the log then says (once per process and move)."""
        model_config = getattr(self._vllm_config, "model_config", None)
        load_config = getattr(self._vllm_config, "load_config", None)
        model = getattr(model_config, "model", None)
        revision = getattr(model_config, "revision", None)
        download_dir = getattr(load_config, "download_dir", None)
        key = (envs.PLE_UM_DIR, model, revision, download_dir)
        if key != self._key:
            # The real path, for the PLE layers and Engram alike: two spellings of one checkpoint (a
            # symlink, say) are one table, not a reason to remap it.
            directory = resolve_table_dir(model, revision, download_dir)
            if self._key is not None and envs.PLE_UM_DIR and self._key[0] == envs.PLE_UM_DIR:
                _say_pinned(directory, self._key[1], model)
            self._files = _safetensors_files(directory)
            self._key, self._directory = key, directory
            self._from_hub = not envs.PLE_UM_DIR and not (model and os.path.isdir(model))
        assert self._directory is not None
        return self._directory

    def is_table_file(self, path: str) -> bool:
        """Whether a file vLLM is loading from is one the table is mapped from. With PLE_UM_DIR set,
        the table is explicitly elsewhere, and shard views of the model's own files are not read:
        PLE_UM_DIR pins the table, also through a reload from another model path (said once in the
        log, ``directory``). A file missing from the listing has it made again: vLLM may have
        downloaded it since."""
        if envs.PLE_UM_DIR:
            return True
        directory = self.directory()
        path = os.path.realpath(path)
        if path not in self._files:
            self._files = _safetensors_files(directory)
        return path in self._files

    def awaits_download(self) -> bool:
        """Whether the directory is a Hugging Face cache snapshot whose weights are not all there
        yet: no ``*.safetensors`` file, or one its index names missing. vLLM's default loader
        downloads them inside its weight iterator, after the model's ``load_weights`` has begun
        (the snapshot folder exists before, holding the config vLLM fetched first)."""
        directory = self.directory()
        if not self._from_hub:
            return False
        self._files = _safetensors_files(directory)
        if not self._files:
            return True
        try:
            with open(os.path.join(directory, INDEX_FILE)) as f:
                named = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False  # no index (one file), or one the open will judge
        return not all(os.path.isfile(os.path.join(directory, name)) for name in named)


def _say_pinned(directory: str, before: str | None, now: str | None) -> None:
    """Log, once per process and reload, that PLE_UM_DIR keeps the table while vLLM's model path moved
    from ``before`` to ``now`` (a reload from another checkpoint): the new checkpoint's shard
    tensors are not read, and only a global scale (FP8, NVFP4) that disagrees would be refused."""
    if before == now or (directory, before, now) in _pinned_said:
        return
    _pinned_said.add((directory, before, now))
    logger.warning(
        "ple-um: vLLM's model moved from %s to %s, but PLE_UM_DIR pins the PLE tables to %s: they stay "
        "mapped from there, and the new checkpoint's shard tensors are not read. To serve its table, "
        "point PLE_UM_DIR at it (or unset PLE_UM_DIR) before the reload",
        before,
        now,
        directory,
    )


def _safetensors_files(directory: str) -> frozenset[str]:
    """The real paths of the ``*.safetensors`` files in ``directory``; CheckpointError naming the
    directory where it cannot be listed."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise CheckpointError(f"cannot list the checkpoint directory {directory}: {exc}") from exc
    return frozenset(
        os.path.realpath(os.path.join(directory, name)) for name in names if name.endswith(".safetensors")
    )


def _hf_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> tuple[str | None, str]:
    """(snapshot directory, "") when ``repo_id`` at ``revision`` is in the local cache, else (None, why)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # vLLM depends on huggingface_hub; without it there is no cache to look in
        return None, "huggingface_hub is not installed"
    where = f"cache {cache_dir}" if cache_dir else "the default cache"
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable", and the message says why
        return None, f"not found in {where}: {type(exc).__name__}: {exc}"
    if not os.path.isdir(path):
        return None, f"{path} is not a directory"
    return path, ""


def file_backing(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(file path, byte offset of the tensor's first byte) when the tensor's data lies wholly in a
    file mapping of this process, else None (host or device memory, or not Linux).

    vLLM's safetensors iterator yields views of a read-only-used private mapping of each file; their
    pages are read from disk only when touched. A private mapping that was written to would no
    longer equal its file, but nothing writes into the tensors a weight iterator yields. The map is
    read afresh on every call, so a range that was unmapped and reused is never mistaken for a file.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        mappings = file_mappings()
    except OSError:
        return None
    for m in mappings:  # mappings do not overlap: the one that holds the first byte, if any
        if m.addr <= start < m.addr + m.length:
            return (m.path, start - m.addr + m.offset) if end <= m.addr + m.length else None
    return None
