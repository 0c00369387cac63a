"""ple_um.metrics.progress_bars: a bar over a mapping's populate, and none below min_bytes."""

from __future__ import annotations

from ple_um import metrics
from ple_um.mapping import MappedShards


def test_progress_bar_over_populate(make_checkpoint, capsys):
    layout = make_checkpoint(num_rows=20000, row_dim=64, shards=4)
    with MappedShards(layout) as mapping:
        with metrics.progress(mapping.mapped_bytes, "prewarm", min_bytes=0) as advance:
            done = mapping.populate(progress=advance)
        assert done == mapping.mapped_bytes
    err = capsys.readouterr().err
    assert "prewarm" in err and "100%" in err
    with metrics.progress(10 << 20, "register") as advance:  # below min_bytes: no bar
        advance(10 << 20)
    assert capsys.readouterr().err == ""
