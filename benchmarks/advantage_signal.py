"""How much of PPO's per-prompt-centred reward is signal: G samples of each prompt from a policy, scored by one or more
rewards and by the gold rule; the correlation, over all samples, of each reward's score less its prompt's mean with the
gold score less its prompt's mean (what `ppo.py --center-scores-per-prompt` hands the advantages). 1 would be the gold
rule itself; the rest of the variance is noise that PPO climbs as well.

    python benchmarks/advantage_signal.py --policy runs/<ppo-run>/checkpoints/step_150 \
        --rewards runs/<rm1>/final/reward.json runs/<rm2>/final/reward.json

A row for each reward, then one for the mean of their scores (an ensemble), when there are two or more.
"""

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rewards import make_reward  # noqa: E402


@dataclass
class Args:
    policy: str
    """a causal LM folder (an SFT model, a ppo.py checkpoint)"""
    rewards: tuple[str, ...]
    """reward specs for rewards.make_reward (a reward model's reward.json)"""
    gold: str = '{"type": "correctness", "wrong": 0}'
    """the rule the rewards stand in for"""
    dataset: str = "data/arith/test.jsonl"
    """prompt / answer rows"""
    prompts: int = 500
    """how many prompts, drawn from the dataset in a seeded shuffle"""
    num_generations: int = 4
    """samples per prompt (the pipeline's ppo.py --num-generations)"""
    temperature: float = 0.7
    """sampling temperature (ppo.py's default)"""
    max_new_tokens: int = 40
    """longest completion (ppo.py's --max-completion-length)"""
    seed: int = 0
    """seeds the prompt shuffle and the sampling"""


def centred_correlation(scores: torch.Tensor, gold: torch.Tensor) -> float:
    """corr(s - mean_prompt(s), g - mean_prompt(g)) over all samples; rows are prompts, columns their samples."""
    s, g = (x - x.mean(1, keepdim=True) for x in (scores.double(), gold.double()))
    return float((s * g).sum() / (s.norm() * g.norm()))


def main(args: Args) -> dict:
    """Prints the table -> {row name: correlation, "gold": the samples' mean gold score}."""
    if args.prompts < 1 or args.num_generations < 2:
        raise SystemExit("--prompts must be >= 1 and --num-generations >= 2 (a prompt's mean needs two samples)")
    rewards = [make_reward(spec) for spec in args.rewards]  # bad specs fail here, before any sampling
    gold = make_reward(args.gold)
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
    if not rows or any(not {"prompt", "answer"} <= set(r) for r in rows):
        raise SystemExit(f"--dataset {args.dataset}: every row needs a prompt and an answer (and there must be rows)")
    random.Random(args.seed).shuffle(rows)
    rows, G = rows[:args.prompts], args.num_generations
    tokenizer, model = AutoTokenizer.from_pretrained(args.policy), AutoModelForCausalLM.from_pretrained(args.policy)
    tokenizer.padding_side, completions = "left", []
    torch.manual_seed(args.seed)
    for i in range(0, len(rows), 64):
        batch = tokenizer([r["prompt"] for r in rows[i:i + 64]], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.eval().generate(**batch, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                        max_new_tokens=args.max_new_tokens, num_return_sequences=G,
                                        pad_token_id=tokenizer.pad_token_id)
        completions += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    answers = [r["answer"] for r in rows for _ in range(G)]
    g = torch.tensor(gold(completions, prompts=prompts, answer=answers)).view(-1, G)
    scores = {spec: torch.tensor(r(completions, prompts=prompts, answer=answers)).view(-1, G)
              for spec, r in zip(args.rewards, rewards)}
    if len(scores) > 1:
        scores["mean of the rewards"] = sum(scores.values()) / len(scores)
    out = {name: centred_correlation(s, g) for name, s in scores.items()}
    print(f"{len(rows)} prompts x {G} samples of {args.policy} (T = {args.temperature}); mean gold {g.mean():.3f}\n")
    print("| reward | correlation with the gold score, both less their prompt's mean |\n|---|---|")
    for name, c in out.items():
        print(f"| {name} | {c:.3f} |")
    return {**out, "gold": float(g.mean())}


if __name__ == "__main__":
    main(tyro.cli(Args))
