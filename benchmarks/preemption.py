"""How long a preempted run takes to save and exit: SIGTERM (SLURM's and Kubernetes' stop) sent to each LLM script at
its defaults, once during the step-0 evaluation and once in the middle of a training step.

    python benchmarks/preemption.py                      # the six scripts, 1 repeat each
    python benchmarks/preemption.py --scripts dpo sft --repeats 3

For each run: the seconds from the signal to the process's exit (the checkpoint written, exit code 143), the script's
seconds per step (its own progress line), and the checkpoint it saved. A grace period (SLURM's KillWait, Kubernetes'
terminationGracePeriodSeconds) is 30 s by default: the exit must come within one step plus the checkpoint write.
Runs go to a temporary folder and are deleted. Time it on a quiet machine.
"""

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    scripts: tuple[str, ...] = ("grpo", "ppo", "dpo", "hybrid", "reward_model", "sft")
    """which scripts to stop (each at its defaults)"""
    repeats: int = 1
    """runs per script and moment (the table shows the median)"""
    eval_delay: float = 0.3
    """seconds after the `run directory:` line before the signal: inside the step-0 evaluation"""
    root: str = str(ROOT)
    """the checkout whose scripts run (e.g. a `git worktree` of another commit, to compare)"""


def stopped(script: str, moment: str, eval_delay: float, root: str) -> dict:
    """One run of `script`, SIGTERM at `moment` ("eval" or "step") -> seconds to exit, s/step, checkpoint, code."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen([sys.executable, f"{script}.py", "--output-dir", out], cwd=root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        per_step = None
        for line in proc.stdout:
            if moment == "eval" and line.startswith("run directory:"):
                time.sleep(eval_delay)  # the step-0 evaluation of 500 prompts takes longer than this
                break
            found = re.match(r"step \d+/\d+ .*\| ([\d.]+) s/step", line)
            if moment == "step" and found:
                per_step = float(found.group(1))
                time.sleep(per_step / 2)  # the middle of the next step
                break
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=600)
        seconds = time.perf_counter() - t0
        saved = re.search(r"interrupted: saved (\S+?);", rest)
        return {"seconds": seconds, "per_step": per_step, "code": proc.returncode,
                "checkpoint": Path(saved.group(1)).name if saved else "none", "tail": rest[-300:]}


def main(args: Args) -> None:
    rows = []
    for script in args.scripts:
        runs = {m: [stopped(script, m, args.eval_delay, args.root) for _ in range(args.repeats)] for m in ("eval", "step")}
        for moment, done in runs.items():
            bad = [r for r in done if r["code"] != 128 + signal.SIGTERM]
            if bad:
                print(f"{script} ({moment}): exit code {bad[0]['code']}, not 143:\n{bad[0]['tail']}", file=sys.stderr)
            rows.append((script, moment, statistics.median(r["seconds"] for r in done), runs["step"][0]["per_step"],
                         done[0]["checkpoint"]))
            print(f"{script} {moment}: {rows[-1][2]:.1f} s", file=sys.stderr, flush=True)
    print("| script | SIGTERM during | signal to exit, s (median) | s/step | checkpoint saved |")
    print("|---|---|---|---|---|")
    for script, moment, seconds, per_step, checkpoint in rows:
        during = "the step-0 evaluation" if moment == "eval" else "a training step"
        step = f"{per_step:.2f}" if per_step else "?"
        print(f"| {script}.py | {during} | {seconds:.1f} | {step} | {checkpoint} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
