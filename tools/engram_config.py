"""The geometry of DeepSeek-V4.1's Engram tables from a model's config, without vLLM: for the
tests' synthetic tables and ``tp_check.py``'s (the package takes it from vLLM's own
``EngramLayout``, ``ple_um/vllm/engram.py``'s ``geometry_of``).

A position is hashed as ``engram_max_ngram_size - 1`` n-grams (2-gram .. max), each split over
``engram_n_heads`` heads; every (layer, n-gram, head) owns a prime-sized range of its layer's
table, the primes drawn in order above ``engram_vocab_size - 1`` and never reused, the ranges laid
out one after the other from row 0. This is the arithmetic of vLLM 0.33's ``EngramLayout``
(``vllm/models/deepseek_v41/common/engram.py``), redone here (``tests/tools/test_engram_config.py``
holds the two equal).
"""

from __future__ import annotations

from ple_um.checkpoint import EngramGeometry

FIELDS = (
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_vocab_size",
)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 2**32 (the bases 2, 7, 61 suffice there)."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in (2, 7, 61):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_prime(start: int, seen: set[int]) -> int:
    candidate = start + 1
    while not _is_prime(candidate) or candidate in seen:
        candidate += 1
    return candidate


def geometry_from_config(config) -> EngramGeometry:
    """The ``EngramGeometry`` of an object (or dict) with vLLM's ``engram_*`` config fields;
    ValueError naming the field that is missing or wrong."""
    get = (
        config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    )
    missing = [name for name in FIELDS if get(name) is None]
    if missing:
        raise ValueError(f"the model config has no {', '.join(missing)}: not an Engram model")
    layer_ids = tuple(int(x) for x in get("engram_layer_ids"))
    num_rows = tuple(int(x) for x in get("engram_num_embeddings"))
    if len(layer_ids) != len(num_rows):
        raise ValueError(
            f"engram_layer_ids has {len(layer_ids)} entries, engram_num_embeddings {len(num_rows)}"
        )
    orders, heads = int(get("engram_max_ngram_size")) - 1, int(get("engram_n_heads"))
    if orders < 1 or heads < 1:
        raise ValueError("engram_max_ngram_size must be at least 2 and engram_n_heads at least 1")
    first = int(get("engram_vocab_size")) - 1
    seen: set[int] = set()
    sizes = []
    for _ in layer_ids:
        layer = []
        for _ in range(orders):
            current = first
            for _ in range(heads):
                current = _next_prime(current, seen)
                seen.add(current)
                layer.append(current)
        sizes.append(tuple(layer))
    geometry = EngramGeometry(layer_ids, num_rows, int(get("engram_head_dim")), tuple(sizes))
    for at, layer_id in enumerate(layer_ids):
        if sum(geometry.head_sizes[at]) > num_rows[at]:
            raise ValueError(
                f"Engram layer {layer_id}: its {len(geometry.head_sizes[at])} hash heads need "
                f"{sum(geometry.head_sizes[at])} rows, engram_num_embeddings gives {num_rows[at]}"
            )
    return geometry
