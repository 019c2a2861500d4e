"""What a training run writes beside its checkpoint (the resumable state, report.json and loss.png), and the
step count that fits a time budget.

Shared by the drafter and adapter trainers, which differ only in what they measure per step.
"""
from __future__ import annotations

import json
import numbers
from pathlib import Path

import torch

STATE_FILE = "train_state.pt"  # fp32 weights + optimizer, for --resume; never committed
REPORT_FILE = "report.json"
PLOT_FILE = "loss.png"
MAX_HISTORY = 500  # history rows kept in the report (evenly thinned)
BUDGET_PROBE = 30  # steps timed (after the first, which compiles / warms up) to fit a time budget


# Settings a resumed run takes from the command line: they change neither the batches nor the updates.
RESETTABLE = ("steps", "device", "ckpt_every", "decoder_layers", "time_budget_s")


def open_run(out: Path, resume: bool, settings):
    """Create the run folder and, with `resume`, load its state: (state or None, settings). A resumed run
    keeps its own settings except the RESETTABLE ones given now (a resumed run may be lengthened or
    moved); an existing state without `resume` is an error, never overwritten."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / STATE_FILE
    if path.exists() and not resume:
        raise FileExistsError(f"{path} exists: pass --resume to continue it, or use another --out")
    if not (resume and path.exists()):
        return None, settings
    # weights_only: unpickling may run code; the state is plain dicts, lists, numbers and tensors.
    state = torch.load(path, map_location="cpu", weights_only=True)
    kept = {k: getattr(settings, k) for k in RESETTABLE if hasattr(settings, k)}
    return state, type(settings)(**{**state["settings"], **kept})


class StepBudget:
    """Fits a run's `settings.steps` to `settings.time_budget_s` seconds (0: no budget; the settings need
    `steps`, `time_budget_s` and `decay_frac`). The trainer reports each step done with its own clock's
    reading; after the first step (which compiles / warms up) every BUDGET_PROBE steps are timed and the
    count re-fitted, until the cosine decay begins, so warmup and the decay stay whole. Re-fitted, not fixed
    once: the first window can be far slower than the rest (on the H200, three runs sharing the GPU while
    others still loaded their data measured 0.27 s/step, then ran at 0.09: the budget was a third used)."""

    def __init__(self, settings, step: int, now: float, bar):
        """step: the steps already done (a resumed run's); now: the clock before the first step; bar: the
        progress bar (its total follows the fitted count)."""
        self.s, self.bar = settings, bar
        self.first, self.started, self.asked = step, now, settings.steps
        self.probe_start = now

    def step_done(self, step: int, now: float) -> None:
        s = self.s
        if step == self.first + 1:
            self.probe_start = now
            return
        if s.time_budget_s > 0 and (step - self.first - 1) % BUDGET_PROBE == 0 and step < decay_start(s):
            s.steps = steps_within_budget(s, step, (now - self.probe_start) / BUDGET_PROBE, now - self.started,
                                          self.bar, cap=self.asked, quiet=step > self.first + 1 + BUDGET_PROBE)
            self.probe_start = now


def steps_within_budget(s, step: int, per_step: float, elapsed: float, bar, cap: int | None = None,
                        quiet: bool = False) -> int:
    """The step count that ends within `s.time_budget_s` at the rate of the latest probe window (never
    more than `cap`, default `s.steps`, never fewer than done). Only re-fitted before the cosine decay
    begins, so warmup and the decay stay whole."""
    fit = step + int((s.time_budget_s - elapsed) / per_step)
    steps = max(step, min(cap or s.steps, fit))
    bar.total = steps
    if not quiet:
        bar.write(f"[train] {per_step * 1e3:.0f} ms/step: {steps} steps fit the {s.time_budget_s:.0f} s budget")
    return steps


def decay_start(s) -> int:
    """The step the cosine decay of the learning rate begins at (the last `decay_frac` of the steps)."""
    return int(s.steps * (1 - s.decay_frac))


def save_state(out: Path, state: dict) -> None:
    """Write the resumable state atomically (a crash mid-write leaves the previous state intact)."""
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(plain(state), tmp)
    tmp.replace(out / STATE_FILE)


def plain(obj):
    """`obj` as what `torch.load(weights_only=True)` reads back: containers, numbers, strings, tensors
    (paths and other objects of the settings become strings)."""
    if isinstance(obj, dict):
        return {plain(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    if obj is None or isinstance(obj, (str, torch.Tensor)):
        return obj
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, numbers.Integral):  # numpy integers too
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    return str(obj)


def tail_mean(history: list[dict], keys: tuple[str, ...], n: int = 50) -> dict:
    """Mean of each key over the last `n` steps; list-valued keys are averaged element-wise."""
    tail = history[-n:]
    if not tail:
        return {}
    out = {}
    for k in keys:
        if isinstance(tail[0][k], list):
            out[k] = [sum(h[k][j] for h in tail) / len(tail) for j in range(len(tail[0][k]))]
        else:
            out[k] = sum(h[k] for h in tail) / len(tail)
    return out


def write_report(out: Path, report: dict, history: list[dict], loss_title: str, loss_label: str,
                 curves: list[tuple[str, list[float], str]], curves_title: str,
                 points: list[tuple[str, list[int], list[float]]] = ()) -> None:
    """report.json (with the thinned history) and a two-panel loss.png: loss (with `points`, losses measured at
    some steps, as (label, steps, values)), then `curves` as (label, per-step values, line style)."""
    report = {**report, "history": history[::max(1, len(history) // MAX_HISTORY)]}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    try:
        _plot(history, out / PLOT_FILE, loss_title, loss_label, curves, curves_title, points)
    except Exception as exc:  # a report without its chart is still a report
        print(f"[train] loss plot failed: {exc}")


def _plot(history, path, loss_title, loss_label, curves, curves_title, points) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [h["loss"] for h in history], lw=0.5, alpha=0.5, label=loss_label)
    ax1.plot(steps, smooth([h["loss"] for h in history]), lw=1.5, label="smoothed")
    for label, at, values in points:
        ax1.plot(at, values, marker="o", ms=3, lw=1, label=label)
    ax1.set_xlabel("step"), ax1.set_yscale("log"), ax1.legend(), ax1.set_title(loss_title)
    for label, values, style in curves:
        ax2.plot(steps, smooth(values), ls=style, label=label)
    ax2.set_xlabel("step"), ax2.legend(fontsize=7), ax2.set_title(curves_title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def smooth(xs: list[float], k: int = 50) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc = x if i == 0 else acc + (x - acc) / min(i + 1, k)
        out.append(acc)
    return out
