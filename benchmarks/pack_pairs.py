"""Prefix sharing (--pack-pairs) against two rows a pair, on one CUDA GPU: reward_model.py's and dpo.py's forward+backward.

    python benchmarks/pack_pairs.py          # needs CUDA

A Qwen2.5-0.5B-shaped model (24 layers, 896 wide, 14 heads / 2 KV heads, vocabulary 151,936) built from a config
with random weights, bfloat16 autocast, no gradient checkpointing. Pairs of random token ids: a prompt of about
P tokens (P + up to P/4) shared by both, then two responses that share nothing (about R and R/2..3R/2 tokens); and
the first 64 pairs of data/arith/prefs.jsonl (prompts of ~6 tokens, completions sharing the trace up to the slip).
One forward+backward of the reward model's loss (PairScorer) and of dpo.py's summed log-probs, median of 10 after
3 warm-ups, wall clock with the device synchronised.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import dpo  # noqa: E402
import reward_model as rm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("benchmarks/pack_pairs.py needs a CUDA GPU")
c = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(c).save_pretrained("/tmp/q")
def timeit(fn, n=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
g = torch.Generator().manual_seed(0)
rand = lambda n: torch.randint(2, 150000, (n,), generator=g).tolist()
ac = torch.autocast("cuda", dtype=torch.bfloat16)
rmodel = AutoModelForSequenceClassification.from_pretrained("/tmp/q", num_labels=1).cuda(); rmodel.config.pad_token_id = 0
lm = AutoModelForCausalLM.from_pretrained("/tmp/q").cuda()
tok = AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith")
arith = [json.loads(line) for line in (ROOT / "data/arith/prefs.jsonl").read_text().splitlines()[:64]]
cases = [("data/arith, 64 pairs", [(tok(r["prompt"])["input_ids"], tok(r["chosen"])["input_ids"] + [1],
                                    tok(r["rejected"])["input_ids"] + [1]) for r in arith])]
for B, P, R in ((16, 512, 128), (32, 256, 64), (8, 1024, 256)):
    pairs = []
    for _ in range(B):
        p = rand(P + int(torch.randint(0, P // 4, (1,), generator=g)))
        pairs.append((p, rand(R), rand(R // 2 + int(torch.randint(0, R, (1,), generator=g)))))
    cases.append((f"{B} pairs, prompt ~{P}, responses ~{R}", pairs))
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16 autocast, Qwen2.5-0.5B shape (random)\n")
print("| pairs | reward model: two rows | packed | speed-up | dpo.py: two rows | packed | speed-up | rows (two rows -> packed) |")
print("|---|---|---|---|---|---|---|---|")
for name, dpo_pairs in cases:
    rm_pairs = [(p + c_, p + r_, 0.0) for p, c_, r_ in dpo_pairs]
    out = []
    for packed in (False, True):
        sc = rm.PairScorer(rmodel, packed)
        b = rm.pair_batch(rm_pairs, 0, packed, "cuda")
        def step():
            with ac: s = sc(*b)
            rm.bradley_terry_loss(s[:, 0], s[:, 1]).mean().backward()
        t_rm = timeit(step); rmodel.zero_grad(set_to_none=True)
        fn = dpo.packed_logprobs if packed else dpo.sequence_logprobs
        bd = [t.cuda() for t in (dpo.pack_completions if packed else dpo.collate_completions)(dpo_pairs, 0)]
        def dstep():
            with ac: l = fn(lm, *bd)
            l.sum().backward()
        t_d = timeit(dstep); lm.zero_grad(set_to_none=True)
        out.append((t_rm, t_d, tuple(b[0].shape)))
    (a, d, s0), (a2, d2, s1) = out
    print(f"| {name} | {a:.1f} ms | {a2:.1f} ms | {a / a2:.2f}x | {d:.1f} ms | {d2:.1f} ms | {d / d2:.2f}x | {s0} -> {s1} |",
          flush=True)
