"""plot.py: pictures from fake runs' metrics.jsonl, the default keys, the CLI, bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import plot

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(path: Path, train_keys=("train/reward", "train/loss"), eval_keys=("eval/accuracy",)) -> Path:
    """A run directory whose metrics.jsonl has train rows every step and eval rows at steps 0 and 10."""
    path.mkdir(parents=True)
    rows = [{"step": 0, **{k: 0.1 for k in eval_keys}, "eval/samples": "a table"}]
    rows += [{"step": s, **{k: s / 10 for k in train_keys}} for s in range(1, 11)]
    rows += [{"step": 10, **{k: 0.9 for k in eval_keys}}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_one_run_writes_curves_png_in_the_run(tmp_path):
    run = fake_run(tmp_path / "arith__grpo__1__0")
    out = plot.main(plot.Args(runs=(run,)))
    assert out == run / "curves.png"
    assert_png(out)


def test_default_keys_are_the_preferred_keys_present_in_some_run():
    assert plot.choose_keys(["perf/step_s", "train/loss", "eval/accuracy", "train/lr"], ()) == \
        ["eval/accuracy", "train/loss", "train/lr"]  # DEFAULT_KEYS order; perf/step_s is not a default
    many = list(plot.DEFAULT_KEYS[::-1])
    assert plot.choose_keys(many, ()) == list(plot.DEFAULT_KEYS[:plot.MAX_PANELS])
    assert plot.choose_keys(["custom/a", "custom/b"], ()) == ["custom/a", "custom/b"]  # any keys (capacity_ppo.py)
    assert plot.choose_keys(["train/lr", "train/kl"], ("train/lr",)) == ["train/lr"]


def test_keys_of_runs_are_numeric_and_unioned(tmp_path):
    rows = plot.read_metrics(fake_run(tmp_path / "r", train_keys=("train/kl",)))
    assert plot.numeric_keys(rows) == ["eval/accuracy", "train/kl"]  # eval/samples (a string) and step left out
    xs, ys, avg = plot.series(rows, "train/kl", smooth=2)
    assert xs == list(range(1, 11)) and avg[:3] == pytest.approx([0.1, 0.15, 0.25])
    assert plot.series(rows, "eval/accuracy", smooth=2) == ([0, 10], [0.1, 0.9], [])  # 2 points: not smoothed


def test_two_runs_side_by_side_via_the_cli(tmp_path):
    a = fake_run(tmp_path / "a")
    b = fake_run(tmp_path / "b", train_keys=("train/kl",), eval_keys=("eval/pref_accuracy",))
    cmd = [sys.executable, str(ROOT / "plot.py"), str(a), str(b), "--smooth", "3"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "train/reward, eval/accuracy, eval/pref_accuracy, train/kl, train/loss" in result.stdout
    assert_png(tmp_path / "curves.png")
    assert not (a / "curves.png").exists()


def test_bad_inputs_say_what_is_wrong(tmp_path):
    run = fake_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty is not a run directory: expected .*empty/metrics\.jsonl"):
        plot.main(plot.Args(runs=(run, tmp_path / "empty")))
    with pytest.raises(ValueError, match=r"\['train/nope'\] found in no run; available keys: \['eval/accuracy', "
                                         r"'train/loss', 'train/reward'\]"):
        plot.main(plot.Args(runs=(run,), keys=("train/nope",)))
    assert not (run / "curves.png").exists()  # errors come before any drawing


def test_legend_names_the_experiment_the_seed_and_what_differs(tmp_path, monkeypatch):
    runs = []
    for seed, loss in ((1, "grpo"), (2, "grpo"), (1, "dapo")):
        run = fake_run(tmp_path / f"arith__grpo__{seed}__{loss}")
        args = {"exp_name": "grpo", "seed": seed, "loss_type": loss, "run_name": run.name, "output_dir": "runs"}
        (run / "args.json").write_text(json.dumps(args))
        runs.append(run)
    drawn = {}
    monkeypatch.setattr(plot, "draw", lambda runs, keys, out, smooth: drawn.update(runs))
    plot.main(plot.Args(runs=tuple(runs[:2]), out=tmp_path / "curves.png"))
    assert list(drawn) == ["grpo seed 1", "grpo seed 2"]  # run_name and output_dir place a run: not shown
    no_args = fake_run(tmp_path / "no_args")
    assert plot.run_labels((*runs, no_args)) == \
        ["grpo seed 1 loss_type=grpo", "grpo seed 2 loss_type=grpo", "grpo seed 1 loss_type=dapo", str(no_args)]
