"""A plot of the lookup tables: median time per batch size, one line per path and id distribution
(log-log; the torch anchor in black), in any image format matplotlib writes (by the file's
extension)."""

from __future__ import annotations

import os

from ple_um.bench.contenders import ANCHOR
from ple_um.bench.report import write_atomically
from ple_um.bench.serving import NO_PLE, RESIDENT
from ple_um.units import format_bytes

LINESTYLES = ("-", "--", ":", "-.")


def plot_format(path: str) -> str:
    """The image format of ``path``, from its extension; ValueError naming the formats accepted (the
    extensions matplotlib can write)."""
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1].lstrip(".").lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if ext not in known:
        given = f"its extension .{ext}" if ext else "no extension"
        raise ValueError(
            f"{path} has {given}: give a file name ending in one of "
            + ", ".join(f".{e}" for e in sorted(known))
        )
    return ext


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    """``fig`` laid out and written whole to ``path`` in its extension's format, then closed."""
    fig.tight_layout()
    try:
        fmt = plot_format(path)
        write_atomically(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=120))
    finally:
        _pyplot().close(fig)


def check_writable_format(path: str) -> None:
    """Render an empty figure in ``path``'s format, in memory: ValueError before a run whose plot
    could not be written (an unknown extension, a format whose writer is missing here)."""
    import io

    plt = _pyplot()
    fmt = plot_format(path)
    fig = plt.figure(figsize=(1, 1))
    try:
        fig.savefig(io.BytesIO(), format=fmt)
    except Exception as exc:  # noqa: BLE001 - any writer's failure means: this format does not work here
        raise ValueError(
            f"{path}: matplotlib cannot write .{fmt} here ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        plt.close(fig)


def _time_axes(ax, result: dict, title: str, xlabel: str, ylabel: str) -> None:
    """A time plot's axes: log times, the labels, a grid, and a title that names the device and
    the table's size, then ``title``."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{result['device']}: {format_bytes(result['table']['bytes'])} table{title}")
    ax.grid(True, which="both", alpha=0.3)


def plot_lookups(result: dict, path: str) -> None:
    """The side-by-side run: median time per batch size, one line per path and id distribution."""
    rows = result["method"]["rows"]
    fig, ax = _pyplot().subplots(figsize=(8, 5))
    colors: dict[str, str] = {}
    for i, dist in enumerate(result["ids"]):
        for name, entry in result["lookup"].items():
            runs = entry.get(dist, {})
            xs = [n for n in rows if str(n) in runs]
            if not xs:
                continue
            label = name if len(result["ids"]) == 1 else f"{name}, {dist}"
            color = "black" if name == ANCHOR else colors.get(name)
            (line,) = ax.plot(
                xs,
                [runs[str(n)]["median_us"] for n in xs],
                marker="o",
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                color=color,
                label=label,
            )
            colors.setdefault(name, line.get_color())
    ax.set_xscale("log")
    _time_axes(ax, result, f", {result['table']['row_bytes']} B rows", "rows per lookup", "median time (us)")
    ax.legend(fontsize="small")
    _save(fig, path)


# A line of plot_limits: its curves, as (key, style, what the label says).
_LIMIT_CURVES = (
    ("steady", {"marker": "o"}, "steady"),
    ("cold", {"marker": "x", "linestyle": "--"}, "cold"),
    ("alone", {"marker": "s", "linestyle": ":"}, "steady, page cache only"),
)


def limit_curves(result: dict) -> dict[tuple[str, str, str], dict[str, list]]:
    """The curves of ``plot_limits``, by (mode, id distribution, batch size): the limits in GiB
    (``x``, smallest first, whatever order they ran in) and at each the median of the cold calls,
    of the steady state and of the steady state without the row cache (NaN where not measured)."""
    limits = sorted((e for e in result["limits"].values() if "modes" in e), key=lambda e: e["bytes"])
    lines: dict[tuple[str, str, str], dict[str, list]] = {}
    for entry in limits:
        for mode, runs in entry["modes"].items():
            for dist in result["ids"]:
                for n, row in runs.get(dist, {}).items():
                    line = lines.setdefault((mode, dist, n), {"x": [], "cold": [], "steady": [], "alone": []})
                    line["x"].append(entry["bytes"] / (1 << 30))
                    line["cold"].append(row["cold"]["median_us"])
                    # NaN: not measured (no row cache to go without, or a steady state that failed)
                    for key, got in (("steady", row.get("steady")), ("alone", row.get("steady_page_cache"))):
                        line[key].append(got["median_us"] if got else float("nan"))
    return lines


def plot_limits(result: dict, path: str) -> None:
    """The bench for tables larger than memory: median lookup time against the memory limit, one
    line per path, id distribution and batch size, steady state solid, cold dashed, and the steady
    state without the row cache (the page cache alone) dotted."""
    fig, ax = _pyplot().subplots(figsize=(11, 5))
    lines = limit_curves(result)
    for (mode, dist, n), line in lines.items():
        color = None  # the first curve's, from the colour cycle, for the line's others
        for key, style, what in _LIMIT_CURVES:
            if all(v != v for v in line[key]):  # all NaN: no limit measured it
                continue
            label = f"ple-um {mode}, {dist}, {n} rows, {what}"
            (drawn,) = ax.plot(line["x"], line[key], **style, color=color, label=label)
            color = drawn.get_color()
    _time_axes(ax, result, " under a memory limit", "memory limit (GiB)", "median lookup time (us)")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines
    _save(fig, path)


def plot_serving(result: dict, path: str) -> None:
    """The serving loop: grouped bars, a group per GPU work and id distribution, a bar per
    configuration (median step time, the p10-p90 spread as its whisker), each bar labelled with
    its ratio to the resident table's step."""
    from ple_um.bench.report import columns

    names = columns(result)
    groups = [(ms, dist, rows) for ms, by_dist in result["steps"].items() for dist, rows in by_dist.items()]
    width = 0.8 / max(1, len(names))
    fig, ax = _pyplot().subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(names)) ** 0.5 + 3), 5))
    fixed = {NO_PLE: "0.6", RESIDENT: "black"}
    for j, name in enumerate(names):
        xs, ys, low, high = [], [], [], []
        for i, (_, _, rows) in enumerate(groups):
            row = rows.get(name)
            if row is None:
                continue
            xs.append(i + (j - (len(names) - 1) / 2) * width)
            ys.append(row["median_us"] / 1e3)
            low.append((row["median_us"] - row["p10_us"]) / 1e3)
            high.append((row["p90_us"] - row["median_us"]) / 1e3)
        bars = ax.bar(xs, ys, width, yerr=[low, high], capsize=2, label=name, color=fixed.get(name))
        ratios = [rows[name].get("vs_resident") for _, _, rows in groups if name in rows]
        labels = [f"{r:.2f}x" if r is not None and name != RESIDENT else "" for r in ratios]
        ax.bar_label(bars, labels=labels, fontsize="x-small", padding=2)
    ax.set_xticks(range(len(groups)), [f"{ms} ms GPU work\n{dist}" for ms, dist, _ in groups])
    ax.set_ylabel("step time, median (ms)")
    t = result["table"]
    ax.set_title(
        f"{result['device']}: serving loop, {format_bytes(t['bytes'])} table (labels: step time over the "
        "resident step's: above 1x is slower)"
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    _save(fig, path)


def draw(result: dict, path: str) -> None:
    """The plot of any run, by its ``kind``."""
    {"serving": plot_serving, "memory-limit": plot_limits}.get(result["kind"], plot_lookups)(result, path)
