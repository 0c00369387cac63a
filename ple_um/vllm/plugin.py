"""The ``vllm.general_plugins`` entry point (``ple_um = "ple_um.vllm.plugin:register"``).

vLLM calls ``register()`` in every process it starts, possibly more than once. With ``PLE_UM=1``
(alias ``VLLM_PLE_MMAP=1``) it patches this platform's ``Qwen4ExpNGramEmbedding`` so Qwen4Exp PLE
layers serve their n-gram table with ple-um (see ``ple_um.vllm.patch``), and DeepSeek-V4.1's
``Engram._create_embedding`` so its Engram tables are served from the files too
(``ple_um.vllm.engram``); otherwise it imports nothing from vLLM and patches nothing.
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
    try:
        from ple_um.vllm import engram
    except ImportError as exc:  # a vLLM without DeepSeek-V4.1's Engram module: PLE tables only
        logger.debug("ple-um: DeepSeek-V4.1 Engram tables not patched: %s", exc)
    else:
        patched += engram.apply()
    if patched:
        logger.info(
            "ple-um: PLE_UM is set: PLE and Engram tables are served from the checkpoint files (%s)",
            ", ".join(patched),
        )


def log_through_vllm() -> None:
    """Make ``ple_um`` (a table's open line, the stats line, the metrics' notes) a child of vLLM's
    ``vllm`` logger: vLLM configures only that tree, after loading plugins, so a ``ple_um`` logger
    outside it would reach no log under ``vllm serve``. As a child, its records follow vLLM's level
    and handlers as configured when they are written, once each; where vLLM configured nothing
    (VLLM_CONFIGURE_LOGGING=0) ``vllm`` passes them on to the root logger, where they go without
    the plugin too (warnings still reach stderr through logging's last resort). Idempotent."""
    logging.getLogger("ple_um").parent = logging.getLogger("vllm")
