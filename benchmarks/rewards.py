"""Throughput of the rule-based rewards on the embedded arithmetic task (completions per second).

    python benchmarks/rewards.py                  # 10,000 completions, 7 repeats, pinned to one core
    python benchmarks/rewards.py --n 2000 --repeats 3

Completions mimic a policy in training: 50% correct and well-formed, 20% wrong and well-formed,
15% an answer without tags, 10% cut off inside <think>, 5% a \\boxed{} answer. Each row times a
full `Reward.__call__` (spec parsing excluded); "vs direct" divides it by the time of calling
the same registered functions directly and summing by hand in the same run, i.e. it shows what
the composition layer (column checks, output validation, trace) costs. Target: >= 50,000/s for
rewards.DEFAULT_SPEC on one core.
"""

import functools
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewards  # noqa: E402


@dataclass
class Args:
    n: int = 10_000
    """number of completions per call"""
    repeats: int = 7
    """timed calls per row (the table shows their median)"""
    seed: int = 0
    """seed of the synthetic completions"""
    one_core: bool = True
    """pin the process to a single CPU core (Linux only)"""


def make_batch(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """(completions, prompts, answers) in the embedded task's format."""
    rng = random.Random(seed)
    completions, prompts, answers = [], [], []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        digits = [(int(x), int(y)) for x, y in zip(str(a)[::-1], str(b)[::-1])]
        steps, carry = [], 0
        for x, y in digits:
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={x + y + carry}")
            carry = (x + y + carry) // 10
        think, truth, kind = ",".join(steps), a + b, rng.random()
        wrong = truth + rng.choice([-10, -1, 1, 10])
        if kind < 0.5:
            text = f"<think>{think}</think><answer>{truth}</answer>"
        elif kind < 0.7:
            text = f"<think>{think}</think><answer>{wrong}</answer>"
        elif kind < 0.85:
            text = f"{a}+{b} is {rng.choice([truth, wrong])}"
        elif kind < 0.95:
            text = f"<think>{think[:rng.randint(1, len(think))]}"
        else:
            text = f"<think>{think}</think> so \\boxed{{{truth}}}"
        completions.append(text)
        prompts.append(f"{a}+{b}=")
        answers.append(str(truth))
    return completions, prompts, answers


def call_directly(reward: rewards.Reward, completions, prompts, columns) -> list[float]:
    """The registered functions behind `reward` (a leaf or a flat sum), called and summed by hand."""
    leaves = reward.components or [(1.0, reward)]
    total = [0.0] * len(completions)
    for weight, leaf in leaves:
        values = leaf.fn(completions=completions, prompts=prompts, **columns, **leaf.options)
        total = [t + weight * v for t, v in zip(total, values)]
    return total


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args: Args) -> list[dict]:
    if args.one_core and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    completions, prompts, answers = make_batch(args.n, args.seed)
    columns = {"answer": answers, "completion_ids": [[0] * len(c) for c in completions]}
    specs = [rewards.DEFAULT_SPEC, "correctness", "format", {"type": "format", "mode": "soft"}, "reasoning_steps",
             "conciseness", "length_penalty", "repetition_penalty", "capitalization", "overlong",
             {"type": "language_consistency", "lang": "en"}, "language_consistency"]
    rows = []
    for spec in specs:
        reward = rewards.make_reward(spec)
        t_reward = timed(functools.partial(reward, completions, prompts=prompts, **columns), args.repeats)
        t_direct = timed(functools.partial(call_directly, reward, completions, prompts, columns), args.repeats)
        name = spec if isinstance(spec, str) else ",".join(f"{k}={v}" for k, v in spec.items() if k != "type")
        name = name if isinstance(spec, str) else f"{spec['type']}({name})"
        rows.append({"spec": name, "per_s": args.n / t_reward, "ms": 1e3 * t_reward, "vs_direct": t_direct / t_reward})
    print(f"{args.n} completions, median of {args.repeats} calls, {'one core' if args.one_core else 'all cores'}, "
          f"Python {sys.version.split()[0]}")
    print(f"| {'spec':<40} | {'completions/s':>13} | {'ms/call':>8} | {'vs direct':>9} |")
    print(f"|{'-' * 42}|{'-' * 14}:|{'-' * 9}:|{'-' * 10}:|")
    for row in rows:
        print(f"| {row['spec']:<40} | {row['per_s']:>13,.0f} | {row['ms']:>8.1f} | {row['vs_direct']:>9.2f} |")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
