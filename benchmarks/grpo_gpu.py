"""grpo.py, ppo.py or hybrid.py on one CUDA GPU with a Qwen2.5-0.5B-shaped model: where a step's time goes, peak memory.

    python benchmarks/grpo_gpu.py                          # needs CUDA; grpo.py, 6 steps of each setting
    python benchmarks/grpo_gpu.py 6 default shared         # only the settings named (keys of SETTINGS)
    python benchmarks/grpo_gpu.py --script ppo 4 default shared
    python benchmarks/grpo_gpu.py --save-model DIR         # write the model and tokenizer (for grpo_vs_trl.py --model)

The model is built from a config (24 layers, 896 wide, 14 heads / 2 KV heads, vocabulary 151,936, random weights,
no download) with the embedded tokenizer; a random model samples ids the tokenizer does not know, which decode
to nothing, so the reward is mostly 0: this measures speed, not learning. The script's default work (grpo.py: 64
prompts x G = 8 completions of up to 40 tokens) under each setting. The table gives the medians of the script's own
`perf/*_s` (sampling, training, whole step) over the steps after the first (the first compiles and captures), the
sampling share of the step (hybrid.py: its PPO steps only), the mean |sampler - trainer| log-prob of the completion tokens (`train/sampler_gap`) and
torch.cuda.max_memory_allocated.
"""
import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "default": ("default (float32 weights, bf16 autocast; auto: copy)", {}, {}),
    "shared": ("--generation-backend shared (the float32 weights sample)", {"generation_backend": "shared"}, {}),
    "static": ("--generation-backend static (float32 weights, autocast off)", {"generation_backend": "static"}, {}),
    "bf16": ("--dtype bfloat16 --generation-backend shared", {"dtype": "bfloat16", "generation_backend": "shared"}, {}),
    "bf16-static": ("--dtype bfloat16 (auto: static)", {"dtype": "bfloat16"}, {}),
    "fused": ("default, KERNELS_LINEAR=fused", {}, {"KERNELS_LINEAR": "fused"}),
    "checkpointing": ("--gradient-checkpointing", {"gradient_checkpointing": True}, {}),
    "lora": ("--lora-r 16 (auto: copy, adapters merged)", {"lora_r": 16, "learning_rate": 1e-4}, {}),
    "lora-shared": ("--lora-r 16 --generation-backend shared", {"lora_r": 16, "learning_rate": 1e-4,
                                                                 "generation_backend": "shared"}, {}),
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


def main(script: str = "grpo", steps: int = 6, names: tuple[str, ...] = ("default", "shared", "lora")) -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/grpo_gpu.py needs a CUDA GPU")
    module = importlib.import_module(script)
    tmp = tempfile.mkdtemp()
    model_dir = Path(tmp) / "qwen05"
    save_model(model_dir)
    print(f"{script}.py on {torch.cuda.get_device_name()}, torch {torch.__version__}, Qwen2.5-0.5B shape (random), "
          f"{steps} steps\n")
    print("| setting | generate s | train s | step s | sampling share | sampler gap | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for name, extra, env in (SETTINGS[n] for n in names):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out = module.main(module.Args(model_name_or_path=str(model_dir), dataset=str(ROOT / "data/arith"),
                                          output_dir=str(Path(tmp) / "runs"), total_steps=steps, eval_split=None,
                                          log_every=1, **extra))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.update({k: v})
        rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "perf/step_s" in r and not r.get("train/is_sft_step")][1:]  # hybrid: PPO steps
        med = {k: statistics.median([r[k] for r in rows if k in r] or [float("nan")]) for k in (
            "perf/generate_s", "perf/train_s", "perf/step_s", "train/sampler_gap")}
        print(f"| {name} | {med['perf/generate_s']:.3f} | {med['perf/train_s']:.3f} | {med['perf/step_s']:.3f} | "
              f"{med['perf/generate_s'] / med['perf/step_s']:.0%} | {med['train/sampler_gap']:.4f} | "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--save-model"]:
        save_model(Path(argv[1]))
        sys.exit()
    script = "grpo"
    if argv[:1] == ["--script"]:
        script, argv = argv[1], argv[2:]
    if script not in ("grpo", "ppo", "hybrid"):
        sys.exit(f"--script {script}: choose grpo, ppo or hybrid")
    unknown = [n for n in argv[1:] if n not in SETTINGS]
    if unknown:
        sys.exit(f"unknown setting(s) {unknown}: choose from {', '.join(SETTINGS)}")
    main(script, int(argv[0]) if argv else 6, tuple(argv[1:]) or main.__defaults__[2])
