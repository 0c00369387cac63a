"""Where the checkpoint's checks report: raise the first problem, or collect them all.

``read_layout`` stops at the first problem; ``validate`` (for
``ple-um inspect``) goes on and lists every one, found by the very same checks in the same order.
"""

from __future__ import annotations

from ple_um.checkpoint.safetensors import TensorEntry
from ple_um.errors import CheckpointError


def refusal(entry: TensorEntry, message: str) -> CheckpointError:
    """A CheckpointError of ``message`` naming ``entry``'s file and tensor."""
    return CheckpointError(message, path=entry.path, tensor=entry.name)


class Problems:
    """A strict one raises each problem as it is reported; a lenient one keeps them in ``found``."""

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
