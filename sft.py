"""Supervised fine-tuning (SFT), the first stage of RLHF (InstructGPT, arXiv:2203.02155, Sec. 3.5): maximise the
log-likelihood of demonstration completions given their prompts (prompt and padding masked out of the loss).

    L(theta) = - sum_t log pi_theta(y_t | x, y_<t) / (the step's completion tokens).
Details: docs/sft.md.

Run:
    python sft.py  # 100 more SFT steps on models/tiny-arith, CPU
    python sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset my/dataset --dataset-split train --max-length 1024
    torchrun --nproc-per-node 2 sft.py  # data parallel

Choice: --packing lets packed examples attend to each other (TRL's simple packing).
"""
import atexit
import contextlib
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, make_dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro
from datasets import Dataset, load_dataset
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers import logging as hf_logging


@dataclass
class Algorithm:
    max_length: int = 64
    """most tokens of prompt + completion (the rest is cut)"""
    packing: bool = False
    """concatenate examples into full rows"""


@dataclass
class ModelData:
    model_name_or_path: str = "models/tiny-arith"
    """folder or hub id of the model and its tokenizer"""
    model_config: Optional[str] = None
    """config JSON of a new, random model"""
    tokenizer_name_or_path: Optional[str] = None
    """tokenizer folder or id (None: the model's)"""
    dataset: str = "data/arith"
    """folder of <split>.jsonl files, a JSON-lines file, or hub id"""
    dataset_split: str = "sft"
    """split of prompts and completions"""
    eval_split: Optional[str] = "test"
    """split of prompts and answers for greedy accuracy (None: none)"""
    prompt_column: str = "prompt"
    """column of prompts"""
    completion_column: str = "completion"
    """column of demonstrations"""
    answer_column: str = "answer"
    """column of eval answers"""
    eval_limit: int = 500
    """most eval prompts"""
    max_new_tokens: int = 48
    """tokens generated per eval prompt"""


@dataclass
class Optimisation:
    learning_rate: float = 3e-4
    """peak AdamW learning rate"""
    total_steps: int = 100
    """optimiser steps (may change on --resume)"""
    batch_size: int = 64
    """rows per step, all processes"""
    gradient_accumulation_steps: int = 1
    """micro-batches per step"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """decay after warmup"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""


@dataclass
class Logging:
    log_every: int = 10
    """steps per row of metrics.jsonl"""
    eval_every: int = 100
    """steps per evaluation (0: first and last)"""
    save_every: int = 0
    """steps between saves (0: at the end or a stop)"""
    save_every_minutes: float = 30.0
    """also save every this many minutes (0: off)"""
    resume: Optional[str] = None
    """runs/<run>/checkpoints/step_N to continue"""
    final_dir: Optional[str] = None
    """the trained model's folder (None: the run's final/)"""


@dataclass
class Engineering:
    gradient_checkpointing: bool = False
    """recompute activations in backward"""
    fsdp: bool = False
    """under torchrun, shard the model and AdamW (FSDP2), not copy (DDP)"""
    device: str = "auto"
    """cuda, cpu, or auto (cuda if available)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights dtype; auto: float32, bfloat16 autocast on CUDA"""
    exp_name: str = "sft"
    """part of the run directory's name"""
    seed: int = 1
    """seed of the RNGs and data order"""
    output_dir: str = "runs"
    """parent of run directories"""
    run_dir: Optional[str] = None
    """a new run directory (None: one in --output-dir)"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanrl-llm"
    """W&B project"""
    wandb_entity: Optional[str] = None
    """W&B team or user"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time"""


@dataclass
class Args(Engineering, Logging, Optimisation, ModelData, Algorithm):
    pass

# ---- the algorithm


def completion_only_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss above as a sum, and its token count. logits: [B, T, V]; labels: [B, T], -100 where masked."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                            reduction="sum")
    return nll, int((labels[:, 1:] != -100).sum())


def build_example(prompt_ids: list[int], completion_ids: list[int], eos_id: int, max_length: int):
    """input_ids = prompt + completion + EOS, truncated to max_length; labels mask the prompt."""
    ids = (prompt_ids + completion_ids + [eos_id])[:max_length]
    labels = ([-100] * len(prompt_ids) + completion_ids + [eos_id])[:max_length]
    return ids, labels


def pack_examples(examples: list[tuple], max_length: int):
    """The (ids, labels) pairs joined and cut into rows of max_length, the tail dropped."""
    ids = [t for e, _ in examples for t in e]
    labels = [t for _, e in examples for t in e]
    starts = range(0, len(ids) - max_length + 1, max_length)
    return [(ids[i : i + max_length], labels[i : i + max_length]) for i in starts]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-pad to the longest example: input_ids, attention_mask, labels, each [B, T]."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([x + [pad_id] * (width - len(x)) for x, _ in examples])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in examples])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in examples])
    return ids, mask, labels


def lr_factor(step: int, warmup: int, total: int, schedule: str, anchor: Optional[tuple[int, float]] = None) -> float:
    """Multiplier of the peak lr: linear warmup, then cosine/linear decay to 0, or constant. anchor (s0, f0): a
    resume at s0 with a new `total` decays from f0."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    start, scale = anchor if anchor is not None and anchor[0] >= warmup else (warmup, 1.0)
    progress = min(1.0, max(0, step - start) / max(1, total - start))
    return scale * (0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress)


def load_examples(args: Args, tokenizer) -> tuple[list, list, list]:
    """-> the training rows (at least a batch), the eval prompts and answers."""
    flags = "--prompt-column/--completion-column/--answer-column"
    split = load_split(args, "dataset_split", [args.prompt_column, args.completion_column], flags)
    prompts, completions = (tokenizer(list(split[column]), add_special_tokens=False)["input_ids"]
                            for column in (args.prompt_column, args.completion_column))
    too_long = sum(len(p) >= args.max_length for p in prompts)
    if too_long:  # they would have no token to learn
        raise ValueError(f"{too_long} prompts are longer than --max-length {args.max_length} - 1 tokens: raise it")
    rows = [build_example(p, c, tokenizer.eos_token_id, args.max_length) for p, c in zip(prompts, completions)]
    if args.packing:
        rows = pack_examples(rows, args.max_length)
    if len(rows) < args.batch_size:
        raise ValueError(f"{len(rows)} training rows{' (packed)' * args.packing} < --batch-size {args.batch_size}")
    if not args.eval_split:
        return rows, [], []
    ev = load_split(args, "eval_split", [args.prompt_column, args.answer_column], flags)[: args.eval_limit]
    return rows, ev[args.prompt_column], ev[args.answer_column]


def batch_indices(step: int, n: int, size: int, seed: int) -> list[int]:
    """Step `step`'s global batch, alike in all processes and resumes: seeded epochs of permutations, the tail
    skipped."""
    epoch, k = divmod(step - 1, n // size)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1_000_003 * epoch))
    return order[k * size : (k + 1) * size].tolist()


def sft_update(model, optimizer, batch: list, micro: int, args: Args, run, pad_id: int):
    """One optimiser step on this process's share of `batch`, `micro` rows at a time -> (this process's NLL sum,
    global completion tokens, grad norm)."""
    n_tokens = sum(t != -100 for _, labels in batch for t in labels[1:])
    accum = args.gradient_accumulation_steps
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=run.device.type == "cuda" and args.dtype == "auto")
    nll_sum = 0.0
    for k in range(accum):
        ids, mask, labels = (t.to(run.device) for t in collate(batch[(run.rank * accum + k) * micro :][:micro], pad_id))
        with (model.no_sync() if k < accum - 1 and hasattr(model, "no_sync") else torch.enable_grad()), autocast:
            nll, _ = completion_only_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
            (nll * run.world / n_tokens).backward()  # x world: DDP averages the gradients
        nll_sum += nll.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    return nll_sum, n_tokens, grad_norm


RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "save_every_minutes", "eval_limit",
                     "track", "wandb_project_name", "wandb_entity", "device", "final_dir")


def main(args: Args) -> dict:
    # 0. Check every input first (--resume: the run's own arguments).
    args, overrides = resume_args(args, RESUME_MAY_CHANGE)
    micro = check_args(args)
    run = Run(args, overrides, ("train/loss", "eval/accuracy"))

    # 1. Data: the training rows, the eval split.
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path or args.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    examples, eval_prompts, eval_answers = load_examples(args, tokenizer)

    # 2. Model, fresh or pretrained, if the data fit its context; DDP or FSDP2.
    config = AutoConfig.from_pretrained(args.model_config or args.model_name_or_path)
    if args.model_config and config.vocab_size < len(tokenizer):
        raise ValueError(f"--model-config: vocab_size {config.vocab_size} < the tokenizer's {len(tokenizer)}")
    check_context(config, [[]], args.max_length, "--max-length")
    check_context(config, [tokenizer(p, add_special_tokens=False).input_ids for p in eval_prompts], args.max_new_tokens,
                  "--max-new-tokens")
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = (AutoModelForCausalLM.from_config(config, dtype=dtype) if args.model_config else
             AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)).to(run.device)
    eos_ids = own_generation_config(model, tokenizer)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trained = model
    if run.fsdp:
        trained = run.shard(model, decoder_layers(model))
    elif run.ddp:
        trained = torch.nn.parallel.DistributedDataParallel(model)

    # 3. Optimiser and schedule; --resume restores them and the weights.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    run.trained = (trained, optimizer)  # what --fsdp checkpoints in shards
    lr_anchor = None
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    lr_anchor = run.restore(model, optimizer, scheduler).get("lr_anchor")
    if "total_steps" in overrides:  # decay from here to the new last step
        lr_anchor = (run.start, lr_factor(run.start, args.warmup_steps, overrides["total_steps"][0], args.lr_schedule,
                                          lr_anchor))

    def measure() -> tuple[dict, list]:
        acc, samples = greedy_accuracy(model, tokenizer, eval_prompts, eval_answers, args.max_new_tokens, eos_ids,
                                       run.progress)
        return {"eval/accuracy": acc} if eval_prompts else {}, samples

    def save() -> Path:
        return run.checkpoint(model, tokenizer, {"optimizer": None if run.fsdp else optimizer.state_dict(),
                                                 "scheduler": scheduler.state_dict(), "lr_anchor": lr_anchor}, {})

    # 4. Train.
    run.say(f"run directory: {run.dir}  |  {len(examples)} training rows, {len(eval_prompts)} eval prompts")
    final = {}
    with run:
        for step in run.steps(measure, save):
            t0 = time.perf_counter()
            # 4a. The step's global batch; each process keeps its share.
            batch = [examples[i] for i in batch_indices(step, len(examples), args.batch_size, args.seed)]
            # 4b. One optimiser step on the completion-only loss.
            nll, n_tokens, grad_norm = sft_update(trained, optimizer, batch, micro, args, run, tokenizer.pad_token_id)
            lr = scheduler.get_last_lr()[0]  # the rate of this step's update
            scheduler.step()
            seconds = time.perf_counter() - t0

            # 4c. Log the metrics.
            if step % args.log_every == 0 or step == args.total_steps:
                loss = float(run.gather(torch.tensor([nll], device=run.device)).sum()) / n_tokens
                final = {"step": step, "train/loss": loss, "train/grad_norm": float(grad_norm), "train/lr": lr,
                         "perf/step_s": seconds, "perf/tokens_per_s": sum(len(ids) for ids, _ in batch) / seconds}
                run.log(final)

    # 5. Final evaluation, a checkpoint, final/ (or --final-dir).
    return run.finish(final, measure, save, model, tokenizer)


def check_args(args: Args) -> int:
    """Checks needing no loading -> the micro-batch each process uses."""
    check_common(args, ("total_steps", "batch_size", "gradient_accumulation_steps", "max_length", "log_every",
                        "max_new_tokens", "learning_rate", "eval_limit"), ("eval_every", "save_every", "warmup_steps"),
                 () if args.model_config else (args.model_name_or_path,))  # a fresh model loads no weights
    passes = int(os.environ.get("WORLD_SIZE", 1)) * args.gradient_accumulation_steps
    if args.batch_size % passes:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by processes x --gradient-accumulation-steps"
                         f" = {passes}: use --batch-size {passes * max(1, args.batch_size // passes)}")
    if args.model_config and not Path(args.model_config).is_file():
        raise ValueError(f"--model-config {args.model_config} is not a file")
    tok = args.tokenizer_name_or_path
    if tok and check_local_or_hub("model", tok) and not list(Path(tok).expanduser().glob("tokenizer*.*")):
        raise ValueError(f"--tokenizer-name-or-path {tok}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    return args.batch_size // passes


# ---- plumbing: one text per name in all scripts


def answer_matches(text: str, answer) -> bool:
    """The text's <answer>...</answer> equals the reference (numerically where both parse)."""
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    got = m.group(1).strip() if m else None
    try:
        return float(got) == float(answer)
    except (TypeError, ValueError):
        return got == str(answer).strip()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts, answers, max_new_tokens, eos_ids, progress, batch_size=128):
    """Greedy decoding on left-padded batches -> (accuracy, [(prompt, completion, answer)])."""
    model.eval()
    samples = []
    for i in tqdm(range(0, len(prompts), batch_size), desc="eval", leave=False, disable=not progress):
        batch = prompts[i : i + batch_size]
        enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        out = model.generate(**enc.to(model.device), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, synced_gpus=False)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        samples += zip(batch, texts, answers[i : i + batch_size])
    model.train()
    return sum(answer_matches(t, a) for _, t, a in samples) / max(1, len(prompts)), samples


CHECKPOINT_GENERATION_CONFIG = {}  # "policy": the checkpoint's own, kept in final/


def own_generation_config(model, tokenizer) -> list[int]:
    """Only its generation_config's special tokens, so generate samples softmax(logits / T) -> EOS ids."""
    old = model.generation_config
    kept = ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "_from_model_config", "use_cache",
            "output_attentions", "output_hidden_states")
    eos = sorted({tokenizer.eos_token_id} | set(np.atleast_1d(old.eos_token_id or []).tolist()))
    dropped = [f"{k}={v}" for k, v in old.to_diff_dict().items() if k not in kept]
    model.generation_config = type(old)(
        bos_token_id=old.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    CHECKPOINT_GENERATION_CONFIG["policy"] = old
    if dropped and int(os.environ.get("RANK", 0)) == 0:
        print(f"{model.name_or_path}: its generation_config's {', '.join(dropped)} not used: the flags decide")
    return eos


def load_split(args, flag: str, columns: list[str], column_flags: str):
    """--<flag>'s split: a folder's <split>.jsonl, a hub split; one file: seeded 10% eval, 90% train."""
    split, path = getattr(args, flag), Path(args.dataset).expanduser()
    file = path / f"{split}.jsonl" if path.is_dir() else path
    skip = f", or skip this split with --{flag.replace('_', '-')} None" if "eval" in flag else ""
    splits = {f: s for f, s in vars(args).items() if f.endswith("_split") and s}
    have = sorted(f.stem for f in path.glob("*.jsonl"))
    missing = {f: s for f, s in splits.items() if s not in have}
    if path.is_dir() and missing:
        fixes = [f"--{f.replace('_', '-')} {'None' if 'eval' in f else '|'.join(have) or '<split>'}" for f in missing]
        raise ValueError(f"split not found: {path} has no {', '.join(s + '.jsonl' for s in missing.values())} (its "
                         f"splits: {', '.join(have) or 'none'}): pass {' '.join(fixes)}")
    if path.exists():
        rows = []
        for i, line in enumerate(file.read_text().splitlines(), 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}, line {i}: not valid JSON at column {e.colno}: {e.msg}{skip}") from None
            if rows and not isinstance(rows[-1], dict):
                raise ValueError(f"{file}, line {i}: expected a JSON object, got {type(rows[-1]).__name__}{skip}")
        if not rows:
            raise ValueError(f"{file} is empty: it needs at least one JSON line")
        try:
            ds = Dataset.from_dict({k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{file}: a column's values differ in type ({e}): give each column one type") from None
    else:
        check_local_or_hub("dataset", args.dataset)
        try:
            ds = load_dataset(args.dataset, split=split)
        except Exception as e:
            raise ValueError(f"dataset '{args.dataset}': {e} (offline? load it once online, or pass a folder of "
                             "<split>.jsonl files)") from None
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        where = file if path.is_file() else f"split '{split}'"
        raise ValueError(f"{where} has no column {missing}; available columns: {ds.column_names} (choose with "
                         f"{column_flags}{skip})")
    if path.is_file() and any("eval" in f for f in splits):
        if len(ds) < 2:
            raise ValueError(f"{path} has 1 row: none to hold out for eval; pass --eval-split None")
        parts = ds.train_test_split(test_size=0.1, seed=0)
        if flag == "dataset_split" and int(os.environ.get("RANK", 0)) == 0:
            print(f"{path} is one file: {len(parts['test'])} of its {len(ds)} rows (a fixed seeded 10%) are held out")
        ds = parts["test" if "eval" in flag else "train"]
    return ds


def check_local_or_hub(kind: str, name: str) -> bool:
    """True for a local path; a hub id must be on the Hub (offline: in the cache)."""
    if Path(name).expanduser().exists():
        return True
    hint = f"a local folder or a hub id, e.g. {'models/tiny-arith' if kind == 'model' else 'data/arith'}"
    if name.startswith((".", "/", "~")) or name.endswith((".json", ".jsonl")) or name.count("/") > 1 or Path(
            name.split("/")[0]).exists():
        raise ValueError(f"{kind} '{name}' does not exist: pass {hint}")
    from huggingface_hub import repo_exists, snapshot_download

    get = (f"`hf download {name}`, then pass the folder it prints" if kind == "model" else
           "pass a folder of <split>.jsonl files")
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    try:
        if offline and kind == "model":
            snapshot_download(name, local_files_only=True)
        found = offline or repo_exists(name, repo_type=kind)
    except Exception as e:  # not cached, no network, a proxy
        raise ValueError(f"{kind} '{name}': " + ("not in the Hugging Face cache (HF_HUB_OFFLINE=1): " if offline else
                         f"the Hugging Face Hub cannot be reached ({type(e).__name__}): set HF_HUB_OFFLINE=1 if the "
                         "cache holds it, or ") + get) from None
    if not found:
        raise ValueError(f"{kind} '{name}' is not on the Hugging Face Hub (private? `hf auth login`): pass {hint}")
    return False


def check_common(args, positive: tuple, non_negative: tuple, model_paths):
    """Counts, device, model folders, --fsdp: before any work."""
    args.notes = []  # Run.__enter__ prints them
    for name in positive + non_negative + ("save_every_minutes",):
        value, strict = getattr(args, name), name in positive
        if value < 0 or strict and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be {'positive' if strict else '>= 0'}, got {value}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device {args.device}: use auto, cpu, cuda or cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA GPU; use --device cpu or auto")
    for name in model_paths:
        try:
            if check_local_or_hub("model", name) and not (Path(name).expanduser() / "config.json").exists():
                raise ValueError(f"'{name}' is not a model folder: it has no config.json")
        except ValueError as e:
            flag = next(k for k, v in vars(args).items() if v == name)
            raise ValueError(f"--{flag.replace('_', '-')}: {e}") from None
    if args.run_dir and not args.resume and Path(args.run_dir).exists():
        raise ValueError(f"--run-dir {args.run_dir} exists: pass a new one, or --resume one of its checkpoints")
    if args.warmup_steps >= args.total_steps and not args.resume:  # else the lr never leaves warmup
        if args.warmup_steps != type(args)().warmup_steps:
            args.notes.append(f"--warmup-steps {args.warmup_steps} >= --total-steps: warmup {args.total_steps // 10}")
        args.warmup_steps = args.total_steps // 10
    if not args.fsdp:
        return
    if "LOCAL_RANK" not in os.environ:
        raise ValueError("--fsdp needs several processes: launch with torchrun --nproc-per-node N, or drop it")
    if getattr(args, "lora_r", 0):
        raise ValueError("--fsdp with --lora-r is not supported: drop one (LoRA fits DDP)")
    if args.resume and not (Path(args.resume) / "sharded").is_dir():
        raise ValueError(f"--resume {args.resume}: an --fsdp run's checkpoint has a sharded/ folder; this has none")
    config = AutoConfig.from_pretrained(getattr(args, "model_config", None) or args.model_name_or_path)
    with torch.device("meta"):  # weightless
        decoder_layers(AutoModel.from_config(config))


def decoder_layers(model) -> list:
    """FSDP2's units: the longest ModuleList of one class (model.layers, h, ...)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ValueError(f"--fsdp: no list of decoder layers found in {type(model).__name__}: drop --fsdp (DDP)")
    return list(max(lists, key=len))


def check_context(config, prompt_ids: list, new_tokens: int, flag: str):
    """The longest prompt plus new tokens fit the model's positions."""
    context, longest = getattr(config, "max_position_embeddings", None), max(map(len, prompt_ids), default=0)
    if context and longest + new_tokens > context:
        raise ValueError(f"a {longest}-token prompt and {flag} {new_tokens} exceed the model's {context} positions: "
                         f"pass {flag} {context - longest} or less, or shorter prompts")


def resume_args(args, may_change: tuple[str, ...]):
    """--resume: the run's args, plus the flags given here that `may_change` -> (args, changes)"""
    for name in ("model_name_or_path", "dataset") * (not args.resume):  # run from elsewhere: beside this file
        beside = Path(__file__).parent / getattr(args, name)
        if not Path(getattr(args, name)).expanduser().exists() and beside.exists():
            setattr(args, name, str(beside))
    if not args.resume:
        return args, {}
    resume = Path(args.resume)
    if not (resume / "trainer_state.pt").exists():
        found = sorted(resume.glob("checkpoints/step_*"), key=lambda p: int(p.name[5:]))
        where = f"one of this run's checkpoints: {', '.join(map(str, found))}" if found else "<run>/checkpoints/step_N"
        raise ValueError(f"--resume {args.resume}: no trainer_state.pt there; pass {where}")
    cls, saved = type(args), json.loads((resume / "args.json").read_text())
    defaults, changed, fields = cls(), {}, cls.__dataclass_fields__
    out = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields})  # JSON: no tuples
    for name in fields:
        given = getattr(args, name)
        if name in ("exp_name", "output_dir", "run_dir", "run_name", "resume") or given in (
                getattr(defaults, name), getattr(out, name)):
            continue
        if name not in may_change:
            may = ", ".join("--" + n.replace("_", "-") for n in may_change)
            raise ValueError(f"--{name.replace('_', '-')} {given} differs from the run's {saved.get(name)!r} and "
                             f"cannot change on resume (drop it); these may: {may}")
        setattr(out, name, given)
        changed[name] = [saved.get(name), given]
    out.resume = args.resume
    step = torch.load(resume / "trainer_state.pt", weights_only=False, mmap=True)["step"]
    if step > out.total_steps - (resume.parents[1] / "final").exists():  # stopped in the last evaluation: go on
        raise ValueError(f"--resume {args.resume}: the run ended here (--total-steps {out.total_steps}); to train on, "
                         f"pass a larger --total-steps")
    return out, changed


def save_pretrained(path: Path, model, tokenizer, state=None, weights=None, sharded=None):
    """A temporary folder, renamed: a killed run leaves no half checkpoint."""
    tmp, old = path.with_name(f".tmp-{path.name}"), path.with_name(f".old-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=weights)
    if (tmp / "generation_config.json").exists() and "policy" in CHECKPOINT_GENERATION_CONFIG:
        CHECKPOINT_GENERATION_CONFIG["policy"].save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if sharded:
        os.replace(sharded, tmp / "sharded")
    if state:
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(state["args"], indent=2))
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


class Run:
    """One process's run: device, seeds, torchrun; inside `with run:` the run dir, W&B, signals."""

    def __init__(self, args, overrides: dict, shown: tuple[str, ...]):
        hf_logging.disable_progress_bar()
        self.args, self.overrides, self.shown = args, overrides, shown
        self.ddp = "LOCAL_RANK" in os.environ
        if self.ddp:  # ended at exit, after main's DDP modules (else gloo can hang)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            atexit.register(dist.destroy_process_group)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.ddp else (0, 1)
        cuda = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(cuda if args.device == "auto" else args.device)
        self.fsdp, self.sharded, self.trained = args.fsdp, [], None  # trained: (root, optimizer)
        random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
        if not args.resume:  # rank 0's clock names the run
            stamp = torch.tensor([int(time.time())], device=self.device)
            if self.ddp:
                dist.broadcast(stamp, 0)
            args.run_name = f"{Path(args.dataset).name}__{args.exp_name}__{args.seed}__{stamp.item()}"
            args.run_dir = args.run_dir or f"{args.output_dir}/{args.run_name}"
        self.dir = Path(args.resume).parents[1] if args.resume else Path(args.run_dir)
        self.start = self.step = 0
        self.seconds, self.first, self.last, self.wandb, self.stop = 0.0, {}, {}, None, False  # stop: a pause, a signal
        self.signal, self.saved_at, self.saved_step, self.evaluating, self.evaluated = 0, time.time(), -1, False, False
        self.progress = self.rank == 0 and sys.stderr.isatty()

    def restore(self, model, optimizer, scheduler):
        """--resume: weights, optimizer, scheduler, RNGs -> trainer_state.pt's dict."""
        self.trained[0].train()  # from_pretrained leaves eval mode
        if not self.args.resume:
            return {}
        path = Path(self.args.resume)
        if self.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            shards = dict(zip(("model", "optimizer"), get_state_dict(*self.trained)))
            dcp.load(shards, checkpoint_id=str(path / "sharded"))
            set_state_dict(*self.trained, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
        elif getattr(self.args, "lora_r", 0):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors", device=str(self.device)))
        else:
            model.load_state_dict(type(model).from_pretrained(path, dtype=next(model.parameters()).dtype).state_dict())
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        state.update({k: v[self.rank].clone() for k, v in state.pop("per_rank").items()})
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.start = self.step = state["step"]
        if not self.fsdp:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state

    def shard(self, module, layers: list):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy()
        if self.device.type == "cuda" and self.args.dtype == "auto":
            mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        for unit in [*layers, module]:  # the root last
            fully_shard(unit, mesh=mesh, mp_policy=mp)
        self.sharded.append(module)
        module._get_fsdp_state()._lazy_init()  # the root even if a layer runs first (generate)
        return module

    @contextlib.contextmanager
    def whole(self):
        """--fsdp: whole weights inside: decoding needs no collective per step."""
        from torch.distributed.fsdp import FSDPModule

        units = [u for root in self.sharded[:1] for u in root.modules() if isinstance(u, FSDPModule)]
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)

    def full_weights(self, model):
        """--fsdp: the whole state dict on rank 0's CPU; else None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.fsdp:
            return None
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        first = {}
        for k, v in model.state_dict(keep_vars=True).items():  # tied weights: one tensor
            whole[k] = whole[first.setdefault(id(v), k)]
        return whole

    def gather(self, x):
        if not self.ddp:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def checkpoint(self, model, tokenizer, state: dict, per_rank: dict) -> Path:
        """checkpoints/step_N: weights, tokenizer, trainer_state.pt (`state`, args, RNGs, `per_rank` of each)."""
        path, weights = self.dir / "checkpoints" / f"step_{self.step}", self.full_weights(model)
        self.saved, self.saved_at, self.saved_step = path, time.time(), self.step
        per_rank = {k: self.gather(torch.as_tensor(v)[None].to(self.device)).cpu()
                    for k, v in {**per_rank, "torch_rng": torch.get_rng_state()}.items()}
        sharded = path.with_name(f".tmp-sharded-{path.name}") if self.fsdp else None
        if self.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            dcp.save(dict(zip(("model", "optimizer"), get_state_dict(*self.trained))), checkpoint_id=str(sharded))
            self.barrier()
        if self.rank == 0:
            save_pretrained(path, model, tokenizer, {**state, "step": self.step, "per_rank": per_rank, "args": asdict(
                self.args), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()}, weights, sharded)
            last = path.with_name("last")
            shutil.rmtree(last, ignore_errors=True)  # a folder in a copied run
            last.unlink(missing_ok=True)
            last.symlink_to(path.name)
        self.barrier()
        return path

    def barrier(self):
        if self.ddp:
            dist.barrier()

    def log(self, metrics: dict, table=None):  # table: (key, columns, rows)
        if self.device.type == "cuda" and "perf/step_s" in metrics:
            metrics = {**metrics, "perf/peak_gb": torch.cuda.max_memory_allocated(self.device) / 2**30}
        if self.rank != 0:
            return
        with (self.dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.first, self.last = {**metrics, **self.first}, {**self.last, **metrics}
        if self.wandb:
            extra = {table[0]: self.wandb.Table(columns=table[1], data=table[2])} if table and table[2] else {}
            self.wandb.log({**metrics, **extra}, step=metrics["step"])

    def say(self, text: str):
        if self.rank == 0:
            tqdm.write(text) if self.progress else print(text, flush=True)

    def evaluate(self, measure: Callable[[], tuple[dict, list]]) -> dict:
        """Rank 0's measure() -> (metrics, samples), logged and printed; a stop cuts it short."""
        metrics, samples = {}, []
        with self.whole(), contextlib.suppress(InterruptedError):  # raised by interrupt()
            self.evaluating = not self.stopping() and self.rank == 0
            metrics, samples = measure() if self.evaluating else ({}, [])
            self.evaluating = False
        if metrics:
            table = ("eval/samples", ["prompt", "completion", "answer"], [list(s) for s in samples[:16]])
            self.log({"step": self.step, **metrics}, table)
            self.say(f"eval at step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        self.barrier()
        return metrics

    def __enter__(self):
        args = self.args
        if self.rank == 0 and args.resume:  # drop half-written checkpoints and rows logged after this one
            for tmp in [*self.dir.glob("**/.tmp-*"), *self.dir.glob("**/.old-*")]:
                shutil.rmtree(tmp, ignore_errors=True)
            metrics = self.dir / "metrics.jsonl"
            rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["step"] <= self.start]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
            for row in rows:
                self.first, self.last = {**row, **self.first}, {**self.last, **row}
                self.evaluated = self.evaluated or row["step"] == self.start and "eval/" in str(row)
            saved = json.loads((self.dir / "args.json").read_text())
            resumed = {"step": self.start, "checkpoint": args.resume, "overrides": self.overrides}
            saved.setdefault("resumed", []).append(resumed)
            (self.dir / "args.json").write_text(json.dumps(saved, indent=2))
            print(f"resumed from step {self.start} of {args.total_steps} ({args.resume})" + "".join(
                f"; --{k.replace('_', '-')} {new} (the run had {old})" for k, (old, new) in self.overrides.items()))
        elif self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
            (self.dir / "metrics.jsonl").touch()  # (a resume reads it)
        self.bar = tqdm(total=args.total_steps, initial=self.start, unit="step", disable=not self.progress)
        if self.ddp:
            self.say(f"{self.world} processes, {'FSDP2' if self.fsdp else 'DDP'}")
        for note in getattr(args, "notes", []):
            self.say(note)
        self.previous = signal.signal(signal.SIGINT, self.interrupt), signal.signal(signal.SIGTERM, self.interrupt)
        return self

    def interrupt(self, signum, frame):  # SIGTERM (preemption) as the first Ctrl-C
        ctrl_c, self.signal = signum == signal.SIGINT, signum
        if ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C quits
        if self.rank == 0:
            print(f"\n{'Ctrl-C' if ctrl_c else 'SIGTERM'}: saving a checkpoint after step {self.step}" +
                  " (Ctrl-C again to quit without saving)" * ctrl_c, file=sys.stderr, flush=True)
        if self.evaluating:  # evaluate() catches it; a step runs to its end
            self.evaluating = False
            raise InterruptedError

    def __exit__(self, kind, *exc):  # after a Ctrl-C, or started with SIGINT ignored (`&`), a Ctrl-C quits
        quit_at_once = self.signal or self.previous[0] == signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler if quit_at_once else self.previous[0])
        signal.signal(signal.SIGTERM, self.previous[1])
        self.bar.close()
        if kind and self.rank == 0 and not self.args.resume and self.saved_step < 0:
            shutil.rmtree(self.dir, ignore_errors=True)

    def steps(self, measure, save):
        """Steps start+1 .. --total-steps, evaluating and saving; a signal saves and ends."""
        args = self.args
        if args.track and self.rank == 0:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name,
                       config=vars(args), dir=str(self.dir), resume="allow")
            self.wandb = wandb
        every = args.eval_every or args.total_steps + 1
        if self.start < args.total_steps and self.start % every == 0 and not self.evaluated:
            self.evaluate(measure)
        for step in range(self.start + 1, args.total_steps + 1):
            if self.stopping(save):
                return
            self.step, t0 = step, time.perf_counter()
            yield step
            self.seconds += time.perf_counter() - t0
            self.report()
            if step % every == 0 and step != args.total_steps:
                self.evaluate(measure)
            if args.save_every and step % args.save_every == 0:
                save()

    def stopping(self, save=None) -> bool:
        """A signal (or pause) in one process stops all; save then, or when --save-every-minutes is due."""
        minutes = self.step > self.start and time.time() - self.saved_at > 60 * self.args.save_every_minutes > 0
        flags = torch.tensor([max(int(self.stop), self.signal), int(minutes)], device=self.device)
        if self.ddp:  # whichever process the signal reached
            dist.all_reduce(flags, dist.ReduceOp.MAX)
        self.stop = int(flags[0])
        if save and (self.stop or flags[1]) and self.saved_step != self.step:
            save()
        return bool(self.stop)

    def report(self):
        per_step = self.seconds / (self.step - self.start)
        text = " | ".join(f"{k.split('/')[-1]} {self.last[k]:.3g}" for k in self.shown if k in self.last)
        self.bar.update(1)
        if self.progress:  # (tqdm shows s/step)
            self.bar.set_postfix_str(text)
        elif self.rank == 0 and self.step % self.args.log_every == 0:
            print(f"step {self.step}/{self.args.total_steps} | {text} | {per_step:.2f} s/step | ETA "
                  f"{tqdm.format_interval((self.args.total_steps - self.step) * per_step)}", flush=True)

    def finish(self, final: dict, measure, save, model, tokenizer, notes: tuple[str, ...] = ()) -> dict:
        """Unless stopped: the last evaluation, a checkpoint, final/ (`model`, or a function making it)."""
        final.update({} if self.stop else self.evaluate(measure))
        self.stopping()  # a signal in the last step or evaluation
        if self.saved_step != self.step:
            save()
        if not self.stop:
            if self.rank == 0 or self.fsdp:  # (--fsdp: all processes gather)
                model = model if isinstance(model, torch.nn.Module) else model()
                weights = self.full_weights(model)
            if self.rank == 0:
                path = Path(getattr(self.args, "final_dir", None) or self.dir / "final")
                save_pretrained(path, model, tokenizer, weights=weights)
                print(f"done: step {self.step} in {tqdm.format_interval(self.seconds)}" + "".join(
                    f" | {k} {self.first[k]:.4g} -> {v:.4g}" for k, v in self.last.items() if k.startswith("eval/")))
                print(f"final model: {path}", *notes, sep="\n", flush=True)
        if self.wandb:
            self.wandb.finish()
        if self.stop:
            self.say(f"interrupted: saved {self.saved}; continue with --resume {self.saved}")
        return {**final, "step": self.step, "run_dir": str(self.dir), "interrupted": self.stop}


def command_line(Args, main) -> None:
    """main(the flags); our ValueErrors in one line."""
    boxes = [(re.sub(r"\B(?=[A-Z])", "_", g.__name__).lower(), tyro.conf.OmitArgPrefixes[g]) for g in Args.__bases__]
    flags = asdict(tyro.cli(make_dataclass("Flags", boxes[::-1]), description=__doc__.split("\n\n")[0])).values()
    try:
        stop = main(Args(**{k: v for box in flags for k, v in box.items()}))["interrupted"]
        if stop > 1:  # Ctrl-C 130, SIGTERM 143 (True: a planned pause)
            sys.exit(128 + stop)
    except KeyboardInterrupt:
        print("\ninterrupted again: quit without saving", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:
        if Path(inspect.trace()[-1].filename).resolve().parent != Path(__file__).resolve().parent:
            raise  # from a library: the traceback says where
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    command_line(Args, main)
