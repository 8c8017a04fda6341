"""Draw the curves of one or several runs from their metrics.jsonl (x axis: `step`).

    python plot.py runs/<run>                      # -> runs/<run>/curves.png
    python plot.py runs/<a> runs/<b>               # side by side on the same axes -> ./curves.png
    python plot.py runs/<run> --keys train/loss eval/accuracy --smooth 10 --out loss.png

By default one panel per key of DEFAULT_KEYS that some run logs (at most MAX_PANELS), so each
script gets its usual curves; a run that logs none of them (custom keys) gets its first keys.
`--smooth N` draws a trailing N-row moving average over the faint raw curve (of series longer than
N). The legend names each run from its args.json: the experiment, the seed, and the arguments in
which it differs from the other runs of that experiment (`grpo seed 1`, `grpo seed 2 loss_type=dapo`).
The training scripts never import this file; it needs only matplotlib and tyro.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

# In order of preference; a script's run shows the first MAX_PANELS it logs, e.g. grpo.py: reward,
# accuracy, KL, completion length, entropy, loss; dpo.py: accuracies, loss, chosen/rejected log-probs.
DEFAULT_KEYS = (
    "train/reward", "eval/accuracy", "eval/pref_accuracy", "eval/return",
    "train/sft_loss", "train/sft_fraction", "train/kl", "train/value_loss", "train/explained_variance",
    "train/completion_length", "train/entropy", "train/loss", "rewards/accuracies", "logps/chosen",
    "logps/rejected", "train/accuracy", "eval/margin", "train/lr",
    "charts/episodic_return", "eval/oracle_return", "losses/approx_kl", "losses/value_loss", "losses/entropy",
)
MAX_PANELS = 6
# args.json fields that name or place a run rather than change what it does (the seed is always shown)
NOT_FLAGS = ("exp_name", "seed", "output_dir", "run_dir", "run_name", "resume", "resumed")


@dataclass
class Args:
    runs: tyro.conf.Positional[tuple[Path, ...]]
    """run directories (each holding a metrics.jsonl)"""
    keys: tuple[str, ...] = ()
    """metric keys to draw, one panel each (default: the DEFAULT_KEYS the runs log, at most 6)"""
    out: Path | None = None
    """the picture to write (default: <run>/curves.png for one run, ./curves.png for several)"""
    smooth: int = 0
    """moving-average window in rows (0: off)"""


def read_metrics(run: Path) -> list[dict]:
    """The rows of `run`/metrics.jsonl; a ValueError if `run` is not a run directory."""
    file = run / "metrics.jsonl"
    if not file.is_file():
        raise ValueError(f"{run} is not a run directory: expected {file} (written by every training script)")
    rows = []
    for i, line in enumerate(file.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}, line {i}: not valid JSON ({e.msg})") from None
    return rows


def run_labels(runs: tuple[Path, ...]) -> list[str]:
    """Legend labels: each run's exp_name and seed, then the arguments in which its args.json differs from the
    other runs of the same exp_name; the run's path where it has no args.json or two labels would be the same."""
    files = [run / "args.json" for run in runs]
    configs = [json.loads(file.read_text()) if file.is_file() else {} for file in files]
    labels = []
    for run, config in zip(runs, configs):
        if not config:
            labels.append(str(run))
            continue
        peers = [c for c in configs if c.get("exp_name") == config["exp_name"]]
        differing = [f"{k}={v}" for k, v in config.items() if k not in NOT_FLAGS and any(c.get(k) != v for c in peers)]
        labels.append(" ".join([config["exp_name"], f"seed {config['seed']}", *differing]))
    return [f"{label} ({run})" if labels.count(label) > 1 else label for run, label in zip(runs, labels)]


def numeric_keys(rows: list[dict]) -> list[str]:
    """Keys with a number in some row, in order of first appearance (`step` excepted)."""
    seen = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                seen[key] = None
    return list(seen)


def choose_keys(available: list[str], wanted: tuple[str, ...]) -> list[str]:
    """The keys asked for (each must be logged by some run), else the DEFAULT_KEYS present."""
    missing = [key for key in wanted if key not in available]
    if missing:
        raise ValueError(f"key(s) {missing} found in no run; available keys: {sorted(available)}")
    if wanted:
        return list(wanted)
    return ([key for key in DEFAULT_KEYS if key in available] or available)[:MAX_PANELS]


def series(rows: list[dict], key: str, smooth: int) -> tuple[list, list, list]:
    """(steps, values, trailing moving average of `smooth` rows) of one key; no average (an empty list)
    when smoothing is off or the series is no longer than the window (eval rows: a few points)."""
    pts = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    windows = [ys[max(0, i - smooth + 1):i + 1] for i in range(len(ys))] if 1 < smooth < len(ys) else []
    return xs, ys, [sum(w) / len(w) for w in windows]


def draw(runs: dict[str, list[dict]], keys: list[str], out: Path, smooth: int) -> None:
    cols = min(3, len(keys))
    rows_of_panels = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(4.5 * cols, 3.2 * rows_of_panels), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, rows in enumerate(runs.values()):
            xs, ys, avg = series(rows, key, smooth)
            ax.plot(xs, ys, color=f"C{i}", alpha=0.3 if avg else 1.0, marker="." if len(xs) < 30 else None)
            if avg:
                ax.plot(xs, avg, color=f"C{i}")
        ax.set(title=key, xlabel="step")
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=f"C{i}", label=name) for i, name in enumerate(runs)]
    axes.flat[0].legend(handles=handles, fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(args: Args) -> Path:
    """Draw the runs' curves; returns the picture's path."""
    if not args.runs:
        raise ValueError("no run given: python plot.py runs/<run> [runs/<other> ...]")
    if args.smooth < 0:
        raise ValueError(f"--smooth {args.smooth}: expected a window of rows >= 0 (0: off)")
    metrics = [read_metrics(run) for run in args.runs]  # checks every path before drawing
    runs = dict(zip(run_labels(args.runs), metrics))
    available = list(dict.fromkeys(key for rows in runs.values() for key in numeric_keys(rows)))
    if not available:
        raise ValueError(f"no numeric metric in {[str(run / 'metrics.jsonl') for run in args.runs]}")
    keys = choose_keys(available, args.keys)
    out = args.out or (args.runs[0] / "curves.png" if len(args.runs) == 1 else Path("curves.png"))
    draw(runs, keys, out, args.smooth)
    print(f"wrote {out} ({', '.join(keys)})")
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
