"""hybrid.py's ablation: SFT only, PPO only and the curriculum, at (about) equal training time, over seeds.

Each arm is `python hybrid.py` with the flags below; only the step kinds and the step count differ:
- `curriculum`: the default (SFT share 0.9 -> 0.3, linear), --curriculum-steps steps;
- `sft_only`:   --sft-fraction-start 1 --sft-fraction-end 1, --sft-steps steps;
- `ppo_only`:   --sft-fraction-start 0 --sft-fraction-end 0, --ppo-steps steps.
The step counts are chosen so the arms cost about the same training time (a PPO step costs several SFT
steps); the table prints each run's summed step time (evaluation and checkpointing excluded) so a reader
can check that they match. Extra hybrid.py flags (the demonstration set) go after `--`, e.g.
`-- --sft-split sft_noisy` or `-- --sft-limit 200`; every arm gets them.

    python benchmarks/hybrid_ablation.py --seeds 1 2 3 --jobs 2             # 9 runs, 2 at a time, 1 thread each
    python benchmarks/hybrid_ablation.py --tag noisy -- --sft-split sft_noisy
    python benchmarks/hybrid_ablation.py --tag limit200 --summarize-only -- --sft-limit 200   # table of finished runs

Runs go to runs/ablation/<tag>/ (--output-dir); a finished run (its final/ exists) is not run again. The table: greedy
accuracy on the test split at the end (each seed, and the mean), the mean training reward of each run's last
20 PPO steps, and the training seconds; `--plot` draws accuracy against the share of training time.
"""

import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
ARM_FLAGS = {"curriculum": [], "sft_only": ["--sft-fraction-start", "1", "--sft-fraction-end", "1"],
             "ppo_only": ["--sft-fraction-start", "0", "--sft-fraction-end", "0"]}


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds of every arm"""
    arms: tuple[str, ...] = ("curriculum", "sft_only", "ppo_only")
    """which arms to run (curriculum, sft_only, ppo_only)"""
    curriculum_steps: int = 400
    """steps of the curriculum arm (hybrid.py's default)"""
    sft_steps: int = 660
    """steps of the SFT-only arm (about the curriculum's training time)"""
    ppo_steps: int = 250
    """steps of the PPO-only arm (about the curriculum's training time)"""
    jobs: int = 2
    """runs at once (each with --threads torch threads)"""
    threads: int = 1
    """OMP_NUM_THREADS of each run"""
    output_dir: str = str(ROOT / "runs" / "ablation")
    """where the runs go, a sub-folder per --tag"""
    tag: str = "gold"
    """sub-folder of --output-dir for this setting"""
    summarize_only: bool = False
    """only print the table of the runs already finished"""
    plot: str = ""
    """if set, a PNG path for accuracy against the share of training time"""
    hybrid_flags: tyro.conf.Positional[tuple[str, ...]] = field(default_factory=tuple)
    """extra hybrid.py flags for every arm (after --)"""


def arm_steps(args: Args, arm: str) -> int:
    return {"curriculum": args.curriculum_steps, "sft_only": args.sft_steps, "ppo_only": args.ppo_steps}[arm]


def run_dir(root: Path, arm: str, seed: int):
    found = sorted(root.glob(f"*__{arm}__{seed}__*"))
    return found[-1] if found else None


def launch(args: Args, root: Path, arm: str, seed: int) -> None:
    done = run_dir(root, arm, seed)
    if done is not None and (done / "final").exists():
        return
    cmd = [sys.executable, str(ROOT / "hybrid.py"), "--seed", str(seed), "--exp-name", arm, "--output-dir", str(root),
           "--total-steps", str(arm_steps(args, arm)), *ARM_FLAGS[arm], *args.hybrid_flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    log = root / f"{arm}__{seed}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); see {log}")


def summary(path: Path) -> dict:
    """-> final accuracy, accuracy curve [(step, acc)], mean reward of the last 20 PPO steps, training seconds."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "perf/step_s" in r]
    seconds, last, clock = 0.0, 0, []
    for r in train:
        seconds += r["perf/step_s"] * (r["step"] - last)
        last = r["step"]
        clock.append((r["step"], seconds))
    rewards = [r["train/reward"] for r in train if "train/reward" in r][-20:]
    return {"accuracy": evals[-1][1], "evals": evals, "clock": clock, "seconds": seconds,
            "reward": statistics.mean(rewards) if rewards else None}


def main(args: Args) -> None:
    unknown = set(args.arms) - set(ARM_FLAGS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: choose from {list(ARM_FLAGS)}")
    root = Path(args.output_dir) / args.tag
    root.mkdir(parents=True, exist_ok=True)
    if not args.summarize_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            for f in [pool.submit(launch, args, root, arm, seed) for seed in args.seeds for arm in args.arms]:
                f.result()
    results = {arm: {s: summary(d) for s in args.seeds if (d := run_dir(root, arm, s)) and (d / "final").exists()}
               for arm in args.arms}
    flags = " ".join(args.hybrid_flags) or "(none)"
    print(f"hybrid.py ablation, extra flags {flags}; greedy accuracy (%) on the test split at the end\n")
    print("| arm | steps | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | reward, last 20 PPO steps | "
          "training s (mean) |")
    print("|---|---|" + "---|" * len(args.seeds) + "---|---|---|")
    for arm, by_seed in results.items():
        if not by_seed:
            continue
        accs = [100 * by_seed[s]["accuracy"] if s in by_seed else None for s in args.seeds]
        rewards = [r["reward"] for r in by_seed.values() if r["reward"] is not None]
        reward = f"{statistics.mean(rewards):.2f}" if rewards else "—"
        print(f"| {arm} | {arm_steps(args, arm)} | " + " | ".join("–" if a is None else f"{a:.1f}" for a in accs) +
              f" | **{statistics.mean(a for a in accs if a is not None):.1f}** | {reward} | "
              f"{statistics.mean(r['seconds'] for r in by_seed.values()):.0f} |")
    if args.plot:
        draw(results, Path(args.plot), args.tag if not args.hybrid_flags else f"{args.tag}: {flags}")


def draw(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (arm, by_seed), color in zip(results.items(), ("C0", "C1", "C2")):
        for k, r in enumerate(by_seed.values()):
            steps, acc = zip(*r["evals"])
            clock = dict(r["clock"])
            share = [clock.get(s, 0.0) / r["seconds"] for s in steps]
            label = arm if k == 0 else None
            axes[0].plot(steps, [100 * a for a in acc], color=color, alpha=0.8, label=label)
            axes[1].plot(share, [100 * a for a in acc], color=color, alpha=0.8, label=label)
    axes[0].set(xlabel="step", ylabel="greedy accuracy (%)", title=f"hybrid.py ablation ({title})")
    axes[1].set(xlabel="share of the run's training time", ylabel="greedy accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
