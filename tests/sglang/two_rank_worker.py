"""One rank of the two-rank test (``test_two_ranks.py``): a gloo world of two tensor-parallel ranks,
the stock model and the ple-um model loaded by SGLang's DefaultModelLoader from the same checkpoint,
their rows compared; prints one JSON line.

argv: rank, port, checkpoint directory, ids file (torch.save of the [n, 4] int64 ids and of the table's
rows as bf16, read by the safetensors package). The rows before the all-reduce are compared with
those (after it, a -0.0 row element is +0.0, in stock's sum as in ple-um's).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    rank, port, directory, ids_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.plugins import load_plugins
    from sglang.test.test_utils import publish_build_topology

    init_distributed_environment(
        world_size=2,
        rank=rank,
        local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    publish_build_topology(world_rank=rank, tp_size=2, ep_size=1, pp_size=1)
    # SGLang's groups of more than one rank make a PyNccl communicator, which needs a CUDA device; on
    # this CPU host the groups use gloo alone (the capability a CUDA-less machine has).
    make_group = parallel_state.init_model_parallel_group
    parallel_state.init_model_parallel_group = lambda *a, **k: make_group(
        *a, **{**k, "use_pynccl": False, "use_custom_allreduce": False}
    )
    initialize_model_parallel(backend="gloo")
    os.environ["PLE_UM"] = "1"
    load_plugins()

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    def load(ple_um: bool):
        if ple_um:
            os.environ["PLE_UM"] = "1"
        else:
            os.environ.pop("PLE_UM", None)
        model_config = ModelConfig(directory, language_model_only=True)
        loader = get_model_loader(load_config=LoadConfig(), model_config=model_config)
        model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
        return model.model.layers[1].ple.ple_embedding

    stock, ours = load(False), load(True)
    ids, reference = torch.load(ids_path)  # the ids, and the file's rows as bf16
    table = ours.ngram_embedding
    start, end = table.owned_rows
    partial = table.gather(ids)  # this rank's rows, zeros elsewhere (before the all-reduce)
    owned = (ids >= start) & (ids < end)
    combined = table(ids)  # gather + SGLang's tensor-parallel all-reduce
    expected = stock.ngram_embedding(ids)  # stock: masked gather + the same all-reduce
    n = ids.shape[0]
    scaled_equal = torch.equal(
        ours._embed_ngram_ids(ids, None, n).view(torch.int16),
        stock._embed_ngram_ids(ids, None, n).view(torch.int16),
    )
    result = {
        "rank": rank,
        "rows": [start, end],
        "tp_size": table.tp_size,
        "zeros_outside": bool((partial[~owned] == 0).all()),
        "owned_equal": torch.equal(partial[owned].view(torch.int16), reference[ids][owned].view(torch.int16)),
        "combined_equal": torch.equal(combined.view(torch.int16), expected.view(torch.int16)),
        "scaled_equal": scaled_equal,
        "owned_ids": int(owned.sum()),
        "table_rows": list(table.table.rows),
    }
    table.close_table()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
