"""How a reward model's scores separate right from wrong samples: across prompts (one threshold on the whitened
score, what a clipped "verdict" reward sees at --num-generations 1) and within a prompt (what a Bradley-Terry model is
trained on, and what ppo.py --center-scores-per-prompt sees).

    python benchmarks/rm_calibration.py --reward-model runs/<rm>/final \
        --comparisons runs/<comparisons run>/comparisons_test.jsonl

The comparisons are reward_model.py --comparisons rows ranked by correctness: every chosen text a right sample, every
rejected one a wrong sample, `ranking` the prompt. Each distinct text is scored once, whitened with the model's
reward_mean / reward_std (the `reward_model` reward with "normalize": true, as ppo.py scores).
"""

import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rewards import make_reward  # noqa: E402


@dataclass
class Args:
    reward_model: str
    """a reward_model.py final/ folder (with reward_mean / reward_std)"""
    comparisons: str
    """a comparisons JSON-lines file of reward_model.py --comparisons (labeler: correctness)"""
    thresholds: tuple[float, ...] = (-3.0, -2.0, -1.5, -1.0, -0.5, 0.0)
    """whitened thresholds for the across-prompt table"""


def main(args: Args) -> dict:
    """Prints the tables -> {ranking: ({right text: whitened score}, {wrong text: whitened score})}."""
    groups = defaultdict(lambda: ({}, {}))  # ranking -> ({right text: prompt}, {wrong text: prompt}), each text once
    for n, line in enumerate(Path(args.comparisons).read_text().splitlines(), 1):
        r = json.loads(line)
        missing = [c for c in ("prompt", "chosen", "rejected", "ranking") if c not in r]
        if missing:  # checked before the model loads
            raise ValueError(f"{args.comparisons}:{n} has no column {missing}: pass the comparisons.jsonl or "
                             f"comparisons_test.jsonl that reward_model.py --comparisons writes")
        if r.get("tie"):  # --tie-strength's tied pairs: both right or both wrong, no verdict to read
            continue
        groups[r["ranking"]][0][r["chosen"]] = r["prompt"]
        groups[r["ranking"]][1][r["rejected"]] = r["prompt"]
    if not groups:
        raise ValueError(f"{args.comparisons} holds no comparisons: every prompt's samples tied; sample more prompts")
    score = make_reward({"type": "reward_model", "model": args.reward_model, "normalize": True})
    right, wrong, gaps, spread_wrong, scored = [], [], [], [], {}
    for key, (ok, bad) in groups.items():
        s = score([*ok, *bad], prompts=[*ok.values(), *bad.values()])
        r, w = s[:len(ok)], s[len(ok):]
        scored[key] = (dict(zip(ok, r)), dict(zip(bad, w)))
        right += r
        wrong += w
        gaps.append(statistics.mean(r) - statistics.mean(w))
        if len(w) > 1:
            spread_wrong.append(statistics.stdev(w))
    print(f"{args.reward_model} on {len(right)} right and {len(wrong)} wrong samples of {len(groups)} prompts "
          f"(whitened scores)\n")
    print("| across prompts | right | wrong |\n|---|---|---|")
    print(f"| median | {statistics.median(right):.2f} | {statistics.median(wrong):.2f} |")
    for t in args.thresholds:
        print(f"| above {t:g} | {sum(x > t for x in right) / len(right):.1%} | {sum(x > t for x in wrong) / len(wrong):.1%} |")
    print(f"\nwithin a prompt: mean right - mean wrong {statistics.mean(gaps):.2f} (negative in {sum(g < 0 for g in gaps)} "
          f"of {len(gaps)} prompts); spread (std) of a prompt's wrong samples "
          f"{statistics.mean(spread_wrong) if spread_wrong else float('nan'):.2f}")
    return scored


if __name__ == "__main__":
    main(tyro.cli(Args))
