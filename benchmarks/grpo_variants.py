"""grpo.py's loss types and options on the embedded task, each over seeds, at the default budget.

Each variant is `python grpo.py` with the flags in VARIANTS; everything else is grpo.py's default (models/tiny-arith on
data/arith, 64 prompts x 8 completions a step), except that evaluation runs only at the start and the end
(`--eval-every 0`): the curves are the training reward, logged every step. The ratio variants (GSPO, GSPO-token,
CISPO, delta) differ from GRPO only because the default takes two updates per batch (mu = 2): at mu = 1 every ratio is
1 and they give GRPO's or DAPO's gradient exactly (tests/test_grpo.py). bnpo equals dapo on one process: not run.

    python benchmarks/grpo_variants.py --jobs 2                    # every variant, seeds 1 2 3, 2 runs at a time
    python benchmarks/grpo_variants.py --variants grpo rloo --seeds 1
    python benchmarks/grpo_variants.py --summarize-only --plot docs/grpo_variants.png

Runs go to runs/grpo_variants/ (--output-dir); a finished run (its final/ exists) is not run again. The table: greedy
accuracy on the 500 test problems at the end (each seed and the mean, and the gain over the start), the mean training
reward of the last 20 steps, the median seconds a step (and its ratio to grpo's) and the wall time of the run. Times
depend on how many runs share the machine (--jobs, --threads): compare them only within one table. For step times
alone, on a quiet machine: `--jobs 1 --threads 2 --seeds 1 --output-dir runs/grpo_variants_timing -- --total-steps 12
--warmup-steps 2 --eval-limit 20`.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
GSPO_CLIP = ["--clip-low", "3e-4", "--clip-high", "4e-4"]  # GSPO Sec. 5.1: its length-normalised ratio moves little
VARIANTS = {
    "grpo": [],
    "gspo": ["--importance-sampling-level", "sequence", *GSPO_CLIP],
    "cispo": ["--loss-type", "cispo"],
    "dapo": ["--loss-type", "dapo"],
    "rloo": ["--baseline", "rloo"],
    "entropy_0.2": ["--top-entropy-quantile", "0.2"],
    "gspo_token": ["--importance-sampling-level", "sequence_token", *GSPO_CLIP],
    "delta_4": ["--delta", "4"],
    "dr_grpo": ["--loss-type", "dr_grpo"],
    "grpo_mu1_500": ["--num-iterations", "1", "--total-steps", "500"],  # the default until 2026-11
}


@dataclass
class Args:
    variants: tuple[str, ...] = tuple(VARIANTS)
    """which variants to run (keys of VARIANTS)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds of every variant"""
    jobs: int = 2
    """runs at once (each with --threads torch threads)"""
    threads: int = 1
    """OMP_NUM_THREADS of each run"""
    output_dir: str = str(ROOT / "runs" / "grpo_variants")
    """where the runs go"""
    summarize_only: bool = False
    """only print the table of the runs already finished"""
    plot: str = ""
    """if set, a PNG path for the training reward of every variant (mean over seeds, 20-step moving average)"""
    grpo_flags: tyro.conf.Positional[tuple[str, ...]] = field(default_factory=tuple)
    """extra grpo.py flags for every variant (after --)"""


def run_dir(root: Path, variant: str, seed: int):
    found = sorted(d for d in root.glob(f"*__{variant}__{seed}__*") if (d / "final").exists())
    return found[-1] if found else None


def launch(args: Args, root: Path, variant: str, seed: int) -> None:
    if run_dir(root, variant, seed) is not None:
        return
    cmd = [sys.executable, str(ROOT / "grpo.py"), "--seed", str(seed), "--exp-name", variant, "--output-dir", str(root),
           "--eval-every", "0", *VARIANTS[variant], *args.grpo_flags]
    log, t0 = root / f"{variant}__{seed}.log", time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); see {log}")
    (run_dir(root, variant, seed) / "wall_s.txt").write_text(f"{time.time() - t0:.1f}\n")


def summary(path: Path) -> dict:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "perf/step_s" in r]
    wall = float((path / "wall_s.txt").read_text()) if (path / "wall_s.txt").exists() else None
    return {"start": evals[0], "end": evals[-1], "rewards": [r["train/reward"] for r in train],
            "step_s": statistics.median(r["perf/step_s"] for r in train), "wall": wall}


def main(args: Args) -> None:
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}: choose from {list(VARIANTS)}")
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    if not args.summarize_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            for f in [pool.submit(launch, args, root, v, s) for v in args.variants for s in args.seeds]:
                f.result()
    results = {v: {s: summary(d) for s in args.seeds if (d := run_dir(root, v, s))} for v in args.variants}
    print(f"grpo.py variants, extra flags {' '.join(args.grpo_flags) or '(none)'}; greedy accuracy (%) on the test "
          f"split at the end\n")
    print("| variant | flags | " + " | ".join(f"seed {s}" for s in args.seeds) +
          " | mean | gain | reward, last 20 steps | s/step (median) | vs grpo | wall (mean) |")
    print("|---|---|" + "---|" * len(args.seeds) + "---|---|---|---|---|---|")
    base = statistics.median(r["step_s"] for r in results["grpo"].values()) if results.get("grpo") else None
    for v, by_seed in results.items():
        if not by_seed:
            continue
        ends = [100 * by_seed[s]["end"] if s in by_seed else None for s in args.seeds]
        done = [r for r in by_seed.values()]
        gain = statistics.mean(100 * (r["end"] - r["start"]) for r in done)
        print(f"| {v} | `{' '.join(VARIANTS[v]) or '(default)'}` | " +
              " | ".join("–" if e is None else f"{e:.1f}" for e in ends) +
              f" | **{statistics.mean(e for e in ends if e is not None):.1f}** | {gain:+.1f} | "
              f"{statistics.mean(statistics.mean(r['rewards'][-20:]) for r in done):.3f} | "
              f"{(step_s := statistics.median(r['step_s'] for r in done)):.2f} | "
              f"{f'{step_s / base:.2f}x' if base else '–'} | {wall(done)} |")
    if args.plot:
        draw(results, Path(args.plot))


def wall(done: list[dict]) -> str:
    walls = [r["wall"] for r in done if r["wall"] is not None]
    return f"{int(statistics.mean(walls) // 60)} min {statistics.mean(walls) % 60:.0f} s" if walls else "–"


def draw(results: dict, path: Path, window: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, (v, by_seed) in enumerate(r for r in results.items() if r[1]):
        n = min(len(r["rewards"]) for r in by_seed.values())
        mean = [statistics.mean(r["rewards"][i] for r in by_seed.values()) for i in range(n)]
        smooth = [statistics.mean(mean[max(0, i - window + 1): i + 1]) for i in range(n)]
        ax.plot(range(1, n + 1), smooth, color=f"C{k}", label=f"{v} ({len(by_seed)} seeds)")
    ax.set(title="grpo.py variants on tiny-arith", xlabel="step", ylabel=f"training reward ({window}-step mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
