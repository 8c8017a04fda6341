"""The embedded task: deterministic generation, correct traces, a tokenizer that round-trips it."""
import json
import random
import re
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))
import make_arith  # noqa: E402

SPLITS = ("train", "test", "sft", "prefs", "prefs_test", "sft_noisy", "verify", "verify_test")


def test_generation_reproduces_committed_files(tmp_path):
    make_arith.main(tmp_path, seed=1234, n_train=20000, n_test=500, n_prefs=4000, max_digits=3)
    for split in SPLITS:
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (ROOT / "data/arith" / f"{split}.jsonl").read_bytes()
    assert json.loads((tmp_path / "tokenizer/tokenizer.json").read_text())["model"]["vocab"] == \
        json.loads((ROOT / "data/arith/tokenizer/tokenizer.json").read_text())["model"]["vocab"]


def test_seed_decides_the_data(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        make_arith.main(tmp_path / name, seed=seed, n_train=50, n_test=10, n_prefs=10, max_digits=3)
    read = lambda name: (tmp_path / name / "sft.jsonl").read_text().splitlines()  # noqa: E731
    assert read("a") == read("b")
    assert sum(x != y for x, y in zip(read("a"), read("c"))) > 40


@pytest.mark.parametrize("a,op,b,steps,answer", [
    (347, "+", 589, ["7+9=16", "4+8+1=13", "3+5+1=9"], "936"),
    (999, "+", 1, ["9+1=10", "9+0+1=10", "9+0+1=10"], "1000"),
    (503, "-", 47, ["13-7=6", "10-4-1=5", "5-0-1=4"], "456"),
    (500, "-", 499, ["10-9=1", "10-9-1=0", "5-4-1=0"], "1"),
    (7, "-", 7, ["7-7=0"], "0"),
])
def test_column_trace_hand_examples(a, op, b, steps, answer):
    assert make_arith.column_trace(a, op, b) == (steps, answer)


def test_traces_and_slips_against_python_arithmetic():
    rng = random.Random(0)
    for _ in range(2000):
        a, op, b = make_arith.sample_problem(rng, 3)
        truth = a + b if op == "+" else a - b
        steps, answer = make_arith.column_trace(a, op, b)
        assert int(answer) == truth and truth >= 0
        slipped = {make_arith.column_trace(a, op, b, slip=i)[1] for i in range(len(steps))}
        assert any(s != answer for s in slipped)


def test_files_are_consistent():
    rows = {s: [json.loads(line) for line in (ROOT / f"data/arith/{s}.jsonl").open()] for s in SPLITS}
    assert len(rows["train"]) == len(rows["sft"]) == 20000 and len(rows["test"]) == 500
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["test"]}
    for r in rows["sft"]:
        assert r["completion"].endswith(f"<answer>{r['answer']}</answer>")
    for r in rows["prefs"] + rows["prefs_test"]:
        assert r["chosen"].endswith(f"<answer>{r['answer']}</answer>")
        assert not r["rejected"].endswith(f"<answer>{r['answer']}</answer>")
    # held-out pairs are on the test prompts only
    assert {r["prompt"] for r in rows["prefs_test"]} <= {r["prompt"] for r in rows["test"]}
    assert len(rows["prefs_test"]) >= 450
    # the noisy SFT split: same prompts and answers, a slip (a wrong final answer) in about 40% of the rows
    assert [(r["prompt"], r["answer"]) for r in rows["sft_noisy"]] == [(r["prompt"], r["answer"]) for r in rows["sft"]]
    wrong = sum(not r["completion"].endswith(f"<answer>{r['answer']}</answer>") for r in rows["sft_noisy"])
    assert 0.35 < wrong / len(rows["sft_noisy"]) < 0.45


def test_tokenizer_round_trips_every_character():
    tok = AutoTokenizer.from_pretrained(ROOT / "data/arith/tokenizer")
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and tok.padding_side == "left"
    texts = [r["prompt"] + r["completion"] for r in map(json.loads, (ROOT / "data/arith/sft.jsonl").open())]
    texts += [r["rejected"] for r in map(json.loads, (ROOT / "data/arith/prefs.jsonl").open())]
    texts.append("".join(make_arith.CHARS))
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    assert all(tok.unk_token_id not in ids for ids in encoded)
    assert tok.batch_decode(encoded) == texts
    # The four tags are single tokens: 6 characters + 4 tags.
    assert len(tok("<think>1+1=2</think><answer>2</answer>", add_special_tokens=False)["input_ids"]) == 10


def test_verification_rows_are_balanced_labelled_and_held_out():
    """verify*.jsonl: Y exactly for the right trace, about half the rows; each negative of its kind; the judge's input
    is data/rewards/judge_arith.json's template filled in; held-out problems are neither test nor verify problems."""
    rows = {s: [json.loads(line) for line in (ROOT / f"data/arith/{s}.jsonl").open()] for s in ("verify", "verify_test",
                                                                                                  "test")}
    spec = json.loads((ROOT / "data/rewards/judge_arith.json").read_text())["components"][0]
    assert spec["template"] == make_arith.JUDGE_TEMPLATE and set(spec["choices"]) == {"Y", "N"}
    assert (len(rows["verify"]), len(rows["verify_test"])) == (19000, 1000)
    problems = {s: {r["prompt"] for r in rows[s]} for s in rows}
    assert not problems["verify_test"] & problems["test"] and not problems["verify"] & problems["test"]
    assert not problems["verify_test"] & problems["verify"]
    for r in rows["verify"] + rows["verify_test"]:
        assert r["judge_prompt"] == spec["template"].format(**r)
        assert r["verdict"] == ("Y" if r["kind"] == "correct" else "N")
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", r["prompt"]).groups()
        assert r["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        right = make_arith.completion(*make_arith.column_trace(int(a), op, int(b)))
        tagged = re.fullmatch(r"(?:<think>(.*)</think>)?<answer>(\d+)</answer>", r["completion"])
        if r["kind"] == "correct":
            assert r["completion"] == right
        elif r["kind"] == "truncated":
            assert right.startswith(r["completion"]) and r["completion"] != right and "</answer>" not in r["completion"]
        elif r["kind"] == "no_work":
            assert tagged and tagged.group(1) is None
        else:  # slip and nonsense: a trace of the right shape ending at a wrong answer
            assert tagged and tagged.group(1) and tagged.group(2) != r["answer"]
            columns = tagged.group(1).split(",")
            assert all(re.fullmatch(rf"1?\d{re.escape(op)}\d(?:{re.escape(op)}1)?=\d+", c) for c in columns)
    for split in ("verify", "verify_test"):
        kinds = [r["kind"] for r in rows[split]]
        assert 0.45 < kinds.count("correct") / len(kinds) < 0.55
        assert {k: kinds.count(k) > 0.05 * len(kinds) for k in make_arith.VERDICT_KINDS} == dict.fromkeys(
            make_arith.VERDICT_KINDS, True)
    assert any(r["completion"].startswith("<think>0+0=0") for r in rows["verify"] if r["kind"] == "nonsense")
