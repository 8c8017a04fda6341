"""TRL's GRPOTrainer and grpo.py on identical work, one after the other in this process, on CPU (or one GPU).

    python benchmarks/grpo_vs_trl.py                 # 10 steps each
    python benchmarks/grpo_vs_trl.py --steps 30 --order grpo-first
    python benchmarks/grpo_vs_trl.py --model MODEL --eval-limit 0   # on a CUDA machine: bf16 autocast for both
    python benchmarks/grpo_vs_trl.py --model MODEL --eval-limit 0 --trl-dtype bfloat16 --backends auto shared

On a GPU both trainers run with bfloat16 autocast over float32 weights (TRL's bf16=True, grpo.py's default);
--dtype bfloat16 loads both in bfloat16 instead (TRL's model, and grpo.py --dtype bfloat16: AdamW on bfloat16
weights, no autocast), the setting under which grpo.py's static backend compiles its decode step. --eval-limit 0
skips the accuracy (a model with random weights scores 0).

Identical work: models/tiny-arith, prompts of data/arith train, rewards.DEFAULT_SPEC (one function for
both), G = 8, 64 completions per step (8 prompts), at most 40 new tokens, temperature 1 (plain
multinomial sampling), beta 0.04 with the k3 KL to a frozen reference, one update per batch, loss type `dapo`
(TRL's default), group-scaled advantages, clip 0.2, AdamW(0.9, 0.99) at a constant learning rate
without warmup, gradient clipping at 1, dropout off, float32, the same number of threads. TRL runs
twice: with gradient checkpointing (its GRPOConfig default, which recomputes the forward pass in the
backward) and without (the same work as grpo.py, which does not checkpoint by default).

"s/step" is the median over steps of the wall time of one training step (sampling, scoring,
log-probs, backward, optimiser), taken by a TrainerCallback for TRL and from grpo.py's own
`perf/step_s` (which excludes evaluation and checkpoints). "speed-up" divides the median of TRL
(with its defaults, and without checkpointing) by each row's. Final accuracy is greedy decoding on the first --eval-limit test prompts, measured by
the same function (grpo.greedy_accuracy) for both trained models. The two runs sample different
completions (different RNG streams and prompt orders), so accuracies after a few steps differ by
noise; the per-step time is the comparison that the number of steps does not change.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402
from rewards import DEFAULT_SPEC, make_reward  # noqa: E402


@dataclass
class Args:
    steps: int = 10
    """training steps for each trainer"""
    learning_rate: float = 1e-5
    """constant learning rate for both: with only 8 prompts a step, 1e-4 wrecks tiny-arith in a few steps
    (for both trainers), which would make the accuracy comparison one of two broken models"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """token aggregation for both (TRL's default is dapo)"""
    eval_limit: int = 500
    """test prompts for the final greedy accuracy"""
    threads: int = 2
    """torch threads for both runs"""
    order: Literal["trl-first", "grpo-first"] = "trl-first"
    """which trainer runs first"""
    seed: int = 1
    """seed of both runs"""
    backends: tuple[str, ...] = ("auto",)
    """grpo.py's --generation-backend(s), one run each (e.g. --backends shared static on a GPU)"""
    grpo_micro_batch_size: int = 32
    """grpo.py's completions per forward/backward (sorted by length, so less padding than one batch of 64)"""
    dtype: Literal["auto", "bfloat16"] = "auto"
    """weights of both: auto = float32 (with bf16 autocast on a GPU), or bfloat16 for both"""
    trl_dtype: Literal["auto", "bfloat16"] | None = None
    """TRL's weights when they differ from --dtype (e.g. bfloat16, its fastest, against grpo.py's default)"""
    trl_cache_implementation: str | None = None
    """TRL's GRPOConfig.cache_implementation for its `generate` (e.g. static; default: its dynamic cache)"""
    model: str = str(ROOT / "models/tiny-arith")
    """the policy both trainers start from"""
    dataset: str = str(ROOT / "data/arith")
    """folder with train.jsonl and test.jsonl"""


G, COMPLETIONS_PER_STEP, MAX_NEW_TOKENS, BETA = 8, 64, 40, 0.04
WEIGHTS = {"auto": torch.float32, "bfloat16": torch.bfloat16}
TRL_DEFAULT = "TRL GRPOTrainer (its default: gradient checkpointing)"
TRL_PLAIN = "TRL GRPOTrainer (no checkpointing)"


def run_trl(args: Args, out_dir: str, gradient_checkpointing: bool) -> tuple[list[float], torch.nn.Module]:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    reward = make_reward(DEFAULT_SPEC)

    def arith_reward(completions, prompts, answer, **_):
        return reward(completions, prompts=prompts, answer=answer)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    config = GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=COMPLETIONS_PER_STEP,
        gradient_accumulation_steps=1, num_generations=G, max_completion_length=MAX_NEW_TOKENS, temperature=1.0,
        top_p=1.0, top_k=0, beta=BETA, num_iterations=1, epsilon=0.2, loss_type=args.loss_type, scale_rewards="group",
        learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9,
        adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(), fp16=False, report_to="none",
        save_strategy="no", logging_steps=1, seed=args.seed, disable_dropout=True, dataloader_num_workers=0,
        log_completions=False, gradient_checkpointing=gradient_checkpointing,
        cache_implementation=args.trl_cache_implementation)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model, dtype=WEIGHTS[args.trl_dtype or args.dtype]), reward_funcs=[arith_reward],
        args=config, train_dataset=load_dataset("json", data_files=str(Path(args.dataset) / "train.jsonl"), split="train"),
        processing_class=AutoTokenizer.from_pretrained(args.model), callbacks=[timer])
    trainer.train()
    return timer.times, trainer.model


def run_grpo(args: Args, out_dir: str, backend: str) -> tuple[list[dict], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    out = grpo.main(grpo.Args(
        model_name_or_path=args.model, dataset=args.dataset, output_dir=out_dir, seed=args.seed, eval_split=None,
        total_steps=args.steps, num_generations=G, prompts_per_step=COMPLETIONS_PER_STEP // G,
        micro_batch_size=args.grpo_micro_batch_size, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, beta=BETA,
        kl_estimator="k3", num_iterations=1, loss_type=args.loss_type, scale_rewards="group",
        learning_rate=args.learning_rate, lr_schedule="constant", warmup_steps=0, max_grad_norm=1.0, log_every=1,
        save_every=0, generation_backend=backend, dtype=args.dtype))
    rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "perf/step_s" in r], AutoModelForCausalLM.from_pretrained(Path(out["run_dir"]) / "final")


def main(args: Args) -> list[dict]:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    test = load_dataset("json", data_files=str(Path(args.dataset) / "test.jsonl"), split="train")
    prompts, answers = list(test["prompt"][: args.eval_limit]), list(test["answer"][: args.eval_limit])

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def accuracy(model) -> float:
        if not prompts:
            return float("nan")
        return grpo.greedy_accuracy(model.float().to(device), tokenizer, prompts, answers, MAX_NEW_TOKENS,
                                    [tokenizer.eos_token_id], False)[0]

    start = accuracy(AutoModelForCausalLM.from_pretrained(args.model))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trl_runs = {TRL_DEFAULT: True, TRL_PLAIN: False}
        ours = {f"grpo.py (--generation-backend {b})": b for b in args.backends}
        for name in ((*trl_runs, *ours) if args.order == "trl-first" else (*ours, *trl_runs)):
            torch.manual_seed(args.seed)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            if name in trl_runs:
                times, model = run_trl(args, os.path.join(tmp, name[-4:]), gradient_checkpointing=trl_runs[name])
                results[name] = {"s/step": statistics.median(times)}
            else:
                rows, model = run_grpo(args, os.path.join(tmp, ours[name]), ours[name])
                results[name] = {"s/step": statistics.median(r["perf/step_s"] for r in rows),
                                 **{k: statistics.median(r[f"perf/{k}_s"] for r in rows)
                                    for k in ("generate", "score", "train")},
                                 "decode tok/s": statistics.median(r["train/completion_length"] * COMPLETIONS_PER_STEP /
                                                                   r["perf/generate_s"] for r in rows),
                                 "sampler gap": statistics.median(r["train/sampler_gap"] for r in rows)}
            results[name]["peak GB"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            results[name]["acc"] = accuracy(model)
    import trl
    import transformers

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {args.threads} threads"
    print(f"\nGRPO on {where} ({Path(args.model).name}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {trl.__version__}): {args.steps} steps, G={G}, {COMPLETIONS_PER_STEP} completions/step, "
          f"{MAX_NEW_TOKENS} new tokens, beta={BETA}, loss {args.loss_type}, lr {args.learning_rate} constant, "
          f"weights {args.dtype}" + (f" (TRL {args.trl_dtype})" if args.trl_dtype else ""))
    print(f"greedy accuracy before training: {start:.3f} ({len(prompts)} test prompts)\n")
    print("| trainer | median s/step | generate s | score s | logp+backward+step s | decode tok/s | peak GB | "
          "sampler gap | speed-up vs TRL default | speed-up vs TRL without checkpointing | final accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base, plain = results[TRL_DEFAULT]["s/step"], results[TRL_PLAIN]["s/step"]
    rows = []
    for name, r in results.items():
        phases = [f"{r[k]:.3f}" if k in r else "-" for k in ("generate", "score", "train")]
        phases += [f"{r['decode tok/s']:.0f}" if "decode tok/s" in r else "-",
                   "-" if r["peak GB"] is None else f"{r['peak GB']:.1f}",
                   f"{r['sampler gap']:.4f}" if "sampler gap" in r else "-"]
        print(f"| {name} | {r['s/step']:.3f} | {' | '.join(phases)} | {base / r['s/step']:.2f}x | "
              f"{plain / r['s/step']:.2f}x | {r['acc']:.3f} |")
        rows.append({"trainer": name, **r, "speedup": base / r["s/step"], "speedup_plain": plain / r["s/step"]})
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
