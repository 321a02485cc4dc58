"""The plan as a table (rich) and as a plot of step time against cross-island bandwidth, crossovers marked."""

from __future__ import annotations

from rich.table import Table

from islands.plan.costs import Prediction


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def table(predictions: list[Prediction], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "#",
        "strategy",
        "step ms",
        "compute ms",
        "own ms",
        "comm ms (in/x)",
        "util",
        "MB/step in",
        "MB/round x",
        "mem MB",
        "fits",
        "checked",
    ):
        t.add_column(col)
    for i, p in enumerate(predictions, 1):
        t.add_row(
            str(i),
            p.label,
            f"{p.step_s * 1e3:.2f}",
            f"{p.compute_s * 1e3:.2f}",
            f"{p.strategy_s * 1e3:.2f}",
            f"{p.inside_comm_s * 1e3:.2f}/{p.cross_comm_s * 1e3:.2f}",
            f"{p.utilisation * 100:.0f}%",
            _mb(p.inside_bytes_per_step),
            _mb(p.cross_bytes_per_round) + (f" /{p.round_steps}" if p.round_steps > 1 else ""),
            _mb(p.memory.total),
            "yes" if p.fits else "NO",
            "yes" if p.checked else "never",
        )
    return t


def plot(curves: dict[str, list[tuple[float, float]]], crossings: list, path: str, title: str) -> None:
    """Step time (ms) against cross-island rate (Mbit/s), log-log, one line per strategy, crossovers as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in curves.items():
        ax.plot([r / 1e6 for r, _ in pts], [t * 1e3 for _, t in pts], label=label)
    for c in crossings:
        ax.axvline(c.rate_bps / 1e6, linestyle="--", color="grey", linewidth=0.8)
        ax.annotate(f"{c.faster}", (c.rate_bps / 1e6, ax.get_ylim()[0]), rotation=90, fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cross-island link (Mbit/s)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
