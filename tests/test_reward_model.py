"""reward_model.py: the Bradley-Terry loss against hand-computed numbers, the score read at the last real token
whatever the padding side, packed pairs, runs, learning on the embedded task, the saved model loaded both ways
(transformers and the `reward_model` reward of rewards.py, whitened), its own bad input (the shared run plumbing:
tests/test_lifecycle.py)."""
import contextlib
import itertools
import json
import math
import re
import shlex
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, train_rows
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

import reward_model as rm
from rewards import answers_match, extract_answer, make_reward

ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tiny, tmp_path, **kw) -> rm.Args:
    base = rm.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                   total_steps=2, batch_size=2, eval_limit=8, eval_every=0, warmup_steps=0, learning_rate=3e-3,
                   log_every=1)
    return replace(base, **kw)


def benchmark(name: str):
    """A script of benchmarks/, imported as a module."""
    import importlib
    import sys

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- pure functions


def test_preference_loss_hand_computed():
    chosen, rejected = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([1.0, 1.5, -1.0])
    # differences 1, -1, 0: -log sigmoid(d) = log(1 + e^-d) = 0.3132617, 1.3132617, log 2
    plain = rm.bradley_terry_loss(chosen, rejected)
    assert plain.tolist() == pytest.approx([0.3132617, 1.3132617, 0.6931472], abs=1e-6)
    # margins 0.5, 0, 1 -> differences 0.5, -1, -1: log(1 + e^-0.5) = 0.4740770
    margin = rm.bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.5, 0.0, 1.0]))
    assert margin.tolist() == pytest.approx([0.4740770, 1.3132617, 1.3132617], abs=1e-6)
    # centring 0.01 * (r_c + r_r)^2: sums 3, 2, -2 -> + 0.09, 0.04, 0.04
    both = rm.bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.5, 0.0, 1.0]), center_coef=0.01)
    assert both.tolist() == pytest.approx([0.5640770, 1.3532617, 1.3532617], abs=1e-6)
    # gradient of the plain loss w.r.t. r_c is -sigmoid(-d): -0.2689414 at d = 1
    c = chosen.clone().requires_grad_()
    rm.bradley_terry_loss(c, rejected)[0].backward()
    assert c.grad.tolist() == pytest.approx([-0.2689414, 0.0, 0.0], abs=1e-6)


def test_tokenize_pairs_drops_long_pairs_and_refuses_identical_ones():
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-arith")
    pairs, dropped = rm.tokenize_pairs(tok, ["1+1=", "2+2="], ["<answer>2</answer>", "<answer>4</answer>" * 9],
                                       ["<answer>3</answer>", "<answer>5</answer>"], None, 20, "split 'x'")
    assert dropped == 1 and len(pairs) == 1
    assert pairs[0][0] == tok("1+1=<answer>2</answer>")["input_ids"] and pairs[0][2] == 0.0
    with pytest.raises(ValueError, match=r"split 'x', row 1: chosen and rejected are the same text"):
        rm.tokenize_pairs(tok, ["1+1=", "2+2="], ["a", "4"], ["b", "4"], None, 20, "split 'x'")


def test_ranking_to_pairs_and_its_weights_hand_computed():
    # a labeler's scores of K = 4 responses: 0 and 2 tie (correct), 1 and 3 tie (wrong): 2 x 2 pairs, ties dropped
    assert rm.ranking_pairs([1.0, -0.5, 1.0, -0.5]) == [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert rm.ranking_pairs([0.0, 2.0, 1.0]) == [(1, 0), (2, 0), (1, 2)] and rm.ranking_pairs([1.0, 1.0]) == []
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-arith")
    # ranking "a" of K = 4 (the four pairs above, responses y0..y3), ranking "b" of K = 2; y3 of "a" is too long
    ys = ["<answer>1", "<answer>2", "<answer>3", "<answer>9" * 9]
    rows = [(ys[c], ys[r]) for c, r in rm.ranking_pairs([1.0, -0.5, 1.0, -0.5])] + [("4", "5")]
    rankings, dropped = rm.tokenize_rankings(tok, ["1+0="] * 4 + ["2+2="], [c for c, _ in rows], [r for _, r in rows],
                                             ["a"] * 4 + ["b"], [4] * 4 + [2], 12, "split 'x'")
    assert dropped == 2 and len(rankings) == 2
    (texts_a, pairs_a, w_a), (texts_b, pairs_b, w_b) = rankings
    assert texts_a == [tok("1+0=" + y)["input_ids"] for y in ys[:3]]  # y0, y1, y2: each text once
    assert pairs_a == [(0, 1, False), (2, 1, False)] and w_a == pytest.approx(1 / 6)  # 1 / C(4, 2); no tie
    assert texts_b == [tok("2+2=4")["input_ids"], tok("2+2=5")["input_ids"]] and pairs_b == [(0, 1, False)]
    assert w_b == 1.0
    # the step's loss: each ranking's pairs weighted 1 / C(K,2), summed, over the batch of 2 rankings (Eq. 1);
    # a stand-in scorer reads each text's score off a table at its last token: y0 2.0, y1 0.0, y2 1.0; b: 0.5, 1.5
    table = torch.nn.Parameter(torch.zeros(tok.vocab_size))
    with torch.no_grad():
        for texts, score in ((texts_a, [2.0, 0.0, 1.0]), (texts_b, [0.5, 1.5])):
            for t, v in zip(texts, score):
                table[t[-1]] = v

    class Scorer(torch.nn.Module):
        packed = False

        def forward(self, ids, mask, flat=False):
            return table[ids.gather(1, (mask.sum(1, keepdim=True) - 1))[:, 0]]

    assert len({t[-1] for t in texts_a + texts_b}) == 5  # every text ends in its own token
    args = rm.Args(batch_size=2)
    optimizer = torch.optim.SGD([table], lr=0.0)
    sums, _ = rm.preference_update(Scorer(), optimizer, rankings, 2, args, 0, 1, "cpu", contextlib.nullcontext(),
                                   rankings=True)
    # -log sigmoid(d) = log(1 + e^-d): d = 2 -> 0.1269280, d = 1 -> 0.3132617, d = -1 -> 1.3132617
    expected = ((0.1269280 + 0.3132617) / 6 + 1.3132617) / 2
    assert sums["loss"] == pytest.approx(expected, abs=1e-6)
    assert (sums["pairs"], sums["correct"], sums["texts"]) == (3, 2, 5)


def test_davidson_ties_hand_computed():
    """Davidson (1970) in strengths e^r, computed by hand (float64 probabilities, then -log): nu = 1, r = (2, 1):
    P(win) = e^2 / (e^2 + e + e^1.5), P(tie) = e^1.5 / (the same); nu = 0 is Bradley-Terry; in a step, a tie's loss
    counts and its pair does not count towards the accuracy."""
    chosen, rejected = torch.tensor([2.0, 0.5, -1.0, 2.0]), torch.tensor([1.0, 1.5, -1.0, 1.0])
    tie = torch.tensor([False, False, False, True])
    assert rm.bradley_terry_loss(chosen, rejected, tie=tie, nu=1.0).tolist() == pytest.approx(
        [0.6802697, 1.6802697, 1.0986123, 1.1802697], abs=1e-6)  # the tie at d = 1 costs -log(e^1.5 / 11.0)
    assert rm.bradley_terry_loss(chosen, rejected, tie=tie, nu=0.5).tolist()[::3] == pytest.approx(
        [0.5135089, 1.7066561], abs=1e-6)
    assert rm.bradley_terry_loss(chosen, rejected, tie=tie, nu=0.0).tolist() == pytest.approx(
        rm.bradley_terry_loss(chosen, rejected).tolist())  # nu = 0: no tie term, Bradley-Terry
    # gradients w.r.t. r_c at d = 1: a win -(e^-1 + e^-0.5 / 2) / (1 + e^-1 + e^-0.5), a tie sinh(1/2) / (2 cosh(1/2) + 1)
    c = chosen.clone().requires_grad_()
    rm.bradley_terry_loss(c, rejected, tie=tie, nu=1.0)[[0, 3]].sum().backward()
    assert c.grad[[0, 3]].tolist() == pytest.approx([-0.3399217, 0.1600783], abs=1e-6)  # the tie pulls d back to 0
    assert rm.tied_pairs([1.0, -0.5, 1.0, -0.5, 2.0], ["a", "b", "c", "b", "d"]) == [(0, 2)]  # 1, 3: the same text
    # one step on two pairs, a preference (d = 1) and a tie (d = 1), through plain rows and a stand-in scorer
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-arith")
    texts = [tok(x)["input_ids"] for x in ("1+1=2", "1+1=3", "2+2=4", "2+2=5")]
    table = torch.nn.Parameter(torch.zeros(tok.vocab_size))
    with torch.no_grad():
        table[[t[-1] for t in texts]] = torch.tensor([2.0, 1.0, 2.0, 1.0])

    class Scorer(torch.nn.Module):
        packed = False

        def forward(self, ids, mask):
            return table[ids.gather(1, (mask.sum(1, keepdim=True) - 1))[:, 0]].view(2, -1).T

    pairs = [(texts[0], texts[1], 0.0, False), (texts[2], texts[3], 0.0, True)]
    for nu, loss in ((1.0, (0.6802697 + 1.1802697) / 2), (0.0, 0.3132617 / 2)):  # nu = 0: the tie adds nothing
        sums, _ = rm.preference_update(Scorer(), torch.optim.SGD([table], lr=0.0), pairs, 2, rm.Args(batch_size=2,
                                       tie_strength=1.0), 0, 1, "cpu", contextlib.nullcontext(), nu=nu)
        assert sums["loss"] == pytest.approx(loss, abs=1e-6)  # log(1 + e^-1) = 0.3132617
        assert (sums["pairs"], sums["correct"], sums["texts"]) == (1, 1, 4)


@pytest.mark.parametrize("rankings", [False, True])
def test_ties_train_only_after_the_tie_start_step(tmp_path, monkeypatch, capsys, rankings):
    """--comparisons --tie-strength 1 --tie-start-step 2: steps 1-2 are Bradley-Terry (nu = 0; as independent pairs
    with --no-comparison-rankings, no tie is even drawn), steps 3-4 train the ties (nu = 1, ties in the batches)."""
    seen, update = [], rm.preference_update

    def spy(scorer, optimizer, items, *rest):
        flags = [t for _, pairs, _ in items for _, _, t in pairs] if rankings else [p[3] for p in items]
        seen.append((sum(flags), rest[-1], rest[-2]))  # (ties drawn, nu, rankings)
        return update(scorer, optimizer, items, *rest)

    monkeypatch.setattr(rm, "preference_update", spy)
    rm.main(rm.Args(comparisons=4, comparison_prompts=24, dataset_split="train", tie_strength=1.0, tie_start_step=2,
                    comparison_rankings=rankings, output_dir=str(tmp_path), total_steps=4, batch_size=8, eval_limit=8,
                    eval_every=0, warmup_steps=0))
    assert f" training {'rankings' if rankings else 'pairs'}," in capsys.readouterr().out
    assert [nu for _, nu, _ in seen] == [0.0, 0.0, 1.0, 1.0] and {r for _, _, r in seen} == {rankings}
    assert all(n == 0 for n, _, _ in seen[:2]) != rankings and all(n > 0 for n, _, _ in seen[2:])


def test_comparisons_with_ties_write_and_train_them(tmp_path, capsys):
    """--comparisons 4 --tie-strength 1 from models/tiny-arith: every pair of different texts of a prompt is a row,
    a right over a wrong answer (tie false) or two answers both right or both wrong (tie true); the held-out file has
    no ties; the file then trains as independent pairs with its ties (the recipe of the docs), and without
    --tie-strength as Bradley-Terry pairs, its ties left out."""
    out = rm.main(rm.Args(comparisons=4, comparison_prompts=24, dataset_split="train", tie_strength=1.0,
                          output_dir=str(tmp_path / "rm"), total_steps=2, batch_size=4, eval_limit=8, eval_every=0,
                          warmup_steps=0))
    run = Path(out["run_dir"])
    rows = read_jsonl(run / "comparisons.jsonl")
    assert {r["tie"] for r in rows} == {False, True}
    assert all("tie" not in r for r in read_jsonl(run / "comparisons_test.jsonl"))
    for r in rows:
        right = [answers_match(extract_answer(r[c]), r["answer"]) for c in ("chosen", "rejected")]
        assert r["chosen"] != r["rejected"] and (right[0] == right[1] if r["tie"] else right == [True, False])
    for key in {r["ranking"] for r in rows}:  # at most C(4, 2) pairs, every two different texts among them
        mine = [{r["chosen"], r["rejected"]} for r in rows if r["ranking"] == key]
        texts = set().union(*mine)
        assert len(mine) <= 6 and {frozenset(m) for m in mine} == {frozenset(p) for p in itertools.combinations(texts, 2)}
    rm_calibration = benchmark("rm_calibration")  # reads a file with ties: their texts are neither right nor wrong

    scored = rm_calibration.main(rm_calibration.Args(reward_model=str(run / "final"),
                                                     comparisons=str(run / "comparisons.jsonl")))
    preferences = [r for r in rows if not r["tie"]]
    assert {k: (set(ok), set(bad)) for k, (ok, bad) in scored.items()} == {
        k: ({r["chosen"] for r in preferences if r["ranking"] == k}, {r["rejected"] for r in preferences
                                                                     if r["ranking"] == k})
        for k in {r["ranking"] for r in preferences}}
    again = rm.main(rm.Args(dataset=str(run), dataset_split="comparisons", eval_split="comparisons_test",
                            tie_strength=1.0, output_dir=str(tmp_path / "pairs"), total_steps=2, batch_size=8,
                            eval_limit=8, eval_every=0, warmup_steps=0, log_every=1))
    assert all(math.isfinite(r["train/loss"]) for r in train_rows(again["run_dir"]))
    capsys.readouterr()
    rm.main(rm.Args(dataset=str(run), dataset_split="comparisons", eval_split=None, total_steps=1,
                    output_dir=str(tmp_path / "bt"), batch_size=4, warmup_steps=0))  # Bradley-Terry: the ties left out
    assert f" {sum(not r['tie'] for r in rows)} training pairs," in capsys.readouterr().out


def test_comparisons_leave_out_texts_the_tokenizer_makes_one(tmp_path, monkeypatch):
    """A policy sampled "= 4" where the tokenizer reads "=4" (the same token ids): to the reward model the two are one
    text, so no preference or tie of them is written (such a row is refused, and it stopped a run). Samples a, b, b,
    c with labeler scores 1, 1, 0, 0, a and b one text: rows a > c, b > c and the tie b ~ c, nothing else."""
    a, b = "<think>8+6=14,0+3+1= 4</think><answer>44</answer>", "<think>8+6=14,0+3+1=4</think><answer>44</answer>"
    c = "<think>8+6=14,0+3+1=5</think><answer>54</answer>"
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-arith")
    assert tok("1+2=" + a)["input_ids"] == tok("1+2=" + b)["input_ids"]
    monkeypatch.setattr(type(tok), "batch_decode", lambda self, ids, **kw: [a, b, b, c] * (len(ids) // 4))
    labeler = rm.make_reward("correctness")
    fake = type("Fake", (), {"required_columns": labeler.required_columns,
                             "__call__": lambda self, ys, **kw: [1.0, 1.0, 0.0, 0.0]})
    monkeypatch.setattr(rm, "make_reward", lambda spec: fake())
    out = rm.main(rm.Args(comparisons=4, comparison_prompts=4, dataset_split="train", tie_strength=1.0,
                          output_dir=str(tmp_path), total_steps=1, batch_size=2, eval_limit=8, eval_every=0,
                          warmup_steps=0))
    rows = read_jsonl(Path(out["run_dir"]) / "comparisons.jsonl")
    assert [(r["chosen"], r["rejected"], r["tie"]) for r in rows] == [(a, c, False), (b, c, False), (b, c, True)] * 4


def tiny_classifier(tiny, arch: str):
    torch.manual_seed(0)
    if arch == "qwen2":
        model = AutoModelForSequenceClassification.from_pretrained(tiny / "model", num_labels=1)
        rm.init_score_head(model, {"score.weight"})
    else:  # learned absolute positions: left padding would shift them without the position ids
        model = GPT2ForSequenceClassification(GPT2Config(vocab_size=103, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                                         pad_token_id=0, eos_token_id=1, num_labels=1))
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_score_is_read_at_the_last_real_token_whatever_the_padding_side(tiny, arch):
    model = tiny_classifier(tiny, arch)
    rows = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 1]]  # the last ends in EOS (id 1), a real token
    with torch.no_grad():
        alone = torch.cat([rm.sequence_scores(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))
                           for r in rows])
        right = rm.sequence_scores(model, *rm.right_pad(rows, pad_id=0))
        width = max(map(len, rows))
        left_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        left = rm.sequence_scores(model, left_ids, (left_ids != 0).long())
        # independent reference: the last hidden state of each unpadded sequence through the score head
        hidden = [model.base_model(input_ids=torch.tensor([r])).last_hidden_state[0, -1] for r in rows]
        want = torch.stack([model.score(h)[0] for h in hidden])
    assert torch.allclose(alone, want, atol=1e-5)
    assert torch.allclose(right, want, atol=1e-5) and torch.allclose(left, want, atol=1e-5)
    assert want.std() > 1e-3  # the sequences do get different scores


def test_score_sequences_scores_each_distinct_text_once_in_length_order(tiny, monkeypatch):
    """Evaluation and the reward statistics: duplicates are scored once and the batches go in length order (less
    padding), yet each row gets its own text's score, in the rows' order."""
    model, original, shapes = tiny_classifier(tiny, "qwen2"), rm.sequence_scores, []
    monkeypatch.setattr(rm, "sequence_scores", lambda m, ids, mask: shapes.append(tuple(ids.shape))
                        or original(m, ids, mask))
    rows = [[5, 6, 7, 8, 9, 10], [11, 12], [5, 6, 7, 8, 9, 10], [13, 14, 15, 1], [11, 12]]
    got = rm.score_sequences(model, rows, 0, torch.device("cpu"), contextlib.nullcontext(), batch_size=2)
    assert shapes == [(2, 4), (1, 6)]  # 3 distinct texts: the two shorter together, then the longest
    with torch.no_grad():
        alone = torch.cat([original(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long)) for r in rows])
    assert torch.allclose(got, alone, atol=1e-5) and alone.std() > 1e-3


def test_micro_batches_are_length_sorted(tiny, monkeypatch):
    """4 packed pairs, 2 a micro-batch: the two short rows go together, then the two long ones (widths 3 and 8, not
    8 and 8 in the drawn order). That the sum of the micro-batches is the batch's update:
    test_micro_batches_give_the_same_update."""
    model, original, widths = tiny_classifier(tiny, "qwen2").train(), rm.pack_texts, []
    monkeypatch.setattr(rm, "pack_texts", lambda pairs, pad_id: widths.append(original(pairs, pad_id)[0].shape[1])
                        or original(pairs, pad_id))
    pairs = [([5, 6, 7, 8, 9, 10, 11], [5, 6, 12], 0.0, False),  # packed: 7 + 1 tokens
             ([5, 6], [5, 7], 0.0, False),                       # 2 + 1
             ([5, 6, 7, 8, 9, 10, 12], [5, 13], 0.0, False),     # 7 + 1
             ([5, 8], [5, 9], 0.0, False)]                       # 2 + 1
    args = rm.Args(batch_size=4)
    sums, _ = rm.preference_update(rm.PairScorer(model, packed=True), torch.optim.SGD(model.parameters(), lr=0.0),
                                   pairs, 2, args, 0, 1, torch.device("cpu"), contextlib.nullcontext())
    assert widths == [3, 8] and sums["pairs"] == 4


def test_pack_pairs_layout_hand_checked():
    """Row = chosen + the rejected tokens after the shared prefix; the rejected tail sees the prefix and itself,
    with positions continuing from the prefix; the ends are the two texts' last tokens."""
    pairs = [([5, 6, 7, 8], [5, 6, 9], 0.5),  # shared prefix 2: row 5 6 7 8 9
             ([5, 6], [5, 6, 7], 0.0),        # chosen is a prefix of rejected: row 5 6 7
             ([5, 6, 7], [5, 6], 0.0),        # rejected is a prefix of chosen: it ends inside the prefix
             ([4], [3, 2], 1.0)]              # nothing shared: row 4 3 2
    ids, allowed, position_ids, ends = rm.pack_texts(pairs, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0], [5, 6, 7, 0, 0], [4, 3, 2, 0, 0]]
    assert position_ids[:, :3].tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 0, 1]]
    assert position_ids[0].tolist() == [0, 1, 2, 3, 2]
    assert ends.tolist() == [[3, 4], [1, 2], [2, 1], [0, 2]]
    seen = lambda b, q: [k for k in range(5) if allowed[b, q, k]]  # noqa: E731
    assert seen(0, 3) == [0, 1, 2, 3] and seen(0, 4) == [0, 1, 4]  # the tail 9 does not see 7 8
    assert seen(1, 2) == [0, 1, 2] and seen(3, 1) == [1] and seen(3, 2) == [1, 2]  # 3 2 do not see 4
    assert all(allowed[b, q, q] for b in range(4) for q in range(5))  # no row of the mask is empty


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("qwen2", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager")])
def test_packed_pairs_give_the_scores_and_gradients_of_separate_sequences(tiny, arch, attn):
    """The packed forward against each text scored alone (no padding, no custom mask), and its gradient against
    the plain padded forward's, with rotary (Qwen2) and learned absolute (GPT-2) positions, on sdpa's boolean
    mask and eager attention's additive one."""
    model = tiny_classifier(tiny, arch)
    model.config._attn_implementation = attn
    pairs = [([5, 6, 7, 8, 9, 10], [5, 6, 7, 11], 0.0), ([5, 12], [5, 12, 13, 14, 15], 0.0),
             ([16, 17, 18], [16, 17], 0.0), ([19, 20], [21, 22, 23], 0.0), ([7, 8, 9, 1], [7, 8, 9, 2], 0.0)]
    with torch.no_grad():
        alone = torch.tensor([[model.score(model.base_model(input_ids=torch.tensor([t])).last_hidden_state[0, -1])[0]
                               for t in (c, r)] for c, r, _ in pairs])
        ids, allowed, position_ids, ends = rm.pack_texts(pairs, pad_id=0)
        packed = rm.PairScorer(model, packed=True)(ids, allowed, position_ids, ends)
    assert torch.allclose(packed, alone, atol=1e-5) and alone.std() > 1e-3

    def grads(packed: bool):
        model.zero_grad()
        scores = rm.PairScorer(model, packed)(*rm.pair_batch(pairs, 0, packed, "cpu"))
        rm.bradley_terry_loss(scores[:, 0], scores[:, 1], center_coef=0.1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, packed_grads = grads(False), grads(True)
    assert plain.keys() == packed_grads.keys()
    assert all(torch.allclose(packed_grads[n], plain[n], atol=1e-6, rtol=1e-4) for n in plain)
    packing = SimpleNamespace(args=SimpleNamespace(pack_pairs=True), say=pytest.fail)  # a notice fails the test
    assert rm.use_packing(packing, model, lambda p: rm.PairScorer(model, p)(*rm.pair_batch(pairs, 0, p, "cpu")))


def test_a_model_that_cannot_take_the_packed_mask_is_scored_unpacked(tiny, tmp_path, monkeypatch, capsys):
    """A packed forward whose scores are wrong (here: the mask ignored, as an attention implementation without
    custom masks would) is caught by the check at start; the run then scores the texts in rows of their own and
    trains exactly as --no-pack-pairs."""
    def ignore_the_mask(pairs, pad_id):
        ids, allowed, *rest = PACK(pairs, pad_id)
        return (ids, torch.ones_like(allowed).tril(), *rest)

    PACK = rm.pack_texts
    plain = rm.main(tiny_args(tiny, tmp_path / "plain", pack_pairs=False, eval_split=None))
    assert "packed in one row each" not in capsys.readouterr().out
    monkeypatch.setattr(rm, "pack_texts", ignore_the_mask)
    model = AutoModelForSequenceClassification.from_pretrained(tiny / "model", num_labels=1)
    pairs = rm.tokenize_pairs(AutoTokenizer.from_pretrained(tiny / "model"), ["1+1=", "2+2="],
                              ["<answer>2</answer>"] * 2, ["<answer>3</answer>"] * 2, None, 64, "x")[0]
    said = []
    packing = SimpleNamespace(args=SimpleNamespace(pack_pairs=True), say=said.append)
    assert not rm.use_packing(packing, model, lambda p: rm.PairScorer(model, p)(*rm.pair_batch(pairs, 0, p, "cpu")))
    assert len(said) == 1 and "differ from its plain ones" in said[0]
    fallback = rm.main(tiny_args(tiny, tmp_path / "fallback", eval_split=None))
    assert "--pack-pairs: chosen and rejected in rows of their own" in capsys.readouterr().out
    assert fallback["train/loss"] == plain["train/loss"] and fallback["train/grad_norm"] == plain["train/grad_norm"]


def test_score_head_init_scale(tiny):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny / "model", num_labels=1)
    assert rm.init_score_head(model, {"score.weight"}) == ["score.weight"]
    # H = 32: std 1 / sqrt(33) = 0.174 (HF's own init: 0.02)
    assert model.score.weight.std().item() == pytest.approx(1 / math.sqrt(33), rel=0.3)


# ----------------------------------------------------------------------------- runs


def test_few_step_lora_run_and_the_saved_model_loads_both_ways(tiny, tmp_path, capsys):
    """A LoRA run (the score head trained in full) whose final/ is a plain, merged classifier, and whose last lines
    give ppo.py the score statistics saved in final/config.json."""
    out = rm.main(tiny_args(tiny, tmp_path / "runs", total_steps=3, save_every=2, micro_batch_size=1,
                            center_rewards_coef=0.01, track=True, lora_r=4, learning_rate=5e-2))
    run = Path(out["run_dir"])
    assert json.loads((run / "args.json").read_text())["center_rewards_coef"] == 0.01
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("train/loss", "train/accuracy", "train/margin", "train/reward", "train/grad_norm", "perf/step_s",
                "perf/tokens_per_s"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(r["train/accuracy"] in (0.0, 0.5, 1.0) for r in rows)
    evals = [r for r in read_metrics(run) if "eval/pref_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and all(math.isfinite(r["eval/margin"]) for r in evals)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last", "step_2", "step_3"]
    assert list((run / "wandb").rglob("*.wandb"))

    # transformers: the classifier, with the score statistics of the training prompts' chosen completions
    final = run / "final"
    weights, base = load_file(final / "model.safetensors"), load_file(tiny / "model" / "model.safetensors")
    assert "score.weight" in weights and not any("lora" in k for k in weights)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(weights[name], base[name])  # the adapters were trained and merged
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    assert model.config.architectures == ["Qwen2ForSequenceClassification"]
    prefs = read_jsonl(tiny / "data" / "prefs.jsonl")
    with torch.no_grad():
        scores = [model(**tok(r["prompt"] + r["chosen"], return_tensors="pt")).logits[0, 0].item() for r in prefs]
    mean, std = model.config.reward_mean, model.config.reward_std
    assert mean == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    assert std == pytest.approx(torch.tensor(scores).std().item(), abs=1e-4) and std > 0
    assert out["final/reward_mean"] == pytest.approx(mean)
    assert (f"reward statistics for ppo.py: reward_mean {mean:.4g}, reward_std {std:.4g} (saved in {final}/config.json"
            in capsys.readouterr().out)
    # rewards.py: the same scores in one padded batch, and whitened with normalize
    prompts, completions = [r["prompt"] for r in prefs], [r["chosen"] for r in prefs]
    raw = make_reward({"type": "reward_model", "model": str(final), "device": "cpu"})
    assert raw(completions, prompts=prompts) == pytest.approx(scores, abs=1e-4)
    white = make_reward({"type": "reward_model", "model": str(final), "device": "cpu", "normalize": True})
    assert white(completions, prompts=prompts) == pytest.approx([(s - mean) / std for s in scores], abs=1e-4)


def test_micro_batches_give_the_same_update(tiny, tmp_path):
    """Gradient accumulation: 4 pairs a step in one pass or in 4 passes of 1 give the same loss and weights."""
    runs = [rm.main(tiny_args(tiny, tmp_path / str(m), batch_size=4, micro_batch_size=m, eval_split=None,
                              center_rewards_coef=0.1)) for m in (4, 1)]
    assert runs[0]["train/loss"] == pytest.approx(runs[1]["train/loss"], abs=1e-6)
    assert runs[0]["train/grad_norm"] == pytest.approx(runs[1]["train/grad_norm"], rel=1e-5)
    a, b = (load_file(Path(r["run_dir"]) / "final" / "model.safetensors") for r in runs)
    # Adam divides by sqrt(v): float rounding in near-zero gradients moves weights by a few 1e-6
    assert all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)


def test_packed_and_plain_runs_train_alike(tiny, tmp_path, capsys):
    """Three steps with pairs packed (the default) and with --no-pack-pairs: the same losses and weights up to
    float rounding."""
    runs = []
    for packed in (True, False):
        runs.append(rm.main(tiny_args(tiny, tmp_path / str(packed), total_steps=3, batch_size=4, eval_split=None,
                                      pack_pairs=packed, center_rewards_coef=0.1)))
        assert ("packed in one row each" in capsys.readouterr().out) == packed
    rows = [train_rows(Path(r["run_dir"])) for r in runs]
    assert [r["train/loss"] for r in rows[0]] == pytest.approx([r["train/loss"] for r in rows[1]], abs=1e-5)
    assert [r["train/accuracy"] for r in rows[0]] == [r["train/accuracy"] for r in rows[1]]
    a, b = (load_file(Path(r["run_dir"]) / "final" / "model.safetensors") for r in runs)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_learning_on_the_embedded_task(tmp_path):
    """models/tiny-arith on the first 960 of data/arith's preference pairs, 40 steps of 32 pairs: held-out pair
    accuracy (200 pairs) rises from its start (0.61: the new head on the LM's features) to 0.75 (measured). A loss
    with the wrong sign, or scores read at the wrong token, leaves it at or below its start."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "prefs.jsonl").write_text("".join(line + "\n" for line in
                                              (ROOT / "data/arith/prefs.jsonl").read_text().splitlines()[:960]))
    shutil.copy(ROOT / "data/arith/prefs_test.jsonl", data / "prefs_test.jsonl")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores wait for each other (6x slower measured under load)
    try:
        out = rm.main(rm.Args(dataset=str(data), output_dir=str(tmp_path / "runs"), total_steps=40, batch_size=32,
                              eval_limit=200, eval_every=0))
    finally:
        torch.set_num_threads(threads)
    evals = [r["eval/pref_accuracy"] for r in read_metrics(out["run_dir"]) if "eval/pref_accuracy" in r]
    assert len(evals) == 2
    assert evals[1] >= 0.7 and evals[1] >= evals[0] + 0.08


def pipeline_commands() -> list[list[str]]:
    """docs/rlhf_pipeline.md's recipe: the first bash block after '## The recipe', one argv per command."""
    block = (ROOT / "docs/rlhf_pipeline.md").read_text().split("## The recipe")[1].split("```bash\n")[1].split("```")[0]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


# Appended to each documented command in turn (the last value of a flag wins): a tiny budget. sft.py goes on from
# models/tiny-arith at its default rate, so that its samples are right often enough to make preferences; the
# documented --tie-start-step 800 and --pause-at-step 150 scale to the shorter runs (step 2 of 3, step 1 of 2); the
# resume takes the run's own flags.
RM_TINY = "--comparisons 4 --comparison-prompts 96 --batch-size 4 --micro-batch-size 2 --eval-limit 64 --eval-every 0"
TINY = ("--model-config None --learning-rate 3e-4 --total-steps 2 --batch-size 8 --eval-split None --warmup-steps 0",
        f"{RM_TINY} --total-steps 3 --warmup-steps 0",
        "--prompts-per-step 2 --micro-batch-size 4 --total-steps 2 --eval-split None "
        "--warmup-steps 0",
        f"{RM_TINY} --total-steps 2 --warmup-steps 0",
        "")


def test_instructgpt_pipeline_the_five_commands(tmp_path, monkeypatch):
    """docs/rlhf_pipeline.md's five commands as written, run in a fresh folder (data/ and models/ linked in) with a
    tiny budget appended: sft.py into runs/sft; reward_model.py --comparisons (the SFT model's samples, ranked by
    correctness: a preference has a right chosen and a wrong rejected answer, a tie two of one kind) trained as
    pairs, Bradley-Terry then the ties, in micro-batches, into runs/rm; ppo.py --reward runs/rm/final/reward.json
    with the gold reward beside it, its score centred per prompt, a one-layer critic, in micro-batches, paused after
    step 1 in runs/ppo: PPO's reward is the reward model's alone; reward_model.py again, from the first reward model,
    on comparisons of the paused policy's samples, into runs/rm2; ppo.py resumed against that one."""
    import ppo
    import sft
    import tyro

    for folder in ("data", "models"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    commands = pipeline_commands()
    assert [argv[:2] for argv in commands] == [["python", s] for s in ("sft.py", "reward_model.py", "ppo.py",
                                                                        "reward_model.py", "ppo.py")]
    outs = []
    for argv, tiny in zip(commands, TINY, strict=True):
        module = {"sft.py": sft, "reward_model.py": rm, "ppo.py": ppo}[argv[1]]
        flags = argv[2:] + tiny.split()
        outs.append(module.main(tyro.cli(module.Args, args=flags)))
    _, rm_out, paused_out, rm2_out, out = outs

    run = tmp_path / "runs" / "rm"
    assert (tmp_path / "runs/sft/model.safetensors").exists() and rm_out["run_dir"] == "runs/rm"
    pairs, train = read_jsonl(run / "comparisons.jsonl"), read_jsonl(ROOT / "data/arith/train.jsonl")[:96]
    assert pairs and {p["k"] for p in pairs} == {4} and {p["ranking"] for p in pairs} <= set(range(96))
    for p in pairs:
        assert p["prompt"] == train[p["ranking"]]["prompt"] and p["answer"] == train[p["ranking"]]["answer"]
        right = [answers_match(extract_answer(p[c]), p["answer"]) for c in ("chosen", "rejected")]
        assert right[0] == right[1] if p["tie"] else right == [True, False]
    for key in {p["ranking"] for p in pairs}:  # c right and 4 - c wrong samples: c (4 - c) preferences
        assert sum(p["ranking"] == key and not p["tie"] for p in pairs) in (0, 3, 4)
    assert read_jsonl(run / "comparisons_test.jsonl") and "eval/comparison_accuracy" in rm_out
    check_calibration_benchmark(run)
    check_advantage_signal_benchmark(run)
    spec = json.loads((run / "final" / "reward.json").read_text())
    assert spec == {"type": "reward_model", "model": str((run / "final").resolve()), "normalize": True}
    assert json.loads((run / "args.json").read_text())["tie_start_step"] == 2  # 800 of 1000 -> 2 of 3
    paused = tmp_path / "runs/ppo/checkpoints/step_1"
    assert json.loads((tmp_path / "runs/ppo/args.json").read_text())["pause_at_step"] == 1
    assert paused_out["interrupted"] and paused_out["step"] == 1 and (paused / "trainer_state.pt").exists()
    assert read_jsonl(tmp_path / "runs/rm2/comparisons.jsonl") and rm2_out["step"] == 2
    rows = train_rows(tmp_path / "runs/ppo")
    assert out["run_dir"] == "runs/ppo" and [r["step"] for r in rows] == [1, 2] and not out["interrupted"]
    resumed = json.loads((tmp_path / "runs/ppo/args.json").read_text())["resumed"]
    assert resumed[0]["overrides"]["reward"] == ["runs/rm/final/reward.json", "runs/rm2/final/reward.json"]
    for r in rows:  # the learned reward alone is trained on, less each prompt's mean; the gold one is the fraction
        assert math.isfinite(r["rewards/reward_model"]) and abs(r["train/reward"]) < 1e-5  # of the 8 samples right
        assert any(r["rewards/gold"] == pytest.approx(n / 8) for n in range(9))


def check_calibration_benchmark(run: Path) -> None:
    """benchmarks/rm_calibration.py on the pipeline's reward model: every distinct right and wrong text of each held-out
    ranking scored once, and a score equal to the classifier's own on that text alone, whitened by final/config.json."""
    rm_calibration = benchmark("rm_calibration")

    held = read_jsonl(run / "comparisons_test.jsonl")
    scored = rm_calibration.main(rm_calibration.Args(reward_model=str(run / "final"),
                                                     comparisons=str(run / "comparisons_test.jsonl")))
    assert {k: (set(ok), set(bad)) for k, (ok, bad) in scored.items()} == {
        k: ({p["chosen"] for p in held if p["ranking"] == k}, {p["rejected"] for p in held if p["ranking"] == k})
        for k in {p["ranking"] for p in held}}
    row = held[-1]
    model = AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    ids = AutoTokenizer.from_pretrained(run / "final")(row["prompt"] + row["rejected"], return_tensors="pt").input_ids
    with torch.no_grad():
        raw = model(input_ids=ids).logits[0, 0].item()
    assert scored[row["ranking"]][1][row["rejected"]] == pytest.approx(
        (raw - model.config.reward_mean) / model.config.reward_std, abs=1e-4)


def check_advantage_signal_benchmark(run: Path) -> None:
    """benchmarks/advantage_signal.py with the reward model and the gold rule itself as the rewards: the gold's
    centred score correlates 1 with itself, the reward model's is a correlation, and their mean has a row."""
    advantage_signal = benchmark("advantage_signal")

    gold, learned = '{"type": "correctness", "wrong": 0}', str(run / "final" / "reward.json")
    out = advantage_signal.main(advantage_signal.Args(policy=str(ROOT / "models/tiny-arith"), rewards=(learned, gold),
                                                      prompts=8, num_generations=4))
    assert out[gold] == pytest.approx(1.0) and -1 <= out[learned] <= 1 and 0 < out["gold"] < 1
    assert set(out) == {gold, learned, "mean of the rewards", "gold"}


def test_advantage_signal_correlation_by_hand():
    """Scores [[0, 2, 1], [8, 5, 5]] and gold [[0, 1, 0], [1, 0, 0]], each less its row's mean: s = [-1, 1, 0, 2, -1,
    -1], g = [-1, 2, -1, 2, -1, -1] / 3; s.g = 3, |s|^2 = 8, |g|^2 = 4/3: 3 / sqrt(32 / 3) = 0.918559."""
    advantage_signal = benchmark("advantage_signal")

    scores, gold = torch.tensor([[0., 2, 1], [8, 5, 5]]), torch.tensor([[0., 1, 0], [1, 0, 0]])
    c = advantage_signal.centred_correlation(scores, gold)
    assert c == pytest.approx(3 / math.sqrt(32 / 3)) and c == pytest.approx(0.918559, abs=1e-6)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "1+1=", "chosen": "a", "rejected": "b"}], "has no column ['ranking']"),
    ([], "holds no comparisons"),
])
def test_calibration_benchmark_refuses_bad_comparisons_before_loading(tmp_path, rows, message):
    rm_calibration = benchmark("rm_calibration")

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=re.escape(message)):  # the model path does not exist: nothing was loaded
        rm_calibration.main(rm_calibration.Args(reward_model=str(tmp_path / "no-model"), comparisons=str(path)))


@pytest.mark.parametrize("change,error,message", [
    ({"num_generations": 1}, SystemExit, "--num-generations >= 2"),
    ({"rewards": ("no_such_reward",)}, ValueError, "no_such_reward"),
    ({"dataset": "no-answers.jsonl"}, SystemExit, "every row needs a prompt and an answer"),
])
def test_advantage_signal_refuses_bad_input_before_loading(tmp_path, change, error, message):
    advantage_signal = benchmark("advantage_signal")
    if "dataset" in change:
        change = {"dataset": str(tmp_path / change["dataset"])}
        Path(change["dataset"]).write_text(json.dumps({"prompt": "1+1="}) + "\n")

    args = replace(advantage_signal.Args(policy=str(tmp_path / "no-model"), rewards=("correctness",)), **change)
    with pytest.raises(error, match=re.escape(message)):  # the policy path does not exist: nothing was loaded
        advantage_signal.main(args)


def write_prefs(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


GOOD = {"prompt": "1+1=", "chosen": "<answer>2</answer>", "rejected": "<answer>3</answer>"}


@pytest.mark.parametrize("rows,overrides,message", [
    ([GOOD, {"prompt": "2+2=", "chosen": "4"}], {}, r"prefs.jsonl, line 2: no column \['rejected'\]"),
    ([GOOD, {**GOOD, "rejected": GOOD["chosen"]}], {}, r"prefs.jsonl, line 2: 'chosen' and 'rejected' are the same text"),
    ([GOOD], {"margin_column": "margin"}, r"split 'prefs' has no column \['margin'\]"),
    ([GOOD, {**GOOD, "margin": 1.0}], {"margin_column": "margin"}, r"prefs.jsonl, line 1: no column \['margin'\]"),
    ([{**GOOD, "margin": "big"}], {"margin_column": "margin"}, r"line 1: margin 'margin' is 'big', not a number"),
    ([GOOD], {"chosen_column": "good"}, r"has no column \['good'\].*--chosen-column"),
    ([GOOD], {"ranking_column": "ranking"}, r"split 'prefs' has no column \['ranking', 'k'\]"),
    ([GOOD], {"comparisons": 4}, r"split 'prefs' has no column \['answer'\]"),
    ([{**GOOD, "ranking": 0, "k": 1}], {"ranking_column": "ranking"}, r"row 0: ranking size k=1"),
    ([GOOD], {"tie_strength": 1.0}, r"split 'prefs' has no column \['tie'\]"),
    ([{**GOOD, "tie": True}], {"tie_strength": 1.0}, r"every row is a tie \(column `tie` true\), which orders nothing"),
    ([{**GOOD, "tie": "yes"}], {"tie_strength": 1.0}, r"line 1: 'tie' is 'yes': it must be true \(a tie\) or false"),
    ([{**GOOD, "ranking": 0, "k": 2}, {**GOOD, "chosen": "2", "ranking": 0, "k": 2}], {"ranking_column": "ranking"},
     r"row 1: ranking 0 has more than C\(2,2\) = 1 pairs"),
])
def test_bad_data_fails_before_any_work(tiny, tmp_path, rows, overrides, message):
    data = write_prefs(tmp_path / "data", rows)
    with pytest.raises(ValueError, match=message):
        rm.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), eval_split=None, **overrides))
    assert not (tmp_path / "out").exists()


def test_a_folder_without_prefs_jsonl_trains_on_its_train_jsonl(tiny, tmp_path, capsys):
    """--dataset-split left at prefs, on a folder with pairs in train.jsonl and no prefs.jsonl: the run trains on
    train.jsonl, says so in one line, and records the split in args.json, which a resume reads."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(tiny / "data" / "prefs.jsonl", data / "train.jsonl")
    out = rm.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), eval_split=None, total_steps=1))
    assert capsys.readouterr().out.count(f"{data} has no prefs.jsonl: training on its train.jsonl") == 1
    assert json.loads((Path(out["run_dir"]) / "args.json").read_text())["dataset_split"] == "train"
    resumed, _ = rm.resume_args(rm.Args(resume=str(Path(out["run_dir"]) / "checkpoints" / "step_1"), total_steps=2),
                                rm.RESUME_MAY_CHANGE)
    assert resumed.dataset_split == "train"


def test_comparisons_check_the_eval_split_for_the_labelers_columns_first(tiny, tmp_path):
    data = write_prefs(tmp_path / "data", [GOOD])  # held-out pairs without an answer: their prompts cannot be labeled
    (data / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"split 'prefs' has no column \['answer'\]"):
        rm.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), dataset_split="train", eval_split="prefs",
                          comparisons=2))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides,message", [
    ({"batch_size": 3, "micro_batch_size": 2}, "use --micro-batch-size 1"),
    ({"max_length": 0}, "--max-length must be positive"),
    ({"center_rewards_coef": -1.0}, "--center-rewards-coef must be >= 0"),
    ({"comparisons": 1}, "--comparisons 1: it ranks K >= 2 samples"),
    ({"comparisons": 4, "margin_column": "margin"}, "drop --margin-column and --ranking-column"),
    ({"comparisons": 4, "labeler": "correctnes"}, "unknown reward type 'correctnes'"),
    ({"comparisons": 4, "policy": "no/such/model"}, "model 'no/such/model' does not exist"),
    ({"ranking_column": "ranking", "margin_column": "margin"}, "a ranking's pairs carry no margin"),
    ({"tie_strength": -1.0}, "--tie-strength must be >= 0"),
    ({"tie_strength": 1.0, "margin_column": "margin"}, "--tie-strength with --margin-column: a tie has no margin"),
    ({"tie_start_step": 5}, "--tie-start-step 5: the ties would never train; pass --tie-strength 1"),
    ({"tie_start_step": -1}, "--tie-start-step must be >= 0"),
    ({"comparison_rankings": False}, "--no-comparison-rankings: there are no --comparisons to train as pairs"),
])
def test_bad_input_fails_before_any_work(tiny, tmp_path, overrides, message):
    with pytest.raises(ValueError) as e:
        rm.main(tiny_args(tiny, tmp_path, **overrides))
    assert message in str(e.value)
    assert not any(tmp_path.iterdir())


def test_reward_refuses_a_causal_lm_checkpoint_and_missing_statistics(tiny):
    """A causal LM loaded as a classifier would score with a random head: refused when the reward is built."""
    with pytest.raises(ValueError, match=r"is a Qwen2ForCausalLM checkpoint, not a sequence classifier.*reward_model.py"):
        make_reward({"type": "reward_model", "model": str(tiny / "model")})
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM checkpoint, not a sequence classifier"):
        make_reward({"type": "reward_model", "model": str(ROOT / "models" / "tiny-arith")})


def test_normalize_needs_the_statistics(tiny, tmp_path):
    model = tiny_classifier(tiny, "qwen2")
    model.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny / "model").save_pretrained(tmp_path / "rm")
    assert len(make_reward({"type": "reward_model", "model": str(tmp_path / "rm")})(["a"], prompts=["b"])) == 1
    with pytest.raises(ValueError, match=r"normalize=true needs reward_mean and reward_std > 0"):
        make_reward({"type": "reward_model", "model": str(tmp_path / "rm"), "normalize": True})


def test_reward_refuses_a_causal_lm_from_the_hub_at_first_use(tiny, monkeypatch):
    """A hub id has no local config to read when the reward is built: the loaded model's config is checked."""
    import rewards

    def fake_load(auto_class, model, device="auto", dtype="float32"):  # what loading a causal LM as a classifier gives
        network = AutoModelForSequenceClassification.from_pretrained(tiny / "model", num_labels=1)
        return AutoTokenizer.from_pretrained(tiny / "model"), network.eval()

    monkeypatch.setattr(rewards, "load_model", fake_load)
    reward = make_reward({"type": "reward_model", "model": "some-org/some-causal-lm", "device": "cpu"})
    with pytest.raises(ValueError, match=r"'some-org/some-causal-lm' is a Qwen2ForCausalLM checkpoint, not a sequence"):
        reward(["<answer>2</answer>"], prompts=["1+1="])


def test_packed_padding_keeps_position_ids_within_a_learned_position_table(tiny):
    """GPT-2 with 8 positions: each text fits, and so must the packed rows' padding (it once got positions past the
    table, an IndexError on CPU and a device assert on CUDA)."""
    model = GPT2ForSequenceClassification(GPT2Config(vocab_size=103, n_embd=32, n_layer=2, n_head=2, n_positions=8,
                                                     pad_token_id=0, eos_token_id=1, num_labels=1)).eval()
    pairs = [([5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], 0.0), ([5, 6], [5, 7], 0.0)]
    ids, allowed, position_ids, ends = rm.pack_texts(pairs, pad_id=0)
    assert int(position_ids.max()) < 8
    with torch.no_grad():
        packed = rm.PairScorer(model, packed=True)(ids, allowed, position_ids, ends)
        alone = torch.tensor([[model.score(model.base_model(input_ids=torch.tensor([t])).last_hidden_state[0, -1])[0]
                               for t in (c, r)] for c, r, _ in pairs])
    assert torch.allclose(packed, alone, atol=1e-5)


def test_rlhf_pipeline_benchmark_runs_and_draws(tiny, tmp_path):
    """benchmarks/rlhf_pipeline.py at a tiny budget, its iterated recipe: the reward model, PPO against its spec with
    the gold reward beside, paused at step 2, a second reward model from that checkpoint's samples, PPO resumed against
    it; the table and the picture, on the small copy of the task. The other recipes run the first two stages of the
    same code; the default one's clipped verdict (VERDICT) is checked on the first reward model's spec: every score in
    [-1, 0]."""
    rlhf_pipeline = benchmark("rlhf_pipeline")

    data = f"--dataset {tiny / 'data'} "
    rlhf_pipeline.main(rlhf_pipeline.Args(
        recipes=("iterated",), seeds=(1,), threads=1, output_dir=str(tmp_path), pause=2, plot=str(tmp_path / "p.png"),
        rm_flags=data + "--comparison-prompts 64 --total-steps 2 --tie-start-step 1 --batch-size 4 "
                        "--micro-batch-size 2 --eval-limit 32",
        ppo_flags=data + "--total-steps 3 --prompts-per-step 8 --micro-batch-size 16 --eval-limit 8 --eval-every 0"))
    spec = json.loads((tmp_path / "iterated_1.json").read_text())
    assert spec["type"] == "reward_model" and spec["postprocess"] == rlhf_pipeline.RECIPES["iterated"][1]
    verdict = make_reward(json.dumps({**spec, "postprocess": rlhf_pipeline.VERDICT}))
    texts = ["<think>7+5=12</think><answer>12</answer>", "<think>7+5=13</think><answer>13</answer>", "12", "x" * 30]
    scores = verdict(texts, prompts=["7+5="] * 4)
    assert len(scores) == 4 and all(-1.0 <= s <= 0.0 for s in scores)
    run, rm2 = (rlhf_pipeline.finished(tmp_path, name) for name in ("ppo_iterated_1", "rm2_iterated_1"))
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(0.0 <= r["rewards/gold"] <= 1.0 for r in rows)
    assert json.loads((rm2 / "args.json").read_text())["policy"] == str(run / "checkpoints" / "step_2")
    resumed = json.loads((run / "args.json").read_text())["resumed"]
    assert [r["step"] for r in resumed] == [2] and resumed[0]["overrides"]["reward"][1] == str(
        rm2 / "final" / "reward.json")
    assert (tmp_path / "p.png").stat().st_size > 0
