"""InstructGPT's pipeline on the embedded task, end to end: reward model, then ppo.py against it; the gold reward beside.

Each recipe is two commands (the SFT model, models/tiny-arith, is sft.py's and already made):

    python reward_model.py <the recipe's reward-model flags>                 # -> runs/<rm>/final/reward.json
    python ppo.py --reward <that spec, its score postprocessed as the recipe says> \
        --gold-reward '{"type": "correctness", "wrong": 0}'

and an iterated one (ROUND_TWO) three more: ppo.py pauses at step --pause, reward_model.py goes on from the first reward
model with comparisons of that checkpoint's samples, and ppo.py resumes against the new one.

PPO never sees the rule reward: it is logged beside the learned one as rewards/gold (here the fraction of the step's
samples that are correct). The table: greedy accuracy on the 500 test problems at the start and the end (each seed),
the learned and the gold reward and the KL over the last 20 steps, and the minutes of each stage. The plot: gold and
proxy (learned, whitened) reward against the KL per completion, the over-optimisation picture of Gao et al. 2022
(arXiv:2210.10760, Fig. 1), for every recipe run.

    python benchmarks/rlhf_pipeline.py                                  # onpolicy_clip, seeds 1 2 3
    python benchmarks/rlhf_pipeline.py --recipes iterated --seeds 2     # docs/rlhf_pipeline.md's five commands
    python benchmarks/rlhf_pipeline.py --recipes synthetic onpolicy --seeds 1 --ppo-flags="--total-steps 150"
    python benchmarks/rlhf_pipeline.py --recipes synthetic --seeds 1 --summarize-only \
        --runs "clipped, 600 steps=runs/<ppo run>" --plot docs/rlhf_overoptimisation.png     # other runs beside

Runs go to runs/rlhf_pipeline/ (--output-dir); a stage already finished (its final/ exists) is not run again. Times
depend on what else runs on the machine: compare them only within one table.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
GOLD = '{"type": "correctness", "wrong": 0}'  # 1 for a correct answer, else 0: the step's mean is its accuracy
REWARD_MODELS = {  # name: reward_model.py flags
    "offline": [],  # 4,000 offline pairs of one slip each (data/arith/prefs.jsonl)
    "comparisons": ["--comparisons", "8", "--dataset-split", "train"],  # 2,000 prompts x 8 samples of the SFT model
    "ties": ["--comparisons", "8", "--comparison-prompts", "3000", "--dataset-split", "train", "--no-comparison-rankings",
             "--tie-strength", "1", "--tie-start-step", "800", "--total-steps", "1000", "--batch-size", "128",
             "--micro-batch-size", "32", "--learning-rate", "1e-3", "--warmup-steps", "50",
             "--eval-every", "250"],  # Bradley-Terry, then the ties too
    "ties_b64": ["--comparisons", "8", "--comparison-prompts", "3000", "--dataset-split", "train",
                 "--no-comparison-rankings", "--tie-strength", "1", "--tie-start-step", "1500", "--total-steps", "2000",
                 "--learning-rate", "1e-3", "--warmup-steps", "50", "--eval-every", "500"],  # its first version
}
CENTRED = ["--num-generations", "4", "--prompts-per-step", "64", "--center-scores-per-prompt", "--total-steps", "300",
           "--eval-every", "50"]  # 4 samples of 64 prompts a step, each score less its prompt's mean
VERDICT = [{"type": "clip", "min": -1.0, "max": 0.0}]  # the whitened score clipped: right ~ 0, wrong below
RECIPES = {  # name: (reward model, postprocess of its whitened score for ppo.py, ppo.py flags)
    "synthetic": ("offline", [], []),
    "onpolicy": ("comparisons", [], []),
    "onpolicy_clip": ("comparisons", VERDICT, []),
    "ties": ("ties", [], [*CENTRED, "--value-model-layers", "1"]),  # the pipeline of docs/reward_model.md
    "ties_b64": ("ties_b64", [], CENTRED),  # its first version: reward model at batch 64, 2,000 steps; full critic
    "iterated": ("ties", [], [*CENTRED, "--value-model-layers", "1",
                              "--micro-batch-size", "64"]),  # "ties", and a second reward model at --pause
}
ROUND_TWO = {"iterated": ["--comparisons", "8", "--comparison-prompts", "2000", "--dataset-split", "train",
                          "--no-comparison-rankings", "--tie-strength", "1", "--total-steps", "150", "--batch-size", "128",
                          "--micro-batch-size", "32", "--learning-rate", "3e-4", "--warmup-steps", "20",
                          "--eval-every", "150"]}


@dataclass
class Args:
    recipes: tuple[str, ...] = ("onpolicy_clip",)
    """which recipes to run (keys of RECIPES)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """the seed of both stages"""
    threads: int = 2
    """OMP_NUM_THREADS of each stage"""
    output_dir: str = str(ROOT / "runs" / "rlhf_pipeline")
    """where the runs go"""
    summarize_only: bool = False
    """only print the table of the runs already finished"""
    plot: str = ""
    """if set, a PNG path for gold and proxy reward against KL"""
    rm_flags: str = ""
    """extra reward_model.py flags for every recipe, e.g. "--total-steps 600" (quoted)"""
    ppo_flags: str = ""
    """extra ppo.py flags for every recipe, e.g. "--total-steps 150 --eval-every 50" (quoted)"""
    pause: int = 150
    """the step at which an iterated recipe's ppo.py pauses for its second reward model"""
    runs: tuple[str, ...] = ()
    """other ppo.py runs (with --gold-reward) for the table and the plot, as label=run-folder"""


def finished(root: Path, name: str, done: str = "final"):
    found = sorted(d for d in root.glob(f"*__{name}__*") if (d / done).exists())
    return found[-1] if found else None


def stage(root: Path, name: str, cmd: list[str], threads: int, done: str = "final") -> Path:
    """Runs `cmd` unless a run of this name has `done`; its minutes add up in wall_s.txt (a resumed run's too)."""
    if finished(root, name, done) is None:
        t0, log = time.time(), root / f"{name}.log"
        with log.open("w") as f:
            rc = subprocess.run([sys.executable, *cmd, "--exp-name", name, "--output-dir", str(root)], cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=f, stderr=subprocess.STDOUT)
        if rc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc.returncode}); see {log}")
        wall = finished(root, name, done) / "wall_s.txt"
        wall.write_text(f"{time.time() - t0 + (float(wall.read_text()) if wall.exists() else 0):.1f}\n")
    return finished(root, name, done)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summary(rm, ppo: Path, rm2=None) -> dict:
    """A PPO run's metrics (and its reward models', if given) -> the table's numbers and the curve."""
    steps = [r for r in rows(ppo) if "rewards/gold" in r]
    evals = [r["eval/accuracy"] for r in rows(ppo) if "eval/accuracy" in r]
    last = steps[-20:]
    wall = lambda run: float((run / "wall_s.txt").read_text()) / 60 if run and (run / "wall_s.txt").exists() else None
    rm_min = wall(rm) and wall(rm) + (wall(rm2) or 0)
    metric = lambda key: ([r[key] for r in rows(rm) if key in r] or [None])[-1] if rm else None
    return {"start": 100 * evals[0], "end": 100 * evals[-1], "evals": evals, "steps": steps[-1]["step"],
            "proxy": statistics.mean(r["rewards/reward_model"] for r in last),
            "gold": statistics.mean(r["rewards/gold"] for r in last), "kl": statistics.mean(r["train/kl"] for r in last),
            "rm_min": rm_min, "ppo_min": wall(ppo), "rm_comparisons": metric("eval/comparison_accuracy"),
            "rm_pairs": metric("eval/pref_accuracy"),
            "curve": [(r["train/kl"], r["rewards/reward_model"], r["rewards/gold"]) for r in steps]}


def main(args: Args) -> None:
    unknown = set(args.recipes) - set(RECIPES)
    if unknown:
        raise SystemExit(f"unknown recipe(s) {sorted(unknown)}: choose from {list(RECIPES)}")
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for recipe in args.recipes:
        for seed in args.seeds:
            reward_model, postprocess, ppo_flags = RECIPES[recipe]
            rm_name, ppo_name = f"rm_{reward_model}_{seed}", f"ppo_{recipe}_{seed}"
            if args.summarize_only and not (finished(root, rm_name) and finished(root, ppo_name)):
                continue
            rm = stage(root, rm_name, ["reward_model.py", "--seed", str(seed), *REWARD_MODELS[reward_model],
                                       *shlex.split(args.rm_flags)], args.threads)
            spec = {**json.loads((rm / "final" / "reward.json").read_text()), "postprocess": postprocess}
            (root / f"{recipe}_{seed}.json").write_text(json.dumps(spec))
            ppo_cmd = ["ppo.py", "--seed", str(seed), "--reward", str(root / f"{recipe}_{seed}.json"), "--gold-reward",
                       GOLD, *ppo_flags, *shlex.split(args.ppo_flags)]
            rm2 = None
            if recipe in ROUND_TWO:  # iterated RLHF: pause, a reward model retrained on the policy's samples, resume
                paused = f"checkpoints/step_{args.pause}"
                if finished(root, ppo_name) is None:
                    ppo = stage(root, ppo_name, [*ppo_cmd, "--pause-at-step", str(args.pause)], args.threads, paused)
                    rm2 = stage(root, f"rm2_{recipe}_{seed}", [
                        "reward_model.py", "--seed", str(seed), "--model-name-or-path", str(rm / "final"), "--policy",
                        str(ppo / paused), *ROUND_TWO[recipe], *shlex.split(args.rm_flags)], args.threads)
                    ppo_cmd = ["ppo.py", "--resume", str(ppo / paused), "--reward", str(rm2 / "final" / "reward.json")]
                rm2 = finished(root, f"rm2_{recipe}_{seed}")
            ppo = stage(root, ppo_name, ppo_cmd, args.threads)
            results[recipe, seed] = summary(rm, ppo, rm2)
    for label, folder in (run.rsplit("=", 1) for run in args.runs):
        results[label, 1] = summary(None, Path(folder))
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    print("| recipe | seed | RM held-out: synthetic pairs / policy comparisons | greedy accuracy, start -> evals -> end | "
          "gain | steps | proxy / gold / KL, last 20 steps | RM min | PPO min |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (recipe, seed), r in results.items():
        print(f"| {recipe} | {seed} | {pct(r['rm_pairs'])} / {pct(r['rm_comparisons'])} | "
              f"{' -> '.join(f'{100 * e:.1f}' for e in r['evals'])} | **{r['end'] - r['start']:+.1f}** | {r['steps']} | "
              f"{r['proxy']:.2f} / {r['gold']:.3f} / {r['kl']:.2f} | {r['rm_min'] or float('nan'):.1f} | "
              f"{r['ppo_min'] or float('nan'):.1f} |")
    for recipe in args.recipes:
        gains = [r["end"] - r["start"] for (name, _), r in results.items() if name == recipe]
        if gains:
            print(f"\n{recipe}: gain {statistics.mean(gains):+.1f} points on average over {len(gains)} seeds "
                  f"(min {min(gains):+.1f})")
    if args.plot:
        draw(results, Path(args.plot))


def draw(results: dict, path: Path, window: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for k, ((recipe, seed), r) in enumerate(results.items()):
        smooth = lambda xs: [statistics.mean(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]
        kl, proxy, gold = (smooth([c[j] for c in r["curve"]]) for j in range(3))
        style = dict(color=f"C{k}", alpha=1.0 if seed == 1 else 0.5)
        axes[0].plot(kl, proxy, **style, label=f"{recipe}, seed {seed}")
        axes[1].plot(kl, gold, **style, label=f"{recipe}, seed {seed}")
    axes[0].set(title="proxy: the learned reward (whitened)", xlabel="KL per completion (nats)", ylabel="reward")
    axes[1].set(title="gold: fraction of samples correct", xlabel="KL per completion (nats)", ylabel="accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xscale("symlog", linthresh=1.0)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"ppo.py against a learned reward on tiny-arith ({window}-step means, in the order of training)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
