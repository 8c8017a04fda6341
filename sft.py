"""Supervised fine-tuning (SFT) with a completion-only loss; also makes the embedded tiny model.

The classic first stage of RLHF (InstructGPT, arXiv:2203.02155, Sec. 3.5): maximise the
log-likelihood of demonstration completions given their prompts,
    L(theta) = - sum_t log pi_theta(y_t | x, y_<t) / (number of completion tokens),
with prompt and padding tokens masked out of the loss.

Run:
    python sft.py                                                 # fine-tune models/tiny-arith on data/arith
    python sft.py --model-config models/tiny-arith-config.json --tokenizer-name-or-path data/arith/tokenizer \
        --total-steps 700 --learning-rate 2e-3 --warmup-steps 50 --final-dir models/tiny-arith   # remake the embedded model
    python sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset my/hub-dataset --dataset-split train \
        --prompt-column question --completion-column response --max-length 1024     # any HF causal LM
    torchrun --nproc-per-node 2 sft.py                           # data parallel (DDP), gloo on CPU, nccl on GPU

Deviations and choices:
- The loss is the token mean over the whole optimiser step (all micro-batches and processes), so
  gradient accumulation and DDP give the same gradient as one big batch.
- `--packing` concatenates examples (each ending in EOS) into rows of `--max-length`; attention is
  not blocked between packed examples (as in TRL's simple packing), a small leak we accept.
- `--dtype auto` keeps float32 weights and autocasts to bfloat16 on CUDA (float32 on CPU).
"""

import json
import math
import netrc
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
import tyro
from datasets import load_dataset
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging


@dataclass
class Args:
    # --- experiment / tracking
    exp_name: str = "sft"
    """name of this experiment, part of the run directory name"""
    seed: int = 1
    """seed of python, numpy and torch, and of the data order"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanrl-llm"
    """Weights & Biases project"""
    wandb_entity: Optional[str] = None
    """Weights & Biases team or user"""
    output_dir: str = "runs"
    """where run directories are created"""

    # --- model / data
    model_name_or_path: str = "models/tiny-arith"
    """local folder or Hugging Face id of the causal LM (and its tokenizer)"""
    model_config: Optional[str] = None
    """build a fresh, randomly initialised model from this config JSON instead of loading weights"""
    tokenizer_name_or_path: Optional[str] = None
    """tokenizer folder or id; defaults to --model-name-or-path"""
    dataset: str = "data/arith"
    """local folder of `<split>.jsonl` files, a JSON-lines file, or a Hugging Face dataset id"""
    dataset_split: str = "sft"
    """split with prompts and demonstration completions"""
    eval_split: Optional[str] = "test"
    """split with prompts and reference answers for greedy-decoding accuracy (None: no eval)"""
    prompt_column: str = "prompt"
    """column holding the prompt"""
    completion_column: str = "completion"
    """column holding the demonstration completion"""
    answer_column: str = "answer"
    """column of the eval split holding the reference answer"""
    max_length: int = 64
    """longest prompt + completion in tokens; longer completions are truncated"""
    packing: bool = False
    """concatenate examples into full rows of --max-length"""
    eval_limit: int = 500
    """evaluate on at most this many eval examples"""
    max_new_tokens: int = 48
    """generation budget of the greedy evaluation"""

    # --- optimisation
    learning_rate: float = 3e-4
    """peak learning rate of AdamW"""
    total_steps: int = 100
    """optimiser steps; changed on --resume, the lr decay continues from where it is and reaches 0 at the new
    last step"""
    batch_size: int = 64
    """sequences (or packed rows) per optimiser step, over all processes and micro-batches"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimiser step"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warmup"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    device: str = "auto"
    """cuda, cpu, or auto (cuda when available)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """weights dtype; auto = float32 weights with bfloat16 autocast on CUDA"""

    # --- logging / checkpointing
    log_every: int = 10
    """steps between rows of metrics.jsonl (and printed lines when the output is not a terminal)"""
    eval_every: int = 100
    """steps between greedy evaluations (0: only at start and end)"""
    save_every: int = 0
    """steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: Optional[str] = None
    """checkpoint folder (runs/<run>/checkpoints/step_N) to continue from, in its run directory, with the run's own
    arguments; flags given here that differ from their defaults may change the cadence (--total-steps, --log-every,
    --eval-every, --save-every, --eval-limit, tracking, --device, --final-dir), any other is refused"""
    final_dir: Optional[str] = None
    """also write the final model here (e.g. models/tiny-arith)"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time: {dataset}__{exp_name}__{seed}__{time}"""


# ----------------------------------------------------------------------------- math and data


def completion_only_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token negative log-likelihood over labelled tokens, and their count.

    logits: [B, T, V]; labels: [B, T] with -100 on prompt and padding. Position t predicts t+1.
    """
    targets = labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return nll, int((targets != -100).sum())


def build_example(prompt_ids: list[int], completion_ids: list[int], eos_id: int, max_length: int):
    """input_ids = prompt + completion + EOS, truncated to max_length; labels mask the prompt."""
    ids = (prompt_ids + completion_ids + [eos_id])[:max_length]
    labels = ([-100] * len(prompt_ids) + completion_ids + [eos_id])[:max_length]
    return ids, labels


def pack_examples(examples: list[tuple[list[int], list[int]]], max_length: int):
    """Greedily concatenate (ids, labels) pairs into rows of exactly max_length (the tail is dropped)."""
    rows, ids, labels = [], [], []
    for e_ids, e_labels in examples:
        ids, labels = ids + e_ids, labels + e_labels
        while len(ids) >= max_length:
            rows.append((ids[:max_length], labels[:max_length]))
            ids, labels = ids[max_length:], labels[max_length:]
    return rows


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad to the longest example: input_ids, attention_mask, labels, each [B, T]."""
    width = max(len(ids) for ids, _ in examples)
    out = torch.full((3, len(examples), width), 0, dtype=torch.long)
    out[0].fill_(pad_id)
    out[2].fill_(-100)
    for i, (ids, labels) in enumerate(examples):
        out[0, i, : len(ids)] = torch.tensor(ids)
        out[1, i, : len(ids)] = 1
        out[2, i, : len(labels)] = torch.tensor(labels)
    return out[0], out[1], out[2]


def lr_factor(step: int, warmup: int, total: int, schedule: str, anchor: Optional[tuple[int, float]] = None) -> float:
    """Multiplier of the peak learning rate: linear warmup, then cosine/linear decay to 0 or constant.

    anchor (s0, f0): a run resumed at step s0 (after warmup) with a new `total`: the decay starts again from the
    factor f0 it had reached and ends at 0 on the new last step, so the lr neither jumps nor stops early.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    start, scale = anchor if anchor is not None and anchor[0] >= warmup else (warmup, 1.0)
    progress = min(1.0, max(0, step - start) / max(1, total - start))
    return scale * (0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress)


ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)


def answer_matches(text: str, answer: str) -> bool:
    """True when the text's <answer>...</answer> equals the reference (numerically where both parse)."""
    m = ANSWER_RE.search(text)
    if m is None:
        return False
    got, want = m.group(1).strip(), str(answer).strip()
    try:
        return float(got) == float(want)
    except ValueError:
        return got == want


# ----------------------------------------------------------------------------- run plumbing


def load_split(dataset: str, split: str):
    """A split of a local folder of `<split>.jsonl`, a local JSON-lines file, or a hub dataset."""
    path = Path(dataset)
    if path.is_dir():
        file = path / f"{split}.jsonl"
        if not file.exists():
            have = sorted(f.stem for f in path.glob("*.jsonl"))
            raise ValueError(f"split '{split}' not found: {file} does not exist (splits in {path}: {have})")
        if not file.read_text().strip():
            raise ValueError(f"split '{split}' ({file}) is empty: it needs at least one row")
        return load_dataset("json", data_files={split: str(file)}, split=split)
    if path.is_file():
        return load_dataset("json", data_files=str(path), split="train")
    return load_dataset(dataset, split=split)


def check_columns(ds, columns: list[str], what: str) -> None:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{what} has no column {missing}; available columns: {ds.column_names} "
                         f"(choose with --prompt-column/--completion-column/--answer-column)")
    if len(ds) == 0:
        raise ValueError(f"{what} is empty: it needs at least one row")


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts, answers, max_new_tokens, device, batch_size=128, progress=False):
    """Greedy decoding on left-padded batches; returns (accuracy, [(prompt, completion, answer)])."""
    model.eval()
    correct, samples = 0, []
    for i in tqdm(range(0, len(prompts), batch_size), desc="eval", leave=False, disable=not progress):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        for p, t, a in zip(prompts[i : i + batch_size], texts, answers[i : i + batch_size]):
            correct += answer_matches(t, a)
            samples.append((p, t, a))
    model.train()
    return correct / max(1, len(prompts)), samples


def save_checkpoint(path: Path, model, tokenizer, state: Optional[dict] = None) -> None:
    """Write into a temporary folder, then rename: a killed run never leaves half a checkpoint."""
    tmp, old = path.with_name(f".tmp-{path.name}"), path.with_name(f".old-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if state is not None:
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(state["args"], indent=2))
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def plot_curves(metrics_file: Path, out: Path, keys=("train/loss", "eval/accuracy", "train/lr")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
    for ax, key in zip(axes, keys):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- run lifecycle

# Flags a resumed run may change (a notice is printed); any other flag that differs from the run's own value
# is refused, since it would change the algorithm or the data. The run directory is the checkpoint's, so
# --exp-name and --output-dir are ignored on resume.
RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "eval_limit", "track",
                     "wandb_project_name", "wandb_entity", "device", "final_dir")
RESUME_IGNORES = ("exp_name", "output_dir", "run_name", "resume")


def resume_args(args: Args) -> tuple[Args, dict]:
    """--resume: the run's own arguments from the checkpoint, with the flags given on this command line that
    differ from their defaults applied on top (RESUME_MAY_CHANGE) or refused. -> (args, {flag: [run's, new]})."""
    saved = json.loads((Path(args.resume) / "args.json").read_text())
    defaults, out, changed = Args(), Args(**{k: v for k, v in saved.items() if k in Args.__dataclass_fields__}), {}
    for name in Args.__dataclass_fields__:
        given = getattr(args, name)
        if name in RESUME_IGNORES or given == getattr(defaults, name) or given == saved.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if name not in RESUME_MAY_CHANGE:
            raise ValueError(f"{flag} {given} differs from the run's {saved.get(name)!r} ({args.resume}/args.json): "
                             f"it would change the algorithm or the data, so it cannot change on resume; drop the "
                             f"flag, or start a new run. Flags that may change: "
                             f"{', '.join('--' + n.replace('_', '-') for n in RESUME_MAY_CHANGE)}")
        setattr(out, name, given)
        changed[name] = [saved.get(name), given]
    out.resume = args.resume
    return out, changed


def looks_local(name: str) -> bool:
    """A path rather than a hub id: starts with . / ~, ends in .json/.jsonl, or its first part exists here."""
    return (name.startswith((".", "/", "~")) or name.endswith((".json", ".jsonl")) or name.count("/") > 1
            or ("/" in name and Path(name.split("/")[0]).exists()))


def check_hub_reachable(kind: str, name: str, local_hint: str) -> None:
    """A hub id is meant: fail at once when the hub cannot be reached, rather than after retries."""
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "0") not in ("", "0")]
    if offline:
        raise ValueError(f"{kind} '{name}' is not a local path, and {offline[0]}=1 forbids the Hugging Face Hub: "
                         f"pass a local path ({local_hint}) or unset {offline[0]}")
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        raise ValueError(f"{kind} '{name}' is not a local path and huggingface.co cannot be reached (offline?): "
                         f"pass a local path ({local_hint})") from None


def check_jsonl(file: Path) -> None:
    """Every line of a JSON-lines file is a JSON object, and there is at least one: name the file and line if not."""
    n = 0
    with file.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}, line {i}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{file}, line {i}: expected a JSON object with named columns, got {type(row).__name__}")
            n += 1
    if n == 0:
        raise ValueError(f"{file} is empty: it needs at least one JSON line")


def check_dataset(dataset: str, splits: list[str]) -> None:
    """The dataset and its splits exist and parse, before anything is loaded."""
    path = Path(dataset).expanduser()
    if path.is_dir():
        for split in splits:
            file = path / f"{split}.jsonl"
            if not file.exists():
                have = sorted(f.stem for f in path.glob("*.jsonl"))
                raise ValueError(f"split '{split}' not found: {file} does not exist (splits in {path}: {have})")
            check_jsonl(file)
    elif path.is_file():
        check_jsonl(path)
    elif looks_local(dataset):
        raise ValueError(f"dataset '{dataset}' does not exist: pass a folder of <split>.jsonl files, a .jsonl file "
                         f"(e.g. data/arith) or a hub id")
    else:
        check_hub_reachable("dataset", dataset, "e.g. data/arith")


def check_model_path(name: str, tokenizer_only: bool = False) -> None:
    """A local model folder has a config and a tokenizer (a tokenizer folder: the tokenizer alone); a hub id needs
    the hub."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not tokenizer_only and not (path / "config.json").exists():
            raise ValueError(f"'{name}' is not a model folder: it has no config.json (pass a folder written by "
                             f"save_pretrained, e.g. models/tiny-arith, or a hub id)")
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise ValueError(f"model folder '{name}' has no tokenizer (tokenizer.json or tokenizer_config.json): "
                             f"save the tokenizer beside the weights")
    elif path.exists() or looks_local(name):
        raise ValueError(f"model path '{name}' does not exist or is not a folder: pass a local model folder "
                         f"(e.g. models/tiny-arith) or a Hugging Face id")
    else:
        check_hub_reachable("model", name, "e.g. models/tiny-arith")


def check_device(device: str, dtype: str) -> None:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device {device}: use auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch sees no CUDA GPU on this machine: use --device cpu (or auto)")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and dtype == "float16":
        raise ValueError("--dtype float16 on CPU overflows to inf/nan within a step or two: use --dtype float32 "
                         "(or bfloat16) on CPU; float16 is for GPUs")


def check_wandb_login() -> None:
    """--track: wandb is installed and logged in (or offline), before any work is done."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError("--track needs the wandb package: `pip install wandb`") from None
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        login = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        login = None
    if not login:
        raise ValueError(f"--track: no Weights & Biases login for {host}: run `wandb login` (or set WANDB_API_KEY), "
                         f"or log locally with WANDB_MODE=offline")


def clean_run_dir(run_dir: Path, step: int) -> None:
    """On resume: drop half-written checkpoints left by a kill, and metrics logged after the checkpoint's step."""
    for tmp in [*run_dir.glob("checkpoints/.tmp-*"), *run_dir.glob("checkpoints/.old-*"), *run_dir.glob(".tmp-*"),
                *run_dir.glob(".old-*")]:
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [line for line in metrics.read_text().splitlines() if line.strip()]
        metrics.write_text("".join(line + "\n" for line in rows if json.loads(line)["step"] <= step))


class Interrupt:
    """Ctrl-C: the first asks the loop to finish its step and save; the second quits at once, without saving."""

    def __init__(self, rank: int):
        self.requested, self.rank, self.step = False, rank, 0

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self.first)
        return self

    def first(self, signum, frame):
        # the second Ctrl-C's handler goes in first: one arriving while the notice is written must not run this again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.requested = True
        if self.rank == 0:
            print(f"\nCtrl-C: finishing step {self.step}, then saving a checkpoint (Ctrl-C again to quit without "
                  f"saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def eta(seconds: float) -> str:
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m" if seconds >= 3600 else \
        f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def validate(args: Args) -> None:
    for name in ("total_steps", "batch_size", "gradient_accumulation_steps", "max_length", "log_every",
                 "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_every", "save_every", "warmup_steps", "eval_limit"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.learning_rate <= 0:
        raise ValueError(f"--learning-rate must be positive, got {args.learning_rate}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    share = world * args.gradient_accumulation_steps
    if args.batch_size % share:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by processes ({world}) x "
                         f"--gradient-accumulation-steps ({args.gradient_accumulation_steps}) = {share}: use "
                         f"--batch-size {share * max(1, args.batch_size // share)}")
    if args.model_config is not None and not Path(args.model_config).is_file():
        raise ValueError(f"--model-config {args.model_config} is not a file")
    check_device(args.device, args.dtype)
    if args.model_config is None:
        check_model_path(args.model_name_or_path)
    if args.tokenizer_name_or_path:
        check_model_path(args.tokenizer_name_or_path, tokenizer_only=True)
    check_dataset(args.dataset, [args.dataset_split] + ([args.eval_split] if args.eval_split else []))
    if args.track:
        check_wandb_login()


# ----------------------------------------------------------------------------- main


def main(args: Args) -> dict:
    # 0. Check every input before any work (a resumed run takes its own arguments from the checkpoint), then set
    #    up processes, device and seeds.
    overrides = {}
    if args.resume:
        if not (Path(args.resume) / "trainer_state.pt").exists():
            raise ValueError(f"--resume {args.resume}: no trainer_state.pt there; pass a runs/<run>/checkpoints/step_N "
                             f"folder")
        args, overrides = resume_args(args)
    validate(args)
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
    ddp = "LOCAL_RANK" in os.environ
    if ddp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    if args.device == "auto":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # 1. Data: tokenise prompt + completion, mask the prompt.
    tok_name = args.tokenizer_name_or_path or args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(tok_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = load_split(args.dataset, args.dataset_split)
    check_columns(train, [args.prompt_column, args.completion_column], f"split '{args.dataset_split}'")
    prompt_ids = tokenizer(list(train[args.prompt_column]), add_special_tokens=False)["input_ids"]
    comp_ids = tokenizer(list(train[args.completion_column]), add_special_tokens=False)["input_ids"]
    too_long = [i for i, p in enumerate(prompt_ids) if len(p) >= args.max_length]
    if too_long:
        i = too_long[0]
        raise ValueError(f"{len(too_long)} prompts are longer than --max-length {args.max_length} - 1 tokens "
                         f"(row {i} has {len(prompt_ids[i])}); raise --max-length or shorten them")
    examples = [build_example(p, c, tokenizer.eos_token_id, args.max_length) for p, c in zip(prompt_ids, comp_ids)]
    if args.packing:
        examples = pack_examples(examples, args.max_length)
        if not examples:
            raise ValueError(f"--packing: the data fills no row of --max-length {args.max_length}")
    eval_prompts, eval_answers = [], []
    if args.eval_split:
        ev = load_split(args.dataset, args.eval_split)
        check_columns(ev, [args.prompt_column, args.answer_column], f"eval split '{args.eval_split}'")
        n = min(len(ev), args.eval_limit)
        eval_prompts, eval_answers = list(ev[args.prompt_column][:n]), list(ev[args.answer_column][:n])

    # 2. Model: fresh from a config (how models/tiny-arith is made) or pretrained weights.
    weights_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.model_config is not None:
        config = AutoConfig.for_model(**json.loads(Path(args.model_config).read_text()))
        if config.vocab_size < len(tokenizer):
            raise ValueError(f"config vocab_size {config.vocab_size} < tokenizer size {len(tokenizer)}")
        model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=weights_dtype)
    model.to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    raw_model = model
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")

    # 3. Optimiser, schedule and data order; restore them all on --resume.
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    lr_anchor = None  # set when a resumed run changes --total-steps (lr_factor)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    order_gen = torch.Generator().manual_seed(args.seed)
    order, cursor, start_step = torch.randperm(len(examples), generator=order_gen), 0, 0
    if args.resume:
        ckpt = Path(args.resume)
        raw_model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=weights_dtype).state_dict())
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        order_gen.set_state(state["order_gen"])
        order, cursor, start_step = state["order"], state["cursor"], state["step"]
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        torch.set_rng_state(state["torch_rng"])
        lr_anchor = state["lr_anchor"]
        if "total_steps" in overrides:  # the decay continues from where it is to the new last step
            lr_anchor = (start_step, lr_factor(start_step, args.warmup_steps, overrides["total_steps"][0],
                                               args.lr_schedule, lr_anchor))
        run_dir = ckpt.parents[1]
    else:
        args.run_name = f"{Path(args.dataset).name}__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir = Path(args.output_dir) / args.run_name
    metrics_file = run_dir / "metrics.jsonl"
    wandb = None
    progress = rank == 0 and sys.stderr.isatty()  # a progress bar on a terminal, compact lines otherwise
    last = {"eval/accuracy": None}  # the latest values the progress line shows

    def log(metrics: dict) -> None:
        if rank != 0:
            return
        with metrics_file.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        last.update(metrics)
        if wandb:
            wandb.log(metrics, step=metrics["step"])

    def report(step: int, seconds_per_step: float) -> None:
        """The key numbers: on the progress bar (a terminal), or one compact line."""
        if rank != 0:
            return
        shown = {"loss": last.get("train/loss"), "acc": last["eval/accuracy"]}
        text = " | ".join(f"{k} {v:.3g}" for k, v in shown.items() if v is not None)
        if progress:
            bar.set_postfix_str(f"{text} | {seconds_per_step:.2f} s/step")
        else:
            print(f"step {step}/{args.total_steps} | {text} | {seconds_per_step:.2f} s/step | "
                  f"ETA {eta((args.total_steps - step) * seconds_per_step)}", flush=True)

    def evaluate(step: int) -> float:
        acc = None
        if rank == 0 and eval_prompts:
            acc, samples = greedy_accuracy(raw_model, tokenizer, eval_prompts, eval_answers, args.max_new_tokens, device,
                                           progress=progress)
            log({"step": step, "eval/accuracy": acc})
            if not progress:
                print(f"eval at step {step}: accuracy {acc:.4f} on {len(eval_prompts)} prompts", flush=True)
            if wandb:
                wandb.log({"eval/samples": wandb.Table(columns=["prompt", "completion", "answer"],
                                                       data=[list(s) for s in samples[:16]])}, step=step)
        if ddp:
            dist.barrier()
        return acc

    def checkpoint(step: int) -> Path:
        path = run_dir / "checkpoints" / f"step_{step}"
        if rank == 0:
            save_checkpoint(path, raw_model, tokenizer, {
                "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "order_gen": order_gen.get_state(), "order": order, "cursor": cursor,
                "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
                "torch_rng": torch.get_rng_state(), "lr_anchor": lr_anchor, "args": asdict(args)})
        if ddp:
            dist.barrier()
        return path

    # 4. Train: the run directory (a fresh one is removed if the run fails before its first step ends); Ctrl-C
    #    finishes the current step, saves a checkpoint and exits; a second Ctrl-C quits without saving.
    if rank == 0:
        if args.resume:
            clean_run_dir(run_dir, start_step)
            args_json = json.loads((run_dir / "args.json").read_text())
            args_json.setdefault("resumed", []).append({"step": start_step, "checkpoint": str(args.resume),
                                                        "overrides": overrides})
            (run_dir / "args.json").write_text(json.dumps(args_json, indent=2))
            for name, (old, new) in overrides.items():
                print(f"resume: --{name.replace('_', '-')} {new} (the run had {old})")
        else:
            run_dir.mkdir(parents=True)
            (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
        print(f"run directory: {run_dir}  |  {len(examples)} training rows, {len(eval_prompts)} eval prompts, "
              f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters on {device}", flush=True)
    micro = args.batch_size // (world * args.gradient_accumulation_steps)
    step, final = start_step, {}
    t_log, tokens_since_log, last_log_step = time.time(), 0, start_step
    stop, steps_timed, seconds_timed = Interrupt(rank), 0, 0.0
    bar = tqdm(total=args.total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=not progress)
    try:
        if args.track and rank == 0:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name,
                       config=vars(args), dir=str(run_dir), resume="allow")
        with stop:
            if start_step == 0:
                evaluate(0)
            for step in range(start_step + 1, args.total_steps + 1):
                stop.step = step
                t_step = time.perf_counter()
                # 4a. Next global batch in epoch order; every process draws the same indices and keeps its share.
                if cursor + args.batch_size > len(order):
                    order, cursor = torch.randperm(len(examples), generator=order_gen), 0
                batch = [examples[i] for i in order[cursor : cursor + args.batch_size].tolist()]
                cursor += args.batch_size
                n_tokens = sum(sum(1 for t in labels[1:] if t != -100) for _, labels in batch)
                mine = batch[rank * micro * args.gradient_accumulation_steps:][: micro * args.gradient_accumulation_steps]
                # 4b. Loss = summed NLL / tokens of the whole global batch; DDP averages over processes, hence x world.
                loss_total = 0.0
                for k in range(args.gradient_accumulation_steps):
                    ids, mask, labels = (t.to(device) for t in collate(mine[k * micro : (k + 1) * micro], tokenizer.pad_token_id))
                    sync = k == args.gradient_accumulation_steps - 1 or not ddp
                    with (model.no_sync() if not sync else torch.enable_grad()), autocast:
                        nll, _ = completion_only_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
                        (nll * world / n_tokens).backward()
                    loss_total += nll.item()
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr = scheduler.get_last_lr()[0]  # the rate of this step's update (logged below)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                tokens_since_log += sum(len(ids) for ids, _ in batch)
                steps_timed, seconds_timed = steps_timed + 1, seconds_timed + time.perf_counter() - t_step

                if step % args.log_every == 0 or step == args.total_steps:
                    if ddp:
                        t = torch.tensor([loss_total], device=device)
                        dist.all_reduce(t)
                        loss_total = t.item()
                    elapsed = time.time() - t_log
                    final = {"step": step, "train/loss": loss_total / n_tokens, "train/grad_norm": float(grad_norm),
                             "train/lr": lr, "perf/step_s": elapsed / (step - last_log_step),
                             "perf/tokens_per_s": tokens_since_log / max(elapsed, 1e-9)}
                    log(final)
                    t_log, tokens_since_log, last_log_step = time.time(), 0, step
                bar.update(1)
                if progress or step % args.log_every == 0:
                    report(step, seconds_timed / steps_timed)
                if args.eval_every and step % args.eval_every == 0 and step != args.total_steps:
                    evaluate(step)
                if args.save_every and step % args.save_every == 0:
                    checkpoint(step)
                if ddp:  # every process stops at the same step, even if the signal reached them apart
                    flag = torch.tensor([float(stop.requested)], device=device)
                    dist.all_reduce(flag)
                    stop.requested = bool(flag.item())
                if stop.requested:
                    path = checkpoint(step)
                    if rank == 0:
                        print(f"interrupted: saved {path}; continue with --resume {path}", flush=True)
                    break
    except BaseException:
        if rank == 0 and not args.resume and steps_timed == 0:  # a failed start leaves no run directory
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        bar.close()

    # 5. Final evaluation, the trained model, the curves.
    if not stop.requested:
        final["eval/accuracy"] = evaluate(step)
        checkpoint(step)
        if rank == 0:
            save_checkpoint(run_dir / "final", raw_model, tokenizer)
            if args.final_dir:
                save_checkpoint(Path(args.final_dir), raw_model, tokenizer)
    if rank == 0:
        plot_curves(metrics_file, run_dir / "curves.png")
    if wandb:
        wandb.finish()
    if ddp:
        dist.destroy_process_group()
    final.update({"run_dir": str(run_dir), "interrupted": stop.requested})
    return final


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except KeyboardInterrupt:  # the second Ctrl-C: quit at once; the last checkpoint written is intact
        print("\ninterrupted again: quit without saving", file=sys.stderr)
        sys.exit(130)
