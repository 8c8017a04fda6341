"""reward_model.py's padding cuts on CPU: a step's pairs in length-sorted micro-batches, and evaluation scoring each
distinct text once, shortest first, each against the way before it, in the same process.

    python benchmarks/rm_padding.py                      # data/arith/prefs.jsonl, two threads
    python benchmarks/rm_padding.py --pairs runs/<rm-run>/comparisons.jsonl \
        --eval-pairs runs/<rm-run>/comparisons_test.jsonl  # the pipeline's own comparisons

models/tiny-arith as a reward model, pairs packed (the default). A step: `preference_update` on 128 pairs at
--micro-batch-size 128 (one pass, no sorting) and at 32 and 16 (sorted); median of --repeats steps after 2 warm-ups,
each on the next 128 of the pairs shuffled (seed 0). Evaluation: every text of the held-out pairs in the pairs'
order, 256 a batch (the way before), against `score_sequences`; median of --repeats.
"""
import contextlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import reward_model as rm  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402


@dataclass
class Args:
    pairs: str = str(ROOT / "data/arith/prefs.jsonl")
    """training pairs (prompt, chosen, rejected), e.g. the pipeline's comparisons.jsonl"""
    eval_pairs: str = str(ROOT / "data/arith/prefs_test.jsonl")
    """held-out pairs to score"""
    threads: int = 2
    repeats: int = 10


def median_s(fn, repeats: int, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:])


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(ROOT / "models/tiny-arith")
    model = AutoModelForSequenceClassification.from_pretrained(ROOT / "models/tiny-arith", num_labels=1)
    read = lambda path: [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]  # noqa: E731
    ids = lambda r, y: tok(r["prompt"] + r[y])["input_ids"]  # noqa: E731
    need = 128 * (args.repeats + 2)
    drawn = read(args.pairs)
    random.Random(0).shuffle(drawn)  # a step draws its pairs at random, not a few prompts' rankings in file order
    pairs = [(ids(r, "chosen"), ids(r, "rejected"), 0.0, bool(r.get("tie"))) for r in drawn[:need]]
    if len(pairs) < need:
        sys.exit(f"--pairs has {len(pairs)} pairs; {need} are needed for --repeats {args.repeats}")
    held = [(ids(r, "chosen"), ids(r, "rejected")) for r in read(args.eval_pairs)]
    scorer, opt = rm.PairScorer(model, packed=True), torch.optim.AdamW(model.parameters(), lr=1e-6)
    cfg, cpu, off = rm.Args(batch_size=128), torch.device("cpu"), contextlib.nullcontext()
    print(f"torch {torch.__version__}, {args.threads} threads, models/tiny-arith; {args.pairs}, {args.eval_pairs}\n")
    print("| what | before | after | speed-up |\n|---|---|---|---|")

    def step(micro: int):
        return lambda i: rm.preference_update(scorer, opt, pairs[128 * i : 128 * (i + 1)], micro, cfg, 0, 1, cpu, off)

    one = median_s(step(128), args.repeats)
    for micro in (32, 16):
        t = median_s(step(micro), args.repeats)
        print(f"| a step of 128 pairs, micro-batches of {micro} sorted | {one:.3f} s (one of 128) | {t:.3f} s | "
              f"{one / t:.2f}x |", flush=True)
    rows = [p[0] for p in held] + [p[1] for p in held]

    @torch.no_grad()
    def plain(_):
        model.eval()
        for i in range(0, len(rows), 256):
            rm.sequence_scores(model, *rm.right_pad(rows[i : i + 256], 0))

    before = median_s(plain, args.repeats)
    after = median_s(lambda _: rm.score_sequences(model, rows, 0, cpu, off), args.repeats)
    print(f"| scoring {len(rows)} held-out texts ({len(set(map(tuple, rows)))} distinct) | {before:.3f} s | "
          f"{after:.3f} s | {before / after:.2f}x |")


if __name__ == "__main__":
    main(tyro.cli(Args))
