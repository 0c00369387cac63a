"""One rank of the two-rank test (run by test_vllm_backend_two_ranks.py, not collected by pytest).

usage: two_rank_worker.py RANK WORLD_SIZE TMP_DIR CHECKPOINT_DIR OUT_DIR

Tensor parallelism over both ranks, so the embedding-parallel group spans them: the stock device
backend holds this rank's vocab range and so does the ple-um backend. Both forwards reduce across the
group (FP8 bytes as int8; BF16 rows and decoded NVFP4 rows as they are); the results, the owned
ranges and the mapped bytes are written to OUT_DIR/rank<R>.pt, per table dtype (DTYPES).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import vllm_harness as h  # noqa: E402

DTYPES = ("fp8", "bf16", "nvfp4")


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    tmp_dir, checkpoints, out_dir = sys.argv[3:6]
    os.environ["PLE_UM"] = "1"
    from ple_um.vllm.plugin import register

    register()
    report: dict = {"rank": rank, "runs": {}}
    with h.vllm_world(tmp_dir, world_size=world_size, rank=rank):
        for dtype in DTYPES:
            directory = os.path.join(checkpoints, dtype)
            os.environ["PLE_UM_DIR"] = directory
            config = h.text_config(dtype=dtype)
            stock = h.build(config, ple_um_on=False)
            h.load(stock, directory)
            mapped = h.build(config, ple_um_on=True)
            h.load(mapped, directory)
            backend = mapped.ngram_embedding
            table = backend.table
            run = {
                "tp_size": backend.tp_size,
                "owned_rows": backend.owned_rows,
                "stock_rows": (
                    stock.ngram_embedding.shard_indices.org_vocab_start_index,
                    stock.ngram_embedding.shard_indices.org_vocab_end_index,
                ),
                "table_rows": table.rows,
                "num_rows": table.num_rows,
                "lookup_dtype": backend.lookup_dtype,
                "mapped_bytes": table.stats()["mapped_bytes"],
                # The bytes of the rows this rank owns (NVFP4: packed rows and their block scales).
                "owned_bytes": sum(
                    m.owned_bytes for m in (table.mapping, table.scale_mapping) if m is not None
                ),
                "table_bytes": table.layout.nbytes,
                "outputs": [],
            }
            for seed in (0, 1):
                raw_stock, deq_stock = h.forward(stock, seed)
                raw_mapped, deq_mapped = h.forward(mapped, seed)
                run["outputs"].append(
                    {
                        "raw_equal": h.same_bits(raw_mapped, raw_stock),
                        "dequantized_equal": h.same_bits(deq_mapped, deq_stock),
                        "raw": raw_mapped.view(torch.uint8).clone(),
                    }
                )
            backend.close_table()
            report["runs"][dtype] = run
    torch.save(report, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
