"""A PNG chart beside the bench JSON, for people."""
from __future__ import annotations

from pathlib import Path


def write_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    tps = [report["modes"][m]["tokens_per_s"] or 0.0 for m in modes]
    tau = [report["modes"][m]["tau"] or 0.0 for m in modes]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar(modes, tps, color="tab:blue")
    ax1.set_title("tokens / s")
    for i, v in enumerate(tps):
        ax1.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    ax2.bar(modes, tau, color="tab:green")
    ax2.set_title("tau (tokens committed per round)")
    for i, v in enumerate(tau):
        ax2.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    s = report["settings"]
    fig.suptitle(f"{report['model']} | drafter {report['drafter']} | T={s['temperature']} | block {s['block_size']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
