"""TRL's RewardTrainer and reward_model.py on the same work, one after the other, on CPU (or one GPU).

    pip install trl==1.16.0                                  # not in requirements.txt; only this benchmark needs it
    python benchmarks/reward_model_vs_trl.py                 # reward_model.py's default run: 200 steps of 64 pairs
    python benchmarks/reward_model_vs_trl.py --steps 30 --order rm-first

The same work: models/tiny-arith with a new one-output score head, --steps optimiser steps of --batch-size
pairs of data/arith/prefs.jsonl (each trainer shuffles them its own way, epoch after epoch) in one
micro-batch, the plain Bradley-Terry loss (no margin, no centring), AdamW(0.9, 0.99) at --learning-rate
with 10 warmup steps and cosine decay, gradient clipping at 1, no weight decay, dropout off, float32, no
gradient checkpointing (TRL's default is on: the plain run is the same work as reward_model.py's), the same
number of threads. What differs is each trainer's own convention: TRL appends EOS to every text and reads
the score there, and keeps HF's head initialisation (std 0.02); reward_model.py reads the score at the last
text token and initialises the head N(0, 1/(H+1)). Held-out pair accuracy is measured on the 500 pairs of
prefs_test.jsonl, each model scoring texts the way it was trained (TRL's with EOS), with the same function
(reward_model.sequence_scores).

reward_model.py runs twice: by default, each pair in one row that holds the prefix its two texts share once
(--pack-pairs: the same scores from about 0.68x the tokens here), and with --no-pack-pairs, two rows a pair as
TRL does, which separates the plumbing from the packing.

Each trainer runs in its own fresh process (this script called again with --only). "s/step" is the median
over steps of one optimiser step's wall time (TRL: a TrainerCallback from step begin to step end;
reward_model.py: its `perf/step_s`, logged every step here); "train s" is the sum over steps.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import reward_model as rm  # noqa: E402

TRL = "TRL RewardTrainer (no gradient checkpointing)"
RM = "reward_model.py"
RM_PLAIN = "reward_model.py --no-pack-pairs"


@dataclass
class Args:
    steps: int = 200
    """optimiser steps for each trainer"""
    batch_size: int = 64
    """preference pairs per step (one micro-batch)"""
    learning_rate: float = 1e-3
    """peak learning rate (10 warmup steps, cosine decay)"""
    threads: int = 2
    """torch threads for every run"""
    order: Literal["trl-first", "rm-first"] = "trl-first"
    """which trainer runs first"""
    seed: int = 1
    """seed of every run"""
    model: str = str(ROOT / "models/tiny-arith")
    """the causal LM both start from"""
    dataset: str = str(ROOT / "data/arith")
    """folder with prefs.jsonl and prefs_test.jsonl"""
    only: Optional[str] = None
    """internal: run one trainer in this process and print its result as JSON"""


def run_trl(args: Args, out_dir: str):
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    config = RewardConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, learning_rate=args.learning_rate, lr_scheduler_type="cosine", warmup_steps=10,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(),
        bf16=False, fp16=False, report_to="none", save_strategy="no", logging_steps=10, seed=args.seed,
        disable_dropout=True, dataloader_num_workers=0, gradient_checkpointing=False, max_length=None)
    timer = StepTimer()
    train = load_dataset("json", data_files=str(Path(args.dataset) / "prefs.jsonl"), split="train")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = RewardTrainer(model=args.model, args=config, processing_class=tokenizer, callbacks=[timer],
                            train_dataset=train.select_columns(["prompt", "chosen", "rejected"]))
    trainer.train()
    return timer.times, trainer.model, [tokenizer.eos_token_id]


def run_rm(args: Args, out_dir: str, packed: bool):
    from transformers import AutoModelForSequenceClassification

    out = rm.main(rm.Args(pack_pairs=packed, model_name_or_path=args.model, dataset=args.dataset, output_dir=out_dir, seed=args.seed,
                          eval_split=None, total_steps=args.steps, batch_size=args.batch_size,
                          micro_batch_size=args.batch_size, learning_rate=args.learning_rate, warmup_steps=10,
                          lr_schedule="cosine", log_every=1))
    rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return ([r["perf/step_s"] for r in rows if "perf/step_s" in r],
            AutoModelForSequenceClassification.from_pretrained(Path(out["run_dir"]) / "final"), [])


def one(args: Args) -> dict:
    """--only NAME: one trainer, in this fresh process; held-out pair accuracy of what it trained."""
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        times, model, suffix = run_trl(args, tmp) if args.only == TRL else run_rm(args, tmp, packed=args.only == RM)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    test = [json.loads(line) for line in (Path(args.dataset) / "prefs_test.jsonl").read_text().splitlines()]
    encode = lambda key: [tokenizer(r["prompt"] + r[key])["input_ids"] + suffix for r in test]  # noqa: E731
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.float().to(device)
    model.config.pad_token_id = tokenizer.pad_token_id
    nothing = torch.autocast("cpu", enabled=False)
    chosen = rm.score_sequences(model, encode("chosen"), tokenizer.pad_token_id, device, nothing)
    rejected = rm.score_sequences(model, encode("rejected"), tokenizer.pad_token_id, device, nothing)
    return {"s/step": statistics.median(times), "train_s": sum(times), "steps": len(times),
            "pair_acc": float((chosen > rejected).float().mean())}


def main(args: Args) -> dict:
    try:
        import trl
    except ImportError:
        sys.exit("benchmarks/reward_model_vs_trl.py compares against TRL, which is not installed (it is not in "
                 "requirements.txt): `pip install trl==1.16.0`, then run it again")
    if args.only:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return {}
    import transformers

    results = {}
    for name in ((TRL, RM_PLAIN, RM) if args.order == "trl-first" else (RM, RM_PLAIN, TRL)):
        cmd = [sys.executable, __file__, "--only", name, "--steps", str(args.steps), "--batch-size",
               str(args.batch_size), "--learning-rate", str(args.learning_rate), "--threads", str(args.threads),
               "--seed", str(args.seed), "--model", args.model, "--dataset", args.dataset]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        results[name] = json.loads(lines[-1][len("RESULT "):])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {args.threads} threads"
    print(f"\nBradley-Terry reward model on tiny-arith ({device}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, trl {trl.__version__}): {args.steps} steps of {args.batch_size} pairs, "
          f"lr {args.learning_rate}, warmup 10, cosine\n")
    print("| trainer | median s/step | train s | speed-up vs TRL | held-out pair accuracy |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['s/step']:.3f} | {r['train_s']:.0f} | {results[TRL]['s/step'] / r['s/step']:.2f}x | "
              f"{r['pair_acc']:.3f} |")
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
