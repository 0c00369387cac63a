"""``ple_um.vllm.patch.replace`` undone, for tests that patch a vLLM class and must leave it as they
found it (the originals are kept on the class under ``ORIGINAL``; None for one it inherits)."""

from __future__ import annotations

from ple_um.vllm.patch import ORIGINAL


def restore(cls: type) -> None:
    """Undo ``replace`` on ``cls``; nothing when it is not patched."""
    for name, value in cls.__dict__.get(ORIGINAL, {}).items():
        if value is None:
            delattr(cls, name)
        else:
            setattr(cls, name, value)
    if ORIGINAL in cls.__dict__:
        delattr(cls, ORIGINAL)
