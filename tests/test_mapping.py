"""ple_um.mapping: read-only mmaps of the owned rows, their addresses, residency and lifetime.

Real files, real mmaps: read-only-ness is checked by writing through the mapping in a child process
(which must die of SIGSEGV or SIGBUS, leaving the file unchanged), residency through mincore after
dropping the files from the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers.hand_checkpoints import sparse_table
from helpers.reference import drop_page_cache, maps_of, reference_rows

import ple_um
from ple_um import residency
from ple_um.errors import CheckpointError, TableClosedError
from ple_um.mapping import PAGE, MappedShards


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def resident(mapping) -> int:
    return sum(r for _, r, _ in mapping.residency())


def read_at(addr: int, n: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(addr, n), dtype=np.uint8)


def row_page(layout, row: int) -> int:
    """The file page that holds ``row`` (rows of 512 bytes never straddle a page)."""
    spec = layout.shards[row // layout.rows_per_shard]
    return (spec.offset + (row - spec.index * layout.rows_per_shard) * layout.row_bytes) // PAGE


@pytest.fixture
def big_layout(make_checkpoint):
    """1 MiB of FP8 rows in one file: 2048 rows of 512 bytes (8 rows a page), 4 shards of 512 rows."""
    return make_checkpoint(num_rows=2048, row_dim=512, dtype="fp8", shards=4, files=1)


@pytest.fixture
def evictable(big_layout):
    """big_layout, after checking that its files can be evicted here (not on tmpfs, say)."""
    drop_page_cache(big_layout)
    with MappedShards(big_layout) as m:
        if resident(m) > 2 * PAGE:
            pytest.skip("the page cache keeps these files resident (tmpfs?): residency cannot be observed")
    return big_layout


def test_mapping_is_read_only_and_shared(fp8_layout):
    with MappedShards(fp8_layout) as m:
        for region in m.regions:
            (line,) = maps_of([region.path])
            assert line.split()[1] == "r--s", line  # PROT_READ, MAP_SHARED


def test_write_through_the_mapping_faults_and_leaves_the_file(fp8_layout):
    before = {p: digest(p) for p in fp8_layout.files}
    child = textwrap.dedent(
        f"""
        from ple_um.checkpoint import read_layout
        from ple_um.mapping import MappedShards
        m = MappedShards(read_layout({fp8_layout.directory!r}))
        view = m.regions[-1].array()
        print(int(view[-1]), flush=True)  # reading is fine
        view[-1] = view[-1] ^ 0xFF
        print("wrote", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (done.returncode, done.stderr[-2000:])
    assert "wrote" not in done.stdout and done.stdout.strip().isdigit()
    assert {p: digest(p) for p in fp8_layout.files} == before


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_a_rank_maps_its_own_rows_not_the_shards_between_them(make_checkpoint, ranks):
    """A file's tensors lie in name order (shard_1, shard_10, ..., shard_19, shard_2, ...), as
    safetensors writes them: a tensor-parallel rank's shards lie apart, other ranks' between them.
    Each rank maps its own rows and no other rank's (one mapping per run of its shards), so that
    what it maps, registers, prewarms and counts as its table is its own; every row it reads is
    the file's."""
    layout = make_checkpoint(num_rows=32 * 64, row_dim=256, dtype="fp8", shards=32, files=1)
    offsets = [s.offset for s in layout.shards]
    assert offsets != sorted(offsets)  # name order: the shards' rows lie out of index order
    per = layout.num_rows // ranks
    for rank in range(ranks):
        rows = (rank * per, (rank + 1) * per)
        with MappedShards(layout, rows) as m:
            assert m.owned_bytes == per * layout.row_bytes
            assert m.mapped_bytes <= m.owned_bytes + len(m.regions) * PAGE, (rank, len(m.regions))
            assert len(m.regions) <= len(m.owned)
            for index, owned in m.owned.items():
                region = m.regions[owned.region]
                assert region.addr <= owned.addr
                assert owned.addr + owned.rows * layout.row_bytes <= region.addr + region.length
                start = index * layout.rows_per_shard
                expected = reference_rows(layout, range(start + owned.lo, start + owned.hi))
                assert np.array_equal(m.shard_rows(index), expected)
        if rank == 1:  # the table over those mappings: every id, through the host path
            ids = torch.arange(-1, layout.num_rows + 1)
            with ple_um.open_table(layout.directory, rows=rows, mode="cpu") as table:
                got = table.lookup(ids).view(torch.uint8).numpy()
            assert np.array_equal(got, reference_rows(layout, ids, rows))


@pytest.mark.parametrize(
    ("rows", "owned"),
    [
        ((1000, 1010), {1: (488, 498)}),
        ((1020, 1030), {1: (508, 512), 2: (0, 6)}),
        ((0, 1), {0: (0, 1)}),
        ((2047, 2048), {3: (511, 512)}),
        ((0, 2048), {i: (0, 512) for i in range(4)}),
        ((700, 700), {}),
        ((-5, 3000), {i: (0, 512) for i in range(4)}),  # clamped to the table
    ],
)
def test_only_the_owned_rows_are_mapped(big_layout, rows, owned):
    layout = big_layout
    file_size = os.path.getsize(layout.files[0])
    with MappedShards(layout, rows) as m:
        assert (m.row_start, m.row_end) == (max(0, rows[0]), min(layout.num_rows, rows[1]))
        assert {i: (o.lo, o.hi) for i, o in m.owned.items()} == owned
        assert m.owned_bytes == sum(hi - lo for lo, hi in owned.values()) * layout.row_bytes
        if not owned:
            assert m.regions == [] and m.mapped_bytes == 0
            assert m.host_bases() == [0] * layout.parts
            return
        (region,) = m.regions  # one file
        first = min(layout.shards[i].offset + lo * layout.row_bytes for i, (lo, _) in owned.items())
        last = max(layout.shards[i].offset + hi * layout.row_bytes for i, (_, hi) in owned.items())
        assert region.file_offset % PAGE == 0 and region.addr % PAGE == 0
        assert region.file_offset == first - first % PAGE
        assert region.length == last - region.file_offset
        if m.owned_bytes <= 16 * layout.row_bytes:
            assert m.mapped_bytes <= 3 * PAGE < file_size
        # What lies mapped is the file's bytes.
        for index in owned:
            got = m.shard_rows(index)
            lo, hi = owned[index]
            start = index * layout.rows_per_shard
            assert np.array_equal(got, reference_rows(layout, range(start + lo, start + hi)))


@pytest.mark.parametrize("rows", [None, (300, 1900)])
def test_shard_base_addresses(make_checkpoint, rows):
    # Four files; the last one's FP8 data lies 4 mod 8.
    layout = make_checkpoint(num_rows=2000, row_dim=12, dtype="fp8", shards=6, files=4)
    rb = layout.row_bytes
    with MappedShards(layout, rows) as m:
        bases = m.host_bases()
        assert len(bases) == layout.parts
        for spec in layout.shards:
            owned = m.owned.get(spec.index)
            if owned is None:
                assert bases[spec.index] == 0
                continue
            region = m.regions[owned.region]
            assert region.path == spec.path
            assert bases[spec.index] == m.shard_base(spec.index)
            assert bases[spec.index] == region.addr + spec.offset - region.file_offset
            assert bases[spec.index] % 8 == spec.offset % 8  # alignment follows the file offset
            assert owned.addr == bases[spec.index] + owned.lo * rb
            # base + local * row_bytes is the row, for the owned local rows (both ends).
            for local in (owned.lo, owned.hi - 1):
                row = spec.index * layout.rows_per_shard + local
                got = read_at(bases[spec.index] + local * rb, rb)
                assert np.array_equal(got, reference_rows(layout, [row])[0])


def test_touch_rows_makes_their_pages_resident(evictable, rng):
    layout = evictable
    drop_page_cache(layout)
    with MappedShards(layout) as m:
        m.advise("random")  # no readahead: a touched row brings in little more than its own page
        assert resident(m) <= PAGE
        ids = rng.choice(layout.num_rows, 12, replace=False)
        outside = np.array([-1, layout.num_rows, 10**9])
        assert m.touch_rows(np.concatenate([ids, outside])) == ids.size
        pages = {row_page(layout, int(i)) for i in ids}
        after = resident(m)
        # Every touched page, and not the whole file (the page cache may read a few neighbours:
        # large folios).
        assert len(pages) * PAGE <= after <= m.mapped_bytes // 2
        assert m.touch_rows(np.array([], dtype=np.int64)) == 0


def test_touch_rows_skips_rows_not_owned(evictable):
    layout = evictable
    with MappedShards(layout, (512, 1024)) as m:
        drop_page_cache(layout)
        m.advise("random")
        assert m.touch_rows(np.array([0, 100, 511, 1024, 2000])) == 0
        assert m.touch_rows(np.array([0, 600, 1023])) == 2


def test_populate_brings_the_mapping_in(evictable):
    layout = evictable
    drop_page_cache(layout)
    with MappedShards(layout) as m:
        assert resident(m) <= PAGE
        seen = []
        asked = m.populate(fraction=0.5, workers=2, progress=seen.append)
        assert asked == sum(seen) == int(m.mapped_bytes * 0.5)
        assert resident(m) >= asked - PAGE
        assert m.populate() == m.mapped_bytes
        ((path, res, length),) = m.residency()
        assert (path, res, length) == (layout.files[0], m.mapped_bytes, m.mapped_bytes)


def test_close_releases_everything_once(fp8_layout):
    m = MappedShards(fp8_layout)
    paths = [r.path for r in m.regions]
    fds = [r.fd for r in m.regions]
    assert all(maps_of([p]) for p in paths)
    m.close()
    assert m.closed and m.regions == [] and m.owned == {}
    assert not any(maps_of([p]) for p in paths)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    m.close()  # idempotent
    for call in (
        lambda: m.advise("random"),
        lambda: m.populate(),
        lambda: m.touch_rows(np.array([0])),
        lambda: m.residency(),
    ):
        with pytest.raises(TableClosedError):
            call()


def test_context_manager_closes(fp8_layout):
    with MappedShards(fp8_layout) as m:
        assert not m.closed
    assert m.closed


def test_changed_files_detects_replace_truncate_and_delete(make_checkpoint):
    layout = make_checkpoint(num_rows=64, row_dim=16, dtype="bf16", shards=4, files=4)
    a, b, c, d = layout.files
    with MappedShards(layout) as m:
        before = m.shard_rows(0).copy()
        assert m.changed_files() == []
        # a: replaced by a copy with the same bytes (a new inode), as a re-download would.
        shutil.copyfile(a, a + ".new")
        os.replace(a + ".new", a)
        # b: truncated (never read again here: that would fault).
        os.truncate(b, os.path.getsize(b) - 1)
        # c: deleted.
        os.unlink(c)
        assert m.changed_files() == [a, b, c]
        # The mapping still shows the replaced file's old inode.
        assert np.array_equal(m.shard_rows(0), before)
        # d: only its modification time changes.
        st = os.stat(d)
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert m.changed_files() == [a, b, c, d]


def test_changed_files_compares_the_device_as_replaced_files_does(make_checkpoint):
    """A path that now shows a file of another filesystem (the same inode number, size and mtime
    there) is another file: changed_files names it, as replaced_files (``FileIdentity``) does."""
    layout = make_checkpoint(num_rows=64, row_dim=16, dtype="bf16", shards=2, files=2)
    a, _ = layout.files
    with MappedShards(layout) as m:
        assert m.changed_files() == []
        # The record of what was mapped names another device, all else equal: as if another
        # filesystem were mounted over the checkpoint's folder with a file alike in all but that.
        next(r for r in m.regions if r.path == a).st_dev += 1
        assert m.changed_files() == [a]


def test_a_file_mapped_in_two_runs_is_one_changed_file(make_checkpoint):
    """A rank whose shards lie apart in one file maps it in two runs; the file changed is one file."""
    layout = make_checkpoint(num_rows=32 * 64, row_dim=256, dtype="fp8", shards=32, files=1)
    (path,) = layout.files
    with MappedShards(layout, (0, layout.num_rows // 2)) as m:
        assert len(m.regions) >= 2 and {r.path for r in m.regions} == {path}
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert m.changed_files() == [path]


def test_a_file_shorter_than_its_header_says_is_a_checkpoint_error(make_checkpoint):
    layout = make_checkpoint(num_rows=40, row_dim=8, dtype="fp8", shards=2, files=2)
    path = layout.shards[0].path
    os.truncate(path, layout.shards[0].offset + 3 * layout.row_bytes)  # after the header was read
    with pytest.raises(CheckpointError, match="truncated") as info:
        MappedShards(layout)
    assert info.value.path == path
    # Even a range that needs none of the missing bytes: the file is not the one whose header was read.
    with pytest.raises(CheckpointError, match=r"changed after its header was read \(size") as info:
        MappedShards(layout, (0, 3))
    assert info.value.path == path
    assert not maps_of(layout.files)
    # The other file, untouched, maps.
    with MappedShards(layout, (layout.rows_per_shard, layout.num_rows)) as m:
        assert list(m.owned) == [1]


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
@pytest.mark.parametrize("gone", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_missing_file_is_a_checkpoint_error_naming_it_and_its_tensor(make_checkpoint, gone, dtype):
    """A file gone after its header was read (first, middle or last; the rows' mapping, and an
    NVFP4 table's block scales'): a CheckpointError naming the file and the first tensor mapped
    from it, and nothing left mapped."""
    layout = make_checkpoint(num_rows=60, row_dim=32, dtype=dtype, shards=6, files=3)
    path = layout.files[gone]
    os.unlink(path)
    for table in (layout, layout.scale_layout()) if dtype == "nvfp4" else (layout,):
        with pytest.raises(CheckpointError, match="cannot open shard file") as info:
            MappedShards(table)
        first = min((s for s in table.shards if s.path == path), key=lambda s: s.index)
        assert (info.value.path, info.value.tensor) == (path, first.tensor), str(info.value)
        assert path in str(info.value) and first.tensor in str(info.value)
    assert not maps_of(layout.files)


# -- residency in windows ------------------------------------------------------------------------
def _runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """The reference: runs of resident pages of a whole-mapping mincore vector."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], pages, [0])).astype(np.int8)))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def test_residency_read_in_windows_matches_one_mincore(evictable, monkeypatch):
    """Counts and runs of resident pages read window by window (windows of 3 pages here: runs cross
    their edges) are those of one mincore over the whole mapping; map_resident takes the longest."""
    layout = evictable
    drop_page_cache(layout)
    monkeypatch.setattr(residency, "RESIDENCY_WINDOW", 3)
    fd = os.open(layout.files[0], os.O_RDONLY)
    with MappedShards(layout) as m:
        (region,) = m.regions
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # only the pages read come in
            page = region.file_offset // PAGE
            for length in (1, 7, 2, 5, 3, 4, 6):  # runs of these lengths, a gap of 2 after each
                for k in range(length):
                    os.pread(fd, 1, (page + k) * PAGE)
                page += length + 2
        finally:
            os.close(fd)
        whole = residency.resident_pages(region)
        if whole.sum() < 28:
            pytest.skip("pages read did not stay in the page cache")
        windowed = [
            run for starts, ends in residency.resident_runs(region) for run in zip(starts, ends, strict=True)
        ]
        assert sorted(windowed) == _runs(whole) and len(_runs(whole)) >= 7
        assert residency.resident_count(region) == int(whole.sum())
        # Any byte range, pages cut at both ends, asked of mincore in windows of 3 pages at most.
        asked = []
        mincore = residency.mincore
        monkeypatch.setattr(residency, "mincore", lambda a, n, where: asked.append(n) or mincore(a, n, where))
        for start, length in ((0, region.length), (PAGE // 3, 11 * PAGE), (5 * PAGE + 7, 9 * PAGE - 20)):
            pages = np.arange(whole.size) * PAGE
            overlap = np.clip(np.minimum(pages + PAGE, start + length) - np.maximum(pages, start), 0, None)
            want = int(overlap[whole.astype(bool)].sum())
            assert residency.resident_bytes(region.addr + start, length, region.path) == want > 0
        assert asked and max(asked) <= 3 * PAGE
        ((_, resident_bytes, _),) = m.residency()
        assert resident_bytes == min(int(whole.sum()) * PAGE, region.length)
        runs = _runs(whole)
        longest = sorted(runs, key=lambda run: (run[0] - run[1], run[0]))[:3]
        want = sum(min(b * PAGE, region.length) - a * PAGE for a, b in longest)
        populated = m.map_resident(most_runs=3)
        if populated:  # 0 where the kernel lacks MADV_POPULATE_READ
            assert populated == want


# A child that measures its peak memory around the mapping of a huge sparse table and every
# residency reading of it; one mincore vector for the whole of it took about 10 B a page (2 TiB:
# 5.1 GiB, 61 s).
_SPARSE_CHILD = textwrap.dedent(
    """
    import resource, sys, time
    from ple_um.checkpoint import read_layout
    from ple_um.mapping import MappedShards
    layout = read_layout(sys.argv[1])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with MappedShards(layout) as m:
        residency = m.residency()
        resident = m.resident()
        populated = m.map_resident()
        mapped = m.mapped_bytes
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(mapped, sum(r for _, r, _ in residency), resident, populated, grown * 1024, time.monotonic() - t0)
    """
)


def test_a_huge_sparse_table_costs_bounded_memory_and_time(tmp_path):
    """A table of 1 TiB declared in a sparse file: mapped, its residency counted, its resident runs
    mapped, in a bounded amount of memory (the windows of mincore) and time."""
    rows, dim = 1 << 29, 1 << 10  # 2 shards of 2**29 rows of 1 KiB (FP8): 1 TiB
    path = sparse_table(tmp_path, rows, dim)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SPARSE_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300
        )
    finally:
        os.unlink(path)
    assert done.returncode == 0, done.stderr[-3000:]
    mapped, resident_bytes, resident, populated, grown, seconds = done.stdout.split()
    assert int(mapped) >= 2 * rows * dim and int(resident_bytes) < 1 << 20 and resident == "False"
    assert int(populated) < 1 << 20
    assert int(grown) < 200 << 20, f"peak memory grew by {int(grown) >> 20} MiB"
    assert float(seconds) < 120, f"{float(seconds):.1f} s"


def test_evicting_pages_unmaps_them_here_then_drops_them_from_the_page_cache(evictable):
    """``residency.evict_pages``, the one way the package, its tools and its tests drop pages: the
    page cache keeps a page this process maps (fadvise alone drops nothing of a populated mapping),
    so the mapping is emptied first; ``evict_file_pages`` drops the range asked and no other."""
    layout = evictable
    with MappedShards(layout) as m:
        (region,) = m.regions
        m.populate()
        assert resident(m) == m.mapped_bytes
        residency.evict_file_pages(region.path)
        assert resident(m) == m.mapped_bytes
        residency.evict_pages(layout.files, m.regions)
        assert resident(m) <= PAGE
        m.populate()
        residency.evict_pages([], m.regions)  # unmapped here, still in the page cache
        assert resident(m) == m.mapped_bytes
        half = (region.file_offset + region.length // 2) // PAGE * PAGE
        residency.evict_file_pages(region.path, half)  # from there to the end
        pages = residency.resident_pages(region)
        first_dropped = (half - region.file_offset) // PAGE
        assert pages[:first_dropped].all() and pages[first_dropped:].sum() <= 2


def test_evicting_pages_of_a_file_system_without_fsync_still_drops_them(evictable, monkeypatch):
    """squashfs, erofs and iso9660 have no fsync (EINVAL; EROFS on some others): their files have no
    dirty page, and their pages are dropped all the same. Any other write-back failure raises, and
    drops nothing; ``write_back=False`` (the first-read child, the benches reading a table) never
    calls fsync."""
    layout, fsyncs = evictable, []

    def failing(code: int):
        def fsync(fd: int) -> None:
            fsyncs.append(fd)
            raise OSError(code, os.strerror(code))

        return fsync

    with MappedShards(layout) as m:
        (region,) = m.regions

        def cached_not_mapped() -> None:
            m.populate()
            residency.evict_pages([], m.regions)  # unmapped here, still in the page cache
            assert resident(m) == m.mapped_bytes

        for code in (errno.EINVAL, errno.EROFS):
            cached_not_mapped()
            monkeypatch.setattr(residency.os, "fsync", failing(code))
            residency.evict_file_pages(region.path)
            assert fsyncs and resident(m) <= PAGE
        cached_not_mapped()
        monkeypatch.setattr(residency.os, "fsync", failing(errno.EIO))
        with pytest.raises(OSError) as raised:
            residency.evict_file_pages(region.path)
        assert raised.value.errno == errno.EIO and resident(m) == m.mapped_bytes
        fsyncs.clear()
        m.populate()
        residency.evict_pages(layout.files, m.regions, write_back=False)
        assert not fsyncs and resident(m) <= PAGE


def test_file_mappings_are_this_process_mappings_of_files_that_are_there(tmp_path):
    """Each mapping of a file, with its address, length, path and offset in the file; anonymous
    memory not among them, a closed mapping gone, and the mapping of a file deleted since left out."""
    path = tmp_path / "mapped.bin"
    path.write_bytes(os.urandom(4 * PAGE))
    heap = np.zeros(4 * PAGE, dtype=np.uint8).ctypes.data  # anonymous memory
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 2 * PAGE, prot=mmap.PROT_READ, offset=PAGE)
    try:
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        mine = [fm for fm in residency.file_mappings() if fm.path == str(path)]
        assert mine == [residency.FileMapping(addr, 2 * PAGE, str(path), PAGE)]
        assert not any(fm.addr <= heap < fm.addr + fm.length for fm in residency.file_mappings())
        path.unlink()
        assert not [fm for fm in residency.file_mappings() if fm.path.startswith(str(path))]
    finally:
        m.close()
    path.write_bytes(b"x")  # the name there again, no longer mapped
    assert not [fm for fm in residency.file_mappings() if fm.path == str(path)]
