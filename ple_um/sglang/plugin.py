"""The ``sglang.srt.plugins`` entry point (``ple_um = "ple_um.sglang.plugin:register"``).

SGLang's ``load_plugins()`` calls ``register()`` in every process it starts (server, scheduler,
engine, data-parallel controller), once each, then applies the registered hooks. With ``PLE_UM=1``
(alias ``VLLM_PLE_MMAP=1``) it registers the hooks of ``ple_um.sglang.hooks``, so Qwen4Exp PLE
tables are served by ple-um; otherwise it imports nothing from SGLang and registers nothing.
"""

from __future__ import annotations

import logging

from ple_um import envs

logger = logging.getLogger("ple_um.sglang")


def register() -> None:
    """Register the hooks when PLE_UM is set; idempotent."""
    if not envs.PLE_UM:
        return
    from ple_um.sglang import hooks

    targets = hooks.register()
    if targets:
        logger.info(
            "ple-um: PLE_UM is set: Qwen4Exp PLE tables are served from the checkpoint files (hooks on %s)",
            ", ".join(targets),
        )
