"""sft.py: the loss against hand-computed numbers, batching, the update step, runs, --final-dir, bad input.

Resume, Ctrl-C, torchrun and the generic bad inputs are in tests/test_lifecycle.py."""
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, short_gpt2
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import sft

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "data"))
import make_arith  # noqa: E402


def tiny_args(tiny, tmp_path, **kw) -> sft.Args:
    base = sft.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(tmp_path),
                    total_steps=3, batch_size=8, log_every=1, eval_limit=4, max_new_tokens=8, warmup_steps=0,
                    lr_schedule="constant", learning_rate=1e-3)
    return replace(base, **kw)


# ----------------------------------------------------------------------------- pure functions


def test_completion_only_loss_hand_computed():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [3.0, 0.0, -1.0], [9.0, 9.0, 9.0]],
                           [[0.5, 0.5, 0.0], [0.0, 2.0, 0.0], [7.0, 7.0, 7.0], [7.0, 7.0, 7.0]]])
    # position 0 is a prompt token in row 0; row 1 has padding at positions 2-3.
    labels = torch.tensor([[-100, 2, 0, 1], [-100, 1, -100, -100]])
    # Next-token targets: row 0 predicts 2 from logits[0,0], 0 from logits[0,1], 1 from logits[0,2];
    # row 1 predicts 1 from logits[1,0]. The last position and every -100 are ignored.
    lse = lambda xs: math.log(sum(math.exp(x) for x in xs))  # noqa: E731
    expected = ((lse([0, 1, 2]) - 2) + (lse([1, 0, 0]) - 1) + (lse([3, 0, -1]) - 0) + (lse([0.5, 0.5, 0]) - 0.5))
    nll, n = sft.completion_only_loss(logits, labels)
    assert n == 4
    assert nll.item() == pytest.approx(expected, rel=1e-6)


def test_build_example_collate_and_pack():
    ids, labels = sft.build_example([5, 6], [7, 8], eos_id=1, max_length=10)
    assert ids == [5, 6, 7, 8, 1] and labels == [-100, -100, 7, 8, 1]
    assert sft.build_example([5, 6], [7, 8, 9], eos_id=1, max_length=4) == ([5, 6, 7, 8], [-100, -100, 7, 8])
    x, mask, y = sft.collate([([5, 6, 7], [-100, 6, 7]), ([9], [-100])], pad_id=0)
    assert x.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert y.tolist() == [[-100, 6, 7], [-100, -100, -100]]
    rows = sft.pack_examples([([1, 2, 3], [-100, 2, 3]), ([4, 5], [-100, 5]), ([6, 7, 8], [-100, 7, 8])], 4)
    assert rows == [([1, 2, 3, 4], [-100, 2, 3, -100]), ([5, 6, 7, 8], [5, -100, 7, 8])]


@pytest.mark.parametrize("step,schedule,expected", [
    (0, "cosine", 0.25), (3, "cosine", 1.0), (4, "cosine", 1.0), (9, "cosine", 0.5 * (1 + math.cos(math.pi * 5 / 10))),
    (14, "cosine", 0.0), (9, "linear", 0.5), (14, "linear", 0.0), (12, "constant", 1.0)])
def test_lr_factor(step, schedule, expected):
    assert sft.lr_factor(step, warmup=4, total=14, schedule=schedule) == pytest.approx(expected)


@pytest.mark.parametrize("text,answer,ok", [
    ("<think>1+1=2</think><answer>2</answer>", "2", True), ("<answer> 84.0 </answer>", "84", True),
    ("<answer>85</answer>", "84", False), ("84", "84", False), ("<answer>abc</answer>", "abc", True)])
def test_answer_matches(text, answer, ok):
    assert sft.answer_matches(text, answer) is ok


# ----------------------------------------------------------------------------- runs


def test_batch_indices_epochs_skip_the_tail():
    draw = [sft.batch_indices(step, n=10, size=4, seed=0) for step in range(1, 6)]
    assert all(len(b) == 4 for b in draw)
    assert len(set(draw[0] + draw[1])) == 8  # one epoch: no index twice
    assert len(set(draw[2] + draw[3])) == 8  # 2 left in the first epoch < 4: step 3 starts the second
    assert draw[0] == torch.randperm(10, generator=torch.Generator().manual_seed(0))[:4].tolist()
    assert draw[2] == torch.randperm(10, generator=torch.Generator().manual_seed(1_000_003))[:4].tolist()
    # seed 0's second epoch is not seed 1's first: runs with neighbouring seeds are independent
    assert sft.batch_indices(1, n=1000, size=10, seed=1) != sft.batch_indices(101, n=1000, size=10, seed=0)


def test_gradient_accumulation_gives_the_one_batch_update(tiny):
    """The loss is the token mean over the whole step: 4 micro-batches of 2 make the update one batch of 8 makes."""
    tok = AutoTokenizer.from_pretrained(tiny / "model")
    batch = sft.load_examples(sft.Args(dataset=str(tiny / "data"), batch_size=8, eval_split=None), tok)[0][:8]
    assert len({len(ids) for ids, _ in batch}) > 1  # padding differs between micro-batches and the whole batch
    flat = lambda model: torch.cat([p.detach().flatten() for p in model.parameters()])  # noqa: E731
    start, weights, losses = flat(AutoModelForCausalLM.from_pretrained(tiny / "model")), [], []
    for accum in (1, 4):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny / "model")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        run = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
        nll, n_tokens, _ = sft.sft_update(model, optimizer, batch, 8 // accum, sft.Args(gradient_accumulation_steps=accum),
                                          run, tok.pad_token_id)
        losses.append(nll / n_tokens)
        weights.append(flat(model))
    assert n_tokens == sum(sum(t != -100 for t in labels[1:]) for _, labels in batch)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert (weights[0] - start).abs().max() > 1e-3  # the step moved the weights
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


# ----------------------------------------------------------------------------- runs


def test_few_step_run_writes_the_run_directory_and_final_dir(tiny, tmp_path, capsys):
    out = sft.main(tiny_args(tiny, tmp_path, packing=True, gradient_accumulation_steps=2, save_every=2, warmup_steps=2,
                             final_dir=str(tmp_path / "made")))
    run = Path(out["run_dir"])
    assert json.loads((run / "args.json").read_text())["total_steps"] == 3
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    # the logged rate is the one each step's update used: warmup 1/2, 2/2, then constant
    assert [r["train/lr"] for r in rows if "train/loss" in r] == pytest.approx([1e-3 / 2, 1e-3, 1e-3])
    assert {r["step"] for r in rows if "eval/accuracy" in r} == {0, 3}
    assert all(math.isfinite(r["train/loss"]) and r["perf/tokens_per_s"] > 0 for r in rows if "train/loss" in r)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last", "step_2", "step_3"]
    # --final-dir holds the trained model (how models/tiny-arith is written), instead of the run's final/
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "made")
    saved = load_file(tmp_path / "made" / "model.safetensors")
    assert torch.equal(saved["model.norm.weight"], model.state_dict()["model.norm.weight"])
    AutoTokenizer.from_pretrained(tmp_path / "made")
    assert not (run / "final").exists() and f"final model: {tmp_path / 'made'}" in capsys.readouterr().out


def test_learning_from_scratch(tmp_path):
    """A fresh model learns the format and unseen one-digit sums: loss falls, greedy accuracy rises from zero."""
    make_arith.main(tmp_path / "data", seed=5, n_train=140, n_test=15, n_prefs=4, max_digits=1)
    config = json.loads((ROOT / "models/tiny-arith-config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = sft.main(sft.Args(model_config=str(tmp_path / "config.json"), tokenizer_name_or_path=str(ROOT / "data/arith/tokenizer"),
                            dataset=str(tmp_path / "data"), output_dir=str(tmp_path), total_steps=400, learning_rate=3e-3,
                            batch_size=32, log_every=10, eval_every=0, eval_limit=15))
    rows = read_metrics(out["run_dir"])
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    accs = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert losses[-1] < 0.05 * losses[0]
    assert accs[0] == 0.0 and accs[-1] >= 0.25  # 15 problems none of which was trained on


# ----------------------------------------------------------------------------- bad input


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for split in ("sft", "test"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("change,message", [
    (dict(eval_every=-1), "--eval-every must be >= 0"),
    (dict(total_steps=0), "--total-steps must be positive"),
    (dict(max_new_tokens=0), "--max-new-tokens must be positive"),
    (dict(completion_column="response"), "split 'sft' has no column ['response']; available columns: "
                                         "['prompt', 'answer', 'completion']"),
    (dict(max_length=4), "prompts are longer than --max-length 4"),
    (dict(batch_size=6, gradient_accumulation_steps=4), "--batch-size 6 is not divisible by processes x "
                                                         "--gradient-accumulation-steps = 4: use --batch-size 4"),
    (dict(model_config="models/nope.json"), "--model-config models/nope.json is not a file"),
    (dict(tokenizer_name_or_path=str(ROOT / "data/arith")), "data/arith: no tokenizer (tokenizer.json"),
    (dict(tokenizer_name_or_path="/no/such/tokenizer"), "model '/no/such/tokenizer' does not exist"),
])
def test_bad_input_fails_before_training(tiny, tmp_path, change, message):
    with pytest.raises(ValueError) as err:
        sft.main(tiny_args(tiny, tmp_path, **change))
    assert message in str(err.value)
    assert not list(tmp_path.glob("*/metrics.jsonl"))


def test_the_evaluation_and_the_training_rows_must_fit_the_context(tiny, tmp_path):
    """The eval prompts (as greedy_accuracy tokenises them) + --max-new-tokens, and --max-length, must fit the model's
    positions: one short is refused before any work (a GPT-2 would index past its position table); at the limit a
    run completes."""
    tok = AutoTokenizer.from_pretrained(tiny / "model")
    eval_prompts = [json.loads(r)["prompt"] for r in (tiny / "data" / "test.jsonl").read_text().splitlines()[:4]]
    longest = max(len(tok(p, add_special_tokens=False).input_ids) for p in eval_prompts)
    short = short_gpt2(tmp_path / "short", longest + 7)
    with pytest.raises(ValueError, match=rf"a {longest}-token prompt and --max-new-tokens 8 exceed the model's "
                                         rf"{longest + 7} positions"):
        sft.main(tiny_args(tiny, tmp_path / "a", model_name_or_path=short, max_length=longest + 7))
    with pytest.raises(ValueError, match=rf"--max-length {longest + 8} exceed the model's {longest + 7} positions: "
                                         rf"pass --max-length {longest + 7} or less"):
        sft.main(tiny_args(tiny, tmp_path / "a", model_name_or_path=short, max_length=longest + 8, eval_split=None))
    assert not (tmp_path / "a").exists()
    fits = short_gpt2(tmp_path / "fits", longest + 8)
    out = sft.main(tiny_args(tiny, tmp_path / "b", model_name_or_path=fits, max_length=longest + 8, total_steps=1))
    assert out["step"] == 1 and "eval/accuracy" in out


def test_without_an_eval_split_nothing_is_evaluated(tiny, tmp_path):
    out = sft.main(tiny_args(tiny, tmp_path, eval_split=None, total_steps=1))
    assert out["step"] == 1 and not [r for r in read_metrics(out["run_dir"]) if "eval/accuracy" in r]


def test_a_fresh_model_needs_no_model_folder_only_a_tokenizer(tiny, tmp_path):
    args = tiny_args(tiny, tmp_path, model_name_or_path="./no/such/model", gradient_accumulation_steps=2,
                     model_config=str(ROOT / "models/tiny-arith-config.json"),
                     tokenizer_name_or_path=str(ROOT / "data/arith/tokenizer"))
    assert sft.check_args(args) == 4
    with pytest.raises(ValueError, match="model './no/such/model' does not exist"):
        sft.check_args(replace(args, model_config=None))


def test_missing_eval_column_is_named(tiny, tmp_path):
    data = write_rows(tmp_path / "d", [{"prompt": "1+1=", "completion": "<answer>2</answer>"}] * 8)
    with pytest.raises(ValueError, match=r"split 'test' has no column \['answer'\]"):
        sft.main(tiny_args(tiny, tmp_path, dataset=str(data)))


@pytest.mark.parametrize("packing,message", [(True, r"0 training rows \(packed\) < --batch-size 8"),
                                             (False, "4 training rows < --batch-size 8")])
def test_fewer_rows_than_a_batch_are_refused(tiny, tmp_path, packing, message):
    data = write_rows(tmp_path / "d", [{"prompt": "1+1=", "completion": "<answer>2</answer>", "answer": "2"}] * 4)
    with pytest.raises(ValueError, match=message):
        sft.main(tiny_args(tiny, tmp_path, dataset=str(data), packing=packing))
