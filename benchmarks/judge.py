"""The judge reward (rewards.judge): how often a judge agrees with the verdicts, and what it costs per step.

    python benchmarks/judge.py accuracy runs/judge-arith          # held-out accuracy on data/arith/verify_test.jsonl
    python benchmarks/judge.py speed                              # the embedded judge vs sampling, on CPU
    python benchmarks/judge.py speed --shape 0.5b --n 512         # a Qwen2.5-0.5B-shaped judge (random weights)

accuracy: the judge's score of each held-out candidate against its verdict (Y when the score is above 0.5), per kind
of candidate (data/make_arith.py's VERDICT_KINDS), with the mean score of each kind, through the spec
data/rewards/judge_arith.json (its model replaced by the folder given).

speed: seconds to score `--n` completions of the embedded task with the judge (one forward pass per batch of
`--batch-size`), next to the seconds to sample them with a policy of the same shape (grpo.py's generation: `generate`,
temperature 1, `--max-new-tokens`). A judge should cost no more than the sampling it grades. Random weights, built
here: nothing downloads. "tiny" is models/tiny-arith's shape; "0.5b" is Qwen2.5-0.5B's (24 layers, width 896,
151,936 tokens).
"""

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import rewards  # noqa: E402

SHAPES = {"tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=103),
          "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936)}


@dataclass
class Args:
    mode: tyro.conf.Positional[Literal["accuracy", "speed"]]
    """accuracy: agreement with the held-out verdicts; speed: judge vs sampling seconds"""
    judge: tyro.conf.Positional[str] = "runs/judge-arith"
    """accuracy: the judge's folder (sft.py's --final-dir)"""
    split: str = "data/arith/verify_test.jsonl"
    """accuracy: the held-out verification rows"""
    spec: str = "data/rewards/judge_arith.json"
    """accuracy: the reward spec holding the judge (its model is replaced by --judge)"""
    shape: Literal["tiny", "0.5b"] = "tiny"
    """speed: the judge's and the policy's shape"""
    n: int = 512
    """speed: completions scored and sampled"""
    batch_size: int = 64
    """speed: the judge's batch and the sampling batch"""
    max_new_tokens: int = 48
    """speed: tokens sampled per completion (grpo.py's --max-completion-length)"""
    repeats: int = 3
    """speed: timed repeats (the table shows their median)"""
    device: str = "auto"
    """cpu, cuda or auto"""


def judge_spec(args: Args) -> dict:
    spec = rewards._normalize_spec(args.spec)
    leaves = spec["components"] if spec["type"] == "weighted_sum" else [spec]
    return {**next(c for c in map(rewards._parse_component, leaves) if c["type"] == "judge"), "model": args.judge,
            "device": args.device}


def accuracy(args: Args) -> None:
    rows = [json.loads(line) for line in Path(args.split).read_text().splitlines()]
    spec = judge_spec(args)
    start = time.perf_counter()
    scores = rewards.make_reward(spec)([r["completion"] for r in rows], prompts=[r["prompt"] for r in rows],
                                       answer=[r["answer"] for r in rows])
    seconds = time.perf_counter() - start
    kinds = defaultdict(list)
    for row, s in zip(rows, scores):
        kinds[row["kind"]].append(((s > 0.5) == (row["verdict"] == "Y"), s))
    print(f"judge {args.judge} on {args.split}: {len(rows)} rows scored in {seconds:.1f} s "
          f"({torch.get_num_threads()} threads)\n")
    print("| kind | rows | accuracy | mean score |\n|---|---|---|---|")
    for kind, hits in [*sorted(kinds.items()), ("all", [h for v in kinds.values() for h in v])]:
        print(f"| {kind} | {len(hits)} | {statistics.fmean(h for h, _ in hits):.1%} | "
              f"{statistics.fmean(s for _, s in hits):.3f} |")


def speed(args: Args, tmp: Path) -> None:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=256, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(ROOT / "data/arith/tokenizer").save_pretrained(tmp)
    rows = [json.loads(line) for line in (ROOT / "data/arith/verify_test.jsonl").read_text().splitlines()]
    rows = (rows * (args.n // len(rows) + 1))[: args.n]
    spec = {"type": "judge", "model": str(tmp), "template": "{prompt}{completion}ref:{answer},ok?",
            "choices": {"Y": 1, "N": 0}, "batch_size": args.batch_size, "device": args.device}
    reward = rewards.make_reward(spec)
    tokenizer, policy = rewards.load_model("AutoModelForCausalLM", str(tmp), spec["device"],
                                           "bfloat16" if device.type == "cuda" else "float32")
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                           min_new_tokens=args.max_new_tokens, pad_token_id=0, eos_token_id=1)

    def sample():
        with torch.inference_mode():
            for i in range(0, args.n, args.batch_size):
                enc = tokenizer([r["prompt"] for r in rows[i:i + args.batch_size]], return_tensors="pt", padding=True,
                                padding_side="left").to(device)
                policy.generate(**enc, generation_config=gen)

    def judge():
        unique = [f"{i}:{r['completion']}" for i, r in enumerate(rows)]  # every input distinct: none is skipped
        reward(unique, prompts=[r["prompt"] for r in rows], answer=[r["answer"] for r in rows])

    times = {}
    for name, fn in (("sample", sample), ("judge", judge)):
        fn()  # warm-up
        runs = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        times[name] = statistics.median(runs)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.shape} shape, {args.n} completions of {args.max_new_tokens} tokens, batch {args.batch_size}, "
          f"{name}, median of {args.repeats}\n")
    print("| work | seconds | per completion | vs sampling |\n|---|---|---|---|")
    for key, label in (("sample", "sample (generate)"), ("judge", "judge (one forward per batch)")):
        share = times[key] / times["sample"]
        print(f"| {label} | {times[key]:.3f} | {1e3 * times[key] / args.n:.2f} ms | {share:.2f}x |")


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.mode == "accuracy":
        accuracy(args)
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            speed(args, Path(tmp))
