"""grpo.py's sampling step under each --generation-backend: seconds per batch, decode tokens per second, peak memory.

    python benchmarks/sampling.py                      # the embedded model, grpo.py's default batch, on CPU
    python benchmarks/sampling.py --shape qwen05       # a Qwen2.5-0.5B-shaped model (random weights); for a GPU

The batch is grpo.py's default work: 64 prompts of data/arith train, each repeated G = 8 times (the rows of one
group are consecutive, as grpo.py lays them out), temperature 0.7, at most 40 new tokens; on CUDA under bfloat16
autocast, as grpo.py runs. Each backend samples the batch --repeats times after --warmup untimed calls (compilation,
CUDA graphs and cache set-up happen there); the table gives the median, the ratio to `generate` measured in the same
run, the completion tokens per second (tokens up to each EOS), and the peak of torch.cuda.max_memory_allocated (CUDA
only). A random model rarely samples EOS, so its completions run to 40 tokens.
"""
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402


@dataclass
class Args:
    backends: tuple[str, ...] = ("generate", "shared", "static", "paged")
    """the --generation-backend values to time"""
    shape: Literal["embedded", "qwen05"] = "embedded"
    """models/tiny-arith, or a Qwen2.5-0.5B-shaped model with random weights (24 x 896, vocabulary 151,936)"""
    prompts: int = 64
    """distinct prompts a batch"""
    group: int = 8
    """completions per prompt (G)"""
    max_new_tokens: int = 40
    warmup: int = 1
    """untimed calls per backend first"""
    repeats: int = 5
    """timed calls per backend"""
    threads: int = 2
    """torch threads on CPU"""
    bf16_weights: bool = False
    """bfloat16 weights and no autocast, as grpo.py --dtype bfloat16 runs (default: float32 weights, bf16 autocast on
    CUDA, as --dtype auto runs)"""


def load_model(shape: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith")
    if shape == "embedded":
        return AutoModelForCausalLM.from_pretrained(ROOT / "models/tiny-arith").to(device).eval(), tokenizer
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).eval(), tokenizer


def main(args: Args) -> dict:
    from transformers import GenerationConfig

    unknown = set(args.backends) - {"generate", "shared", "static", "paged"}
    if unknown:
        raise SystemExit(f"unknown backend(s) {sorted(unknown)}: choose from generate, shared, static, paged")
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(args.shape, device)
    model = model.to(torch.bfloat16) if args.bf16_weights else model
    lines = (ROOT / "data/arith/train.jsonl").read_text().splitlines()[: args.prompts]
    rows = [tokenizer(json.loads(line)["prompt"], add_special_tokens=False).input_ids for line in lines]
    ids, mask = (t.to(device) for t in grpo.left_pad([r for r in rows for _ in range(args.group)], tokenizer.pad_token_id))
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda" and not args.bf16_weights)
    eos = torch.tensor([tokenizer.eos_token_id], device=device)
    results = {}
    for backend in args.backends:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times, tokens = [], []
        for k in range(args.warmup + args.repeats):
            torch.manual_seed(k)
            t0 = time.perf_counter()
            with torch.no_grad(), autocast:
                completion, _ = grpo.sample(model, ids, mask, config, backend)
            if device == "cuda":
                torch.cuda.synchronize()
            if k >= args.warmup:
                times.append(time.perf_counter() - t0)
                tokens.append(int(grpo.completion_mask(completion, eos)[0].sum()))
        results[backend] = {"s": statistics.median(times), "tok_s": statistics.median(n / t for n, t in zip(tokens, times)),
                            "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {args.threads} threads"
    weights = "bf16 weights" if args.bf16_weights else "float32 weights"
    print(f"sampling on {where}, {args.shape} model, {weights}, {args.prompts} prompts x G = {args.group}, "
          f"{args.max_new_tokens} new tokens; medians of {args.repeats} calls after {args.warmup} untimed\n")
    print("| --generation-backend | s / batch | vs generate | completion tokens / s | peak GB |")
    print("|---|---|---|---|---|")
    base = results.get("generate", {}).get("s")
    for name, r in results.items():
        ratio = f"{base / r['s']:.2f}x" if base else "-"
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
        print(f"| {name} | {r['s']:.3f} | {ratio} | {r['tok_s']:.0f} | {peak} |")
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
