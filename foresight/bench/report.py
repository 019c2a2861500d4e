"""A PNG chart beside the bench JSON, for people."""
from __future__ import annotations

from pathlib import Path


def write_chart(report: dict, path: Path) -> None:
    plt = _pyplot()
    modes = list(report["modes"])
    peers = list(report.get("peers", {}))
    tau = [report["modes"][m]["tau"] or 0.0 for m in modes]
    # Speed bars: the modes, then the peers (other software on the same prompts), greyed.
    names = modes + peers
    tps = [report["modes"][m]["tokens_per_s"] or 0.0 for m in modes] + \
          [report["peers"][p]["tokens_per_s"] or 0.0 for p in peers]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9 + 0.8 * len(peers), 3.5))
    ax1.bar(names, tps, color=["tab:blue"] * len(modes) + ["tab:gray"] * len(peers))
    ax1.set_title("tokens / s")
    ax1.tick_params(axis="x", labelrotation=30 if peers else 0)
    for i, v in enumerate(tps):
        ax1.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    ax2.bar(modes, tau, color="tab:green")
    ax2.set_title("tau (tokens committed per round)")
    for i, v in enumerate(tau):
        ax2.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    s = report["settings"]
    fig.suptitle(f"{report['model']} | drafter {report['drafter']} | T={s['temperature']} | block {s['block_size']}"
                 + _pipeline_note(report["modes"].get("pipelined", {})), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pipeline_note(pipelined: dict) -> str:
    """The pipeline's efficiency and tau on hits / misses, for the title (empty without a pipelined run)."""
    if pipelined.get("pipeline_efficiency") is None:
        return ""
    taus = " / ".join(f"{pipelined[k]:.2f}" if pipelined.get(k) is not None else "-"
                      for k in ("tau_hits", "tau_misses"))
    return (f"\npipelined: {pipelined['pipeline_efficiency']:.0%} of the ideal gain "
            f"{pipelined['pipeline_gain_ideal']:.2f}x over sync | tau hit / miss {taus}")


def write_quality_chart(report: dict, path: Path) -> None:
    """eval-quality: speed against pass@1, one labelled point per verification setting."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, r in report["results"].items():
        x, y = r["pass_at_1"], r["tokens_per_s"] or 0.0
        ax.scatter([x], [y], color="tab:blue" if key == "exact" else "tab:orange")
        ax.annotate(f"{key}\ntau {r['tau'] or 0:.2f}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("pass@1")
    ax.set_ylabel("tokens / s")
    ax.margins(y=0.25)
    # pass@1 of small models sits near 0: never below 0, and room on the right for the labels.
    best = max(r["pass_at_1"] for r in report["results"].values())
    ax.set_xlim(-0.01, max(0.1, 1.3 * best))
    s = report["settings"]
    ax.set_title(f"{report['model']} | drafter {report['drafter']}\n{s['mode']} | T={s['temperature']} | "
                 f"{s['n_prompts']} problems | max {s['max_tokens']} tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_load_chart(report: dict, path: Path) -> None:
    """The load benchmark: aggregate tokens/s and ITL p50 against concurrency, one line per mode."""
    plt = _pyplot()
    section = report["concurrency"]
    levels = sorted(section, key=int)
    modes = list(dict.fromkeys(m for level in levels for m in section[level]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for mode in modes:
        xs = [int(level) for level in levels if mode in section[level]]
        for ax, key in ((ax1, "tokens_per_s"), (ax2, "itl_ms_p50")):
            ys = [section[str(x)][mode][key] for x in xs]
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=mode)
    for ax, title in ((ax1, "aggregate output tokens / s"), (ax2, "inter-chunk latency p50 (ms)")):
        ax.set_title(title)
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(level) for level in levels], labels=levels)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"{report['model']} | drafter {report['drafter']} | T={s['temperature']} | "
                 f"max {s['max_tokens']} tokens | {s['n_prompts']} prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on servers and CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
