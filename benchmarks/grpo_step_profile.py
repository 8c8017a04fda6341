"""Where grpo.py's step goes on CPU, on the work of benchmarks/grpo_vs_trl.py (models/tiny-arith,
64 completions = 8 prompts x G=8, 40 new tokens, beta 0.04, micro-batches of 32).

    python benchmarks/grpo_step_profile.py              # about 20 s on 2 cores
    python benchmarks/grpo_step_profile.py --compile    # + the policy's pass under torch.compile (~1 min)

Three tables:
1. grpo.py's own per-phase medians (`perf/*_s`) over --steps steps.
2. Sampling: one `generate` call of 64 rows forced to 40 new tokens (min_new_tokens = 40, so every
   call does the same work), wall ms per decoded token, against the same decode step's matmuls
   alone (each nn.Linear of the model, lm_head included, with its own weight and bias, on one
   token for each of the 64 rows: 29 for tiny-arith) and the op shares of
   torch.profiler's self CPU time. If the matmuls are a small share, sampling is bound by per-op
   overhead (Python, dispatch, small elementwise ops), not by arithmetic.
3. Log-probs + backward: the policy's forward + backward and the reference's forward on a real
   sampled batch, split like grpo.py, with FLOPs counted by torch.utils.flop_counter, as GFLOP/s
   against a large float32 matmul (2048^3) measured in the same run: the fraction of this
   machine's reachable matmul rate that this phase gets.

Medians over --repeats calls each; nothing is asserted.
"""

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402


@dataclass
class Args:
    steps: int = 12
    """grpo.py steps for table 1 (the first 2 are dropped as warm-up)"""
    repeats: int = 15
    """timed calls per measurement in tables 2 and 3"""
    threads: int = 2
    """torch threads"""
    compile: bool = False
    """also time the policy's forward + backward with the decoder under torch.compile (inductor, dynamic
    shapes; needs a C++ compiler; the compile itself takes tens of seconds and is reported apart)"""
    model: str = str(ROOT / "models/tiny-arith")
    dataset: str = str(ROOT / "data/arith")


G, PROMPTS, NEW_TOKENS, BETA, MICRO = 8, 8, 40, 0.04, 32


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def phase_table(args: Args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = grpo.main(grpo.Args(
            model_name_or_path=args.model, dataset=args.dataset, output_dir=tmp, eval_split=None, total_steps=args.steps,
            num_generations=G, prompts_per_step=PROMPTS, micro_batch_size=MICRO, max_completion_length=NEW_TOKENS,
            temperature=1.0, beta=BETA, loss_type="dapo", scale_rewards="group", learning_rate=1e-5,
            lr_schedule="constant", warmup_steps=0, save_every=0))
        rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r][2:]
    return {k: [r[f"perf/{k}_s"] for r in rows] for k in ("step", "generate", "score", "train")}


def main(args: Args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if args.steps < 3 or args.repeats < 1:
        raise SystemExit(f"--steps must be >= 3 (the first 2 are warm-up) and --repeats >= 1; got {args.steps}, "
                         f"{args.repeats}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    phases = phase_table(args)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().requires_grad_(False)
    prompts = [json.loads(line)["prompt"] for line in (Path(args.dataset) / "train.jsonl").open()][:PROMPTS]
    ids, mask = grpo.left_pad([tokenizer(p)["input_ids"] for p in prompts for _ in range(G)], tokenizer.pad_token_id)
    forced = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)

    # 2. Sampling: the whole decode step against its matmuls alone.
    def sample():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=forced)

    gen_ms = median_s(sample, args.repeats) * 1e3 / NEW_TOKENS
    # one decode step's matmuls: every nn.Linear of the model (lm_head included), with its own weight and
    # bias, on one token for each of the 64 rows
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(ids.shape[0], m.in_features) for m in linears]

    def decode_matmuls():
        with torch.no_grad():
            for m, x in zip(linears, inputs):
                torch.nn.functional.linear(x, m.weight, m.bias)

    mm_ms = median_s(decode_matmuls, args.repeats * 10) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sample()
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total_us = sum(self_us.values())
    groups = {"matmul (mm, addmm)": ("aten::mm", "aten::addmm"), "attention (sdpa)": ("scaled_dot_product",),
              "concatenation (cat: KV cache, RoPE)": ("aten::cat",),
              "sampling (multinomial, exponential_)": ("aten::multinomial", "aten::exponential_")}
    # self times do not overlap, so an op counted under a parent's name is not counted twice
    shares = {name: sum(us for key, us in self_us.items() if key in names or any(n in key for n in names
                                                                                  if "::" not in n)) / total_us
              for name, names in groups.items()}
    shares["everything else (elementwise, views, copies, ...)"] = 1 - sum(shares.values())

    # 3. Log-probs + backward on a real sampled batch (sampled normally: completions end at EOS).
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    completion = out[:, ids.shape[1]:]
    c_mask, _ = grpo.completion_mask(completion, torch.tensor([tokenizer.eos_token_id]))
    full, attention = torch.cat([ids, completion], dim=1), torch.cat([mask, c_mask.long()], dim=1)
    chunks = [(full[r, first: ids.shape[1] + end], attention[r, first: ids.shape[1] + end], ids.shape[1] - first)
              for r, first, end in grpo.length_sorted_micro_batches(mask, c_mask, MICRO)]

    def policy_fwd_bwd():
        for chunk_ids, chunk_mask, width in chunks:
            logp, entropy = grpo.completion_logprobs(model, chunk_ids, chunk_mask, width, 1.0, with_entropy=True)
            logp.sum().backward()
        model.zero_grad(set_to_none=True)

    def reference_fwd():
        with torch.no_grad():
            for chunk_ids, chunk_mask, width in chunks:
                grpo.completion_logprobs(ref, chunk_ids, chunk_mask, width, 1.0)

    timed = {"policy forward + backward": policy_fwd_bwd, "reference forward": reference_fwd}
    train = {}
    for name, fn in timed.items():
        counter = FlopCounterMode(display=False)
        with counter:
            fn()
        train[name] = (median_s(fn, args.repeats), counter.get_total_flops())
    compile_s = None
    if args.compile:
        model.get_decoder().compile(dynamic=True)
        t0 = time.perf_counter()
        policy_fwd_bwd()
        compile_s = time.perf_counter() - t0
        train["policy forward + backward, torch.compile"] = (median_s(policy_fwd_bwd, args.repeats),
                                                             train["policy forward + backward"][1])
    big = torch.randn(2048, 2048)
    peak = 2 * 2048 ** 3 / median_s(lambda: big @ big, 5)

    print(f"\ngrpo.py step on CPU ({args.threads} threads, torch {torch.__version__}): {PROMPTS} prompts x G={G}, "
          f"{NEW_TOKENS} new tokens, beta {BETA}, micro-batch {MICRO}")
    print("\n| phase (grpo.py's perf/*_s) | median s | share of the summed step time |\n|---|---|---|")
    for k in ("generate", "score", "train", "step"):
        print(f"| {k} | {statistics.median(phases[k]):.3f} | {sum(phases[k]) / sum(phases['step']):.0%} |")
    print(f"\n| sampling, per decoded token (64 rows) | ms |\n|---|---|\n| `generate`, wall | {gen_ms:.2f} |\n"
          f"| its {len(linears)} matmuls alone, wall | {mm_ms:.2f} ({mm_ms / gen_ms:.0%}) |")
    print("\n| `generate`, torch.profiler self CPU time | share |\n|---|---|")
    for name, share in shares.items():
        print(f"| {name} | {share:.0%} |")
    print(f"\n| log-probs + backward (sampled batch: {int(c_mask.sum())} completion tokens, {len(chunks)} micro-batches) "
          f"| s | GFLOP | GFLOP/s | of a 2048^3 matmul's rate |\n|---|---|---|---|---|")
    for name, (s, flops) in train.items():
        print(f"| {name} | {s:.3f} | {flops / 1e9:.2f} | {flops / s / 1e9:.0f} | {flops / s / peak:.0%} |")
    print(f"| 2048^3 float32 matmul | | | {peak / 1e9:.0f} | 100% |")
    if compile_s is not None:
        print(f"\n(torch.compile: the first call, which compiles, took {compile_s:.1f} s)")


if __name__ == "__main__":
    main(tyro.cli(Args))
