"""On CPU, each --generation-backend's sampling of grpo.py's default batch: why `auto` is `shared` there.

    python benchmarks/sampling_cpu.py [REPEATS]   # 2 threads, the embedded model, 64 prompts x G = 8, 40 tokens, T 0.7

`grpo.sample` on the same left-padded batch, the backends interleaved, a fresh seed per repeat; `copy` writes the
model's weights into its bfloat16 copy each time, as a run does before each rollout. Medians of the repeats after the
first (which builds the copy).
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402


def main(repeats: int = 8) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "models/tiny-arith")
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith")
    rows = [json.loads(line)["prompt"] for line in (ROOT / "data/arith/train.jsonl").read_text().splitlines()[:64]]
    ids, mask = grpo.left_pad([tokenizer(r, add_special_tokens=False).input_ids for r in rows for _ in range(8)],
                              tokenizer.pad_token_id)
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, max_new_tokens=40,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    times = {"shared": [], "static": [], "copy": []}
    with torch.no_grad():
        for repeat in range(repeats):
            for backend, seconds in times.items():
                torch.manual_seed(repeat)
                start = time.perf_counter()
                grpo.sample(grpo.sampler_copy(model) if backend == "copy" else model, ids, mask, config, backend)
                seconds.append(time.perf_counter() - start)
    medians = {b: statistics.median(t[1:] or t) for b, t in times.items()}
    print(f"CPU, 2 threads, torch {torch.__version__}: 512 completions of up to 40 tokens, medians of {repeats - 1}\n")
    print("| backend | median s | min s | max s | vs shared |")
    print("|---|---|---|---|---|")
    for backend, t in times.items():
        later = t[1:] or t
        print(f"| {backend} | {medians[backend]:.3f} | {min(later):.3f} | {max(later):.3f} | "
              f"{medians[backend] / medians['shared']:.2f}x |")
    return medians


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
