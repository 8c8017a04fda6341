"""Generate the embedded arithmetic task `data/arith/` and its character-level tokenizer.

    python data/make_arith.py            # rewrites data/arith/*.jsonl and data/arith/tokenizer/

The task is column arithmetic on 1- to 3-digit integers: `347+589=` -> `936`, `503-47=` -> `456`
(subtraction always has the larger operand first, so answers are never negative). The SFT
completion is a short worked trace, one column at a time from the units, followed by the answer:

    <think>7+9=16,4+8+1=13,3+5+1=9</think><answer>936</answer>
    <think>13-7=6,10-4-1=5,5-1=4</think><answer>456</answer>

Addition columns read `x+y[+1]=s` (`+1` is the carry in). Subtraction columns read `[1]x-y[-1]=d`:
a leading `1` on the top digit is a borrow from the next column, `-1` the borrow paid back. The
answer is the last digit of every column, read from the top column down, with leading zeros
dropped. A small transformer learns the format in a few hundred SFT steps but keeps making carry
and borrow mistakes, which is what leaves room for RL.

Files (JSON lines, DESIGN.md): `train.jsonl`/`test.jsonl` (`prompt`, `answer`), `sft.jsonl`
(`prompt`, `completion`, `answer`) over the train prompts, `prefs.jsonl` (`prompt`, `chosen`,
`rejected`, `answer`): the rejected trace makes one plausible slip (a dropped carry or borrow, or
an off-by-one column) and so ends at a wrong answer. `prefs_test.jsonl`: pairs made the same way on
the test prompts (held out: no prompt of train), for `eval/pref_accuracy` in dpo.py and
reward_model.py. `sft_noisy.jsonl`: the SFT rows with a slip in 40% of them (their completion, and
`answer`, still the true answer), so that demonstrations teach some wrong arithmetic that rewards must
correct (hybrid.py's ablation). `sft_tools.jsonl`: grpo.py --tools' cold start, the SFT rows with 30% of
them calling the calculator instead of working the columns, 40% of those with one miscopied digit in the
call (their answer is then the wrong result; the column `answer` stays true):

    <think><calculator>347+589</calculator><result>936</result></think><answer>936</answer>

The extra files draw from their own random streams, so the four original files are unchanged. Output is
byte-identical for a given seed.

`verify.jsonl` / `verify_test.jsonl` (19,000 / 1,000 rows; the held-out rows on the last 5% of the train problems,
none a test problem): data for a judge (rewards.py's `judge`, docs/judge.md). Each row has a problem (`prompt`), a
candidate `completion`, the reference `answer`, its `kind` and `verdict` (Y for the right trace, about half the rows;
N otherwise) and `judge_prompt`, the judge's input: JUDGE_TEMPLATE filled in. The negatives are those judges are
known to fall for: one slip (20%), a truncated trace (10%), a trace of the right shape with nonsense columns such as
`0+0=0` (10%), an answer tag with no work, right or wrong (10%).
"""

import argparse
import json
import random
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

THINK, END_THINK, ANSWER, END_ANSWER = "<think>", "</think>", "<answer>", "</answer>"
EOS, PAD, UNK = "<|endoftext|>", "<|pad|>", "<|unk|>"
# Every printable ASCII character and newline, so any English prompt can be tokenised.
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
NOISY_FRACTION = 0.4  # share of sft_noisy.jsonl rows whose trace has one slip
# verify*.jsonl: the judge's input (data/rewards/judge_arith.json's template), the share of each kind of candidate
JUDGE_TEMPLATE = "{prompt}{completion}ref:{answer},ok?"
VERDICT_KINDS = {"correct": 0.5, "slip": 0.2, "truncated": 0.1, "nonsense": 0.1, "no_work": 0.1}
TOOL_FRACTION, MISCOPY_FRACTION = 0.3, 0.4  # sft_tools.jsonl: rows that call, calls with a miscopied digit


def sample_problem(rng: random.Random, max_digits: int) -> tuple[int, str, int]:
    """Draw operands whose digit counts are uniform in 1..max_digits; `a >= b` for subtraction."""
    a, b = (rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)
            for d in (rng.randint(1, max_digits), rng.randint(1, max_digits)))
    op = rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    return a, op, b


def column_trace(a: int, op: str, b: int, slip: int | None = None) -> tuple[list[str], str]:
    """Worked trace of `a op b` column by column and the answer it implies.

    `slip` injects one plausible mistake at that column (rejected preference completions): the
    carry or borrow out of it is dropped, or, where there is none, its result is off by one.
    """
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if op == "+":
            s = x + y + carry
            if i == slip and s < 10:
                s += 1
            steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
            digits.append(s % 10)
            carry = int(s >= 10) if i != slip else 0
        else:
            d = x - y - carry
            borrow = int(d < 0)
            if i == slip and not borrow:
                d = max(d - 1, 0) if d > 0 else d + 1
            steps.append(f"{'1' if borrow else ''}{x}-{y}{'-1' if carry else ''}={d + 10 * borrow}")
            digits.append(d + 10 * borrow)
            carry = borrow if i != slip else 0
    top = steps and op == "+" and carry
    answer = (("1" if top else "") + "".join(map(str, digits[::-1]))).lstrip("0") or "0"
    return steps, answer


def completion(steps: list[str], answer: str) -> str:
    return f"{THINK}{','.join(steps)}{END_THINK}{ANSWER}{answer}{END_ANSWER}"


def tool_completion(a: int, op: str, b: int, rng: random.Random, miscopy: bool) -> str:
    """A calculator call and its result as the trace; `miscopy`: one digit of one operand copied wrong."""
    if miscopy:
        which = rng.randrange(2)
        text = str((a, b)[which])
        i = rng.randrange(len(text))
        digit = rng.choice([d for d in "0123456789"[1 if i == 0 and len(text) > 1 else 0:] if d != text[i]])
        a, b = [int(text[:i] + digit + text[i + 1:]) if k == which else x for k, x in enumerate((a, b))]
    value = str(a + b if op == "+" else a - b)
    return f"{THINK}<calculator>{a}{op}{b}</calculator><result>{value}</result>{END_THINK}{ANSWER}{value}{END_ANSWER}"


def candidate(a: int, op: str, b: int, kind: str, rng: random.Random) -> str:
    """A completion of `a op b` of one VERDICT_KINDS kind: the right trace, or a negative that judges are known to
    fall for: one slip (a wrong answer), a truncated trace, a trace of the right shape with nonsense columns (`0+0=0`
    or columns of other digits, and the answer they imply), an answer tag with no work (right or wrong)."""
    steps, answer = column_trace(a, op, b)
    if kind == "correct":
        return completion(steps, answer)
    if kind == "slip":
        slipped = [column_trace(a, op, b, slip=i) for i in range(len(steps))]
        return completion(*rng.choice([(s, wrong) for s, wrong in slipped if wrong != answer]))
    if kind == "truncated":  # cut anywhere before the last tag, never inside a tag
        units = re.findall(r"<[^>]+>|.", completion(steps, answer))
        return "".join(units[: rng.randrange(1, len(units))])
    wrong = str(abs(int(answer) + rng.choice([-10, -1, 1, 10])))
    if kind == "no_work":
        return f"{ANSWER}{rng.choice([answer, wrong])}{END_ANSWER}"
    columns = []
    for _ in range(rng.randint(1, 4)):
        x, y = (0, 0) if rng.random() < 0.5 else sorted((rng.randrange(10), rng.randrange(10)), reverse=op == "-")
        columns.append((f"{x}{op}{y}", x + y if op == "+" else x - y))
    implied = "".join(str(v % 10) for _, v in columns[::-1]).lstrip("0") or "0"
    return completion([f"{c}={v}" for c, v in columns], wrong if implied == answer else implied)


def verification_rows(problems: list, rng: random.Random) -> list[dict]:
    """Rows for a judge: the problem, a candidate, the reference, its kind, the verdict (Y: the right trace) and the
    judge's input (JUDGE_TEMPLATE filled in)."""
    rows = []
    for a, op, b in problems:
        kind = rng.choices(list(VERDICT_KINDS), weights=list(VERDICT_KINDS.values()))[0]
        prompt, answer, text = f"{a}{op}{b}=", str(a + b if op == "+" else a - b), candidate(a, op, b, kind, rng)
        rows.append({"prompt": prompt, "completion": text, "answer": answer, "kind": kind,
                     "verdict": "Y" if kind == "correct" else "N",
                     "judge_prompt": JUDGE_TEMPLATE.format(prompt=prompt, completion=text, answer=answer)})
    return rows


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, the four tags as single tokens."""
    specials = [PAD, EOS, UNK]
    tags = [THINK, END_THINK, ANSWER, END_ANSWER]
    vocab = {tok: i for i, tok in enumerate(specials + tags + CHARS)}
    # A BPE model with no merges splits text into its characters; Fuse joins them back on decode.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(tags)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", model_max_length=512,
    )


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(out: Path, seed: int, n_train: int, n_test: int, n_prefs: int, max_digits: int) -> None:
    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < n_train + n_test:
        a, op, b = sample_problem(rng, max_digits)
        if (a, op, b) not in seen:
            seen.add((a, op, b))
            problems.append((a, op, b))
    test, train = problems[:n_test], problems[n_test:]

    def row(a, op, b):
        return {"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)}

    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", [row(*p) for p in train])
    write_jsonl(out / "test.jsonl", [row(*p) for p in test])
    sft = []
    for p in train:
        steps, answer = column_trace(*p)
        sft.append({**row(*p), "completion": completion(steps, answer)})
    write_jsonl(out / "sft.jsonl", sft)
    prefs = []
    for p in train:
        if len(prefs) == n_prefs:
            break
        good_steps, good = column_trace(*p)
        bad_steps, bad = column_trace(*p, slip=rng.randrange(len(good_steps)))
        if bad != good:
            prefs.append({**row(*p), "chosen": completion(good_steps, good),
                          "rejected": completion(bad_steps, bad)})
    write_jsonl(out / "prefs.jsonl", prefs)
    held_rng = random.Random(seed + 1)
    prefs_test = []
    for p in test:
        good_steps, good = column_trace(*p)
        bad_steps, bad = column_trace(*p, slip=held_rng.randrange(len(good_steps)))
        if bad != good:
            prefs_test.append({**row(*p), "chosen": completion(good_steps, good), "rejected": completion(bad_steps, bad)})
    write_jsonl(out / "prefs_test.jsonl", prefs_test)
    noisy_rng, noisy = random.Random(seed + 2), []
    for r, p in zip(sft, train):
        if noisy_rng.random() < NOISY_FRACTION:
            steps, _ = column_trace(*p)
            r = {**r, "completion": completion(*column_trace(*p, slip=noisy_rng.randrange(len(steps))))}
        noisy.append(r)
    write_jsonl(out / "sft_noisy.jsonl", noisy)
    tool_rng, tools = random.Random(seed + 3), []
    for r, p in zip(sft, train):
        if tool_rng.random() < TOOL_FRACTION:
            r = {**r, "completion": tool_completion(*p, tool_rng, tool_rng.random() < MISCOPY_FRACTION)}
        tools.append(r)
    write_jsonl(out / "sft_tools.jsonl", tools)
    verify_rng, held = random.Random(seed + 4), len(train) // 20
    verify, verify_test = verification_rows(train[:-held], verify_rng), verification_rows(train[-held:], verify_rng)
    write_jsonl(out / "verify.jsonl", verify)
    write_jsonl(out / "verify_test.jsonl", verify_test)
    build_tokenizer().save_pretrained(out / "tokenizer")
    print(f"wrote {len(train)} train, {len(test)} test, {len(sft)} sft ({len(noisy)} noisy, {len(tools)} tools), "
          f"{len(prefs)} prefs, "
          f"{len(prefs_test)} held-out prefs, {len(verify)} + {len(verify_test)} verify rows to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "arith")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--n-prefs", type=int, default=4000)
    parser.add_argument("--max-digits", type=int, default=3)
    a = parser.parse_args()
    main(a.out, a.seed, a.n_train, a.n_test, a.n_prefs, a.max_digits)
