"""Row gather from per-shard base addresses: ids -> shard -> base -> row, optionally dequantized.

The table never lives in a torch tensor: ``bases`` is a device tensor of int64 addresses, one per
shard, each the address (device pointer of a registered mapping, a host address under ATS or the
interpreter, or a device allocation) of the shard's local row 0. A row is read as words of
``WORD_BITS`` (8 bytes when the rows and the addresses allow), ``ROWS`` rows per program. A word is
never wider than the alignment the caller gives, since a GPU faults on a misaligned load: a 16-bit
table whose data starts at an odd byte is read in bytes, two to an element. Rows outside the
owned range and ids outside the table are never read: they come back as zeros, and ids outside
the table are counted on the device (no host sync), as are the rows looked up, so replays of a
captured CUDA graph are counted too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple_um.kernels.launch import DirectLaunch, bind

# Storage element formats, as the kernel's STORAGE constexpr.
E4M3, E5M2, BF16, F16 = 0, 1, 2, 3
STORAGE_CODES = {
    torch.float8_e4m3fn: E4M3,
    torch.float8_e5m2: E5M2,
    torch.bfloat16: BF16,
    torch.float16: F16,
}
_WORD_DTYPES = {64: torch.int64, 32: torch.int32, 16: torch.int16, 8: torch.uint8}

# The program shape that measured fastest (docs/lab/PERF_NOTES.md); callers may pass others.
ROWS_PER_PROGRAM = 16
NUM_WARPS = 4


@triton.jit
def _decode(x, STORAGE: tl.constexpr):
    """Storage bits (int32, one element each) -> float32, exactly."""
    if STORAGE == 0:  # float8_e4m3fn: no infinities, 0x7F / 0xFF are NaN
        sign = (x >> 7) & 1
        exp = (x >> 3) & 0xF
        man = x & 0x7
        normal = ((exp + 120) << 23) | (man << 20)
        # Subnormals: man * 2**-9, exact in float32. The sign goes in as a bit, never as a negation:
        # compiled code may negate as 0 - x, which turns -0.0 (0x80) into +0.0.
        sub = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
        val = (tl.where(exp == 0, sub, normal) | (sign << 31)).to(tl.float32, bitcast=True)
        val = tl.where((x & 0x7F) == 0x7F, float("nan"), val)
    elif STORAGE == 1:  # float8_e5m2: the top byte of a float16
        val = (x << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif STORAGE == 2:  # bfloat16: the top half of a float32
        val = (x << 16).to(tl.float32, bitcast=True)
    else:  # float16
        val = x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return val


@triton.jit
def _to_bf16_bits(val):
    """float32 -> bfloat16 bits (int16), round to nearest even (torch's rounding of finite values),
    every NaN -> the quiet NaN 0x7FC0; done by hand so the compiled kernel and the interpreter agree
    bit for bit."""
    bits = val.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(val != val, 0x7FC0, rounded)
    return rounded.to(tl.int16)


@triton.jit
def _locate(ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS: tl.constexpr):
    """This program's rows of the batch: which are in it, which are owned (in the table and the
    owned range), and each id's shard and local row (0 where not owned, so never an address
    outside the table). Counts the batch and the ids outside the table."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    in_batch = rows < n
    ids = tl.load(ids_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    in_table = (ids >= 0) & (ids < num_rows)
    bad = tl.sum((in_batch & ~in_table).to(tl.int64), axis=0)
    # One atomic per launch for the row count, and one per program only when it saw a bad id: no
    # contention on the counters in the common case.
    tl.atomic_add(counters_ptr, pid * 0 + n, mask=pid == 0)
    tl.atomic_add(counters_ptr + 1, bad, mask=bad > 0)
    owned = in_batch & in_table & (ids >= row_start) & (ids < row_end)
    safe = tl.where(owned, ids, 0)
    shard = safe // rows_per_shard
    local = safe - shard * rows_per_shard
    return rows, in_batch, owned, shard, local


@triton.jit
def _store_decoded(out_ptr, val, rows, in_batch, col, row_dim, OUT_BF16: tl.constexpr):
    """Decoded float32 ``val`` [ROWS, len(col)] into ``out`` [n, row_dim] (bfloat16 as its int16 bits
    when OUT_BF16), masked to the batch's rows and the row's elements."""
    if OUT_BF16:
        val = _to_bf16_bits(val)
    dst = out_ptr + rows[:, None] * row_dim + col[None, :]
    tl.store(dst, val.to(out_ptr.dtype.element_ty), mask=in_batch[:, None] & (col < row_dim)[None, :])


# The batch (ids, out, n) changes from call to call of one table: never specialized on, so that one
# compiled kernel serves every call of a kind (ple_um/kernels/launch.py).
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["ids_ptr", "out_ptr"])
def _gather_kernel(
    bases_ptr,  # int64 [parts]: address of each shard's local row 0
    ids_ptr,  # [n] global row ids, of any integer dtype a table takes (int8 to int64)
    out_ptr,  # raw: words [n, row_words]; dequantized: elements [n, row_dim]
    counters_ptr,  # int64 [2]: rows looked up, ids outside [0, num_rows); accumulated on the device
    n,
    row_start,
    row_end,
    num_rows,
    rows_per_shard,
    row_words,
    scale_ptr,  # float32 [1]: the dequantization scale (read only when HAS_SCALE)
    WORD_BITS: tl.constexpr,
    ELEM_BITS: tl.constexpr,
    STORAGE: tl.constexpr,
    DEQUANT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    WORDS: tl.constexpr,
):
    rows, in_batch, owned, shard, local = _locate(
        ids_ptr, counters_ptr, n, row_start, row_end, num_rows, rows_per_shard, ROWS
    )
    base = tl.load(bases_ptr + shard, mask=owned, other=0)
    if WORD_BITS == 64:
        word_ty = tl.int64
    elif WORD_BITS == 32:
        word_ty = tl.int32
    elif WORD_BITS == 16:
        word_ty = tl.int16
    else:
        word_ty = tl.uint8
    row_ptr = base.to(tl.pointer_type(word_ty)) + local * row_words
    w = tl.arange(0, WORDS)
    in_row = w < row_words
    if not DEQUANT:
        words = tl.load(row_ptr[:, None] + w[None, :], mask=owned[:, None] & in_row[None, :], other=0)
        dst = out_ptr + rows[:, None] * row_words + w[None, :]
        tl.store(dst, words, mask=in_batch[:, None] & in_row[None, :])
    else:
        if WORD_BITS >= ELEM_BITS:
            PER_WORD: tl.constexpr = WORD_BITS // ELEM_BITS
            COLS: tl.constexpr = WORDS * PER_WORD
            words = tl.load(row_ptr[:, None] + w[None, :], mask=owned[:, None] & in_row[None, :], other=0)
            shift = (tl.arange(0, PER_WORD) * ELEM_BITS).to(word_ty)
            # Narrow to int32 before masking: the mask of a 16-bit element in a 16-bit word (a 16-bit
            # table whose rows or bases are only 2-aligned) is out of range for int16.
            elems = (words[:, :, None] >> shift[None, None, :]).to(tl.int32) & ((1 << ELEM_BITS) - 1)
            elems = tl.reshape(elems, (ROWS, COLS))
            row_dim = row_words * PER_WORD
        else:
            # Words narrower than an element (a 16-bit table whose data starts at an odd byte: bytes):
            # each element is put together from its words, the lowest first (little-endian), so no
            # load is wider than the alignment the table was given.
            PER_ELEM: tl.constexpr = ELEM_BITS // WORD_BITS
            COLS: tl.constexpr = WORDS // PER_ELEM
            row_dim = row_words // PER_ELEM
            e = tl.arange(0, COLS)
            m = owned[:, None] & (e < row_dim)[None, :]
            elems = tl.zeros((ROWS, COLS), dtype=tl.int32)
            for k in tl.static_range(PER_ELEM):
                part = tl.load(row_ptr[:, None] + (e * PER_ELEM + k)[None, :], mask=m, other=0)
                elems |= (part.to(tl.int32) & ((1 << WORD_BITS) - 1)) << (k * WORD_BITS)
        val = _decode(elems, STORAGE)
        if HAS_SCALE:
            val = val * tl.load(scale_ptr)
        _store_decoded(out_ptr, val, rows, in_batch, tl.arange(0, COLS), row_dim, OUT_BF16)


def word_bits_for(*quantities: int) -> int:
    """The widest word (64, 32, 16 or 8 bits) that divides every byte quantity given."""
    for bits in (64, 32, 16):
        if all(q % (bits // 8) == 0 for q in quantities):
            return bits
    return 8


def gather_rows(
    bases: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
    *,
    storage: torch.dtype,
    row_start: int,
    row_end: int,
    num_rows: int,
    rows_per_shard: int,
    row_bytes: int,
    base_align: int,
    scale: torch.Tensor | None = None,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    launch: DirectLaunch | None = None,
    on_bound=None,
) -> torch.Tensor:
    """Gather ``ids`` (flat, contiguous) into ``out`` ([n, row_dim], contiguous).

    ``out.dtype == storage`` copies raw rows; a float ``out`` gets ``float32(row) * scale``
    (``scale``: a float32 tensor of one element, read on the device; only when given) cast to its
    dtype. ``base_align`` is a byte alignment every base address and row start honours (the widest
    word the table allows). ``launch``: a table's DirectLaunch of this kernel (else Triton's own
    launch); ``on_bound(launch)`` is given, where the compiled kernel may be launched directly, a
    launcher of it bound to this call's fixed arguments (``launch.bind``). No allocation, no host
    sync."""
    n = ids.numel()
    if n == 0:
        return out
    elem_bits = storage.itemsize * 8
    raw = out.dtype == storage
    word_bits = word_bits_for(base_align, row_bytes, out.data_ptr() if raw else 8)
    row_words = row_bytes * 8 // word_bits
    if raw:
        target = out.view(torch.uint8).view(_WORD_DTYPES[word_bits])
    else:
        target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    constexprs = (
        word_bits,  # WORD_BITS
        elem_bits,  # ELEM_BITS
        STORAGE_CODES.get(storage, -1),  # STORAGE
        not raw,  # DEQUANT
        scale is not None and not raw,  # HAS_SCALE
        out.dtype == torch.bfloat16,  # OUT_BF16
        rows_per_program,  # ROWS
        triton.next_power_of_2(row_words),  # WORDS
    )
    args = (
        bases,
        ids,
        target,
        counters,
        n,
        row_start,
        row_end,
        num_rows,
        rows_per_shard,
        row_words,
        counters if scale is None else scale,
        *constexprs,
    )
    kind = (ids.dtype, target.dtype, n >= 1 << 31, *constexprs)
    launch = launch or DirectLaunch(_gather_kernel, direct=False)
    compiled = launch(kind, triton.cdiv(n, rows_per_program), args, num_warps)
    if compiled is not None and on_bound is not None:
        on_bound(bind(compiled, args, ids_at=1, n_at=4, rows_per_program=rows_per_program))
    return out
