"""Each LLM script under torchrun, DDP against --fsdp: seconds a step and peak GPU memory, at a Qwen2.5-0.5B shape.

    python benchmarks/fsdp_gpu.py                        # CUDA: one GPU, 0.5B shape, 6 steps of each script
    python benchmarks/fsdp_gpu.py --nproc 8               # one node of 8 GPUs
    python benchmarks/fsdp_gpu.py --shape tiny --steps 2  # CPU check of the commands (gloo; numbers meaningless)

The model is built from a config (24 layers, 896 wide, vocabulary 151,936, random weights, no download) with the
embedded tokenizer, as benchmarks/grpo_gpu.py does; every script runs its defaults on data/arith (--dataset) with
evaluation off, once with DDP and once with --fsdp. The table gives the median of the scripts' own perf/step_s over
the steps after the first, and the largest perf/peak_gb (rank 0's torch.cuda.max_memory_allocated; CUDA only).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("sft", "grpo", "dpo", "reward_model", "ppo", "hybrid")


@dataclass
class Args:
    scripts: tuple[str, ...] = SCRIPTS
    """which scripts to run"""
    shape: Literal["qwen05", "tiny"] = "qwen05"
    """the Qwen2.5-0.5B shape (random weights), or a 2-layer 32-wide model for a CPU check"""
    nproc: int = 1
    """processes (GPUs) per run"""
    steps: int = 6
    """training steps per run"""
    dataset: str = "data/arith"
    """every script's --dataset (a folder with their splits)"""


def make_model(shape: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith")
    size = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2) if shape == "qwen05" else dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2)
    torch.manual_seed(0)
    config = Qwen2Config(**size, max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(script: str, fsdp: bool, args: Args, model: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(ROOT / f"{script}.py"), "--model-name-or-path", str(model), "--output-dir", str(out), "--total-steps",
           str(args.steps), "--eval-split", "None", "--log-every", "1", "--warmup-steps", "0", "--dataset", args.dataset,
           *(["--fsdp"] * fsdp)]
    if script == "sft":
        cmd += ["--eval-every", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    (run_dir,) = out.iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    later = rows[1:] or rows
    return {"step_s": statistics.median(r["perf/step_s"] for r in later),
            "peak_gb": max((r.get("perf/peak_gb", float("nan")) for r in rows), default=float("nan"))}


def main(args: Args) -> dict:
    unknown = set(args.scripts) - set(SCRIPTS)
    if unknown:
        raise SystemExit(f"unknown script(s) {sorted(unknown)}: choose from {SCRIPTS}")
    if args.shape == "qwen05" and not torch.cuda.is_available():
        raise SystemExit("--shape qwen05 needs CUDA GPUs; --shape tiny checks the commands on CPU")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(args.shape, model)
        for script in args.scripts:
            for mode in ("ddp", "fsdp"):
                results.setdefault(script, {})[mode] = run(script, mode == "fsdp", args, model, Path(tmp) / script / mode)
                print(script, mode, results[script][mode], flush=True)  # as it comes: a run cut short keeps the rest
    where = f"{args.nproc} x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else f"CPU, {args.nproc} processes"
    print(f"DDP against --fsdp on {where}, {args.shape} model, {args.steps} steps; medians of steps 2-{args.steps}\n")
    print("| script | DDP s/step | FSDP s/step | FSDP / DDP | DDP peak GB | FSDP peak GB |")
    print("|---|---|---|---|---|---|")
    for script, r in results.items():
        d, f = r["ddp"], r["fsdp"]
        print(f"| {script} | {d['step_s']:.3f} | {f['step_s']:.3f} | {f['step_s'] / d['step_s']:.2f}x | "
              f"{d['peak_gb']:.1f} | {f['peak_gb']:.1f} |")
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
