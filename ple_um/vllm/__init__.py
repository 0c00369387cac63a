"""ple-um's vLLM integration: with ``PLE_UM=1``, Qwen4Exp PLE layers serve their n-gram table from the
checkpoint files through ple-um, through a small patch of vLLM 0.33.

Which file holds what, in the order a load and a step reach them:

- ``plugin``: the ``vllm.general_plugins`` entry point; applies the patch when PLE_UM is set.
- ``patch``: the vLLM symbols replaced, so that vLLM's own backend selection builds ours and its
  ``load_weights`` hands the shard tensors over instead of copying them.
- ``backend``: the layer itself, ``Qwen4ExpPLEMappedEmbedding`` (storage, opening the table, the
  lookup, the reduce across ranks, vLLM's prefetch hook), and vLLM's CUDA-graph rules (when the
  prefetch forks a side stream, the eager break of a table that is not capture-safe, the graph
  modes refused).
- ``source``: which directory holds the table, and whether a delivered tensor is a view of a file.
- ``loading``: the table a layer expects, and the checks that what vLLM loads is that table.
- ``overlap``: the buffer, side stream and started lookups between ``start_prefetch`` and
  ``finalize_prefetch``.
- ``early``: a step's lookups started together by its first PLE layer.
- ``engram``: DeepSeek-V4.1's Engram tables.

What the SGLang plugin shares with this one (the served table, the opens a capture forbids, shard
and scale comparison, the early lookups' side stream and starts) is ``ple_um.served``. Importing
this package imports nothing from vLLM; its modules other than ``plugin`` and ``source`` do.
"""
