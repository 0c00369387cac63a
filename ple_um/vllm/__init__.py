"""ple-um's vLLM integration: a ``vllm.general_plugins`` entry point (``plugin.register``) that, with
``PLE_UM=1``, makes Qwen4Exp PLE layers build the ``Qwen4ExpPLEMappedEmbedding`` storage backend
(``backend``) through a small patch of vLLM 0.33 (``patch``). ``source`` finds the checkpoint
directory and tells file-backed tensors from tensors in memory.

Importing this package imports nothing from vLLM; its modules other than ``plugin`` and ``source``
do.
"""
