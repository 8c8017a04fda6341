"""DPO and its family: cDPO, SLiC hinge, IPO, robust DPO, SimPO, RPO, on preference pairs (x, y_w, y_l).

DPO (arXiv:2305.18290, Eq. 7), log-probs summed over the completion's tokens:
    L = -log sigmoid(beta d),   d = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)).
`--loss-type`: sigmoid (DPO; cDPO with --label-smoothing), hinge (SLiC-HF, arXiv:2305.10425), ipo (arXiv:2310.12036),
robust (arXiv:2403.00409), simpo (arXiv:2405.14734, no reference). `--rpo-alpha a` adds a times the chosen
completion's length-normalised NLL (RPO, arXiv:2404.19733).

Run:
    python dpo.py  # models/tiny-arith on data/arith's pairs, CPU
    python dpo.py --loss-type simpo --beta 2 --simpo-gamma 1 --rpo-alpha 0  # or ipo, hinge, robust
    python dpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template --dataset my/hub-prefs \
        --dataset-split train --eval-split None --pref-eval-split test --max-completion-length 512 \
        --micro-batch-size 4 --learning-rate 5e-7 --lora-r 16
    torchrun --nproc-per-node 2 dpo.py  # data parallel

Deviations (why, measurements: docs/dpo.md):
- `--rpo-alpha 1` by default: plain DPO lowers tiny-arith's accuracy (likelihood displacement, arXiv:2410.08847).
- One row per pair, the shared prefix once (`--pack-pairs`, arXiv:2410.20305), checked at start against plain rows.
- Completions are tokenised alone + EOS; long prompts keep their last tokens, long completions lose their end.
- Dropout is off; eval/pref_accuracy counts ties as wrong (0 at step 0).
"""

import atexit
import contextlib
import copy
import importlib.util
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
from functools import partial
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from datasets import Dataset, load_dataset
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers import logging as hf_logging

try:
    from kernels import linear_token_logprobs
except ModuleNotFoundError as e:
    if e.name != "kernels":
        raise
    sys.exit(f"error: {e.name} not found: copy kernels/ from cleanrl-llm into {Path(__file__).parent}")


@dataclass
class Algorithm:
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust", "simpo"] = "sigmoid"
    """logistic (DPO, cDPO), hinge (SLiC), squared (IPO), noise-robust DPO, or reference-free SimPO"""
    beta: float = 0.1
    """implicit reward = this x log(policy / reference) (IPO: its tau; SimPO: ~2)"""
    label_smoothing: float = 0.0
    """assumed label-flip rate: sigmoid (cDPO), simpo in [0, 0.5]; robust in [0, 0.5); others 0"""
    simpo_gamma: float = 0.5
    """simpo: target reward margin (gamma of Eq. 6)"""
    ipo_logps: Literal["mean", "sum"] = "mean"
    """ipo: log-ratios averaged over completion tokens (as TRL) or summed (Eq. 17)"""
    rpo_alpha: float = 1.0
    """weight of an SFT loss on the chosen completion (RPO; 0: off)"""
    precompute_ref_logps: bool = False
    """compute the pairs' reference log-probs once, then drop the reference model"""



@dataclass
class ModelData:
    model_name_or_path: str = "models/tiny-arith"
    """folder or hub id of the model and its tokenizer"""
    dataset: str = "data/arith"
    """folder of <split>.jsonl files, a JSON-lines file, or a hub id"""
    dataset_split: str = "prefs"
    """split of training pairs (prefs: train if a folder has no prefs.jsonl)"""
    eval_split: Optional[str] = "test"
    """split of prompts and answers for greedy accuracy (None: none)"""
    pref_eval_split: Optional[str] = "prefs_test"
    """split of held-out pairs for eval/pref_accuracy (None: none)"""
    prompt_column: str = "prompt"
    """prompt column (text, or chat messages)"""
    chosen_column: str = "chosen"
    """column of preferred completions"""
    rejected_column: str = "rejected"
    """column of dispreferred completions"""
    answer_column: str = "answer"
    """reference answer column of --eval-split"""
    use_chat_template: bool = False
    """wrap prompts in the tokenizer's chat template"""
    max_prompt_length: int = 256
    """longer prompts keep their last tokens"""
    max_completion_length: int = 40
    """longer completions (with EOS) lose their end; also the greedy eval's"""
    eval_limit: int = 500
    """at most this many eval examples"""
    pref_eval_limit: int = 500
    """at most this many held-out pairs"""
    lora_r: int = 0
    """LoRA (low-rank adapter) rank on each linear layer (0: off); needs peft"""
    lora_alpha: float = 32.0
    """LoRA scale: the update is x alpha / r"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""



@dataclass
class Optimisation:
    batch_size: int = 32
    """pairs per optimiser step, over all processes"""
    micro_batch_size: int = 0
    """pairs per forward/backward (0: the largest divisor <= 64)"""
    learning_rate: float = 5e-4
    """peak learning rate of AdamW"""
    total_steps: int = 300
    """optimiser steps; may change on --resume"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: decay to 0, or constant"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""



@dataclass
class Logging:
    log_every: int = 1
    """steps between rows of metrics.jsonl"""
    eval_every: int = 50
    """steps between evaluations (0: at start and end)"""
    save_every: int = 0
    """steps between checkpoints (0: at the end or a stop)"""
    save_every_minutes: float = 30.0
    """also save every this many minutes (0: off)"""
    resume: Optional[str] = None
    """runs/<run>/checkpoints/step_N to continue"""



@dataclass
class Engineering:
    pack_pairs: bool = True
    """a pair per row, the shared prefix once (plain rows if the model fails a check)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass"""
    device: str = "auto"
    """cuda, cpu, or auto (cuda if available)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights dtype; auto: float32 with bfloat16 autocast on CUDA"""
    fsdp: bool = False
    """under torchrun, shard weights, gradients, AdamW states (FSDP2), not DDP"""
    exp_name: str = "dpo"
    """part of the run directory's name"""
    seed: int = 1
    """seed of the RNGs and the data order"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanrl-llm"
    """W&B project"""
    wandb_entity: Optional[str] = None
    """W&B team or user"""
    output_dir: str = "runs"
    """parent of run directories"""
    run_dir: Optional[str] = None
    """a new run directory (None: one in --output-dir)"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time"""


@dataclass
class Args(Engineering, Logging, Optimisation, ModelData, Algorithm):
    pass


# ---- the algorithm


def pair_logratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens,
                   loss_type: str, ipo_logps: str = "mean") -> tuple:
    """d's two terms, all [B] -> (chosen, rejected): log pi(y|x) - log pi_ref(y|x) (Eq. 7 of arXiv:2305.18290); ipo
    with "mean": per token (TRL); simpo: log pi(y|x) / |y| (Eq. 6 of arXiv:2405.14734; ref_* may be None)."""
    if loss_type == "simpo":
        return policy_chosen / chosen_tokens, policy_rejected / rejected_tokens
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss_type == "ipo" and ipo_logps == "mean":
        return chosen / chosen_tokens, rejected / rejected_tokens
    return chosen, rejected


def dpo_loss(chosen, rejected, loss_type: str, beta: float, eps: float = 0.0, simpo_gamma: float = 0.0) -> torch.Tensor:
    """pair_logratios' terms [B] -> the per-pair loss [B] of d = chosen - rejected; eps: the label smoothing."""
    d = chosen - rejected
    if loss_type == "hinge":  # SLiC-HF's calibration loss (arXiv:2305.10425), margin 1 / beta
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":  # Eq. 17 of arXiv:2310.12036 (beta is its tau)
        return (d - 1 / (2 * beta)) ** 2
    z = beta * d - simpo_gamma * (loss_type == "simpo")  # Eq. 6 of arXiv:2405.14734: SimPO's margin gamma
    if loss_type == "robust":  # arXiv:2403.00409: unbiased under labels flipped with probability eps
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    # Eq. 7 of arXiv:2305.18290; eps > 0: conservative DPO (cDPO), and for simpo TRL's CPO smoothing
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def sequence_logprobs(model, input_ids, attention_mask, completion_mask) -> torch.Tensor:
    """Each row's completion log-prob log pi(y|x): [B, T] right-padded ids, attention and completion masks -> [B]
    float32; only the hidden states that predict a completion token meet the lm_head."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    predicts = completion_mask[:, 1:].bool()  # hidden state t predicts token t + 1
    logp = linear_token_logprobs(hidden[:, :-1][predicts], targets=input_ids[:, 1:][predicts],
                                 **lm_head(model, hidden.dtype))
    return logp.new_zeros(input_ids.shape[0]).index_add(0, predicts.nonzero()[:, 0], logp)


def packed_logprobs(model, input_ids, allowed, position_ids, columns, targets, owners) -> torch.Tensor:
    """`sequence_logprobs` of `pack_completions` rows -> [2B] float32 (B chosen, then B rejected); a shared token's
    log-prob, computed once, counts for both."""
    mask = allowed[:, None]
    if model.config._attn_implementation != "sdpa":  # eager attention adds its mask to the logits
        dtype = model.get_output_embeddings().weight.dtype
        mask = torch.zeros_like(mask, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    logp = linear_token_logprobs(hidden.flatten(0, 1)[columns], targets=targets, **lm_head(model, hidden.dtype))
    return logp.new_zeros(2 * input_ids.shape[0]).index_add(0, owners[0], logp[owners[1]])


def pair_logprobs(model, pairs: list, pad_id: int, packed: bool) -> torch.Tensor:
    """(prompt, chosen, rejected) token lists -> [2B] float32 summed log-probs, the B chosen then the B rejected."""
    batch = pack_completions(pairs, pad_id) if packed else collate_completions(pairs, pad_id)
    return (packed_logprobs if packed else sequence_logprobs)(model, *(t.to(model.device) for t in batch))


def collate_completions(pairs: list, pad_id: int):
    """(prompt, chosen, rejected) token lists -> ids, attention and completion masks, [2B, T] right-padded: the
    prompt + chosen rows, then the prompt + rejected."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p + c) for p, c in rows], True, pad_id)
    col = torch.arange(ids.shape[1])
    start = torch.tensor([len(p) for p, _ in rows])[:, None]
    end = torch.tensor([len(p + c) for p, c in rows])[:, None]
    return ids, (col < end).long(), ((col >= start) & (col < end)).long()


def pack_completions(pairs: list, pad_id: int):
    """`pack_pairs` of prompt + chosen and prompt + rejected -> (ids, allowed, position ids, columns [E], targets [E],
    owners [2, K]): entry e is token targets[e], predicted by the hidden state at flat position columns[e] (row * T
    + column); owners lists (sequence, entry), sequences 0..B-1 chosen, B..2B-1 rejected; a shared entry has both."""
    ids, allowed, position_ids, *_ = pack_pairs([(p + c, p + r) for p, c, r in pairs], pad_id)
    width, B = ids.shape[1], len(pairs)
    columns, targets, owners = [], [], []
    for b, (p, c, r) in enumerate(pairs):
        n = shared_prefix(c, r)
        targets += c + r[n:]
        for j in range(len(c)):  # chosen token j is predicted at column len(p) + j - 1
            owners += [(b, len(columns))] + [(B + b, len(columns))] * (j < n)
            columns.append(b * width + len(p) + j - 1)
        for j in range(n, len(r)):  # the first tail token is predicted by the prefix's last, the rest by the tail
            owners.append((B + b, len(columns)))
            columns.append(b * width + (len(p) + n - 1 if j == n else len(p) + len(c) + j - n - 1))
    return ids, allowed, position_ids, torch.tensor(columns), torch.tensor(targets), torch.tensor(owners).T


def shared_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens two token lists have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pack_pairs(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple:
    """Prefix sharing (arXiv:2410.20305): token lists (a, b) -> one row a + b[n:], n = shared_prefix(a, b); the tail
    b[n:] attends to the prefix and itself, its positions going on from the prefix, so every token sees what it sees
    alone -> ids [B, T] right-padded, allowed [B, T, T] bool (query, key), position ids [B, T], and [B, 1] each: where
    b's tail starts (len(a)), n, the row's length."""
    shared = [shared_prefix(a, b) for a, b in pairs]
    rows = [a + b[n:] for (a, b), n in zip(pairs, shared)]
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in rows], True, pad_id)
    col = torch.arange(ids.shape[1])
    split = torch.tensor([len(a) for a, _ in pairs])[:, None]
    shared = torch.tensor(shared)[:, None]
    length = torch.tensor([len(row) for row in rows])[:, None]
    tail = col >= split  # [B, T]: b's tail (and the padding after it)
    position_ids = torch.where(tail, col - split + shared, col).masked_fill(col >= length, 0)  # padding: in range
    query, key = col[None, :, None], col[None, None, :]
    allowed = (key <= query) & ~(tail[:, :, None] & (key >= shared[:, :, None]) & (key < split[:, :, None]))
    return ids, allowed, position_ids, split, shared, length


@torch.no_grad()
def use_packing(run, model, forward: Callable[[bool], torch.Tensor]) -> bool:
    """--pack-pairs, unless a few pairs packed differ from plain ones in eval mode (attention ignoring 4D masks?)."""
    if not run.args.pack_pairs:
        return False
    was_training = model.training
    model.eval()
    try:
        plain, packed = forward(False), forward(True)
        tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
        diff = float((packed - plain).abs().max())
        why_not = None if diff <= tol * (1 + float(plain.abs().max())) else (
            f"its packed results differ from its plain ones by {diff:.3g} (attention ignores the custom mask?)")
    except Exception as e:  # noqa: BLE001
        why_not = f"its packed forward fails ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    if why_not:
        run.say(f"--pack-pairs: chosen and rejected in rows of their own, as {why_not}")
    return why_not is None


def optimizer_and_schedule(args, run, trained, model, overrides: dict) -> tuple:
    """AdamW and lr_factor's schedule; --resume restores the weights and both -> (optimizer, scheduler, anchor,
    trainer_state.pt's dict); anchor[0]: lr_factor's."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  betas=(0.9, 0.99), weight_decay=args.weight_decay)
    run.trained = (trained, optimizer)  # what --fsdp checkpoints in shards
    anchor = [None]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, anchor[0]))
    state = run.restore(model, optimizer, scheduler)
    anchor[0] = state.get("lr_anchor")
    if "total_steps" in overrides:  # decay from here to the new last step
        old = lr_factor(run.start, args.warmup_steps, overrides["total_steps"][0], args.lr_schedule, anchor[0])
        anchor[0] = (run.start, old)
    return optimizer, scheduler, anchor, state


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


def pair_problem(row: dict, columns: list[str], margin: Optional[str] = None) -> Optional[str]:
    """What is wrong with a row as a preference pair (`columns`: prompt, chosen, rejected, ...), or None."""
    chosen, rejected = row.get(columns[1]), row.get(columns[2])
    if missing := [c for c in columns if row.get(c) is None]:
        return f"no column {missing}: fill it in or remove the row"
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        return f"'{columns[1]}' and '{columns[2]}' must be text, got {chosen!r} and {rejected!r}"
    if chosen == rejected:
        return f"'{columns[1]}' and '{columns[2]}' are the same text, which states no preference: remove the row"
    if "tie" in columns and not isinstance(row["tie"], bool):
        return f"'tie' is {row['tie']!r}: it must be true (a tie) or false (chosen is better)"
    if margin and (isinstance(row[margin], bool) or not isinstance(row[margin], (int, float))):
        return f"margin '{margin}' is {row[margin]!r}, not a number"


def load_pairs(args, flag: str, columns: list[str], margin: Optional[str] = None):
    """--<flag>'s split with `columns` (prompt, chosen, rejected first), each row checked by `pair_problem`; a folder
    without prefs.jsonl (the default split) trains on its train.jsonl, if of pairs."""
    path = Path(args.dataset).expanduser()
    train = path / "train.jsonl"
    if args.dataset_split == "prefs" and not (path / "prefs.jsonl").exists() and train.exists():
        with train.open() as f:
            if f'"{args.chosen_column}"' in f.readline():
                args.dataset_split = "train"
        if args.dataset_split == "train" and int(os.environ.get("RANK", 0)) == 0:
            print(f"{path} has no prefs.jsonl: training on its train.jsonl")
    split = getattr(args, flag)
    ds = load_split(args, flag, columns, "--prompt-column/--chosen-column/--rejected-column or the flag naming it")
    where = f"{path / split}.jsonl, line" if path.is_dir() else f"{args.dataset}, split '{split}', row"
    for i, row in enumerate(ds, 1):
        if problem := pair_problem(row, columns, margin):
            raise ValueError(f"{where} {i}: {problem}")
    return ds


class PairOrder:
    """Indices in seeded random epochs of whole batches (a partial last batch is skipped)."""

    def __init__(self, n: int, seed: int):
        self.n, self.gen = n, torch.Generator().manual_seed(seed)
        self.order, self.cursor = torch.randperm(n, generator=self.gen), 0

    def draw(self, k: int) -> list[int]:
        if self.cursor + k > len(self.order):
            self.order, self.cursor = torch.randperm(self.n, generator=self.gen), 0
        self.cursor += k
        return self.order[self.cursor - k : self.cursor].tolist()

    def state(self) -> dict:
        return {"order_gen": self.gen.get_state(), "order": self.order, "cursor": self.cursor}

    def load(self, state: dict) -> None:
        self.gen.set_state(state["order_gen"])
        self.order, self.cursor = state["order"], int(state["cursor"])


def prompt_texts(tokenizer, values: list, use_chat_template: bool, column: str) -> list[str]:
    """The prompts as text, or wrapped in the tokenizer's chat template."""
    if not use_chat_template:
        if not isinstance(values[0], str):
            raise ValueError(f"prompts in column '{column}' are chat messages: pass --use-chat-template")
        return list(values)
    if tokenizer.chat_template is None:
        raise ValueError(f"--use-chat-template: the tokenizer of {tokenizer.name_or_path} has no chat template")
    return [tokenizer.apply_chat_template([{"role": "user", "content": v}] if isinstance(v, str) else v,
                                          tokenize=False, add_generation_prompt=True) for v in values]


def tokenize_completions(tokenizer, ds, args: Args) -> list[tuple]:
    """Pairs as (prompt, chosen + EOS, rejected + EOS) token ids, cut to --max-prompt/completion-length."""
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    texts = prompt_texts(tokenizer, list(ds[args.prompt_column]), args.use_chat_template, args.prompt_column)
    prompts = [ids[-args.max_prompt_length :] for ids in encode(texts)]
    if not all(prompts):
        raise ValueError(f"a prompt is empty (row {prompts.index([]) + 1}): remove it")
    chosen, rejected = ([(ids + [tokenizer.eos_token_id])[: args.max_completion_length] for ids in encode(list(ds[c]))]
                        for c in (args.chosen_column, args.rejected_column))
    return list(zip(prompts, chosen, rejected))


def load_data(args: Args, tokenizer) -> tuple:
    """Every split, checked and tokenised before any model loads (eval prompts: in the model's context) ->
    (training pairs, held-out pairs, eval prompts, their answers)."""
    columns = [args.prompt_column, args.chosen_column, args.rejected_column]
    pairs = tokenize_completions(tokenizer, load_pairs(args, "dataset_split", columns), args)
    eval_pairs, prompts, answers = [], [], []
    if args.pref_eval_split:
        held_out = load_pairs(args, "pref_eval_split", columns).take(args.pref_eval_limit)
        eval_pairs = tokenize_completions(tokenizer, held_out, args)
    if args.eval_split:
        ev = load_split(args, "eval_split", [args.prompt_column, args.answer_column], "--prompt-column/--answer-column")
        ev = ev.take(args.eval_limit)
        prompts = prompt_texts(tokenizer, list(ev[args.prompt_column]), args.use_chat_template, args.prompt_column)
        answers = list(ev[args.answer_column])
        check_context(AutoConfig.from_pretrained(args.model_name_or_path), tokenizer(
            prompts, add_special_tokens=False)["input_ids"], args.max_completion_length, "--max-completion-length")
    return pairs, eval_pairs, prompts, answers


def load_model(args: Args, device):
    """A causal LM with dropout off (TRL's disable_dropout): the policy and the reference must be one function."""
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype).to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def load_models(args: Args, tokenizer, device) -> tuple:
    """The policy (with LoRA: a PEFT model), the frozen reference loaded again (None with LoRA, SimPO or
    --precompute-ref-logps), the EOS ids."""
    model, ref_model = load_model(args, device), None
    eos_ids = own_generation_config(model, tokenizer)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear",
                                                 lora_dropout=args.lora_dropout, task_type="CAUSAL_LM"))
    elif args.loss_type != "simpo" and not args.precompute_ref_logps:
        ref_model = load_model(args, device).eval().requires_grad_(False)
    return model, ref_model, eos_ids


@torch.no_grad()
def reference_logps(ref_model, model, pairs: list, rows: list, cache, pad_id: int, packed: bool, k: int, m: int):
    """log pi_ref of pairs k..k+m-1 -> [2, m] (chosen, rejected): precomputed (cache [N, 2], rows: the pairs' indices
    into it), the reference model's, or with LoRA the policy's without its adapters."""
    if cache is not None:
        return cache[rows[k : k + m]].T.to(model.device)
    if ref_model is not None:
        return ref_model(pairs[k : k + m], pad_id, packed).view(2, -1)
    with model.disable_adapter():
        return pair_logprobs(model, pairs[k : k + m], pad_id, packed).view(2, -1)


@torch.no_grad()
def pair_logps(model, pairs: list, pad_id: int, packed: bool, micro: int, autocast) -> torch.Tensor:
    """The model's summed log-probs of every pair in eval mode -> [N, 2] (chosen, rejected) on the CPU."""
    model.eval()
    with autocast:
        out = [pair_logprobs(model, pairs[i : i + micro], pad_id, packed).view(2, -1).T.cpu()
               for i in range(0, len(pairs), micro)]
    model.train()
    return torch.cat([torch.zeros(0, 2), *out])


def pref_metrics(logps, ref, pairs: list, args: Args, say: Callable) -> dict:
    """Held-out pairs: the fraction whose implicit reward ranks chosen first (a tie is wrong), the policy's mean
    log-probs. logps, ref: [N, 2] (chosen, rejected); ref is None for simpo."""
    tokens = logps.new_tensor([[len(c), len(r)] for _, c, r in pairs])
    ref = (None, None) if ref is None else ref.T
    chosen, rejected = pair_logratios(*logps.T, *ref, *tokens.T, args.loss_type, args.ipo_logps)
    if torch.equal(chosen, rejected):
        say(f"eval/pref_accuracy 0: all {len(pairs)} pairs tied (margin 0), and a tie counts as wrong")
    return {"eval/pref_accuracy": float((chosen > rejected).float().mean()),
            "eval/logps_chosen": float(logps[:, 0].mean()), "eval/logps_rejected": float(logps[:, 1].mean())}


# dpo_update's sums over the pairs, under TRL's names.
STATS = ("train/loss", "train/nll", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
         "logps/rejected")


def dpo_update(policy, optimizer, pairs: list, args: Args, micro: int, world: int, pad_id: int, packed: bool,
               reference, autocast) -> tuple:
    """One optimiser step on this process's `pairs`: per micro-batch, the per-pair loss + RPO's NLL, summed /
    --batch-size. reference(k, m): log pi_ref of pairs k..k+m-1 -> [2, m] (False: simpo). -> (STATS' sums, grad norm)"""
    sums = torch.zeros(len(STATS), dtype=torch.float64)
    ddp = isinstance(policy, torch.nn.parallel.DistributedDataParallel)
    for k in range(0, len(pairs), micro):
        some = pairs[k : k + micro]
        with (policy.no_sync() if ddp and k + micro < len(pairs) else torch.enable_grad()), autocast:
            logp = policy(some, pad_id, packed).view(2, -1)
            lengths = logp.new_tensor([[len(c), len(r)] for _, c, r in some]).T  # [2, m] tokens
            ref = reference(k, len(some)) if reference else (None, None)
            chosen, rejected = pair_logratios(*logp, *ref, *lengths, args.loss_type, args.ipo_logps)
            nll = -logp[0] / lengths[0]  # RPO: the chosen completion's per-token NLL (arXiv:2404.19733)
            per_pair = dpo_loss(chosen, rejected, args.loss_type, args.beta, args.label_smoothing,
                                args.simpo_gamma) + args.rpo_alpha * nll
            (per_pair.sum() / args.batch_size * world).backward()  # DDP averages gradients over processes
        rewards = args.beta * torch.stack([chosen, rejected])  # the implicit rewards
        sums += torch.stack([per_pair, nll, *rewards, (rewards[0] > rewards[1]).float(), *logp]).detach().sum(1).cpu()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    return sums, grad_norm


RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "save_every_minutes", "eval_limit",
                     "pref_eval_limit", "track", "wandb_project_name", "wandb_entity", "device", "pack_pairs")


def main(args: Args) -> dict:
    # 0. Check every input first (--resume: the run's own arguments); processes, device, seeds.
    args, overrides = resume_args(args, RESUME_MAY_CHANGE)
    micro = check_args(args)
    run = Run(args, overrides, shown=("train/loss", "rewards/margins", "eval/pref_accuracy", "eval/accuracy"))
    device, world = run.device, run.world

    # 1. Data: the pairs, checked and tokenised once (prompt; completion + EOS).
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    pairs, eval_pairs, eval_prompts, eval_answers = load_data(args, tokenizer)

    # 2. Model: the policy and the reference; one row per pair if the model passes the check.
    model, ref_model, eos_ids = load_models(args, tokenizer, device)
    packed = use_packing(run, model, lambda packed: pair_logprobs(model, pairs[:8], pad_id, packed))
    policy = Forward(pair_logprobs, model)
    ref_model = ref_model and Forward(pair_logprobs, ref_model)
    if run.fsdp:  # the reference too
        policy = run.shard(policy, decoder_layers(model))
        ref_model = ref_model and run.shard(ref_model, decoder_layers(ref_model))
    elif run.ddp:
        policy = torch.nn.parallel.DistributedDataParallel(
            policy, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")
    # The reference's log-probs of the held-out pairs (and with --precompute-ref-logps of every training pair), from
    # the policy: it holds the initial weights until section 3 loads a resumed run's.
    uses_ref = args.loss_type != "simpo"
    with run.whole():  # --fsdp: the model is called outside the sharded root's forward
        eval_ref = pair_logps(model, eval_pairs, pad_id, packed, micro, autocast) if uses_ref else None
        train_ref = pair_logps(model, pairs, pad_id, packed, micro, autocast) if args.precompute_ref_logps else None

    # 3. Optimiser, schedule and data order; --resume restores them.
    optimizer, scheduler, lr_anchor, state = optimizer_and_schedule(args, run, policy, model, overrides)
    order = PairOrder(len(pairs), args.seed)
    if state:
        order.load(state)

    def measure() -> tuple[dict, list]:  # implicit-reward accuracy on held-out pairs, greedy accuracy on --eval-split
        logps = pair_logps(model, eval_pairs, pad_id, packed, micro, autocast)
        metrics, samples = pref_metrics(logps, eval_ref, eval_pairs, args, run.say) if eval_pairs else {}, []
        if eval_prompts:
            metrics["eval/accuracy"], samples = greedy_accuracy(
                model, tokenizer, eval_prompts, eval_answers, args.max_completion_length, eos_ids, run.progress)
        return metrics, samples

    def save() -> Path:
        state = {"optimizer": None if run.fsdp else optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        return run.checkpoint(model, tokenizer, {**state, "lr_anchor": lr_anchor[0], **order.state()}, per_rank={})

    # 4. Train.
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    run.say(f"run directory: {run.dir}  |  {len(pairs)} training pairs, {len(eval_pairs)} held-out pairs, "
            f"{len(eval_prompts)} eval prompts, {n_train / 1e6:.2f}M trainable parameters on {device}, "
            f"micro-batch {micro} pairs{' packed in one row each' if packed else ''}")
    share = args.batch_size // world
    final, tokens, seconds, last_log = {}, 0, 0.0, run.start
    with run:
        for step in run.steps(measure, save):
            t_step = time.perf_counter()
            # 4a. The next batch of pairs in epoch order; each process keeps its share of the same draw.
            rows = order.draw(args.batch_size)[run.rank * share : (run.rank + 1) * share]
            mine = [pairs[i] for i in rows]
            # 4b. Per micro-batch: chosen and rejected in one pass, the reference's log-probs, the per-pair loss
            #     (Eq. 7 or a variant) + RPO's NLL, averaged over the step's pairs.
            ref = uses_ref and partial(reference_logps, ref_model, model, mine, rows, train_ref, pad_id, packed)
            sums, grad_norm = dpo_update(policy, optimizer, mine, args, micro, world, pad_id, packed, ref, autocast)
            lr = scheduler.get_last_lr()[0]  # the rate of this step's update
            scheduler.step()
            seconds += time.perf_counter() - t_step
            tokens += sum(2 * len(p) + len(c) + len(r) for p, c, r in mine)

            # 4c. Log the implicit rewards, margin, accuracy, log-probs, timings.
            if step % args.log_every == 0 or step == args.total_steps:
                mean = run.gather(sums[None].to(device)).sum(0) / args.batch_size  # over every process's pairs
                final = {"step": step, **dict(zip(STATS, mean.tolist())), "rewards/margins": float(mean[2] - mean[3]),
                         "train/grad_norm": float(grad_norm), "train/lr": lr,
                         "perf/step_s": seconds / (step - last_log),
                         "perf/tokens_per_s": tokens * world / max(seconds, 1e-9)}
                run.log(final)
                tokens, seconds, last_log = 0, 0.0, step

    # 5. Final evaluation, a checkpoint, the trained model (LoRA merged) in final/.
    merged = (lambda: copy.deepcopy(model).merge_and_unload()) if args.lora_r else model
    return run.finish(final, measure, save, merged, tokenizer)


def check_args(args: Args) -> int:
    """Every check of the flags before any work -> the micro-batch (pairs) each process uses."""
    positive = ("total_steps", "batch_size", "max_completion_length", "max_prompt_length", "log_every", "learning_rate",
                "beta", "eval_limit")
    check_common(args, positive, ("eval_every", "save_every", "warmup_steps", "pref_eval_limit", "lora_r",
                                  "micro_batch_size", "rpo_alpha", "simpo_gamma"), (args.model_name_or_path,))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {world} processes: "
                         f"use a multiple of {world}, e.g. {world * max(1, args.batch_size // world)}")
    what = f"each process's pairs (--batch-size / {world} processes)" if world > 1 else "--batch-size"
    micro = fit_micro_batch(args.micro_batch_size, args.batch_size // world, what, cap=64)
    eps, loss = args.label_smoothing, args.loss_type
    allowed = {"sigmoid": "[0, 0.5] (cDPO)", "simpo": "[0, 0.5]", "robust": "[0, 0.5) (the label-flip rate)"}
    if eps != 0 and not (loss in allowed and 0 <= eps and (eps < 0.5 if loss == "robust" else eps <= 0.5)):
        raise ValueError(f"--label-smoothing {eps} is outside its range for --loss-type {loss}: "
                         f"{allowed.get(loss, '0 only (use --loss-type sigmoid, simpo or robust)')}")
    if loss == "simpo" and args.precompute_ref_logps:
        raise ValueError("--loss-type simpo is reference-free: --precompute-ref-logps has nothing to compute; drop it")
    if args.lora_r and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-r needs peft: `pip install peft`")
    return micro

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


def lm_head(model, dtype: torch.dtype) -> dict:
    """The head as linear_token_logprobs takes it (logit scale: Cohere, Granite divides; softcap: Gemma 2, 3)."""
    head, config = model.get_output_embeddings(), model.config
    bias = getattr(head, "bias", None)
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    return {"weight": head.weight.to(dtype), "bias": None if bias is None else bias.to(dtype),
            "logit_scale": None if scale == 1.0 else scale, "softcap": getattr(config, "final_logit_softcapping", None)}


class Forward(torch.nn.Module):
    """fn(module, *args) as a module's forward (DDP and FSDP2 act around forward)."""

    def __init__(self, fn: Callable, module):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


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


def fit_micro_batch(requested: int, per_process: int, what: str, cap: int = 128) -> int:
    """`requested`, or with 0 the largest divisor of a process's batch up to `cap`."""
    works = [d for d in range(1, min(requested or cap, per_process) + 1) if per_process % d == 0][-1]
    if requested and works != requested:
        raise ValueError(f"{what} = {per_process} is not divisible by --micro-batch-size {requested}: use "
                         f"--micro-batch-size {works} (or 0, the largest divisor up to {cap})")
    return works


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
