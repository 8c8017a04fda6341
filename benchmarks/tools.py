"""The tool recipe of docs/grpo.md end to end: an SFT cold start that sometimes calls the calculator, then GRPO with
the calculator, over seeds; prints the table of docs/grpo.md#tool-calls and (--plot) draws accuracy and call rate.

    python benchmarks/tools.py                          # seeds 1 2 3 from models/tiny-arith-tools, one at a time
    python benchmarks/tools.py --seeds 1 --threads 1    # one seed on one thread
    python benchmarks/tools.py --summarize-only --plot docs/grpo_tools.png

The cold start (models/tiny-arith-tools, made by COLD_START: sft.py from a fresh model on data/arith/sft_tools.jsonl,
when --cold-start is missing) and the GRPO runs (RECIPE plus
`--seed S --eval-every 10`) are the commands of docs/grpo.md. A finished run (its final/ exists) is not run again.
Columns: greedy accuracy on the 500 test problems at the start and the end; the share of completions with a call,
of calls whose expression is the problem's exactly (read from the end model's greedy completions) and of calls that
failed; the training seconds (the sum of the steps, evaluations excluded) to the first evaluation at or above 90%
and to the end; the run's wall time.
"""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
COLD_START = ["sft.py", "--model-config", "models/tiny-arith-config.json", "--tokenizer-name-or-path",
              "data/arith/tokenizer", "--dataset-split", "sft_tools", "--max-length", "96", "--max-new-tokens", "64",
              "--total-steps", "250", "--learning-rate", "2e-3", "--warmup-steps", "25"]
RECIPE = ["grpo.py", "--tools", "calculator", "--max-completion-length", "64", "--total-steps", "50",
          "--warmup-steps", "5", "--learning-rate", "2e-4", "--max-grad-norm", "0.05"]


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3)
    """GRPO seeds (the cold start is made once, seed 1)"""
    threads: int = 2
    """OMP_NUM_THREADS of each run"""
    cold_start: str = str(ROOT / "models" / "tiny-arith-tools")
    """the cold-start model (made by COLD_START when missing)"""
    output_dir: str = str(ROOT / "runs" / "tools")
    """where the runs go"""
    summarize_only: bool = False
    """only print the table of the runs there"""
    plot: str = ""
    """also draw eval/accuracy and eval/call_rate of the runs to this file"""


def run(cmd: list[str], threads: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - t0


def exact_calls(final: Path) -> tuple[float, int]:
    """The end model's greedy completions on the test split -> (share of calls whose expression is the problem's, calls)."""
    sys.path.insert(0, str(ROOT))
    import grpo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    args = grpo.Args(tools=("calculator",), max_completion_length=64)
    eos = grpo.own_generation_config(model, tokenizer)
    rows = [json.loads(line) for line in (ROOT / "data/arith/test.jsonl").read_text().splitlines()]
    _, samples = grpo.greedy_turns(model, tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows], eos,
                                   grpo.load_tools(args.tools), args, progress=False)
    calls = [(p[:-1], e) for p, c, _ in samples for e in re.findall(r"<calculator>(.*?)</calculator>", c)]
    return sum(p == e for p, e in calls) / max(len(calls), 1), len(calls)


def summarize(out: Path, seeds) -> None:
    print("| seed | accuracy start -> end | completions with a call | exact calls | failed calls | training s to 90% | "
          "training s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        folder = out / f"seed_{seed}"
        if not (folder / "final").exists():
            continue
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        seconds, at = 0.0, {}
        for r in rows:
            seconds += r.get("perf/step_s", 0.0)
            if "eval/accuracy" in r:
                at[r["step"]] = seconds
        evals = [r for r in rows if "eval/accuracy" in r]
        first, last = evals[0], evals[-1]
        reached = next((at[r["step"]] for r in evals if r["eval/accuracy"] >= 0.9), None)
        exact, n = exact_calls(folder / "final")
        wall = json.loads((folder / "wall.json").read_text())["s"] if (folder / "wall.json").exists() else float("nan")
        print(f"| {seed} | {first['eval/accuracy']:.1%} -> **{last['eval/accuracy']:.1%}** | "
              f"{first['eval/call_rate']:.1%} -> {last['eval/call_rate']:.1%} | {exact:.1%} of {n} | "
              f"{last['eval/tool_errors']:.1%} | {'-' if reached is None else f'{reached:.0f}'} | {seconds:.0f} | "
              f"{wall:.0f} |")


def main(a: Args) -> None:
    out = Path(a.output_dir)
    cold = Path(a.cold_start)
    if not a.summarize_only:
        if not (cold / "config.json").exists():
            run([*COLD_START, "--final-dir", str(cold), "--output-dir", str(out / "sft")], a.threads)
        for seed in a.seeds:
            folder = out / f"seed_{seed}"
            if (folder / "final").exists():
                continue
            wall = run([*RECIPE, "--model-name-or-path", str(cold), "--seed", str(seed), "--eval-every", "10",
                        "--run-dir", str(folder)], a.threads)
            (folder / "wall.json").write_text(json.dumps({"s": wall}))
    summarize(out, a.seeds)
    if a.plot:
        runs = [str(out / f"seed_{s}") for s in a.seeds if (out / f"seed_{s}" / "final").exists()]
        subprocess.run([sys.executable, "plot.py", *runs, "--keys", "eval/accuracy", "eval/call_rate",
                        "train/reward", "train/tool_tokens", "--out", a.plot], cwd=ROOT, check=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
