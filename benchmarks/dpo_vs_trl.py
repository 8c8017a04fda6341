"""TRL's DPOTrainer and dpo.py on identical work, one after the other, on CPU (or one GPU).

    pip install trl==1.16.0                            # not in requirements.txt; only this benchmark needs it
    python benchmarks/dpo_vs_trl.py                    # 10 steps each, tiny-arith, then the large-vocabulary model
    python benchmarks/dpo_vs_trl.py --steps 30 --order dpo-first --no-large-vocab

Identical work: the same model and tokenizer, the same steps x --batch-size pairs of data/arith
prefs.jsonl (its first ones), each seen once (each trainer shuffles them its own way), --batch-size pairs
per step in one micro-batch,
sigmoid loss, beta 0.1, no label smoothing and no RPO/SFT term, a frozen reference model, completions
ending in EOS, AdamW(0.9, 0.99) at a constant learning rate without warmup, gradient clipping at 1,
no weight decay, dropout off, float32, the same number of threads. TRL runs twice: with gradient
checkpointing (its default) and without (the same work as dpo.py, which does not checkpoint by default).
dpo.py runs three times: as by default (pairs packed, each pair's shared prefix computed once; no
checkpointing), with --gradient-checkpointing (the like-for-like row for TRL's default), and with
--no-pack-pairs (two rows a pair, as TRL: the like-for-like row for TRL without checkpointing).

Then the same table for a randomly initialised small Qwen2 (tiny-arith's shape, 4 layers x 128 wide)
with a vocabulary of 151,936 (Qwen2's), built from a config, no download: there the lm_head is most of
the work, and not materialising the [B, T, V] logits is what matters. Its accuracy is 0 for every
trainer (a random model), so only time and memory mean anything there.

Each trainer runs in its own fresh process (this script, called again with --only), one after the
other: on CPU, "peak MB" is the peak resident set size of that process while it loads the models and
data and trains (sampled every 2 ms), above its size before (after the imports): weights, reference,
optimiser state, data and activations; on a GPU, torch.cuda.max_memory_allocated. "s/step" is the
median over steps of one optimiser step's wall time (TRL: a TrainerCallback from step begin to step
end; dpo.py: its own `perf/step_s`). Final accuracy is greedy decoding on the first --eval-limit test
prompts with the same function (dpo.greedy_accuracy).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import dpo  # noqa: E402

TRL_DEFAULT = "TRL DPOTrainer (its default: gradient checkpointing)"
TRL_PLAIN = "TRL DPOTrainer (no checkpointing)"
DPO = "dpo.py"
DPO_CKPT = "dpo.py --gradient-checkpointing"
DPO_PLAIN = "dpo.py --no-pack-pairs"
BETA, MAX_NEW_TOKENS = 0.1, 40


@dataclass
class Args:
    steps: int = 10
    """optimiser steps for each trainer"""
    batch_size: int = 32
    """preference pairs per step (one micro-batch) on the tiny-arith model"""
    learning_rate: float = 5e-6
    """constant learning rate for both"""
    eval_limit: int = 500
    """test prompts for the final greedy accuracy"""
    threads: int = 2
    """torch threads for every run"""
    order: Literal["trl-first", "dpo-first"] = "trl-first"
    """which trainer runs first"""
    seed: int = 1
    """seed of every run"""
    large_vocab: bool = True
    """also run the randomly initialised model with a 151,936-token vocabulary"""
    large_vocab_batch_size: int = 8
    """pairs per step on the large-vocabulary model (its logits are 151,936 floats per token)"""
    model: str = str(ROOT / "models/tiny-arith")
    """the policy (and reference) every trainer starts from"""
    dataset: str = str(ROOT / "data/arith")
    """folder with prefs.jsonl and test.jsonl"""
    only: Optional[str] = None
    """internal: run one trainer in this process and print its result as JSON"""


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakMemory:
    """Peak memory of the work inside the `with`: on a GPU torch's peak allocation; on CPU the peak resident set
    size above the size at entry, sampled every 2 ms by a thread (the process's lifetime peak, ru_maxrss, would
    include the imports)."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.baseline = self.peak = rss_mb()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.mb = (torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available()
                   else max(self.peak, rss_mb()) - self.baseline)


def pairs_file(args: Args, out_dir: str, n: int) -> str:
    """The first n pairs: both trainers read exactly these, each once (dpo.py as its whole training split)."""
    rows = (ROOT / args.dataset / "prefs.jsonl").read_text().splitlines()[:n]
    Path(out_dir, "pairs").mkdir(parents=True, exist_ok=True)
    Path(out_dir, "pairs", "prefs.jsonl").write_text("".join(line + "\n" for line in rows))
    return str(Path(out_dir, "pairs"))


def run_trl(args: Args, model_path: str, data: str, out_dir: str, batch: int, gradient_checkpointing: bool):
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    config = DPOConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        loss_type=["sigmoid"], beta=BETA, label_smoothing=0.0, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0,
        max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, report_to="none",
        save_strategy="no", logging_steps=1, seed=args.seed, disable_dropout=True, dataloader_num_workers=0,
        gradient_checkpointing=gradient_checkpointing, max_length=None)
    timer = StepTimer()
    train = load_dataset("json", data_files=str(Path(data) / "prefs.jsonl"), split="train")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), args=config,
                         train_dataset=train.select_columns(["prompt", "chosen", "rejected"]),
                         processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[timer])
    trainer.train()
    return timer.times, trainer.model


def run_dpo(args: Args, model_path: str, data: str, out_dir: str, batch: int, gradient_checkpointing: bool,
            pack_pairs: bool):
    from transformers import AutoModelForCausalLM

    out = dpo.main(dpo.Args(
        model_name_or_path=model_path, dataset=data, output_dir=out_dir, seed=args.seed, eval_split=None,
        pref_eval_split=None, total_steps=args.steps, batch_size=batch, micro_batch_size=batch, loss_type="sigmoid",
        beta=BETA, label_smoothing=0.0, rpo_alpha=0.0, learning_rate=args.learning_rate, lr_schedule="constant",
        warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, log_every=1, save_every=0, max_completion_length=1024,
        max_prompt_length=1024, gradient_checkpointing=gradient_checkpointing, pack_pairs=pack_pairs))
    rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r["perf/step_s"] for r in rows if "perf/step_s" in r], AutoModelForCausalLM.from_pretrained(
        Path(out["run_dir"]) / "final")


def one(args: Args) -> dict:
    """--only NAME|MODEL|BATCH: one trainer, in this fresh process."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    name, model_path, batch = args.only.split("|")
    batch = int(batch)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        data = pairs_file(args, tmp, args.steps * batch)
        with PeakMemory() as memory:
            if name in (DPO, DPO_CKPT, DPO_PLAIN):
                times, model = run_dpo(args, model_path, data, os.path.join(tmp, "runs"), batch, name == DPO_CKPT,
                                       pack_pairs=name != DPO_PLAIN)
            else:
                times, model = run_trl(args, model_path, data, os.path.join(tmp, "trl"), batch, name == TRL_DEFAULT)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    test = load_dataset("json", data_files=str(ROOT / args.dataset / "test.jsonl"), split="train")
    n = min(args.eval_limit, len(test))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    acc = dpo.greedy_accuracy(model.float().to(device), tokenizer, list(test["prompt"][:n]), list(test["answer"][:n]),
                              MAX_NEW_TOKENS, [tokenizer.eos_token_id], False)[0]
    return {"s/step": statistics.median(times), "peak_mb": memory.mb, "acc": acc, "steps": len(times)}


def large_vocab_model(out_dir: str) -> str:
    """tiny-arith's shape with Qwen2's 151,936-token vocabulary, randomly initialised (seed 0), no download."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(ROOT / "models/tiny-arith")
    config.vocab_size = 151936
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith").save_pretrained(out_dir)
    return out_dir


def table(title: str, results: dict) -> list[dict]:
    print(f"\n{title}\n")
    print("| trainer | median s/step | peak MB | speed-up vs TRL default | speed-up vs TRL without checkpointing | "
          "memory vs TRL default | memory vs TRL without checkpointing | final accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    base, plain = results[TRL_DEFAULT], results[TRL_PLAIN]
    rows = []
    for name, r in results.items():
        print(f"| {name} | {r['s/step']:.3f} | {r['peak_mb']:.0f} | {base['s/step'] / r['s/step']:.2f}x | "
              f"{plain['s/step'] / r['s/step']:.2f}x | {r['peak_mb'] / base['peak_mb']:.2f}x | "
              f"{r['peak_mb'] / plain['peak_mb']:.2f}x | {r['acc']:.3f} |")
        rows.append({"trainer": name, **r})
    return rows


def main(args: Args) -> dict:
    try:
        import trl
    except ImportError:
        sys.exit("benchmarks/dpo_vs_trl.py compares against TRL, which is not installed (it is not in "
                 "requirements.txt): `pip install trl==1.16.0`, then run it again")
    if args.only:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return {}
    import transformers

    names = ((TRL_DEFAULT, TRL_PLAIN, DPO_PLAIN, DPO, DPO_CKPT) if args.order == "trl-first"
             else (DPO, DPO_CKPT, DPO_PLAIN, TRL_DEFAULT, TRL_PLAIN))
    cases = [("tiny-arith", args.model, args.batch_size)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.large_vocab:
            big = large_vocab_model(os.path.join(tmp, "big"))
            cases.append(("random Qwen2 shape of tiny-arith, vocab 151,936", big, args.large_vocab_batch_size))
        for case, model_path, batch in cases:
            results = {}
            for name in names:
                cmd = [sys.executable, __file__, "--only", f"{name}|{model_path}|{batch}", "--steps", str(args.steps),
                       "--learning-rate", str(args.learning_rate), "--eval-limit", str(args.eval_limit), "--threads",
                       str(args.threads), "--seed", str(args.seed), "--dataset", args.dataset]
                done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    raise RuntimeError(f"{name} on {case} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
                results[name] = json.loads(lines[-1][len("RESULT "):])
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {args.threads} threads"
            out[case] = table(f"DPO on {case} ({device}, torch {torch.__version__}, transformers "
                              f"{transformers.__version__}, trl {trl.__version__}): {args.steps} steps of {batch} "
                              f"pairs, sigmoid, beta {BETA}, lr {args.learning_rate} constant", results)
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
