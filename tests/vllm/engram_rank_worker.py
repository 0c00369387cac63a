"""One rank of the multi-rank Engram test (run by test_vllm_engram.py, not collected by pytest).

usage: engram_rank_worker.py RANK WORLD_SIZE TMP_DIR CHECKPOINT_DIR

Tensor parallelism over every rank (gloo, CPU): vLLM's stock ParallelEngramEmbedding and ple-um's,
made by vLLM's real Engram._create_embedding, for each Engram layer of the checkpoint; both forwards
all-gather the heads across the ranks. Writes TMP_DIR/rank<R>.pt: per layer the heads and rows each
holds, and whether the gathered rows are equal bit for bit.
"""

from __future__ import annotations

import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from helpers.vllm_engram import LAYERS, as_on_a_gpu, engram_module  # noqa: E402
from helpers.vllm_engram import engram_config as config  # noqa: E402


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    tmp_dir, checkpoint = sys.argv[3:5]
    module = engram_module()
    import vllm_harness as h
    from safetensors import safe_open
    from vllm.config import EngramConfig, get_current_vllm_config

    from ple_um.synthetic_engram import FILE_NAME, scale_name, weight_name
    from ple_um.vllm import engram

    props = types.SimpleNamespace(multi_processor_count=8)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.accelerator.current_device_index = lambda: 0
    os.environ["PLE_UM_DIR"] = checkpoint
    engram.apply()
    report: dict = {"rank": rank, "layers": {}}
    with h.vllm_world(tmp_dir, world_size=world_size, rank=rank):
        object.__setattr__(get_current_vllm_config(), "engram_config", EngramConfig(cpu_offload=False))
        layout = module.EngramLayout(config())
        for index, layer in enumerate(LAYERS):
            with safe_open(os.path.join(checkpoint, FILE_NAME), framework="pt") as f:
                weight, scales = f.get_tensor(weight_name(layer)), f.get_tensor(scale_name(layer))
            os.environ["PLE_UM"] = "0"
            stock = module.Engram._create_embedding(None, layout, index)
            stock.weight.weight_loader(stock.weight, weight)
            stock.weight_scale_inv.weight_loader(stock.weight_scale_inv, scales)
            os.environ["PLE_UM"] = "1"
            ours = module.Engram._create_embedding(None, layout, index)
            ours.weight.weight_loader(ours.weight, torch.empty_like(weight, device="meta"))
            ours.weight_scale_inv.weight_loader(
                ours.weight_scale_inv, torch.empty_like(scales, device="meta")
            )
            sizes = [p for order in layout.primes[index] for p in order]
            rng = np.random.default_rng(layer)  # the same hashes on every rank
            hashes = np.stack([rng.integers(0, s, 60) for s in sizes], axis=1) + np.cumsum([0, *sizes[:-1]])
            hashes = torch.from_numpy(hashes.astype(np.int32))
            want = as_on_a_gpu(stock(hashes), weight, scales, hashes)
            got = ours(hashes)
            report["layers"][layer] = {
                "heads": (ours.head_start, ours.head_start + ours.part_n_hash_cols),
                "stock_rows": (stock.vocab_start_idx, stock.vocab_end_idx),
                "table_rows": ours.served.table.rows,
                "shape": tuple(got.shape),
                "equal": torch.equal(got.view(torch.int16), want.view(torch.int16)),
                "nonzero": bool(got.view(torch.int16).any()),
            }
            ours.served.close()
    torch.save(report, os.path.join(tmp_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
