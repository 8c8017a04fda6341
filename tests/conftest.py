"""Shared test setup: offline, deterministic, importable scripts from the repo root, and the tiny task."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# triton.jit decides interpreted vs compiled when a function is decorated, and triton.language's own
# helpers (tl.max, tl.sum ...) are decorated when triton is first imported. torch imports triton as a
# side effect (the first optimizer step does), which, without a GPU, would leave those helpers
# compiled-only and break the interpreted kernels that tests/test_kernels.py runs later in the same
# process. So, on a machine without CUDA, import triton in interpreter mode before anything else.
try:
    import torch

    if not torch.cuda.is_available():
        _saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        import triton.language  # noqa: F401

        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved
except ImportError:
    pass


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test starts with the process's thread count (capacity_ppo.py's main sets its --torch-threads, 1)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def read_metrics(run_dir) -> list[dict]:
    """The rows of a run directory's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_rows(run_dir) -> list[dict]:
    """The training rows (those with train/loss) of a run directory's metrics.jsonl."""
    return [r for r in read_metrics(run_dir) if "train/loss" in r]


def run_torchrun(script: str, *args: str) -> str:
    """Run ROOT/script under torchrun with 2 processes (gloo on CPU, one thread each), assert it succeeded;
    -> its stdout and stderr."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(ROOT / script),
           *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def interrupt_at_step_2(cmd: list[str], times: int = 1, sig: int = 2, pid=None, **popen) -> tuple[int, str]:
    """Run a training script, send signal `sig` (2: SIGINT, like Ctrl-C) `times` times once it logs step 2 (to the
    process whose pid `pid(proc)` gives, by default the script's), and return its exit code and the output after
    that line."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **popen.pop("env", {})}, **popen)
    try:
        for line in proc.stdout:  # wait until training is under way (the compact progress line, or a metrics line)
            if line.startswith(("step 2/", "step=2 ")):
                break
        target = pid(proc) if pid else proc.pid
        os.kill(target, sig)
        seen = ""
        if times == 2:  # the second once the first is acknowledged
            for line in proc.stdout:
                seen += line
                if line.startswith("Ctrl-C: saving a checkpoint after step"):
                    break
            os.kill(target, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        rest = seen + rest
    finally:
        proc.kill()
    return proc.returncode, rest


def interrupted_run(cmd: list[str], tmp_path, sig: int = 2) -> tuple:
    """Run a training script in tmp_path, stop it with `sig` (Ctrl-C's SIGINT, or SIGTERM) once at step 2, check that
    it exits with 128 + sig having saved one checkpoint and printed the resume command last; -> (run directory,
    checkpoint folder, output)."""
    returncode, rest = interrupt_at_step_2(cmd, sig=sig)
    assert returncode == 128 + sig, rest
    (run,) = Path(tmp_path).iterdir()
    (ckpt,) = (run / "checkpoints").glob("step_*")
    assert rest.rstrip().splitlines()[-1] == f"interrupted: saved {ckpt}; continue with --resume {ckpt}", rest
    return run, ckpt, rest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer, 32-wide Qwen2 with the task's tokenizer, and a small copy of the task.

    The random model never answers correctly, so RL tests on it use the `capitalization` reward,
    which varies inside a group of random strings and so gives non-zero advantages.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    sys.path.insert(0, str(ROOT / "data"))
    import make_arith

    root = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(ROOT / "data/arith/tokenizer")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    make_arith.main(root / "data", seed=3, n_train=96, n_test=8, n_prefs=4, max_digits=2)
    return root


def short_gpt2(folder: Path, n_positions: int) -> str:
    """A random 1-layer GPT-2 with `n_positions` positions and the task's tokenizer, saved in `folder` -> its path
    (for the context-length checks: GPT-2 names its context n_positions)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

    tok = AutoTokenizer.from_pretrained(ROOT / "data/arith/tokenizer")
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=n_positions, vocab_size=len(tok),
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)
