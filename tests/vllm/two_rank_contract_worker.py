"""One rank of the two-rank contract runs (run by test_contract_two_ranks.py, not collected by pytest).

usage: two_rank_contract_worker.py RANK WORLD_SIZE TMP_DIR CHECKPOINT_DIR OUT_DIR DP_PORT

Two worlds of two gloo ranks, one after the other, each rank building the real layer twice (the
stock device backend, and ple-um's) and recording what both return, for the test to compare:

- ``tp``: tensor parallelism over both ranks (the embedding-parallel group spans them). NVFP4
  shards streamed across the ranks' row boundaries (``streamed``); shards delivered in memory with
  a byte changed outside and inside this rank's rows (``overlap``); per table dtype, padded and
  empty ids through the forward and the prefetch hook, with the reduce and without it (sequence
  parallelism), the dtypes handed to the group's all-reduce, and the whole layer's
  sequence-parallel output (``lookups``).
- ``dp``: two data-parallel ranks sharing one table (vLLM's ``embedding_across_dp``, the group
  spanning data parallelism), 5 and 9 local tokens: the ids gathered into fixed slots and each
  rank's own rows selected (``dp``).

Results go to OUT_DIR/rank<R>.pt.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import vllm_harness as h  # noqa: E402

DTYPES = ("fp8", "bf16", "nvfp4")
DP_TOKENS = (5, 9)


def _outcome(call, *args):
    """``call(*args)``'s result, or the text of what it raised (the test compares stock's with ours)."""
    try:
        return call(*args)
    except Exception as exc:  # noqa: BLE001 - recorded for the test, which asserts on it
        return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _reduces(module, seen: list):
    """Record the dtype of every tensor the layer hands its group's all-reduce (the real one runs)."""
    group = module.ngram_embedding.parallel_group
    real = group.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    group.all_reduce = all_reduce
    try:
        yield
    finally:
        del group.all_reduce


def _ids(tokens: int, num_rows: int, seed: int) -> torch.Tensor:
    """Random ids with padded tokens (1 and 4: the row count and -1 in turn, as vLLM's [8, -1])."""
    ids = torch.randint(0, num_rows, (tokens, h.HEADS), generator=torch.Generator().manual_seed(seed))
    for token in (1, 4):
        if token < tokens:
            ids[token] = torch.tensor([num_rows, -1] * (h.HEADS // 2))
    return ids


def _prefetched(module, ids):
    backend = module.ngram_embedding
    backend.start_prefetch(ids)
    return backend.finalize_prefetch(ids.shape[0])


def _streamed(checkpoints: str) -> dict:
    directory = os.path.join(checkpoints, "nvfp4")
    os.environ["PLE_UM_DIR"] = directory
    config = h.text_config(dtype="nvfp4")
    ids = torch.arange(h.table_rows(config)).view(-1, h.HEADS)
    runs = {}
    for delivery in ("file", "memory"):
        run = {}
        for sp in (False, True):
            for name, ple_um_on in (("stock", False), ("mapped", True)):
                module = h.build(config, ple_um_on=ple_um_on, use_sequence_parallel=sp)
                run[f"{name}_loaded"] = h.load_in_calls(module, h.streamed_nvfp4(directory, delivery))
                module.ngram_embedding.quant_method.process_weights_after_loading(module.ngram_embedding)
                with torch.no_grad():
                    run[f"{name}_{'partial' if sp else 'reduced'}"] = module.ngram_embedding(ids)
                if ple_um_on:
                    backend = module.ngram_embedding
                    run["owned_rows"] = backend.owned_rows
                    run["counts"] = (backend.shards_skipped, backend.shards_compared)
                    backend.close_table()
        runs[delivery] = run
    return runs


def _changed(directory: str, shard: int, local_row: int) -> list:
    """The layer's tensors in memory, one byte of row ``local_row`` of shard ``shard`` flipped."""
    weights = []
    for name, tensor in h.delivered(directory, "memory"):
        if name == f"ngram_embedding.shard_{shard}.weight":
            tensor.view(torch.uint8)[local_row, 1] ^= 1
        weights.append((name, tensor))
    return weights


def _overlap(checkpoints: str, rank: int) -> dict:
    """Shards delivered in memory with one byte changed, in a row of shard 3 (which crosses the
    ranks' boundary at row 640) owned by the other rank or by this one, or in a shard wholly the
    other rank's (6 for rank 0, 0 for rank 1)."""
    directory = os.path.join(checkpoints, "fp8")
    os.environ["PLE_UM_DIR"] = directory
    config = h.text_config(dtype="fp8")
    ids = torch.arange(h.table_rows(config)).view(-1, h.HEADS)
    per_shard = -(-h.table_rows(config) // h.PARTS)
    other, own = (700, 600) if rank == 0 else (600, 700)
    cases = {
        "other_rows_of_a_crossing_shard": (3, other - 3 * per_shard),
        "a_shard_of_the_other_rank": (6 if rank == 0 else 0, 5),
        "own_rows": (3, own - 3 * per_shard),
    }
    results = {"rows": {"other": other, "own": own}}
    for case, (shard, local_row) in cases.items():
        result = {}
        for name, ple_um_on in (("stock", False), ("mapped", True)):
            module = h.build(config, ple_um_on=ple_um_on, use_sequence_parallel=True)

            def load(module=module, shard=shard, local_row=local_row):
                module.load_weights(iter(_changed(directory, shard, local_row)))
                with torch.no_grad():
                    return module.ngram_embedding(ids)

            result[name] = _outcome(load)
            if ple_um_on:
                module.ngram_embedding.close_table()
        results[case] = result
    return results


def _lookups_of(config, directory: str, sp: bool, ids, empty) -> tuple[dict, dict]:
    """Both layers, built with the reduce (``sp`` False) or without it: their rows for ``ids`` and
    for ``empty``, directly and (ple-um) through the prefetch hook, and the dtypes they reduced."""
    kind = "partial" if sp else "reduced"
    run, modules = {}, {}
    for name, ple_um_on in (("stock", False), ("mapped", True)):
        build = h.mapped if ple_um_on else h.stock
        module = modules[name] = build(config, directory, use_sequence_parallel=sp)
        seen: list = []
        with torch.no_grad(), _reduces(module, seen):
            run[f"{name}_{kind}"] = module.ngram_embedding(ids)
            run[f"{name}_{kind}_empty"] = _outcome(module.ngram_embedding, empty)
            if ple_um_on:
                run[f"prefetched_{kind}"] = _prefetched(module, ids)
                run[f"prefetched_{kind}_empty"] = _outcome(_prefetched, module, empty)
        run[f"{name}_{kind}_reduces"] = seen
    return run, modules


def _lookups(checkpoints: str) -> dict:
    runs = {}
    for dtype in DTYPES:
        directory = os.path.join(checkpoints, dtype)
        os.environ["PLE_UM_DIR"] = directory
        config = h.text_config(dtype=dtype)
        num_rows = h.table_rows(config)
        ids, empty = _ids(9, num_rows, seed=4), _ids(0, num_rows, seed=0)
        run = {"ids": ids}
        for sp in (False, True):
            found, modules = _lookups_of(config, directory, sp, ids, empty)
            run.update(found)
            if sp:  # the whole layer under sequence parallelism: each rank's token shard
                token_ids, query_start_loc, ngram_context = h.inputs(5)
                with torch.no_grad():
                    modules["mapped"].start_prefetch(token_ids, query_start_loc, ngram_context)
                    for name, module in modules.items():
                        run[f"{name}_layer_shard"] = module(None, token_ids, query_start_loc, ngram_context)
                    run["layer_ids"] = modules["stock"].compute_ngram_ids(
                        token_ids, query_start_loc, ngram_context
                    )
            modules["mapped"].ngram_embedding.close_table()
        runs[dtype] = run
    return runs


def _dp_config(rank: int, port: int):
    from vllm.config import DeviceConfig, EngramConfig, ParallelConfig, VllmConfig

    parallel = ParallelConfig(tensor_parallel_size=1, data_parallel_size=2, data_parallel_rank=rank)
    # vLLM's data-parallel ranks meet on a port the launcher hands them all.
    parallel._data_parallel_master_port_list = []
    parallel.data_parallel_master_port = port
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel)
    config.engram_config = EngramConfig(cpu_offload=False, embedding_across_dp=True)
    return config


def _dp(tmp_dir: str, checkpoints: str, rank: int, port: int) -> dict:
    from vllm.distributed import get_dp_group, get_etp_group
    from vllm.forward_context import set_forward_context

    config = _dp_config(rank, port)
    runs = {}
    # A data-parallel rank starts its world as a world of one; vLLM widens it across DP.
    with h.vllm_world(os.path.join(tmp_dir, "dp"), world_size=1, rank=0, vllm_config=config):
        runs["groups"] = (get_dp_group().world_size, get_dp_group().rank_in_group, get_etp_group().world_size)
        tokens = DP_TOKENS[rank]
        counts = torch.tensor(DP_TOKENS)
        for dtype in DTYPES:
            directory = os.path.join(checkpoints, dtype)
            os.environ["PLE_UM_DIR"] = directory
            text = h.text_config(dtype=dtype)
            ids = _ids(tokens, h.table_rows(text), seed=10 + rank)
            run = {"ids": ids}
            for name, ple_um_on in (("stock", False), ("mapped", True)):
                module = (h.mapped if ple_um_on else h.stock)(text, directory, data_parallel_rank=rank)
                run[f"{name}_etp_dp"] = module.ngram_embedding.etp_data_parallel_size
                seen: list = []
                with torch.no_grad(), _reduces(module, seen):
                    with set_forward_context(None, config, num_tokens=tokens, num_tokens_across_dp=counts):
                        run[name] = module.ngram_embedding(ids)
                        if ple_um_on:
                            run["prefetched"] = _prefetched(module, ids)
                            run["owned_rows"] = module.ngram_embedding.owned_rows
                run[f"{name}_reduces"] = seen
                if ple_um_on:
                    module.ngram_embedding.close_table()
            runs[dtype] = run
    return runs


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    tmp_dir, checkpoints, out_dir, port = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
    os.environ["PLE_UM"] = "1"
    from ple_um.vllm.plugin import register

    register()
    report: dict = {"rank": rank}
    try:
        with h.vllm_world(os.path.join(tmp_dir, "tp"), world_size=world_size, rank=rank):
            report["streamed"] = _streamed(checkpoints)
            report["overlap"] = _overlap(checkpoints, rank)
            report["lookups"] = _lookups(checkpoints)
        report["dp"] = _dp(tmp_dir, checkpoints, rank, port)
    except BaseException:
        traceback.print_exc()
        raise
    torch.save(report, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
