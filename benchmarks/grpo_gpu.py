"""grpo.py on one CUDA GPU with a Qwen2.5-0.5B-shaped model: where a step's time goes, and peak memory.

    python benchmarks/grpo_gpu.py                        # needs CUDA (2 minutes on an H100 before the backend rows)
    python benchmarks/grpo_gpu.py 6 default bf16-static  # only the settings named (keys of SETTINGS)
    python benchmarks/grpo_gpu.py --save-model DIR       # write the model and tokenizer (for grpo_vs_trl.py --model)

The model is built from a config (24 layers, 896 wide, 14 heads / 2 KV heads, vocabulary 151,936, random weights,
no download) with the embedded tokenizer; a random model samples ids the tokenizer does not know, which decode
to nothing, so the reward is mostly 0: this measures speed, not learning. grpo.py's default work (64 prompts x
G = 8 completions of up to 40 tokens, bf16 autocast on CUDA, beta 0) for --steps steps: as is, under each other
--generation-backend (static), with bfloat16 weights (`--dtype bfloat16`, alone and with the
static backend), with --gradient-checkpointing, and with --lora-r 16. The table gives
the medians of grpo.py's own `perf/*_s` (generation, scoring, training, whole step) over the steps after the first
(the first compiles and captures), and torch.cuda.max_memory_allocated.
"""
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402


SETTINGS = {
    "default": ("default (bf16 autocast, --generation-backend shared)", {}),
    "static": ("--generation-backend static", {"generation_backend": "static"}),
    "bf16": ("--dtype bfloat16", {"dtype": "bfloat16"}),
    "bf16-static": ("--dtype bfloat16 --generation-backend static", {"dtype": "bfloat16", "generation_backend": "static"}),
    "checkpointing": ("--gradient-checkpointing", {"gradient_checkpointing": True}),
    "lora": ("--lora-r 16", {"lora_r": 16, "learning_rate": 1e-4}),
}


def save_model(model_dir: Path) -> None:
    """The Qwen2.5-0.5B-shaped model with random weights (seed 0) and the embedded tokenizer, as a model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith").save_pretrained(model_dir)


def main(steps: int = 6, names: tuple[str, ...] = ("default", "static", "checkpointing", "lora")) -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/grpo_gpu.py needs a CUDA GPU")
    tmp = tempfile.mkdtemp()
    model_dir = Path(tmp) / "qwen05"
    save_model(model_dir)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Qwen2.5-0.5B shape (random), {steps} steps\n")
    print("| setting | generate s | score s | train s | step s | peak GB |")
    print("|---|---|---|---|---|---|")
    for name, extra in (SETTINGS[n] for n in names):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        out = grpo.main(grpo.Args(model_name_or_path=str(model_dir), dataset=str(ROOT / "data/arith"),
                                  output_dir=str(Path(tmp) / "runs"), total_steps=steps, eval_split=None, log_every=1,
                                  **extra))
        rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "perf/step_s" in r][1:]
        med = {k: statistics.median(r[f"perf/{k}_s"] for r in rows) for k in ("generate", "score", "train", "step")}
        print(f"| {name} | {med['generate']:.2f} | {med['score']:.3f} | {med['train']:.2f} | {med['step']:.2f} | "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--save-model"]:
        save_model(Path(sys.argv[2]))
    else:
        unknown = [n for n in sys.argv[2:] if n not in SETTINGS]
        if unknown:
            sys.exit(f"unknown setting(s) {unknown}: choose from {', '.join(SETTINGS)}")
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 6, tuple(sys.argv[2:]) or main.__defaults__[1])
