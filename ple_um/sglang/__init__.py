"""ple-um's SGLang 0.5.23 integration: a ``sglang.srt.plugins`` entry point (``plugin.register``)
that, with ``PLE_UM=1``, registers ``HookRegistry`` hooks under which every Qwen4Exp PLE
table is a ``PleUmHostEmbedding`` (``embedding``) served from the checkpoint's files, and SGLang's
loader never reads a table's bytes (``loading``). ``source`` finds the checkpoint directory.

What it shares with the vLLM plugin is ``ple_um.served``. Importing this package imports nothing
from SGLang; ``embedding``, ``loading`` and the plugin's hooks do.
"""
