"""A PNG of the lookup table: median time per batch size, one line per path (log-log)."""

from __future__ import annotations


def plot(result: dict, rows: tuple[int, ...], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, entry in result["lookup"].items():
        xs = [n for n in rows if str(n) in entry]
        if xs:
            ax.plot(xs, [entry[str(n)]["median_us"] for n in xs], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows per lookup")
    ax.set_ylabel("median time (us)")
    t = result["table"]
    ax.set_title(f"{result['device']}: {t['bytes'] / (1 << 30):.1f} GiB table, {t['row_bytes']} B rows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
