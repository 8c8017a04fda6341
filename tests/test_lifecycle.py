"""The run plumbing every LLM script shares, tested over all six: resume equals a
straight run, resume refuses algorithm changes, Ctrl-C once saves and twice quits, torchrun, bad input fails first."""
import importlib
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import interrupt_at_step_2, interrupted_run, read_metrics, run_torchrun, train_rows
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["grpo", "ppo", "dpo", "hybrid", "reward_model", "sft"]
# a few fast steps of each script on the tiny random model (conftest's `tiny`)
TINY = {
    "grpo": dict(reward="capitalization", total_steps=2, num_generations=4, prompts_per_step=4, micro_batch_size=4,
                 max_completion_length=8, eval_limit=4, warmup_steps=0, learning_rate=3e-3, scale_rewards="batch",
                 loss_type="dapo"),  # the two options that gather over processes
    "ppo": dict(reward="capitalization", total_steps=2, prompts_per_step=4, num_mini_batches=2, max_completion_length=8,
                eval_limit=4, warmup_steps=0, learning_rate=3e-3, value_learning_rate=3e-3),
    "dpo": dict(total_steps=2, batch_size=4, micro_batch_size=2, eval_limit=4, warmup_steps=0, learning_rate=3e-3),
    "hybrid": dict(total_steps=2, prompts_per_step=4, sft_batch_size=4, max_completion_length=8, eval_limit=4,
                   warmup_steps=0, learning_rate=3e-3, sft_fraction_start=0.5, sft_fraction_end=0.5),
    "reward_model": dict(total_steps=2, batch_size=2, eval_limit=8, warmup_steps=0, learning_rate=3e-3, log_every=1),
    "sft": dict(total_steps=2, batch_size=8, eval_limit=4, max_new_tokens=8, warmup_steps=0, learning_rate=1e-3,
                log_every=1),
}


def module(script: str):
    return importlib.import_module(script)


def tiny_args(script, tiny, out, **kw):
    m = module(script)
    return replace(m.Args(model_name_or_path=str(tiny / "model"), dataset=str(tiny / "data"), output_dir=str(out),
                          eval_every=0, **TINY[script]), **kw)


def cli(script, tiny, out, **kw) -> list[str]:
    """The command line of tiny_args(script, tiny, out, **kw)."""
    flags = {"model_name_or_path": tiny / "model", "dataset": tiny / "data", "output_dir": out, "eval_every": 0,
             **TINY[script], **kw}
    return [sys.executable, str(ROOT / f"{script}.py")] + [x for k, v in flags.items()
                                                            for x in ("--" + k.replace("_", "-"), str(v))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_equals_straight_run(tiny, tmp_path, script):
    """Resume at step 2 of 4 in a copy of the run directory, with no flag but --resume: the run's own arguments come
    back, steps 3-4 and the final weights equal the straight run's, and a killed run's leftovers (metrics logged after
    the checkpoint, a half-written checkpoint) are dropped."""
    m = module(script)
    straight = m.main(tiny_args(script, tiny, tmp_path / "a", total_steps=4, save_every=2, eval_split=None))
    run = tmp_path / "b" / Path(straight["run_dir"]).name
    shutil.copytree(straight["run_dir"], run)
    shutil.rmtree(run / "final")
    os.replace(run / "checkpoints" / "step_4", run / "checkpoints" / ".tmp-step_4")  # as a kill mid-save leaves it
    resumed = m.main(m.Args(resume=str(run / "checkpoints" / "step_2")))
    assert resumed["run_dir"] == str(run) and not resumed["interrupted"]
    rows = lambda d: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in train_rows(d)]  # noqa: E731
    a, b = rows(straight["run_dir"]), rows(run)
    assert [r["step"] for r in b] == [r["step"] for r in a] and a[-1]["step"] == 4  # no duplicate rows
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6) for k in x), (x, y)
    wa, wb = (load_file(next((Path(d) / "final").glob("*.safetensors"))) for d in (straight["run_dir"], run))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    assert not list((run / "checkpoints").glob(".tmp-*"))
    saved = json.loads((run / "args.json").read_text())
    assert saved["total_steps"] == 4 and saved["resumed"] == [
        {"step": 2, "checkpoint": str(run / "checkpoints" / "step_2"), "overrides": {}}]


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_takes_cadence_flags_and_refuses_the_rest(tiny, tmp_path, script):
    m = module(script)
    first = m.main(tiny_args(script, tiny, tmp_path, save_every=1, eval_split=None))  # 2 steps
    run = Path(first["run_dir"])
    ckpt = str(run / "checkpoints" / "step_1")
    with pytest.raises(ValueError, match=r"--learning-rate 0.5 differs from the run's .*cannot change on resume"):
        m.main(m.Args(resume=ckpt, learning_rate=0.5))
    with pytest.raises(ValueError, match=r"no trainer_state.pt there; pass <run>/checkpoints/step_N"):
        m.main(m.Args(resume=str(tmp_path)))
    with pytest.raises(ValueError, match=rf"pass one of this run's checkpoints: {run}/checkpoints/step_1, {run}/check"):
        m.main(m.Args(resume=str(run)))  # the run folder: its checkpoints are listed
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(ValueError, match=r"the run ended here \(--total-steps 2\); to train on, pass a larger --total-steps"):
        m.main(m.Args(resume=str(run / "checkpoints" / "step_2")))
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # a finished run is left untouched
    out = m.main(m.Args(resume=ckpt, eval_limit=3))
    assert out["step"] == 2
    saved = json.loads((run / "args.json").read_text())
    assert saved["eval_limit"] == TINY[script]["eval_limit"] and saved["resumed"][-1]["overrides"] == {
        "eval_limit": [TINY[script]["eval_limit"], 3]}


# The signal handling is the plumbing's Run, one text in every script; a script's own part, its checkpoint, is in
# the resume tests. Two scripts: one sampling, one not.
@pytest.mark.parametrize("script", ["grpo", "dpo"])
def test_ctrl_c_saves_a_checkpoint_and_a_second_quits_at_once(tiny, tmp_path, script):
    run, ckpt, _ = interrupted_run(cli(script, tiny, tmp_path / "a", total_steps=100000, eval_split=None), tmp_path / "a")
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert ckpt.name == f"step_{state['step']}" and state["step"] >= 2 and not (run / "final").exists()
    assert train_rows(run)[-1]["step"] == state["step"]
    returncode, rest = interrupt_at_step_2(cli(script, tiny, tmp_path / "b", total_steps=100000, eval_split=None), 2)
    assert returncode == 130, rest
    assert "Ctrl-C: saving a checkpoint after step" in rest and "interrupted again: quit without saving" in rest
    assert "Traceback" not in rest


def test_sigterm_saves_like_ctrl_c_and_the_resumed_run_equals_a_straight_one(tiny, tmp_path):
    """SLURM and Kubernetes preempt a job with SIGTERM: the step ends, a checkpoint is written, the exit code is 143
    and the resume command is the last line. Resumed for two more steps (exit code 0), it says where it resumed, its
    progress line keeps the last evaluation, and it equals a straight run of as many steps."""
    import signal
    import subprocess

    flags = dict(total_steps=100000, lr_schedule="constant", log_every=1)
    run, ckpt, _ = interrupted_run(cli("grpo", tiny, tmp_path / "a", **flags), tmp_path / "a", signal.SIGTERM)
    step = int(ckpt.name.split("_")[1])
    done = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--resume", str(ckpt), "--total-steps",
                           str(step + 2)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from step {step} of {step + 2} ({ckpt}); --total-steps {step + 2} (the run had 100000)" in done.stdout
    first_line = next(line for line in done.stdout.splitlines() if line.startswith(f"step {step + 1}/"))
    assert "| accuracy 0 |" in first_line, done.stdout  # the step-0 evaluation, from before the SIGTERM
    straight = module("grpo").main(tiny_args("grpo", tiny, tmp_path / "b", **{**flags, "total_steps": step + 2}))
    a, b = train_rows(straight["run_dir"])[step:], train_rows(run)[step:]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [step + 1, step + 2]
    for x, y in zip(a, b):
        assert all(y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6) for k in x if not k.startswith("perf/")), (x, y)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_a_constant_reward_gets_one_warning_naming_its_values(tiny, tmp_path, script, capsys):
    """The random model is never right, so `correctness` gives every completion the same score: after the third
    logged step one warning names the reward's value and what helps; a reward that varies gets none."""
    m = module(script)
    m.main(tiny_args(script, tiny, tmp_path / "a", reward="correctness", total_steps=4, eval_split=None))
    printed = capsys.readouterr().out
    assert printed.count("warning: nothing can be learned") == 1, printed
    assert "(train/reward -0.5: correctness -0.5)" in printed and "--num-generations" in printed
    m.main(tiny_args(script, tiny, tmp_path / "b", total_steps=3, eval_split=None))
    assert "nothing can be learned" not in capsys.readouterr().out


def test_a_copied_script_names_the_files_it_needs_in_one_line(tmp_path):
    """grpo.py alone: one line naming rewards.py and kernels/ (the README lists what each script imports)."""
    import subprocess

    shutil.copy(ROOT / "grpo.py", tmp_path)
    alone = subprocess.run([sys.executable, "grpo.py"], cwd=tmp_path, capture_output=True, text=True)
    assert alone.returncode == 1 and alone.stderr == (
        f"error: kernels not found: copy rewards.py and kernels/ from cleanrl-llm into {tmp_path}\n"), alone.stderr
    readme = (ROOT / "README.md").read_text()
    for script in SCRIPTS + ["capacity_ppo"]:
        text = (ROOT / f"{script}.py").read_text()
        needs = [n for n, m in (("`rewards.py`", "from rewards "), ("`kernels/`", "from kernels ")) if m in text]
        assert f"`{script}.py`" in readme.split("## Start")[0] and needs == [
            n for n in ("`rewards.py`", "`kernels/`") if n in readme.split(f"`{script}.py`")[1].split(";")[0]], script


def test_a_script_starts_without_the_packages_only_some_flags_need():
    """Importing the scripts loads neither peft (LoRA, a lazy import) nor what transformers.trainer_utils pulls in
    with it: transformers' set_seed and optimization module live there and would add about 2 s to every start (and to
    every torchrun process), so the scripts seed random, numpy and torch themselves and reach Adafactor and
    get_scheduler through `transformers.` when asked for."""
    import subprocess

    code = (f"import sys, {', '.join(SCRIPTS)}, capacity_ppo; "
            "print(sorted({'peft', 'transformers.trainer_utils', 'wandb', 'matplotlib'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n", out.stdout + out.stderr


def test_comparisons_that_rank_nothing_say_why_and_leave_no_run_directory(tiny, tmp_path):
    """reward_model.py --comparisons from the random model, which is never right: every sample of a prompt gets the
    same grade, so there is nothing to rank; the error says so in one line and the run directory is gone, so the same
    command fails the same way again (not with `--run-dir ... exists`)."""
    m = module("reward_model")
    args = tiny_args("reward_model", tiny, tmp_path, comparisons=2, comparison_prompts=4, eval_limit=2,
                     dataset_split="train", run_dir=str(tmp_path / "rm"))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"--comparisons 2: every sample of each of 4 prompts of split 'train' "
                                             r"got the same grade from --labeler, so none can be ranked"):
            m.main(replace(args))
        assert list(tmp_path.iterdir()) == []


def test_the_default_model_and_data_are_found_beside_the_script_from_another_folder(tmp_path, monkeypatch):
    """`python path/to/grpo.py` from another folder: models/tiny-arith and data/arith are the ones beside grpo.py."""
    monkeypatch.chdir(tmp_path)
    m = module("grpo")
    out = m.main(m.Args(total_steps=1, prompts_per_step=2, num_generations=2, eval_split=None, output_dir="out"))
    saved = json.loads((Path(out["run_dir"]) / "args.json").read_text())
    assert saved["model_name_or_path"] == str(ROOT / "models/tiny-arith") and saved["dataset"] == str(ROOT / "data/arith")
    assert Path(out["run_dir"]).resolve().parent == tmp_path / "out"


def sigterm_in_the_first_evaluation(m, monkeypatch):
    """Patch script m so that SIGTERM reaches the process while rank 0 evaluates at step 0."""
    import signal

    evaluate = m.Run.evaluate

    def signalled(run, measure):
        def measure_signalled():
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the evaluation
            raise AssertionError("the evaluation went on after SIGTERM")
        return evaluate(run, measure_signalled if run.step == 0 and run.rank == 0 else measure)

    monkeypatch.setattr(m.Run, "evaluate", signalled)


@pytest.mark.parametrize("script", SCRIPTS)
def test_sigterm_in_the_first_evaluation_cuts_it_short_and_the_resumed_run_equals_a_straight_one(
        tiny, tmp_path, script, monkeypatch):
    """A grace period is short (SLURM, Kubernetes: 30 s): SIGTERM during the step-0 evaluation ends it at once, no
    step starts, step_0 is saved; the resume evaluates at step 0 again and then equals a straight run."""
    m = module(script)
    sigterm_in_the_first_evaluation(m, monkeypatch)
    cut = m.main(tiny_args(script, tiny, tmp_path / "a", eval_every=1))
    monkeypatch.undo()
    run = Path(cut["run_dir"])
    assert cut["interrupted"] == 15 and cut["step"] == 0 and not (run / "final").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last", "step_0"] and read_metrics(run) == []
    m.main(m.Args(resume=str(run / "checkpoints" / "step_0")))
    straight = m.main(tiny_args(script, tiny, tmp_path / "b", eval_every=1))
    rows = lambda d: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(d)]  # noqa: E731
    a, b = rows(straight["run_dir"]), rows(run)
    assert [r["step"] for r in b] == [r["step"] for r in a] and any("eval/" in str(r) for r in b if r["step"] == 0)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6) for k in x), (x, y)


def test_sigterm_in_the_first_evaluation_under_torchrun_saves_step_0_and_resumes(tiny, tmp_path):
    """The same under torchrun (2 gloo processes): rank 0 is signalled while it evaluates, both stop at step 0 with
    one checkpoint; the resume evaluates at step 0 and trains both steps."""
    import subprocess

    wrapper = tmp_path / "grpo_sigterm.py"  # grpo.py's command line, with the signal sent inside rank 0's evaluation
    wrapper.write_text(f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\nimport grpo, pytest\n"
                       "from test_lifecycle import sigterm_in_the_first_evaluation\n"
                       "sigterm_in_the_first_evaluation(grpo, pytest.MonkeyPatch())\ngrpo.command_line(grpo.Args, grpo.main)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(wrapper),
           *cli("grpo", tiny, tmp_path)[2:]]
    cut = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert cut.returncode != 0 and "SIGTERM: saving a checkpoint after step 0" in cut.stderr, cut.stderr[-3000:]
    (run,) = tmp_path.glob("data__*")
    (ckpt,) = (run / "checkpoints").glob("step_*")
    assert ckpt.name == "step_0" and read_metrics(run) == []
    assert len(torch.load(ckpt / "trainer_state.pt", weights_only=False)["per_rank"]["torch_rng"]) == 2
    run_torchrun("grpo.py", "--resume", str(ckpt))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and "eval/accuracy" in rows[0] and "train/loss" in rows[1]


def test_sigterm_reaching_one_torchrun_process_stops_both_at_the_same_step(tiny, tmp_path):
    """torchrun, 2 gloo processes: SIGTERM sent to rank 1 alone stops both after the same step, with one checkpoint
    holding both processes' states; the run says how many processes and which parallelism."""
    import signal

    def rank_1(proc) -> int:  # torchrun's worker process whose environment has RANK=1
        for _ in range(100):
            for d in (d for d in Path("/proc").iterdir() if d.name.isdigit()):
                try:
                    if f"PPid:\t{proc.pid}\n" in (d / "status").read_text() and "RANK=1" in (
                            d / "environ").read_bytes().decode(errors="replace").split("\0"):
                        return int(d.name)
                except OSError:
                    pass
        raise AssertionError("no rank 1 process")

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "grpo.py"), *cli("grpo", tiny, tmp_path, total_steps=100000, eval_split=None, log_every=1)[2:]]
    returncode, rest = interrupt_at_step_2(cmd, sig=signal.SIGTERM, pid=rank_1, env={"OMP_NUM_THREADS": "1"})
    assert returncode != 0, rest  # the processes exit 143, which torchrun reports as a failure
    (run,) = tmp_path.iterdir()
    (ckpt,) = (run / "checkpoints").glob("step_*")
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["step"] >= 2 and ckpt.name == f"step_{state['step']}" and train_rows(run)[-1]["step"] == state["step"]
    assert len(state["per_rank"]["torch_rng"]) == 2  # both processes' RNGs: both were at the same step
    assert f"interrupted: saved {ckpt}; continue with --resume {ckpt}" in rest


def _name_the_run(rank: int, port: int, names):
    """One torchrun process whose clock reads rank seconds later than rank 0's."""
    import time

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    time.time = lambda: 1_000_000.0 + rank
    sft = module("sft")
    run = sft.Run(sft.Args(dataset="data", output_dir="runs"), {}, ())
    names[rank] = run.dir.name  # (the process group ends at exit)


def test_the_processes_of_a_run_share_one_run_directory_when_their_clocks_straddle_a_second():
    """The run name's timestamp is rank 0's on every rank (CI once found two run directories for one torchrun run)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    names = mp.Manager().dict()
    mp.spawn(_name_the_run, args=(port, names), nprocs=2)
    assert names[0] == names[1] == "data__sft__1__1000000", dict(names)


FSDP_SCRIPTS = SCRIPTS


@pytest.mark.parametrize("script", FSDP_SCRIPTS)
def test_fsdp_matches_ddp_resumes_from_its_shards_and_writes_a_whole_final(tiny, tmp_path, script, monkeypatch):
    """torchrun on CPU (gloo, 2 processes): --fsdp takes the same 3 steps as DDP to float tolerance (both average the
    gradients of the same rows); resumed from step 2's sharded checkpoint, step 3 again, so each process's data order
    and RNGs come back; final/ is one safetensors model, DDP's. (A DDP resume loads whole weights, as a single
    process's does: test_resume_equals_straight_run.) grpo and hybrid sample with the bfloat16 copy, which --fsdp
    refreshes from its whole weights. The three runs share one launch (tests/torchrun_runs.py)."""
    copy = {"generation_backend": "copy"} if script in ("grpo", "hybrid") else {}
    runs, ddp, fsdp = [], tmp_path / "ddp" / "run", tmp_path / "fsdp" / "run"
    for parallel, run in (("ddp", ddp), ("fsdp", fsdp)):
        made = {"final_dir": tmp_path / f"made-{parallel}"} if script == "sft" else {}  # sft: whole there too
        flags = cli(script, tiny, run.parent, total_steps=3, eval_split=None, save_every=2, run_dir=run, **copy, **made)
        runs.append(flags[2:] + ["--fsdp"] * (parallel == "fsdp"))
    runs.append(["--resume", str(fsdp / "checkpoints" / "step_2")])  # rows after step 2 are dropped, step 3 again
    out = run_torchrun("tests/torchrun_runs.py", script, json.dumps(runs))
    assert "2 processes, DDP" in out and "2 processes, FSDP2" in out
    assert "returned a view tensor" not in out  # FSDP2 warns of outputs that an in-place op could detach
    assert [r["step"] for r in json.loads((fsdp / "args.json").read_text())["resumed"]] == [2]
    lines = (fsdp / "metrics.1.jsonl").read_text().splitlines()  # the straight run's, before the resume rewrote them
    straight = [r for r in map(json.loads, lines) if "train/loss" in r]
    for a, b in zip(train_rows(ddp), straight, strict=True):
        for k in (k for k in a if k.startswith(("train/", "rewards/"))):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
    resumed = train_rows(fsdp)
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == straight[:2]
    for k in (k for k in resumed[2] if k.startswith(("train/", "rewards/"))):
        assert resumed[2][k] == pytest.approx(straight[2][k], rel=1e-5, abs=1e-6), k
    assert (fsdp / "checkpoints" / "step_2" / "sharded").is_dir() and not (ddp / "checkpoints" / "step_2" / "sharded").exists()
    final = {p: tmp_path / f"made-{p}" if script == "sft" else run / "final" for p, run in (("ddp", ddp), ("fsdp", fsdp))}
    whole, reference = (load_file(final[p] / "model.safetensors") for p in ("fsdp", "ddp"))  # sft: at --final-dir
    assert whole.keys() == reference.keys() and all(torch.allclose(whole[k], reference[k], atol=1e-5) for k in whole)
    # a checkpoint of an --fsdp run without its shards is refused in the checks, before any process group or model
    incomplete = fsdp / "checkpoints" / "step_1"
    shutil.copytree(fsdp / "checkpoints" / "step_2", incomplete, ignore=shutil.ignore_patterns("sharded"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="an --fsdp run.s checkpoint has a sharded/ folder; this has none"):
        module(script).main(module(script).Args(resume=str(incomplete)))


@pytest.mark.parametrize("script", ["grpo", "ppo", "hybrid"])
def test_generation_backend_reaches_the_sampler(tiny, tmp_path, script, monkeypatch):
    """--generation-backend is what every rollout samples with (the backends themselves: tests/test_grpo.py)."""
    m, used = module(script), []
    sample = m.sample
    monkeypatch.setattr(m, "sample", lambda model, ids, mask, config, backend: used.append(backend) or sample(
        model, ids, mask, config, backend))
    m.main(tiny_args(script, tiny, tmp_path, generation_backend="static", eval_split=None))
    assert used and set(used) == {"static"}


def test_fsdp_benchmark_commands_run_on_cpu(tiny):
    """benchmarks/fsdp_gpu.py's commands, at the tiny shape on gloo, in one process as by default, on the small copy
    of the task (its numbers are for GPUs; two processes: test_fsdp_matches_ddp_resumes_from_its_shards_and_...)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fsdp_gpu

    out = fsdp_gpu.main(fsdp_gpu.Args(scripts=("sft",), shape="tiny", nproc=1, steps=2, dataset=str(tiny / "data")))
    assert out["sft"]["ddp"]["step_s"] > 0 and out["sft"]["fsdp"]["step_s"] > 0


def test_the_end_of_a_run_says_what_it_reached_and_where_final_is(tiny, tmp_path, capsys):
    """Also: --run-dir is the run directory, and a second run may not reuse it; a warmup as long as the run is cut to
    a tenth of it, with a notice; --save-every-minutes saves once that much time has passed since the last save."""
    fixed = tmp_path / "fixed"
    args = tiny_args("grpo", tiny, tmp_path / "out", run_dir=str(fixed), warmup_steps=31, save_every_minutes=1e-9)
    out = module("grpo").main(args)
    printed = capsys.readouterr().out
    assert out["run_dir"] == str(fixed) and not (tmp_path / "out").exists()
    assert f"final model: {fixed}/final" in printed
    assert "eval/accuracy 0 -> " in printed and "eval at step 0: eval/accuracy" in printed
    assert "--warmup-steps 31 >= --total-steps: warmup 0" in printed
    assert json.loads((fixed / "args.json").read_text())["warmup_steps"] == 0
    assert train_rows(fixed)[0]["train/lr"] == pytest.approx(args.learning_rate)  # no warmup: the full rate at once
    assert sorted(p.name for p in (fixed / "checkpoints").iterdir()) == ["last", "step_1", "step_2"]
    assert (fixed / "checkpoints" / "last").resolve() == (fixed / "checkpoints" / "step_2").resolve()
    with pytest.raises(ValueError, match=f"--run-dir {fixed} exists: pass a new one"):
        module("grpo").main(args)


def test_the_progress_bar_shows_one_s_per_step_its_own(tiny, tmp_path):
    import io

    from tqdm import tqdm

    run = module("grpo").Run(tiny_args("grpo", tiny, tmp_path), {}, ("train/reward", "eval/accuracy"))
    run.progress, run.bar = True, tqdm(total=2, file=io.StringIO(), unit="step")
    run.last, run.steps_done, run.seconds, run.step = {"train/reward": 0.5, "eval/accuracy": 0.25}, 1, 2.0, 1
    run.report()
    assert run.bar.postfix == "reward 0.5 | accuracy 0.25"


BAD = [
    ({"device": "cuda"}, "torch sees no CUDA GPU"),
    ({"device": "tpu"}, "--device tpu: use auto, cpu, cuda or cuda:N"),
    ({"model_name_or_path": "models/nope"}, "model 'models/nope' does not exist: pass a local folder or a hub id, "
                                            "e.g. models/tiny-arith"),
    ({"model_name_or_path": "data"}, "'data' is not a model folder: it has no config.json"),
    ({"dataset": "data/nope"}, "dataset 'data/nope' does not exist: pass a local folder or a hub id, e.g. data/arith"),
    ({"dataset": "nope.jsonl"}, "dataset 'nope.jsonl' does not exist"),
    ({"dataset": "someone/some-dataset"}, "dataset 'someone/some-dataset': Couldn't reach 'someone/some-dataset' on the Hub"),
    ({"model_name_or_path": "someone/some-model"}, "model 'someone/some-model': not in the Hugging Face cache "
                                                   "(HF_HUB_OFFLINE=1): `hf download someone/some-model`, then pass"),
    ({"total_steps": 0}, "--total-steps must be positive, got 0"),
    ({"learning_rate": -1.0}, "--learning-rate must be positive"),
    ({"save_every": -1}, "--save-every must be >= 0"),
    ({"save_every_minutes": -1.0}, "--save-every-minutes must be >= 0"),
]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_fails_before_any_work(tiny, tmp_path, script, change, message):
    args = tiny_args(script, tiny, tmp_path / "out", **change)
    with pytest.raises(ValueError) as e:
        module(script).main(args)
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()  # no run directory was created


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("content,message", [
    ("", "is empty: it needs at least one JSON line"),
    ('{"prompt": "1+1=", "answer": "2", "completion": "2", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", a: 4}\n',
     "line 2: not valid JSON"),
    ('["1+1=", "2"]\n', "line 1: expected a JSON object"),
    ('{"prompt": "1+1=", "answer": 2, "completion": "2", "chosen": "2", "rejected": "3"}\n'
     '{"prompt": "1/2+1/2=", "answer": "1/1", "completion": "1", "chosen": "1", "rejected": "2"}\n',
     "a column's values differ in type"),
    (None, "not found"),
])
def test_bad_data_names_the_file_and_line(tiny, tmp_path, script, content, message):
    """Every split the script reads is checked before any work: each one in turn is broken."""
    a = module(script).Args()
    splits = sorted({v for k, v in vars(a).items() if k.endswith("split") and isinstance(v, str)})
    assert len(splits) >= 2  # a training split and an eval split at least
    for split in splits:
        data = tmp_path / f"data-{split}"
        shutil.copytree(tiny / "data", data)
        if content is None:
            (data / f"{split}.jsonl").unlink()
        else:
            (data / f"{split}.jsonl").write_text(content)
        with pytest.raises(ValueError) as e:
            module(script).main(tiny_args(script, tiny, tmp_path / "out", dataset=str(data)))
        assert message in str(e.value) and f"{split}.jsonl" in str(e.value), (split, str(e.value))
        assert not (tmp_path / "out").exists()


def test_track_without_a_wandb_login_says_how_to_log_in_and_leaves_no_run_directory(tiny, tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    import wandb

    wandb.teardown()  # W&B caches its settings per process: drop the offline mode earlier tests ran under, and after
    try:  # the test, this one's (no login), so that the next in-process --track run sees WANDB_MODE=offline again
        with pytest.raises(wandb.errors.UsageError, match="wandb login"):  # wandb's own error, as it words it
            module("sft").main(tiny_args("sft", tiny, tmp_path / "out", track=True))
        assert not list(tmp_path.glob("out/*"))
    finally:
        wandb.teardown()


def one_file(tiny, path: Path) -> Path:
    """The tiny task as one .jsonl file with every script's columns: prompt, answer, completion, chosen, rejected."""
    train, sft = ([json.loads(r) for r in (tiny / "data" / f"{s}.jsonl").read_text().splitlines()]
                  for s in ("train", "sft"))
    rows = [{**t, "completion": c["completion"], "chosen": c["completion"], "rejected": c["completion"] + " 0"}
            for t, c in zip(train, sft)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_single_file_holds_out_a_fixed_seeded_tenth_never_the_training_rows(tiny, tmp_path, capsys):
    m, file = module("grpo"), one_file(tiny, tmp_path / "mine.jsonl")
    args = tiny_args("grpo", tiny, tmp_path, dataset=str(file))
    train, held = (m.load_split(args, f, ["prompt", "answer"], "--prompt-column") for f in ("dataset_split", "eval_split"))
    assert "mine.jsonl is one file: 10 of its 96 rows (a fixed seeded 10%) are held out" in capsys.readouterr().out
    key = lambda ds: {(r["prompt"], r["answer"]) for r in ds}  # noqa: E731
    assert len(train) == 86 and len(held) == 10 and not key(train) & key(held) and len(key(train) | key(held)) == 96
    again = m.load_split(replace(args, seed=7), "eval_split", ["prompt", "answer"], "--prompt-column")
    assert list(again["prompt"]) == list(held["prompt"])  # the same rows for every run and seed
    everything = m.load_split(replace(args, eval_split=None), "dataset_split", ["prompt"], "--prompt-column")
    assert len(everything) == 96  # nothing held out when nothing is evaluated


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_trains_on_a_single_file_and_evaluates_on_its_held_out_tenth(tiny, tmp_path, script, capsys):
    file = one_file(tiny, tmp_path / "mine.jsonl")
    extra = {"sft_split": "x"} if script == "hybrid" else {}  # a folder's split name: ignored for a file
    out = module(script).main(tiny_args(script, tiny, tmp_path / "out", dataset=str(file), total_steps=1, **extra))
    assert "is one file: 10 of its 96 rows" in capsys.readouterr().out and out["step"] == 1


@pytest.mark.parametrize("script", ["dpo", "reward_model", "grpo"])
def test_missing_splits_are_named_together_with_the_flags_that_fix_them(tiny, tmp_path, script):
    data = tmp_path / "data"
    data.mkdir()
    one_file(tiny, data / "train.jsonl")
    args = module(script).Args(dataset=str(data), model_name_or_path=str(tiny / "model"), output_dir=str(tmp_path))
    evals = [f for f in vars(args) if f.endswith("eval_split") and getattr(args, f)]
    with pytest.raises(ValueError) as e:
        module(script).main(args)
    fixes = [f"--{f.replace('_', '-')} None" for f in evals]
    if args.dataset_split != "train":
        fixes.append("--dataset-split train")
    assert str(e.value).startswith("split not found: ") and all(fix in str(e.value) for fix in fixes), str(e.value)
    flags = {"dataset_split": "train", **dict.fromkeys(evals, None)}
    assert module(script).main(tiny_args(script, tiny, tmp_path / "out", dataset=str(data), total_steps=1,
                                         **flags))["step"] == 1


def test_an_eval_split_without_the_columns_names_the_column_flags_and_none(tiny, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny / "data", data)
    (data / "test.jsonl").write_text('{"prompt": "1+1=", "solution": "2"}\n')
    with pytest.raises(ValueError, match=r"split 'test' has no column \['answer'\].* or skip this split with "
                                         r"--eval-split None\)"):
        module("grpo").main(tiny_args("grpo", tiny, tmp_path / "out", dataset=str(data)))


def test_a_hub_id_without_a_network_says_how_to_download_it_or_use_the_cache(tiny, tmp_path, monkeypatch):
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "repo_exists", unreachable)
    with pytest.raises(ValueError, match=r"model 'someone/some-model': the Hugging Face Hub cannot be reached "
                                         r"\(ConnectionError\): set HF_HUB_OFFLINE=1 if the cache holds it, or `hf "
                                         r"download someone/some-model`, then pass the folder it prints"):
        module("grpo").main(tiny_args("grpo", tiny, tmp_path, model_name_or_path="someone/some-model"))


def test_bad_input_on_the_command_line_is_one_line_not_a_traceback(tiny, tmp_path):
    import subprocess

    done = subprocess.run(cli("grpo", tiny, tmp_path, total_steps=0), capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1 and done.stderr == "error: --total-steps must be positive, got 0\n", done.stderr


def test_after_a_ctrl_c_a_second_quits_even_if_the_run_started_with_sigint_ignored(tiny, tmp_path):
    """A shell starts background jobs (`python grpo.py &`) with SIGINT ignored; the handler the run leaves behind after
    the first Ctrl-C must not put that back, or a second Ctrl-C during the final save would be ignored."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run = module("grpo").Run(tiny_args("grpo", tiny, tmp_path), {}, ())
        with run:
            run.interrupt(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("script", ["grpo", "ppo", "dpo", "hybrid", "sft"])
def test_the_checkpoints_generation_config_does_not_leak_into_sampling_or_evaluation(tiny, tmp_path, script, capsys):
    """Instruct checkpoints ship generation fields (repetition_penalty, ...) that transformers would apply to every
    generate() call; here one that suppresses the ten digits, which would make every greedy answer wrong."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(ROOT / "models" / "tiny-arith", model)
    digits = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(list("0123456789"))
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "suppress_tokens": digits,
                                                              "repetition_penalty": 1.3}))
    lengths = {k: getattr(module(script).Args(), k) for k in ("max_completion_length", "max_new_tokens")
               if k in TINY[script]}  # the defaults: long enough for the embedded model's answers
    out = module(script).main(tiny_args(script, tiny, tmp_path / "out", model_name_or_path=str(model), total_steps=1,
                                        dataset=str(ROOT / "data" / "arith"), eval_limit=16, **lengths))
    assert "its generation_config's repetition_penalty=1.3, suppress_tokens=" in capsys.readouterr().out
    start = next(r for r in read_metrics(out["run_dir"]) if "eval/accuracy" in r)
    assert start["step"] == 0 and start["eval/accuracy"] > 0.1  # 0.0 when the digits are suppressed
    saved = json.loads((Path(out["run_dir"]) / "final" / "generation_config.json").read_text())
    assert saved["suppress_tokens"] == digits  # final/ keeps the checkpoint's own settings for inference


@pytest.mark.parametrize("script", ["grpo", "ppo", "hybrid"])
def test_the_sampler_matches_the_trainer_and_a_mismatch_stops_the_first_step(tiny, tmp_path, script, monkeypatch):
    """train/sampler_gap: the log-probs generate sampled with against the trainer's. A checkpoint's repetition_penalty
    let through to generate (the leak own_generation_config closes) makes them differ: the run stops at step 1."""
    m = module(script)
    out = m.main(tiny_args(script, tiny, tmp_path / "a", log_every=1))  # hybrid: an SFT step, then a PPO step
    gaps = [r["train/sampler_gap"] for r in train_rows(out["run_dir"]) if "train/sampler_gap" in r]
    assert gaps and max(gaps) < 1e-4, gaps
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    (model / "generation_config.json").write_text(json.dumps({"repetition_penalty": 3.0, "eos_token_id": 1}))
    monkeypatch.setattr(m, "own_generation_config", lambda model, tokenizer: [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=r"the sampler and the trainer disagree: mean \|log-prob gap\| .* on the first"):
        m.main(tiny_args(script, tiny, tmp_path / "b", model_name_or_path=str(model)))
    if script != "hybrid":  # (hybrid's first step is an SFT step: that one is done and kept)
        assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
