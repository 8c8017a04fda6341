"""dpo.py: every loss against hand-computed values, masked log-prob sums against a float64 reference, the concatenated
and packed passes, precomputed reference log-probs, runs, learning, resume with precomputed log-probs, bad pairs and
flags (the shared plumbing: tests/test_lifecycle.py)."""
import json
import math
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, short_gpt2, train_rows
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import dpo

ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tiny, tmp_path, **kw) -> dpo.Args:
    base = dpo.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                    total_steps=2, batch_size=4, micro_batch_size=2, eval_limit=4, eval_every=0, warmup_steps=0,
                    learning_rate=3e-3)
    return replace(base, **kw)


# ----------------------------------------------------------------------------- losses


def softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


# Two pairs: summed log-probs of the policy and the reference, and completion lengths.
POLICY_C, POLICY_R = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
REF_C, REF_R = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -2.5])
LEN_C, LEN_R = torch.tensor([2.0, 4.0]), torch.tensor([4.0, 5.0])
# d by hand: pair 0 (0.5) - (-1.0) = 1.5; pair 1 (-1.0) - (0.5) = -1.5
D = [1.5, -1.5]
# IPO with averaged log-ratios: pair 0: 0.5/2 - (-1.0)/4 = 0.5; pair 1: -1.0/4 - 0.5/5 = -0.35
D_MEAN = [0.5, -0.35]
# SimPO: average log-probs: pair 0: -3/2 - (-4/4) = -0.5; pair 1: -5/4 - (-2/5) = -0.85
D_SIMPO = [-0.5, -0.85]


def loss_of(loss_type, beta=0.1, eps=0.0, gamma=0.0, ipo_logps="mean"):
    chosen, rejected = dpo.pair_logratios(POLICY_C, POLICY_R, REF_C, REF_R, LEN_C, LEN_R, loss_type, ipo_logps)
    return dpo.dpo_loss(chosen, rejected, loss_type, beta, eps, gamma).tolist()


def test_pair_logratios_hand_computed():
    for loss_type, want in (("sigmoid", D), ("hinge", D), ("robust", D), ("ipo", D_MEAN), ("simpo", D_SIMPO)):
        chosen, rejected = dpo.pair_logratios(POLICY_C, POLICY_R, REF_C, REF_R, LEN_C, LEN_R, loss_type)
        assert (chosen - rejected).tolist() == pytest.approx(want), loss_type
    chosen, rejected = dpo.pair_logratios(POLICY_C, POLICY_R, REF_C, REF_R, LEN_C, LEN_R, "ipo", "sum")
    assert (chosen - rejected).tolist() == pytest.approx(D)
    # SimPO never reads the reference
    chosen, _ = dpo.pair_logratios(POLICY_C, POLICY_R, None, None, LEN_C, LEN_R, "simpo")
    assert chosen.tolist() == pytest.approx([-1.5, -1.25])


def test_sigmoid_and_cdpo_hand_computed():
    # Eq. 7: -log sigmoid(beta d) = softplus(-beta d), beta = 0.1
    assert loss_of("sigmoid") == pytest.approx([softplus(-0.15), softplus(0.15)], rel=1e-6)
    # cDPO, eps = 0.2: 0.8 softplus(-beta d) + 0.2 softplus(beta d)
    assert loss_of("sigmoid", eps=0.2) == pytest.approx(
        [0.8 * softplus(-0.15) + 0.2 * softplus(0.15), 0.8 * softplus(0.15) + 0.2 * softplus(-0.15)], rel=1e-6)
    # cDPO at eps = 0 is DPO; at eps = 0.5 no preference is left: the loss is even in d (the pairs have d = +-1.5)
    assert loss_of("sigmoid", eps=0.0) == loss_of("sigmoid")
    even = loss_of("sigmoid", eps=0.5)
    assert even[0] == pytest.approx(even[1], rel=1e-6) and even[0] == pytest.approx(softplus(0.15) - 0.075, rel=1e-6)


def test_hinge_ipo_hand_computed():
    # relu(1 - beta d) with beta = 0.5: 1 - 0.75 and 1 + 0.75
    assert loss_of("hinge", beta=0.5) == pytest.approx([0.25, 1.75])
    assert loss_of("hinge", beta=1.0) == pytest.approx([0.0, 2.5])  # a pair past the margin costs nothing
    # IPO, Eq. 17: (d - 1 / (2 tau))^2 with tau = 0.25 -> target 2
    assert loss_of("ipo", beta=0.25) == pytest.approx([(0.5 - 2) ** 2, (-0.35 - 2) ** 2])
    assert loss_of("ipo", beta=0.25, ipo_logps="sum") == pytest.approx([(1.5 - 2) ** 2, (-1.5 - 2) ** 2])


def test_robust_is_unbiased_under_label_flips():
    """Averaged over a flip with probability eps, the robust loss of the observed label equals the clean DPO loss
    of the true one: (1 - eps) l_rob(d) + eps l_rob(-d) = -log sigmoid(beta d)."""
    d = torch.tensor([1.5, -0.4, 3.0, 0.0], dtype=torch.float64)
    for eps in (0.0, 0.1, 0.3, 0.45):
        kept = dpo.dpo_loss(d, torch.zeros_like(d), "robust", 0.7, eps)
        flipped = dpo.dpo_loss(-d, torch.zeros_like(d), "robust", 0.7, eps)
        clean = dpo.dpo_loss(d, torch.zeros_like(d), "sigmoid", 0.7)
        assert torch.allclose((1 - eps) * kept + eps * flipped, clean, atol=1e-12)
    # by hand, eps = 0.2, beta 0.1, d = 1.5: (0.8 softplus(-0.15) - 0.2 softplus(0.15)) / 0.6
    assert loss_of("robust", eps=0.2)[0] == pytest.approx((0.8 * softplus(-0.15) - 0.2 * softplus(0.15)) / 0.6,
                                                          rel=1e-6)
    assert loss_of("robust", eps=0.0) == loss_of("sigmoid")


def test_simpo_hand_computed_and_length_normalised():
    # Eq. 6: softplus(-(beta d - gamma)), beta 2, gamma 0.5: pair 0 d = -0.5 -> softplus(1.5)
    assert loss_of("simpo", beta=2.0, gamma=0.5) == pytest.approx([softplus(1.5), softplus(2.2)], rel=1e-6)
    # repeating each completion k times (k x the tokens, k x the summed log-prob) leaves SimPO unchanged, not DPO
    for loss_type, same in (("simpo", True), ("sigmoid", False)):
        base = dpo.dpo_loss(*dpo.pair_logratios(POLICY_C, POLICY_R, REF_C, REF_R, LEN_C, LEN_R, loss_type),
                                   loss_type, 2.0, 0.0, 0.5)
        longer = dpo.dpo_loss(*dpo.pair_logratios(3 * POLICY_C, 3 * POLICY_R, 3 * REF_C, 3 * REF_R, 3 * LEN_C,
                                                         3 * LEN_R, loss_type), loss_type, 2.0, 0.0, 0.5)
        assert torch.allclose(base, longer) == same


# ----------------------------------------------------------------------------- log-probs


RAGGED = [([5, 6, 7], [10, 11, 1], [12, 1]), ([8], [13, 14, 15, 16, 1], [17, 1]), ([5, 9, 9, 9], [1], [18, 19, 20, 1])]


def reference_sums(model, rows) -> list[float]:
    """Float64: log_softmax of the full logits of each prompt + completion alone (no padding), summed over the
    completion's tokens."""
    out = []
    for prompt, completion in rows:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
        out.append(float(logp[len(prompt) - 1 :].sum()))
    return out


def test_sequence_logprobs_equal_float64_reference_on_ragged_pairs(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny / "model").eval()
    ids, attention, completion = dpo.collate_completions(RAGGED, pad_id=0)
    assert ids.shape == (6, 8) and completion.sum(1).tolist() == [3, 5, 1, 2, 2, 4]
    with torch.no_grad():
        got = dpo.sequence_logprobs(model, ids, attention, completion)
    rows = [(p, c) for p, c, _ in RAGGED] + [(p, r) for p, _, r in RAGGED]
    assert got.dtype == torch.float32 and (got < 0).all()
    assert got.double().tolist() == pytest.approx(reference_sums(model, rows), abs=1e-5)


def test_concatenated_pass_equals_two_separate_passes(tiny):
    """Chosen and rejected in one [2B, T] pass give the values and the gradient of two passes, each padded to
    its own width."""
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    joint = dpo.sequence_logprobs(model, *dpo.collate_completions(RAGGED, pad_id=0))
    joint.sum().backward()
    grad_joint = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    apart = []
    for i in (1, 2):  # the chosen completions alone, then the rejected ones
        ids, attention, completion = dpo.collate_completions([(pair[0], pair[i], pair[i]) for pair in RAGGED], pad_id=0)
        n = len(RAGGED)
        apart.append(dpo.sequence_logprobs(model, ids[:n], attention[:n], completion[:n]))
    torch.cat(apart).sum().backward()
    assert torch.allclose(joint, torch.cat(apart), atol=1e-5)
    assert torch.allclose(grad_joint, model.model.embed_tokens.weight.grad, atol=1e-5)


# Pairs whose completions share a start: by 2 tokens; not at all; the chosen a prefix of the rejected; equal
# (two completions cut to the same tokens by --max-completion-length).
SHARED = [([5, 6], [7, 8, 9, 1], [7, 8, 10, 11, 1]), ([4], [12, 1], [13, 1]), ([3, 3], [7, 8], [7, 8, 9, 1]),
          ([6], [14, 15], [14, 15])]


def test_pack_pairs_layout_hand_checked():
    """prompt 5 6, chosen 7 8 1, rejected 7 9 1 (shared: 7): row 5 6 7 8 1 9 1; the rejected tail sees 5 6 7
    and itself, at positions 3 4; its 9 is predicted at column 2 (the 7), its 1 at column 5 (the 9)."""
    ids, allowed, position_ids, columns, targets, owners = dpo.pack_completions([([5, 6], [7, 8, 1], [7, 9, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 1, 9, 1]] and position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4]]
    assert columns.tolist() == [1, 2, 3, 2, 5] and targets.tolist() == [7, 8, 1, 9, 1]
    assert owners.T.tolist() == [[0, 0], [1, 0], [0, 1], [0, 2], [1, 3], [1, 4]]  # (sequence, entry); 1 = rejected
    assert [k for k in range(7) if allowed[0, 5, k]] == [0, 1, 2, 5]
    assert [k for k in range(7) if allowed[0, 4, k]] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_float64_reference_and_the_plain_gradient(tiny, attn):
    """One row per pair gives each completion's float64 log-prob of it alone, and the plain [2B, T] pass's
    gradient, with sdpa's boolean mask and eager attention's additive one."""
    model = AutoModelForCausalLM.from_pretrained(tiny / "model", attn_implementation=attn)
    pairs = RAGGED + SHARED
    with torch.no_grad():
        got = dpo.packed_logprobs(model.eval(), *dpo.pack_completions(pairs, pad_id=0))
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    assert got.double().tolist() == pytest.approx(reference_sums(model, rows), abs=1e-5)
    packing = SimpleNamespace(args=SimpleNamespace(pack_pairs=True), say=pytest.fail)  # a notice fails the test
    assert dpo.use_packing(packing, model, lambda packed: dpo.pair_logprobs(model, pairs, 0, packed))

    grads = []
    for logprobs, collate in ((dpo.sequence_logprobs, dpo.collate_completions), (dpo.packed_logprobs, dpo.pack_completions)):
        model.zero_grad()
        logp = logprobs(model.train(), *collate(pairs, 0)).view(2, -1)
        (logp[0] - 2 * logp[1]).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.allclose(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4) for n in grads[0])


def test_packed_and_plain_runs_train_alike_and_a_failed_check_falls_back(tiny, tmp_path, monkeypatch, capsys):
    """Three steps packed (the default) and with --no-pack-pairs: the same losses and weights up to float
    rounding. A packed forward whose log-probs are wrong (the mask ignored) is caught at start, and the run
    trains unpacked, exactly as --no-pack-pairs."""
    runs = []
    for packed in (True, False):
        runs.append(dpo.main(tiny_args(tiny, tmp_path / str(packed), total_steps=3, pack_pairs=packed)))
        assert ("packed in one row each" in capsys.readouterr().out) == packed
    rows = [train_rows(Path(r["run_dir"])) for r in runs]
    assert [r["train/loss"] for r in rows[0]] == pytest.approx([r["train/loss"] for r in rows[1]], abs=1e-5)
    a, b = (load_file(Path(r["run_dir"]) / "final" / "model.safetensors") for r in runs)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)

    pack = dpo.pack_completions
    monkeypatch.setattr(dpo, "pack_completions", lambda pairs, pad_id: (lambda ids, allowed, *rest: (
        ids, torch.ones_like(allowed).tril(), *rest))(*pack(pairs, pad_id)))
    fallback = dpo.main(tiny_args(tiny, tmp_path / "fallback", total_steps=3))
    assert "--pack-pairs: chosen and rejected in rows of their own" in capsys.readouterr().out
    assert [r["train/loss"] for r in train_rows(Path(fallback["run_dir"]))] == [r["train/loss"] for r in rows[1]]


# ----------------------------------------------------------------------------- runs


@pytest.mark.parametrize("loss_type,extra", [("sigmoid", {"label_smoothing": 0.1, "track": True}),
                                             ("hinge", {}), ("ipo", {"ipo_logps": "sum"}),
                                             ("robust", {"label_smoothing": 0.2}),
                                             ("simpo", {"beta": 2.0, "rpo_alpha": 0.0}),
                                             ("sigmoid", {"lora_r": 4, "learning_rate": 5e-2})])
def test_few_step_run_writes_the_run_directory(tiny, tmp_path, capsys, loss_type, extra):
    """A few steps of each loss: the run directory, TRL's metric names, checkpoints, a loadable final/. At step 0,
    where the policy is the reference (simpo has none), the evaluation says that the 8 held-out pairs all tie and
    that a tie counts as wrong; at the end it does not."""
    out = dpo.main(tiny_args(tiny, tmp_path, loss_type=loss_type, total_steps=3, save_every=2, **extra))
    run = Path(out["run_dir"])
    said, tied = capsys.readouterr().out, "eval/pref_accuracy 0: all 8 pairs tied (margin 0), and a tie counts as wrong"
    assert said.count(tied) == said.count(tied + "\neval at step 0: ") == (loss_type != "simpo")
    assert json.loads((run / "args.json").read_text())["loss_type"] == loss_type
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    keys = {"train/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen", "logps/rejected", "perf/step_s"}
    assert keys <= set(rows[0]) and all(math.isfinite(r["train/loss"]) for r in rows)
    if loss_type != "simpo":  # the policy starts as the reference: zero implicit rewards at step 1
        assert rows[0]["rewards/chosen"] == rows[0]["rewards/rejected"] == 0.0 and rows[0]["rewards/accuracies"] == 0
        assert rows[-1]["rewards/margins"] != 0.0
    evals = [r for r in read_metrics(run) if "eval/pref_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3] and "eval/accuracy" in evals[0]
    assert out["eval/pref_accuracy"] == evals[-1]["eval/pref_accuracy"]
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"last", "step_2", "step_3"}
    final = load_file(run / "final" / "model.safetensors")
    assert not any("lora" in k for k in final)  # LoRA merged: loadable without peft
    AutoModelForCausalLM.from_pretrained(run / "final")


@pytest.mark.parametrize("pack_pairs", [False, True])
def test_precomputed_reference_logps_equal_on_the_fly(tiny, tmp_path, pack_pairs):
    kw = {"total_steps": 3, "eval_split": None, "pack_pairs": pack_pairs}
    live = dpo.main(tiny_args(tiny, tmp_path / "a", **kw))
    cached = dpo.main(tiny_args(tiny, tmp_path / "b", precompute_ref_logps=True, **kw))
    for a, b in zip(train_rows(live["run_dir"]), train_rows(cached["run_dir"])):
        for key in ("train/loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert a[key] == pytest.approx(b[key], abs=1e-6)
    assert train_rows(live["run_dir"])[-1]["rewards/margins"] != 0
    a = load_file(Path(live["run_dir"]) / "final" / "model.safetensors")
    b = load_file(Path(cached["run_dir"]) / "final" / "model.safetensors")
    # the precomputing pass batches the pairs in data order, so the reference's log-probs come from rows padded to
    # other widths: float rounding, which Adam's division by sqrt(v) lifts to ~1e-6 in the weights, packed or not
    # depending on the CPU (1.7e-6 packed on one machine, 1.3e-6 unpacked on another): 1e-5 is 0.3% of a step at lr 3e-3
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_micro_batches_give_the_gradient_of_one_batch(tiny, tmp_path):
    one = dpo.main(tiny_args(tiny, tmp_path / "a", micro_batch_size=4, eval_split=None))
    two = dpo.main(tiny_args(tiny, tmp_path / "b", micro_batch_size=1, eval_split=None))
    a, b = train_rows(one["run_dir"])[-1], train_rows(two["run_dir"])[-1]
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_learning_on_the_embedded_task(tmp_path):
    """models/tiny-arith on 30 steps of 16 training pairs (sigmoid, no RPO term): the implicit reward ranks the
    chosen completion first on at least 65% of 100 held-out pairs (0% at step 0, where d = 0; measured 80%). A
    loss with the wrong sign pushes it towards 0, log-probs of the wrong tokens leave it near chance."""
    out = dpo.main(dpo.Args(output_dir=str(tmp_path), total_steps=30, batch_size=16, eval_split=None,
                            pref_eval_limit=100, rpo_alpha=0.0, learning_rate=1e-4, warmup_steps=0))
    evals = [r["eval/pref_accuracy"] for r in read_metrics(out["run_dir"]) if "eval/pref_accuracy" in r]
    assert evals[0] == 0.0 and evals[-1] >= 0.65
    rows = train_rows(out["run_dir"])
    assert sum(r["rewards/margins"] for r in rows[-5:]) > 0


def test_resume_with_precomputed_reference_logps_equals_straight_run(tiny, tmp_path):
    """Resume from step 2 of a 4-step IPO run with --precompute-ref-logps: steps 3-4 and the final weights equal the
    straight run's, so the precomputed reference log-probs come from the initial weights, not the checkpoint's."""
    kw = {"total_steps": 4, "eval_split": None, "save_every": 2, "loss_type": "ipo", "batch_size": 2,
          "lr_schedule": "linear", "warmup_steps": 1, "precompute_ref_logps": True}
    straight = dpo.main(tiny_args(tiny, tmp_path / "a", **kw))
    run = tmp_path / "b" / Path(straight["run_dir"]).name
    shutil.copytree(straight["run_dir"], run)
    shutil.rmtree(run / "final")
    resumed = dpo.main(dpo.Args(resume=str(run / "checkpoints" / "step_2")))
    assert resumed["run_dir"] == str(run) and [r["step"] for r in train_rows(run)] == [1, 2, 3, 4]
    for key in ("train/loss", "rewards/margins", "train/lr", "eval/pref_accuracy"):
        assert resumed[key] == pytest.approx(straight[key], abs=1e-6)
    assert train_rows(run)[2]["rewards/margins"] == pytest.approx(train_rows(straight["run_dir"])[2]["rewards/margins"],
                                                                  abs=1e-6)
    a = load_file(Path(straight["run_dir"]) / "final" / "model.safetensors")
    b = load_file(run / "final" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


# ----------------------------------------------------------------------------- bad input


def write_pairs(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


GOOD = {"prompt": "1+1=", "chosen": "<answer>2</answer>", "rejected": "<answer>3</answer>"}


@pytest.mark.parametrize("rows,message", [
    ([GOOD, {"prompt": "2+2=", "chosen": "<answer>4</answer>"}], "line 2: no column ['rejected']"),
    ([GOOD, {**GOOD, "rejected": GOOD["chosen"]}], "line 2: 'chosen' and 'rejected' are the same text"),
    ([{**GOOD, "chosen": 5}], "line 1: 'chosen' and 'rejected' must be text, got 5"),
])
def test_bad_pairs_fail_before_any_work(tiny, tmp_path, rows, message):
    data = write_pairs(tmp_path / "data", rows)
    with pytest.raises(ValueError) as e:
        dpo.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), eval_split=None, pref_eval_split=None))
    assert message in str(e.value) and str(data / "prefs.jsonl") in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_column_missing_from_the_whole_split_is_named_with_the_flag(tiny, tmp_path):
    data = write_pairs(tmp_path / "data", [{"prompt": "2+2=", "rejected": "4"}])
    with pytest.raises(ValueError, match=r"split 'prefs' has no column \['chosen'\].*--chosen-column"):
        dpo.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), eval_split=None, pref_eval_split=None))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides,message", [
    ({"label_smoothing": 0.6}, "--label-smoothing 0.6 is outside its range for --loss-type sigmoid: [0, 0.5]"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, "outside its range for --loss-type robust: [0, 0.5)"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, "for --loss-type hinge: 0 only"),
    ({"loss_type": "ipo", "label_smoothing": -0.1}, "for --loss-type ipo: 0 only"),
    ({"loss_type": "simpo", "precompute_ref_logps": True}, "simpo is reference-free: --precompute-ref-logps"),
    ({"beta": 0.0}, "--beta must be positive, got 0.0"),
    ({"beta": -0.1}, "--beta must be positive, got -0.1"),
    ({"rpo_alpha": -1.0}, "--rpo-alpha must be >= 0"),
    ({"batch_size": 6, "micro_batch_size": 4}, "use --micro-batch-size 3"),
    ({"pref_eval_split": "nope"}, "has no nope.jsonl"),
    ({"pref_eval_limit": -1}, "--pref-eval-limit must be >= 0"),
])
def test_bad_flags_fail_before_any_work(tiny, tmp_path, overrides, message):
    with pytest.raises(ValueError) as e:
        dpo.main(tiny_args(tiny, tmp_path, **overrides))
    assert message in str(e.value)
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_a_folder_without_prefs_jsonl_trains_on_its_train_jsonl(tiny, tmp_path, capsys):
    """--dataset-split left at prefs, on a folder with pairs in train.jsonl and no prefs.jsonl: the run trains on
    train.jsonl, says so in one line, and records the split in args.json, which a resume reads. A split named on the
    command line, or a train.jsonl without pairs, is no reason to fall back."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(tiny / "data" / "prefs.jsonl", data / "train.jsonl")
    out = dpo.main(tiny_args(tiny, tmp_path / "out", dataset=str(data), eval_split=None, pref_eval_split=None,
                             total_steps=1))
    assert capsys.readouterr().out.count(f"{data} has no prefs.jsonl: training on its train.jsonl") == 1
    assert json.loads((Path(out["run_dir"]) / "args.json").read_text())["dataset_split"] == "train"
    resumed, _ = dpo.resume_args(dpo.Args(resume=str(Path(out["run_dir"]) / "checkpoints" / "step_1"), total_steps=2),
                                 dpo.RESUME_MAY_CHANGE)
    assert resumed.dataset_split == "train"
    with pytest.raises(ValueError, match=r"has no other.jsonl"):  # a split named on the command line: no fallback
        dpo.main(tiny_args(tiny, tmp_path / "out2", dataset=str(data), dataset_split="other", eval_split=None,
                           pref_eval_split=None))
    shutil.copy(tiny / "data" / "test.jsonl", data / "train.jsonl")  # prompts and answers, no pairs: no fallback
    with pytest.raises(ValueError, match=r"split not found: .* has no prefs.jsonl"):
        dpo.main(tiny_args(tiny, tmp_path / "out3", dataset=str(data), eval_split=None, pref_eval_split=None))


def test_the_greedy_evaluation_fits_the_model_context(tiny, tmp_path):
    """The longest eval prompt, tokenised as greedy_accuracy does, and --max-completion-length must fit the model's
    positions (GPT-2's n_positions): one position short is refused naming the flag, before a run directory exists;
    at exactly the limit a step runs (the training pairs cut to fit too)."""
    from transformers import AutoTokenizer

    prompts = [json.loads(line)["prompt"] for line in (tiny / "data" / "test.jsonl").read_text().splitlines()][:4]
    longest = max(map(len, AutoTokenizer.from_pretrained(tiny / "model")(prompts, add_special_tokens=False).input_ids))
    kw = {"max_completion_length": 8, "max_prompt_length": longest, "total_steps": 1}
    short, fits = (short_gpt2(tmp_path / f"gpt2-{n}", n) for n in (longest + 7, longest + 8))  # n positions
    with pytest.raises(ValueError, match=rf"a {longest}-token prompt and --max-completion-length 8 exceed the model's "
                                         rf"{longest + 7} positions: pass --max-completion-length 7 or less"):
        dpo.main(tiny_args(tiny, tmp_path / "short", model_name_or_path=short, **kw))
    assert not (tmp_path / "short").exists()
    out = dpo.main(tiny_args(tiny, tmp_path / "fits", model_name_or_path=fits, **kw))
    assert out["step"] == 1 and "eval/accuracy" in out


def test_micro_batch_defaults_to_the_largest_divisor_up_to_64(tiny, tmp_path):
    assert dpo.check_args(tiny_args(tiny, tmp_path, batch_size=128, micro_batch_size=0)) == 64
    assert dpo.check_args(tiny_args(tiny, tmp_path, batch_size=96, micro_batch_size=0)) == 48
    with pytest.raises(ValueError, match=r"use --micro-batch-size 64 \(or 0, the largest divisor up to 64\)"):
        dpo.check_args(tiny_args(tiny, tmp_path, batch_size=128, micro_batch_size=100))


def test_pairs_are_tokenised_with_eos_and_cut(tiny, tmp_path):
    """A completion keeps its first --max-completion-length tokens (its EOS included); the rows are checked on load,
    naming the file and the line."""
    from transformers import AutoTokenizer

    data = write_pairs(tmp_path / "data", [GOOD, {**GOOD, "rejected": GOOD["chosen"]}])
    with pytest.raises(ValueError, match=r"prefs.jsonl, line 2: 'chosen' and 'rejected' are the same text"):
        dpo.load_pairs(tiny_args(tiny, tmp_path, dataset=str(data), eval_split=None, pref_eval_split=None),
                       "dataset_split", ["prompt", "chosen", "rejected"])
    write_pairs(tmp_path / "data", [GOOD])
    args = tiny_args(tiny, tmp_path, dataset=str(data), max_completion_length=3, eval_split=None, pref_eval_split=None)
    ds = dpo.load_pairs(args, "dataset_split", ["prompt", "chosen", "rejected"])
    pairs = dpo.tokenize_completions(AutoTokenizer.from_pretrained(tiny / "model"), ds, args)
    assert len(pairs) == 1 and len(pairs[0][1]) == 3 and pairs[0][1] != pairs[0][2]  # cut to 3 tokens, EOS lost


def test_trl_benchmark_without_trl_says_how_to_install_it(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import dpo_vs_trl

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl now raises ImportError
    with pytest.raises(SystemExit, match=r"pip install trl"):
        dpo_vs_trl.main(dpo_vs_trl.Args())


def test_packed_padding_keeps_position_ids_within_a_learned_position_table():
    """GPT-2 with 12 positions: every prompt + completion fits, and so must the packed rows' padding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=12)).eval()
    pairs = [([5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 1], [20, 21, 22, 23, 24, 25, 26, 27, 1]), ([4], [12, 1], [13, 1])]
    batch = dpo.pack_completions(pairs, pad_id=0)
    assert int(batch[2].max()) < 12
    with torch.no_grad():
        got = dpo.packed_logprobs(model, *batch)
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    assert got.double().tolist() == pytest.approx(reference_sums(model, rows), abs=1e-5)
