"""sft.py: the loss against hand-computed numbers, data plumbing, runs, resume, Ctrl-C, bad input."""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import interrupt_at_step_2, read_metrics
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


def test_few_step_run_writes_the_run_directory(tiny, tmp_path):
    out = sft.main(tiny_args(tiny, tmp_path, packing=True, gradient_accumulation_steps=2, save_every=2, warmup_steps=2))
    run = Path(out["run_dir"])
    assert json.loads((run / "args.json").read_text())["total_steps"] == 3
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    # the logged rate is the one each step's update used: warmup 1/2, 2/2, then constant
    assert [r["train/lr"] for r in rows if "train/loss" in r] == pytest.approx([1e-3 / 2, 1e-3, 1e-3])
    assert {r["step"] for r in rows if "eval/accuracy" in r} == {0, 3}
    assert all(math.isfinite(r["train/loss"]) and r["perf/tokens_per_s"] > 0 for r in rows if "train/loss" in r)
    assert (run / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    saved = load_file(run / "final" / "model.safetensors")
    assert torch.equal(saved["model.norm.weight"], model.state_dict()["model.norm.weight"])
    AutoTokenizer.from_pretrained(run / "final")


def test_resume_equals_straight_run(tiny, tmp_path):
    straight = sft.main(tiny_args(tiny, tmp_path / "a", total_steps=6, eval_split=None))
    first = sft.main(tiny_args(tiny, tmp_path / "b", total_steps=3, eval_split=None))
    ckpt = Path(first["run_dir"]) / "checkpoints" / "step_3"
    resumed = sft.main(sft.Args(resume=str(ckpt), total_steps=6))  # the run's own (non-default) args come back
    assert resumed["run_dir"] == first["run_dir"]
    assert resumed["train/loss"] == pytest.approx(straight["train/loss"], abs=1e-6)
    a = load_file(Path(straight["run_dir"]) / "final" / "model.safetensors")
    b = load_file(Path(resumed["run_dir"]) / "final" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert [r["step"] for r in read_metrics(resumed["run_dir"])] == [1, 2, 3, 4, 5, 6]


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


def test_sigint_saves_a_checkpoint_that_resumes(tiny, tmp_path):
    cmd = [sys.executable, str(ROOT / "sft.py"), "--model-name-or-path", str(tiny / "model"), "--dataset",
           str(tiny / "data"), "--output-dir", str(tmp_path), "--total-steps", "100000", "--batch-size", "8",
           "--log-every", "1", "--eval-split", "None"]
    returncode, rest = interrupt_at_step_2(cmd)
    assert returncode == 0, rest
    ckpts = list(tmp_path.glob("*/checkpoints/step_*"))
    assert len(ckpts) == 1 and "--resume" in rest
    assert {"model.safetensors", "trainer_state.pt", "config.json", "tokenizer.json"} <= {p.name for p in ckpts[0].iterdir()}
    assert not list(tmp_path.glob("*/checkpoints/.tmp-*"))
    step = int(ckpts[0].name.split("_")[1])
    out = sft.main(sft.Args(resume=str(ckpts[0]), total_steps=step + 1))
    assert out["step"] == step + 1 and not out["interrupted"]


def test_second_ctrl_c_quits_at_once_with_one_line(tiny, tmp_path):
    cmd = [sys.executable, str(ROOT / "sft.py"), "--model-name-or-path", str(tiny / "model"), "--dataset",
           str(tiny / "data"), "--output-dir", str(tmp_path), "--total-steps", "100000", "--batch-size", "8",
           "--log-every", "1", "--eval-split", "None"]
    returncode, rest = interrupt_at_step_2(cmd, times=2)
    assert returncode == 130, rest
    assert "Ctrl-C: finishing step" in rest and "interrupted again: quit without saving" in rest
    assert "Traceback" not in rest


def test_torchrun_two_processes(tiny, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           str(ROOT / "sft.py"), "--model-name-or-path", str(tiny / "model"), "--dataset", str(tiny / "data"),
           "--output-dir", str(tmp_path), "--total-steps", "2", "--batch-size", "8", "--log-every", "1",
           "--eval-limit", "4", "--max-new-tokens", "4"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1  # only rank 0 writes
    assert [r["step"] for r in read_metrics(runs[0]) if "train/loss" in r] == [1, 2]
    assert (runs[0] / "final" / "model.safetensors").exists()


# ----------------------------------------------------------------------------- bad input


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for split in ("sft", "test"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("change,message", [
    (dict(eval_every=-1), "--eval-every must be >= 0"),
    (dict(total_steps=0), "--total-steps must be positive"),
    (dict(model_name_or_path="./no/such/model"), "model path './no/such/model' does not exist"),
    (dict(completion_column="response"), "no column ['response']; available columns: ['prompt', 'answer', 'completion']"),
    (dict(dataset_split="validation"), "split 'validation' not found"),
    (dict(max_length=4), "prompts are longer than --max-length 4"),
    (dict(batch_size=6, gradient_accumulation_steps=4), "--batch-size 6 is not divisible by processes (1) x "
                                                         "--gradient-accumulation-steps (4) = 4: use --batch-size 4"),
    (dict(dataset="data/nope"), "dataset 'data/nope' does not exist"),
    (dict(device="cuda"), "torch sees no CUDA GPU"),
    (dict(dtype="float16", device="cpu"), "--dtype float16 on CPU"),
    (dict(resume="/nonexistent/step_3"), "no trainer_state.pt there"),
])
def test_bad_input_fails_before_training(tiny, tmp_path, change, message):
    with pytest.raises(ValueError) as err:
        sft.main(tiny_args(tiny, tmp_path, **change))
    assert message in str(err.value)
    assert not list(tmp_path.glob("*/metrics.jsonl"))


def test_empty_dataset_is_refused(tiny, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "sft.jsonl").write_text("")
    with pytest.raises(ValueError, match="sft.jsonl is empty: it needs at least one JSON line"):
        sft.main(tiny_args(tiny, tmp_path, dataset=str(empty)))


def test_missing_eval_column_is_named(tiny, tmp_path):
    data = write_rows(tmp_path / "d", [{"prompt": "1+1=", "completion": "<answer>2</answer>"}] * 4)
    with pytest.raises(ValueError, match=r"eval split 'test' has no column \['answer'\]"):
        sft.main(tiny_args(tiny, tmp_path, dataset=str(data)))
