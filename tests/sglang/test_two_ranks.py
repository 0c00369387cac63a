"""Two tensor-parallel ranks (gloo, two processes): each maps only its own rows, gives zeros for the
ids of the other rank, and after SGLang's all-reduce the rows equal the stock layer's bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch

WORKER = os.path.join(os.path.dirname(__file__), "two_rank_worker.py")


def test_two_ranks_split_the_table(sglang_checkpoint, tiny, tmp_path, free_port, file_rows, rng):
    directory, layout, _ = sglang_checkpoint("fp8", seed=int(rng.integers(1 << 30)))
    edges = [
        e for k in range(1, layout.parts) for e in (k * layout.rows_per_shard - 1, k * layout.rows_per_shard)
    ]
    flat = np.concatenate(
        [np.arange(layout.num_rows), edges, [127, 128], rng.integers(0, layout.num_rows, 40)]
    )
    ids = torch.from_numpy(rng.permutation(flat[: len(flat) // 4 * 4])).view(-1, 4)
    ids_path = str(tmp_path / "ids.pt")
    torch.save((ids, file_rows(layout).to(torch.bfloat16)), ids_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PLE_UM", "TRITON_INTERPRET", "SGLANG_PLUGINS")}
    port = str(free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), port, directory, ids_path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    (first, second) = sorted(results, key=lambda r: r["rank"])
    assert first["tp_size"] == second["tp_size"] == 2
    assert first["rows"][0] == 0 and first["rows"][1] == second["rows"][0] and second["rows"][1] == tiny.rows
    assert 0 < first["rows"][1] < tiny.rows  # each rank owns a part
    for result in (first, second):
        assert result["table_rows"] == result["rows"]  # the table maps this rank's rows only
        assert 0 < result["owned_ids"] < ids.numel()  # ids on both sides of the split
        assert result["zeros_outside"] and result["owned_equal"], result
        assert result["combined_equal"] and result["scaled_equal"], result
