"""`lmi tune`'s outputs: the table of every trial (stdout and markdown), the JSON record, the
throughput-vs-latency frontier as a PNG, and the progress bar while it runs."""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import asdict
from typing import Callable, Mapping, Sequence

from container.tune.search import Measurement, Targets, Trial, frontier

COLUMNS = ("trial", "rung", "window s", "tok/s", "ttft p50 s", "ttft p90 s", "tpot p90 ms", "requests", "errors",
           "meets", "config")


def row(trial: Trial, targets: Targets) -> list[str]:
    m = trial.measurement
    rung = "final" if trial.rung < 0 else str(trial.rung)
    if m is None:
        return ["", rung, f"{trial.window_s:.0f}", "-", "-", "-", "-", "-", "-", "no",
                f"{trial.name}: {trial.failure}"]
    meets = "yes" if targets.violation(m) <= 1 else "no"
    censored = f" ({m.num_censored} waiting)" if m.num_censored else ""
    return ["", rung, f"{trial.window_s:.0f}", f"{m.throughput:.1f}", _num(m.ttft_p50), _num(m.ttft_p90) + censored,
            _num(m.tpot_p90 * 1000, 1), str(m.num_requests), str(m.errors), meets, trial.name]


def _num(x: float, digits: int = 3) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def rows(trials: Sequence[Trial], targets: Targets) -> list[list[str]]:
    out = []
    for i, t in enumerate(trials, start=1):
        r = row(t, targets)
        r[0] = str(i)
        out.append(r)
    return out


def text_table(table: list[list[str]]) -> str:
    widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) if i < len(COLUMNS) - 1 else c for i, (c, w) in enumerate(zip(COLUMNS, widths)))]
    lines.append("-" * len(lines[0]))
    for r in table:
        lines.append("  ".join(c.rjust(w) if i < len(r) - 1 else c for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def markdown_table(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in table]
    return "\n".join(lines)


def trial_json(trial: Trial) -> dict:
    body = asdict(trial)
    if trial.measurement is not None:  # JSON has no NaN: a percentile of nothing is null
        body["measurement"] = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                               for k, v in asdict(trial.measurement).items()}
    return body


def plot_frontier(trials: Sequence[Trial], targets: Targets, path: str, *,
                  finals: Mapping[str, Measurement | None] | None = None,
                  group: Callable[[Trial], str] = lambda t: f"rung {t.rung}",
                  title: str = "lmi tune: throughput vs latency") -> str | None:
    """Two panels (p90 TPOT, p90 TTFT): every measured trial a point coloured by its group, the
    frontier a line, the final comparison's medians stars, the targets dashed. None when written,
    else why not (matplotlib is not a dependency of lmi-serve)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    measured = [t for t in trials if t.measurement is not None and t.rung >= 0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, scale, label, target in ((axes[0], "tpot_p90", 1000, "p90 TPOT (ms)", targets.tpot_p90),
                                          (axes[1], "ttft_p90", 1, "p90 TTFT (s)", targets.ttft_p90)):
        _panel(ax, measured, key, scale, group, finals or {})
        if target is not None:
            ax.axvline(target * scale, color="red", ls=":", label="target")
        ax.set_xlabel(label)
        ax.set_ylabel("generated tokens/s")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _panel(ax, measured: Sequence[Trial], key: str, scale: float, group: Callable[[Trial], str],
           finals: Mapping[str, Measurement | None]) -> None:
    def latency(m: Measurement) -> float:
        value = getattr(m, key)
        return math.inf if math.isnan(value) else value

    shown = [t for t in measured if math.isfinite(latency(t.measurement))]
    for name in dict.fromkeys(group(t) for t in shown):
        pts = [t for t in shown if group(t) == name]
        ax.scatter([latency(t.measurement) * scale for t in pts], [t.measurement.throughput for t in pts],
                   label=name, alpha=0.6)
    front = [t for t in frontier(shown, latency)]
    ax.plot([latency(t.measurement) * scale for t in front], [t.measurement.throughput for t in front],
            "k--", lw=1, label="frontier")
    for name, m in finals.items():
        if m is not None and math.isfinite(latency(m)):
            ax.scatter([latency(m) * scale], [m.throughput], marker="*", s=160, edgecolors="k", zorder=3)
            ax.annotate(f"{name} (final)", (latency(m) * scale, m.throughput), fontsize=7)


class Progress:
    """The budget's seconds as a bar on stderr (tqdm), ticking by itself while a trial runs."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic, enabled: bool = True):
        from tqdm import tqdm

        self.clock, self.started, self.total = clock, clock(), total_s
        self.bar = tqdm(total=int(total_s), unit="s", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
        self._interval = 1.0 if sys.stderr.isatty() else 15.0  # a log file gets a line now and then
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def say(self, text: str) -> None:
        self.bar.set_postfix_str(text[:60], refresh=False)

    def _tick(self) -> None:
        while not self._done.wait(self._interval):
            self.bar.n = min(self.clock() - self.started, self.total)
            self.bar.refresh()

    def close(self) -> None:
        self._done.set()
        self._ticker.join()
        self.bar.n = min(self.clock() - self.started, self.total)
        self.bar.close()
