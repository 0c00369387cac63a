"""A PNG of the lookup tables: median time per batch size, one line per path and id distribution
(log-log; the torch anchor in black)."""

from __future__ import annotations

from ple_um.bench.runner import ANCHOR

LINESTYLES = ("-", "--", ":", "-.")


def plot(result: dict, rows: tuple[int, ...], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
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
    ax.set_yscale("log")
    ax.set_xlabel("rows per lookup")
    ax.set_ylabel("median time (us)")
    t = result["table"]
    ax.set_title(f"{result['device']}: {t['bytes'] / (1 << 30):.1f} GiB table, {t['row_bytes']} B rows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
