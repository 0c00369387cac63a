"""The ``vllm.general_plugins`` entry point (``ple_um = "ple_um.vllm.plugin:register"``).

vLLM calls ``register()`` in every process it starts, possibly more than once. With ``PLE_UM=1``
(alias ``VLLM_PLE_MMAP=1``) it patches this platform's ``Qwen4ExpNGramEmbedding`` so Qwen4Exp PLE
layers serve their n-gram table with ple-um (see ``ple_um.vllm.patch``); otherwise it imports
nothing from vLLM and patches nothing.
"""

from __future__ import annotations

import logging

from ple_um import envs


def register() -> None:
    """Apply the patch when PLE_UM is set; idempotent."""
    if not envs.PLE_UM:
        return
    from ple_um.vllm.patch import apply, logger

    log_through_vllm()
    patched = apply()
    if patched:
        logger.info(
            "ple-um: PLE_UM is set: Qwen4Exp PLE tables are served from the checkpoint files (%s)",
            ", ".join(patched),
        )


class _ThroughVllm(logging.Handler):
    """Hands each record of ``ple_um.*`` to vLLM's ``vllm`` logger as it is configured when the
    record is written (vLLM configures its logging after the plugins load, and again in each
    process it starts). Where vLLM configured none (VLLM_CONFIGURE_LOGGING=0) it does nothing:
    the record still propagates to the root logger, as it always did."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers and target.isEnabledFor(record.levelno):
            target.handle(record)


def log_through_vllm() -> None:
    """Route ple-um's own log lines (``ple_um.*``: a table's open line, the stats line, the
    metrics' notes) into vLLM's log: vLLM configures only its ``vllm`` logger tree, so under
    ``vllm serve`` their INFO lines reached no log. Idempotent."""
    ours = logging.getLogger("ple_um")
    if any(isinstance(h, _ThroughVllm) for h in ours.handlers):
        return
    ours.addHandler(_ThroughVllm())
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
