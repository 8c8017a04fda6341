"""Direct Preference Optimization (DPO) and its family: cDPO, SLiC hinge, IPO, robust DPO, SimPO, RPO.

DPO (arXiv:2305.18290, Eq. 7) trains the policy directly on preference pairs (x, y_w, y_l), with the
implicit reward r(x, y) = beta log pi(y|x) / pi_ref(y|x):
    L = -log sigmoid(beta d),   d = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x)),
log-probs summed over the completion's tokens (prompt and padding masked). `--loss-type`:
    sigmoid  DPO, Eq. 7; with --label-smoothing eps > 0 conservative DPO (cDPO):
             (1 - eps) (-log sigmoid(beta d)) + eps (-log sigmoid(-beta d))
    hinge    SLiC-HF's calibration loss (arXiv:2305.10425) on DPO's log-ratios: relu(1 - beta d)
    ipo      IPO (arXiv:2310.12036, Eq. 17): (d - 1 / (2 beta))^2, with d from per-token *averaged*
             log-ratios by default (as TRL); `--ipo-logps sum` uses the summed ones of the paper's Eq. 17
    robust   robust DPO (arXiv:2403.00409): the loss de-biased for a label-flip rate eps = --label-smoothing,
             ((1 - eps) l(d) - eps l(-d)) / (1 - 2 eps), l(d) = -log sigmoid(beta d)
    simpo    SimPO (arXiv:2405.14734, Eq. 6): reference-free and length-normalised,
             -log sigmoid(beta (log pi(y_w|x) / |y_w| - log pi(y_l|x) / |y_l|) - gamma), gamma = --simpo-gamma
`--rpo-alpha a` adds a times the length-normalised NLL of the chosen completion to any of them (RPO,
arXiv:2404.19733; in TRL, `loss_type=["sigmoid", "sft"]` with `loss_weights=[1, a]`).

Run:
    python dpo.py                                                  # embedded: models/tiny-arith on data/arith prefs
    python dpo.py --rpo-alpha 0 --beta 0.1 --lr-schedule constant  # plain DPO (lowers greedy accuracy: README)
    python dpo.py --loss-type ipo --beta 1                         # IPO; --loss-type hinge / robust / simpo likewise
    python dpo.py --loss-type simpo --beta 2 --simpo-gamma 1       # SimPO: no reference model at all
    python dpo.py --precompute-ref-logps                           # reference log-probs in one pass, no 2nd model
    python dpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template \
        --dataset my/hub-prefs --dataset-split train --eval-split None --pref-eval-split test \
        --max-completion-length 512 --micro-batch-size 4 --learning-rate 5e-7 --lora-r 16  # any HF causal LM
    torchrun --nproc-per-node 2 dpo.py                            # data parallel (DDP), gloo on CPU, nccl on GPU

Deviations and choices:
- The default (`--rpo-alpha 1 --beta 0.1`, lr 5e-4 with cosine decay, 300 steps of 32 pairs) is chosen by
  measurement (README): plain offline DPO on these pairs lowers tiny-arith's greedy accuracy, because
  pushing the rejected completion down also pushes the chosen one down (both share all but one digit),
  and the probability mass goes to digits neither completion contains (likelihood displacement,
  arXiv:2410.08847). The RPO term keeps log pi(y_w) rising, which holds and then raises accuracy,
  while the DPO term still separates the pair on held-out prompts (3 seeds: greedy accuracy 38.6% ->
  62-64%, held-out pair accuracy 98-99%; the same run with --rpo-alpha 0 ends at 0% accuracy).
  `--loss-type ipo --beta 1` measured better still (68-69%), but the default stays the paper's DPO.
- Chosen and rejected go through the policy in one forward pass, by default one row per pair holding their
  shared prefix once (`--pack-pairs`; prefix sharing, arXiv:2410.20305): prompt + chosen + the rejected
  completion after the tokens it shares with the chosen one, with a mask that hides the chosen tail from the
  rejected tail and positions that continue from the prefix. Each token sees what it sees in its own sequence,
  so the log-probs and gradients are those of two rows (tested against float64 and the unpacked pass) from
  fewer tokens (0.68x on the embedded pairs); a shared token's log-prob is computed once and counted for both.
  At start 8 pairs are checked against the unpacked pass ([2B, T], chosen rows first), which is used instead
  if a model fails (an attention that ignores custom 4D masks, e.g. flash-attention 2). Either way the
  completion tokens' log-probs come from the last hidden states and the lm_head through
  `kernels.linear_token_logprobs`, for the completion positions only: the [B, T, V] logits never exist.
- Completions are tokenised alone and end with EOS (as sft.py does); prompts longer than
  `--max-prompt-length` keep their last tokens, completions longer than `--max-completion-length`
  lose their end. Rows are right-padded.
- The reference is loaded again from `--model-name-or-path` (not copied from the policy), so a resumed
  run gets the original reference back; with `--lora-r` it is the policy with its adapters disabled.
  `--precompute-ref-logps` instead computes the log-probs of every training pair once, with the policy
  before it loads a checkpoint or takes a step (so it is the reference), and never loads a second model.
  Held-out pairs' reference log-probs are always computed that way, once, at the start.
- Each pair's loss is averaged over the optimiser step's pairs (all micro-batches and processes), so
  micro-batching and DDP give the gradient of one big batch. The RPO NLL is per pair: the chosen
  completion's summed NLL over its token count (TRL averages over all chosen tokens of the batch).
- `rewards/*` are beta times the log-ratios the loss uses (for ipo with averaged log-ratios, those;
  for simpo, beta times the average log-prob); `logps/*` are the policy's log-probs summed over
  completion tokens for every loss type. `eval/pref_accuracy` is the fraction of held-out pairs whose
  implicit reward ranks chosen above rejected (ties count as wrong, so it is 0 at step 0).
- Dropout is switched off (TRL's `disable_dropout`): the policy and reference must be one function.
- Data order: epochs of a fixed random permutation of the pairs; every process draws the same batch
  and keeps its share.
"""

import copy
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
import torch.nn.functional as F
import tyro
from datasets import load_dataset
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from kernels import linear_token_logprobs


@dataclass
class Args:
    # --- experiment / tracking
    exp_name: str = "dpo"
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
    """local folder or Hugging Face id of the causal LM (and its tokenizer); also the reference model"""
    dataset: str = "data/arith"
    """local folder of `<split>.jsonl` files, a JSON-lines file, or a Hugging Face dataset id"""
    dataset_split: str = "prefs"
    """split with the training pairs (prompt, chosen, rejected)"""
    eval_split: Optional[str] = "test"
    """split with prompts and reference answers for greedy-decoding accuracy (None: no eval)"""
    pref_eval_split: Optional[str] = "prefs_test"
    """split with held-out pairs for the implicit-reward accuracy eval/pref_accuracy (None: none)"""
    prompt_column: str = "prompt"
    """column holding the prompt (a string, or a list of chat messages with --use-chat-template)"""
    chosen_column: str = "chosen"
    """column holding the preferred completion"""
    rejected_column: str = "rejected"
    """column holding the dispreferred completion"""
    answer_column: str = "answer"
    """column of --eval-split holding the reference answer"""
    use_chat_template: bool = False
    """wrap each prompt in the tokenizer's chat template (instruct models)"""
    max_prompt_length: int = 256
    """prompts longer than this many tokens keep their last tokens"""
    max_completion_length: int = 40
    """completions (with their EOS) longer than this many tokens lose their end; also the greedy eval's budget"""
    eval_limit: int = 500
    """evaluate greedy accuracy on at most this many eval examples"""
    pref_eval_limit: int = 500
    """evaluate the implicit-reward accuracy on at most this many held-out pairs"""
    lora_r: int = 0
    """rank of LoRA adapters on every linear layer (0: train all weights); needs `pip install peft`"""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""

    # --- algorithm
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust", "simpo"] = "sigmoid"
    """DPO (+cDPO), SLiC hinge, IPO, robust DPO or SimPO (module docstring)"""
    beta: float = 0.1
    """inverse temperature of the implicit reward beta log pi/pi_ref (IPO: its tau; SimPO: its beta, ~2)"""
    label_smoothing: float = 0.0
    """sigmoid (cDPO) and simpo: in [0, 0.5]; robust: the label-flip rate in [0, 0.5); others: 0"""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (Eq. 6 of arXiv:2405.14734); only with --loss-type simpo"""
    ipo_logps: Literal["mean", "sum"] = "mean"
    """IPO's log-ratios: averaged over completion tokens (TRL) or summed (Eq. 17 as written)"""
    rpo_alpha: float = 1.0
    """weight of the chosen completion's length-normalised NLL added to the loss (RPO; 0: off)"""
    precompute_ref_logps: bool = False
    """compute the reference log-probs of every training pair once before training: no reference model in memory"""

    # --- optimisation
    batch_size: int = 32
    """preference pairs per optimiser step (over all processes)"""
    micro_batch_size: int = 0
    """pairs per forward/backward pass (each is 2 sequences); gradient accumulation covers the rest of the
    batch (0: the largest divisor of each process's batch up to 64)"""
    learning_rate: float = 5e-4
    """peak learning rate of AdamW"""
    total_steps: int = 300
    """optimiser steps; changed on --resume, the lr decay continues from where it is and reaches 0 at the new
    last step"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: cosine or linear decay to 0 at the last step, or constant"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    pack_pairs: bool = True
    """run each pair as one row that holds the prompt and the completions' common start once (the same log-probs
    from fewer tokens; checked against the plain forward at start, which is used instead when a model cannot
    take the mask)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    device: str = "auto"
    """cuda, cpu, or auto (cuda when available)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """weights dtype; auto = float32 weights with bfloat16 autocast on CUDA"""

    # --- logging / checkpointing
    log_every: int = 1
    """steps between rows of metrics.jsonl (and printed lines when the output is not a terminal)"""
    eval_every: int = 50
    """steps between evaluations (0: only at start and end)"""
    save_every: int = 0
    """steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: Optional[str] = None
    """checkpoint folder (runs/<run>/checkpoints/step_N) to continue from, in its run directory, with the run's own
    arguments; flags given here that differ from their defaults may change the cadence (--total-steps, --log-every,
    --eval-every, --save-every, --eval-limit, --pref-eval-limit, tracking, --device), any other is refused"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time: {dataset}__{exp_name}__{seed}__{time}"""


# ----------------------------------------------------------------------------- math


def pair_logratios(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: Optional[torch.Tensor],
                   ref_rejected: Optional[torch.Tensor], chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                   loss_type: str, ipo_logps: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """The two terms whose difference is d, one per completion: all inputs [B] -> (chosen [B], rejected [B]).

    log pi(y|x) - log pi_ref(y|x) summed over the completion's tokens (Eq. 7 of arXiv:2305.18290);
    ipo with ipo_logps "mean": divided by the completion's token count (as TRL);
    simpo: log pi(y|x) / |y|, no reference (Eq. 6 of arXiv:2405.14734; ref_* are ignored and may be None).
    """
    if loss_type == "simpo":
        return policy_chosen / chosen_tokens, policy_rejected / rejected_tokens
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss_type == "ipo" and ipo_logps == "mean":
        return chosen / chosen_tokens, rejected / rejected_tokens
    return chosen, rejected


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, loss_type: str, beta: float,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.0) -> torch.Tensor:
    """Per-pair loss from the terms of pair_logratios: chosen, rejected [B] -> loss [B]; d = chosen - rejected."""
    d, eps = chosen - rejected, label_smoothing
    if loss_type == "sigmoid":  # Eq. 7 of arXiv:2305.18290; eps > 0: conservative DPO (cDPO)
        return -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    if loss_type == "hinge":  # SLiC-HF's calibration loss (arXiv:2305.10425) on the log-ratio, margin 1 / beta
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":  # Eq. 17 of arXiv:2310.12036 (beta is its tau)
        return (d - 1 / (2 * beta)) ** 2
    if loss_type == "robust":  # arXiv:2403.00409: unbiased under labels flipped with probability eps
        return (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    if loss_type == "simpo":  # Eq. 6 of arXiv:2405.14734, with cDPO-style label smoothing (TRL's CPO)
        z = beta * d - simpo_gamma
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    raise ValueError(f"unknown loss type {loss_type!r}: choose sigmoid, hinge, ipo, robust or simpo")


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's completion log-prob, log pi(y|x) summed over its tokens, never holding the [B, T, V] logits.

    input_ids, attention_mask, completion_mask: [B, T], right-padded prompt + completion; completion_mask is 1 on
    completion tokens -> [B] float32. Hidden state t predicts token t + 1; only the positions that predict a
    completion token go through the lm_head (kernels.linear_token_logprobs). Assumes logits = hidden @
    lm_head.weight.T (Llama, Qwen, Mistral, GPT-2 ...; not models with logit soft-capping or an lm_head bias).
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    predicts = completion_mask[:, 1:].bool()
    weight = model.get_output_embeddings().weight
    logp = linear_token_logprobs(hidden[:, :-1][predicts], weight.to(hidden.dtype), input_ids[:, 1:][predicts])
    rows = predicts.nonzero()[:, 0]
    return torch.zeros(input_ids.shape[0], dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)


def packed_logprobs(model, input_ids, allowed, position_ids, columns, targets, owners) -> torch.Tensor:
    """`sequence_logprobs` of `pack_pairs` rows -> [2B] float32: the B chosen then the B rejected completions'
    summed log-probs. The decoder runs with the pairs' attention mask; each entry's token log-prob is computed
    once (kernels.linear_token_logprobs) and counted for every sequence that owns it."""
    if model.config._attn_implementation == "sdpa":
        mask = allowed[:, None]
    else:  # eager attention adds its mask to the logits
        dtype = model.get_output_embeddings().weight.dtype
        mask = torch.zeros(allowed[:, None].shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed[:, None], torch.finfo(dtype).min)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    weight = model.get_output_embeddings().weight
    logp = linear_token_logprobs(hidden.flatten(0, 1)[columns], weight.to(hidden.dtype), targets)
    return torch.zeros(2 * input_ids.shape[0], dtype=logp.dtype, device=logp.device).index_add(
        0, owners[0], logp[owners[1]])


class PolicyLogprobs(torch.nn.Module):
    """The policy as DistributedDataParallel sees it: DDP synchronises gradients of the module whose forward runs."""

    def __init__(self, model, packed: bool):
        super().__init__()
        self.model, self.packed = model, packed

    def forward(self, *batch):
        return (packed_logprobs if self.packed else sequence_logprobs)(self.model, *batch)


def collate_pairs(pairs: list[tuple[list[int], list[int], list[int]]], pad_id: int):
    """(prompt, chosen, rejected) token lists -> ids, attention mask, completion mask, each [2B, T]: the B
    prompt + chosen rows, then the B prompt + rejected rows, right-padded to the longest."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention[i, : len(p) + len(c)] = 1
        completion[i, len(p) : len(p) + len(c)] = 1
    return ids, attention, completion


def shared_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens two token lists have in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pack_pairs(pairs: list[tuple[list[int], list[int], list[int]]], pad_id: int):
    """(prompt, chosen, rejected) token lists -> one row per pair that holds what its two sequences share once
    (prefix sharing, arXiv:2410.20305): prompt + chosen + the rejected completion after the n tokens it shares with
    the chosen one. The rejected tail attends to the shared prefix and to itself, not to the chosen tail, and its
    positions continue from the prefix, so every token sees what it sees in its own sequence.
    -> (ids [B, T] right-padded, allowed [B, T, T] bool (query, key), position ids [B, T], columns [E], targets [E],
        owners [2, K]): entry e is token targets[e] predicted by the hidden state at flat position columns[e]
        (row * T + column); owners lists (sequence, entry): sequences 0..B-1 are the chosen completions, B..2B-1
        the rejected ones, and an entry of the shared part belongs to both."""
    width = max(len(p) + len(c) + len(r) - shared_prefix(c, r) for p, c, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    split, shared, columns, targets, owners = [], [], [], [], []
    for b, (p, c, r) in enumerate(pairs):
        n = shared_prefix(c, r)
        ids[b, : len(p) + len(c) + len(r) - n] = torch.tensor(p + c + r[n:])
        split.append(len(p) + len(c))
        shared.append(len(p) + n)
        for j, token in enumerate(c):  # chosen token j is predicted at column len(p) + j - 1
            owners += [(b, len(columns))] + [(len(pairs) + b, len(columns))] * (j < n)
            columns.append(b * width + len(p) + j - 1)
            targets.append(token)
        for j in range(n, len(r)):  # the first tail token is predicted by the prefix's last, the rest by the tail
            owners.append((len(pairs) + b, len(columns)))
            columns.append(b * width + (len(p) + n - 1 if j == n else len(p) + len(c) + j - n - 1))
            targets.append(r[j])
    col = torch.arange(width)
    split, shared = torch.tensor(split)[:, None], torch.tensor(shared)[:, None]
    tail = col >= split  # [B, T]: the rejected tail (and the padding after it)
    position_ids = torch.where(tail, col - split + shared, col)
    query, key = col[None, :, None], col[None, None, :]
    allowed = (key <= query) & ~(tail[:, :, None] & (key >= shared[:, :, None]) & (key < split[:, :, None]))
    return ids, allowed, position_ids, torch.tensor(columns), torch.tensor(targets), torch.tensor(owners).T


@torch.no_grad()
def check_packing(model, pairs, pad_id: int, device) -> Optional[str]:
    """Packed log-probs of a few pairs against the plain forward (eval mode, no autocast) -> why packing cannot be
    used with this model (e.g. an attention implementation that ignores custom 4D masks), or None."""
    pairs, was_training = pairs[:8], model.training
    model.eval()
    try:
        plain = sequence_logprobs(model, *(t.to(device) for t in collate_pairs(pairs, pad_id)))
        packed = packed_logprobs(model, *(t.to(device) for t in pack_pairs(pairs, pad_id)))
    except Exception as e:  # noqa: BLE001
        return f"its packed forward fails ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    tol = 1e-4 if model.get_output_embeddings().weight.dtype == torch.float32 else 5e-2
    diff = float((packed - plain).abs().max())
    if not diff <= tol * (1 + float(plain.abs().max())):
        return f"its packed log-probs differ from its plain ones by {diff:.3g} (attention ignores the custom mask?)"
    return None


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
        return load_dataset("json", data_files={split: str(file)}, split=split)
    if path.is_file():
        return load_dataset("json", data_files=str(path), split="train")
    return load_dataset(dataset, split=split)


def check_columns(ds, columns: list[str], what: str) -> None:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{what} has no column {missing}; available columns: {ds.column_names} "
                         f"(choose with --prompt-column/--chosen-column/--rejected-column/--answer-column)")
    if len(ds) == 0:
        raise ValueError(f"{what} is empty: it needs at least one row")


def check_pairs(rows, what: str, prompt: str, chosen: str, rejected: str) -> None:
    """Every row has a prompt and two different, non-empty completions: name the row if not.

    rows: an iterable of dicts (a JSON-lines file's objects, or a loaded dataset's rows); what: where they come from.
    """
    n = 0
    for i, row in enumerate(rows, 1):
        n += 1
        missing = [c for c in (prompt, chosen, rejected) if c not in row]
        if missing:
            raise ValueError(f"{what}, row {i}: no column {missing}; available columns: {sorted(row)} (choose with "
                             f"--prompt-column/--chosen-column/--rejected-column)")
        for column in (chosen, rejected):
            if not isinstance(row[column], str) or not row[column].strip():
                raise ValueError(f"{what}, row {i}: the '{column}' completion is empty (or not a string): a pair needs "
                                 f"two non-empty completions; remove the row")
        if row[chosen] == row[rejected]:
            raise ValueError(f"{what}, row {i}: chosen and rejected completions are identical ({row[chosen][:40]!r}), "
                             f"so the pair carries no preference (d = 0 always); remove the row")
    if n == 0:
        raise ValueError(f"{what} is empty: it needs at least one preference pair")


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts, answers, max_new_tokens, device, eos_ids, batch_size=128,
                    progress=False):
    """Greedy decoding on left-padded batches; returns (accuracy, [(prompt, completion, answer)])."""
    model.eval()
    correct, samples = 0, []
    for i in tqdm(range(0, len(prompts), batch_size), desc="eval", leave=False, disable=not progress):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)
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


def plot_curves(metrics_file: Path, out: Path,
                keys=("train/loss", ("logps/chosen", "logps/rejected"), "rewards/accuracies", "eval/pref_accuracy",
                      "eval/accuracy")) -> None:
    """One panel per key; a tuple of keys shares a panel (chosen and rejected log-probs: likelihood displacement)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
    for ax, panel in zip(axes, keys):
        for key in (panel,) if isinstance(panel, str) else panel:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, label=key)
        if not isinstance(panel, str):
            ax.legend(fontsize=7)
        ax.set_title(panel if isinstance(panel, str) else " / ".join(panel))
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------- run lifecycle

# Flags a resumed run may change (a notice is printed); any other flag that differs from the run's own value
# is refused, since it would change the algorithm or the data. The run directory is the checkpoint's, so
# --exp-name and --output-dir are ignored on resume.
RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "eval_limit", "pref_eval_limit", "track",
                     "wandb_project_name", "wandb_entity", "device", "pack_pairs")
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


def check_model_path(name: str) -> None:
    """A local model folder has a config and a tokenizer; a hub id needs the hub."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
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


def fit_micro_batch(requested: int, per_process: int, what: str) -> int:
    """The micro-batch a process uses: `requested`, or with 0 the largest divisor of its batch up to 64."""
    if requested == 0:
        return max(d for d in range(1, min(64, per_process) + 1) if per_process % d == 0)
    if per_process % requested:
        works = [d for d in range(1, min(requested, per_process) + 1) if per_process % d == 0][-1]
        raise ValueError(f"{what} = {per_process} is not divisible by --micro-batch-size {requested}: use "
                         f"--micro-batch-size {works} (or 0, the largest divisor up to 64)")
    return requested


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



def label_smoothing_range(loss_type: str) -> tuple[float, float, bool]:
    """The --label-smoothing values a loss accepts: (low, high, high included)."""
    return {"sigmoid": (0.0, 0.5, True), "simpo": (0.0, 0.5, True), "robust": (0.0, 0.5, False)}.get(
        loss_type, (0.0, 0.0, True))


def validate(args: Args) -> int:
    """Every check that needs no model loading (the local pairs files are read and checked); -> the micro-batch
    size (pairs) each process uses."""
    for name in ("total_steps", "batch_size", "max_completion_length", "max_prompt_length", "log_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_every", "save_every", "warmup_steps", "eval_limit", "pref_eval_limit", "lora_r",
                 "micro_batch_size"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {world} processes: "
                         f"use a multiple of {world}, e.g. {world * max(1, args.batch_size // world)}")
    micro = fit_micro_batch(args.micro_batch_size, args.batch_size // world,
                            f"each process's pairs (--batch-size / {world} processes)" if world > 1 else "--batch-size")
    if args.learning_rate <= 0:
        raise ValueError(f"--learning-rate must be positive, got {args.learning_rate}")
    if args.beta <= 0:
        raise ValueError(f"--beta must be > 0, got {args.beta}: it scales the implicit reward beta log pi/pi_ref "
                         f"(typical: 0.1 for sigmoid/hinge/ipo/robust, about 2 for simpo)")
    low, high, closed = label_smoothing_range(args.loss_type)
    if not (low <= args.label_smoothing and (args.label_smoothing <= high if closed else args.label_smoothing < high)):
        allowed = {"sigmoid": "[0, 0.5] (cDPO)", "simpo": "[0, 0.5]", "robust": "[0, 0.5) (the label-flip rate; "
                   "0.5 would divide by 0)"}.get(args.loss_type, "0 only (it has no label smoothing; use --loss-type "
                                                                  "sigmoid or robust)")
        raise ValueError(f"--label-smoothing {args.label_smoothing} is outside its range for --loss-type "
                         f"{args.loss_type}: {allowed}")
    if args.rpo_alpha < 0 or args.simpo_gamma < 0:
        raise ValueError(f"need --rpo-alpha >= 0 and --simpo-gamma >= 0, got {args.rpo_alpha}, {args.simpo_gamma}")
    if args.loss_type == "simpo" and args.precompute_ref_logps:
        raise ValueError("--loss-type simpo is reference-free: --precompute-ref-logps has no reference to compute; "
                         "drop the flag (or choose a loss that uses a reference)")
    if args.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ValueError("--lora-r > 0 needs the peft package: `pip install peft` (or use --lora-r 0)") from None
    check_device(args.device, args.dtype)
    check_model_path(args.model_name_or_path)
    pair_splits = [args.dataset_split] + ([args.pref_eval_split] if args.pref_eval_split else [])
    check_dataset(args.dataset, pair_splits + ([args.eval_split] if args.eval_split else []))
    path = Path(args.dataset).expanduser()
    for file in [path / f"{s}.jsonl" for s in pair_splits] if path.is_dir() else [path] if path.is_file() else []:
        with file.open() as f:
            check_pairs((json.loads(line) for line in f if line.strip()), str(file), args.prompt_column,
                        args.chosen_column, args.rejected_column)
    if args.track:
        check_wandb_login()
    return micro


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
    micro = validate(args)
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

    # 1. Data: the pairs, tokenised once (prompt; completion + EOS), checked up front.
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def prompt_texts(values) -> list[str]:
        if not args.use_chat_template:
            if not isinstance(values[0], str):
                raise ValueError(f"prompts in column '{args.prompt_column}' are chat messages: pass --use-chat-template")
            return list(values)
        if tokenizer.chat_template is None:
            raise ValueError(f"--use-chat-template: the tokenizer of {args.model_name_or_path} has no chat template")
        return [tokenizer.apply_chat_template([{"role": "user", "content": v}] if isinstance(v, str) else v,
                                              tokenize=False, add_generation_prompt=True) for v in values]

    def load_pairs(split: str, limit: Optional[int] = None) -> list[tuple[list[int], list[int], list[int]]]:
        ds = load_split(args.dataset, split)
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        check_pairs(iter(ds), f"split '{split}'", args.prompt_column, args.chosen_column, args.rejected_column)

        def encode(texts):
            return tokenizer(texts, add_special_tokens=False)["input_ids"]

        prompts = [ids[-args.max_prompt_length:] for ids in encode(prompt_texts(list(ds[args.prompt_column])))]
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"{len(empty)} prompts of split '{split}' are empty (row {empty[0] + 1}): remove them")
        chosen, rejected = ([(ids + [tokenizer.eos_token_id])[: args.max_completion_length] for ids in encode(list(ds[c]))]
                            for c in (args.chosen_column, args.rejected_column))
        return list(zip(prompts, chosen, rejected))

    pairs = load_pairs(args.dataset_split)
    eval_pairs = load_pairs(args.pref_eval_split, args.pref_eval_limit) if args.pref_eval_split else []
    eval_prompts, eval_answers = [], []
    if args.eval_split:
        ev = load_split(args.dataset, args.eval_split)
        check_columns(ev, [args.prompt_column, args.answer_column], f"eval split '{args.eval_split}'")
        n = min(len(ev), args.eval_limit)
        eval_prompts, eval_answers = prompt_texts(list(ev[args.prompt_column][:n])), list(ev[args.answer_column][:n])

    # 2. Model: the policy (optionally with LoRA adapters) and the reference: loaded again from the same weights
    #    (frozen), the policy with its adapters disabled (LoRA), precomputed (no second model), or none (SimPO).
    weights_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)

    def load_model():
        m = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=weights_dtype).to(device)
        for module in m.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return m

    model = load_model()
    eos_ids = sorted({tokenizer.eos_token_id} | set(np.atleast_1d(model.generation_config.eos_token_id or []).tolist()))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    elif args.loss_type != "simpo" and not args.precompute_ref_logps:
        ref_model = load_model().eval().requires_grad_(False)
    raw_model = model
    why_not_packed = check_packing(raw_model, pairs, tokenizer.pad_token_id, device) if args.pack_pairs else None
    if why_not_packed and rank == 0:
        print(f"--pack-pairs: running chosen and rejected in rows of their own, as {why_not_packed}", flush=True)
    packed = args.pack_pairs and not why_not_packed
    logprobs = packed_logprobs if packed else sequence_logprobs

    def collate(rows: list) -> tuple[torch.Tensor, ...]:
        """Pairs -> the tensors `logprobs` takes, on the device: one row per pair packed, else two."""
        return tuple(t.to(device) for t in (pack_pairs if packed else collate_pairs)(rows, tokenizer.pad_token_id))

    policy = PolicyLogprobs(model, packed)
    if ddp:
        policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")

    @torch.no_grad()
    def reference_logprobs(*batch):
        if ref_model is not None:
            return logprobs(ref_model, *batch)
        with raw_model.disable_adapter():  # LoRA: the reference is the base model without adapters
            return logprobs(raw_model, *batch)

    def policy_logprobs(*batch):  # the policy as it is now (logps_of runs it without gradients)
        return logprobs(raw_model, *batch)

    @torch.no_grad()
    def logps_of(fn, rows: list) -> torch.Tensor:
        """fn's log-probs of every pair of rows, micro-batch by micro-batch -> [N, 2] (chosen, rejected), on CPU."""
        out = []
        for i in range(0, len(rows), micro):
            with autocast:
                out.append(fn(*collate(rows[i : i + micro])).float().view(2, -1).T.cpu())
        return torch.cat(out) if out else torch.zeros(0, 2)

    # The reference's log-probs of the held-out pairs, and with --precompute-ref-logps of every training pair, once,
    # from the policy itself: it holds the initial weights until section 3 (a resumed run's are loaded there), so it
    # is the reference. Precomputed, no second model is ever loaded and no step runs a reference forward pass.
    uses_ref = args.loss_type != "simpo"
    raw_model.eval()
    eval_ref = logps_of(policy_logprobs, eval_pairs) if uses_ref else None
    train_ref = logps_of(policy_logprobs, pairs) if args.precompute_ref_logps else None
    raw_model.train()

    # 3. Optimiser, schedule and data order; restore them all on --resume.
    optimizer = torch.optim.AdamW([p for p in raw_model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  betas=(0.9, 0.99), weight_decay=args.weight_decay)
    lr_anchor = None  # set when a resumed run changes --total-steps (lr_factor)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    order_gen = torch.Generator().manual_seed(args.seed)
    order, cursor, start_step = torch.randperm(len(pairs), generator=order_gen), 0, 0
    if args.resume:
        ckpt = Path(args.resume)
        if args.lora_r:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(raw_model, load_file(ckpt / "adapter_model.safetensors", device=str(device)))
        else:
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
    last = {"eval/accuracy": None, "eval/pref_accuracy": None}  # the latest values the progress line shows

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
        shown = {"loss": last.get("train/loss"), "margin": last.get("rewards/margins"),
                 "pref_acc": last["eval/pref_accuracy"], "acc": last["eval/accuracy"]}
        text = " | ".join(f"{k} {v:.3g}" for k, v in shown.items() if v is not None)
        if progress:
            bar.set_postfix_str(f"{text} | {seconds_per_step:.2f} s/step")
        else:
            print(f"step {step}/{args.total_steps} | {text} | {seconds_per_step:.2f} s/step | "
                  f"ETA {eta((args.total_steps - step) * seconds_per_step)}", flush=True)

    def evaluate(step: int) -> dict:
        """Greedy accuracy on --eval-split and the implicit-reward accuracy on the held-out pairs (rank 0)."""
        row = {"step": step}
        if rank == 0 and eval_pairs:
            raw_model.eval()
            logps = logps_of(policy_logprobs, eval_pairs)
            raw_model.train()
            tokens = torch.tensor([[len(c), len(r)] for _, c, r in eval_pairs], dtype=torch.float32)
            ref = eval_ref.unbind(1) if uses_ref else (None, None)
            chosen, rejected = pair_logratios(logps[:, 0], logps[:, 1], ref[0], ref[1], tokens[:, 0], tokens[:, 1],
                                              args.loss_type, args.ipo_logps)
            row.update({"eval/pref_accuracy": float((chosen > rejected).float().mean()),
                        "eval/logps_chosen": float(logps[:, 0].mean()), "eval/logps_rejected": float(logps[:, 1].mean())})
        if rank == 0 and eval_prompts:
            row["eval/accuracy"], samples = greedy_accuracy(raw_model, tokenizer, eval_prompts, eval_answers,
                                                            args.max_completion_length, device, eos_ids,
                                                            progress=progress)
            if wandb:
                wandb.log({"eval/samples": wandb.Table(columns=["prompt", "completion", "answer"],
                                                       data=[list(s) for s in samples[:16]])}, step=step)
        if len(row) > 1:
            log(row)
            if not progress:
                print(f"eval at step {step}: " + ", ".join(f"{k[5:]} {v:.4f}" for k, v in row.items() if k != "step"),
                      flush=True)
        if ddp:
            dist.barrier()
        return {k: v for k, v in row.items() if k != "step"}

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
        n_train = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
        reference = ("none (SimPO)" if not uses_ref else "precomputed" if args.precompute_ref_logps else
                     "adapters disabled" if args.lora_r else "frozen copy")
        print(f"run directory: {run_dir}  |  {len(pairs)} training pairs, {len(eval_pairs)} held-out pairs, "
              f"{len(eval_prompts)} eval prompts, {n_train / 1e6:.2f}M trainable parameters on {device}, "
              f"micro-batch {micro} pairs{' packed in one row each' if packed else ''}, reference: {reference}", flush=True)
    mine = args.batch_size // world
    step, final = start_step, {}
    tokens_since_log, seconds_since_log, last_log_step = 0, 0.0, start_step
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
                # 4a. The next batch of pairs in epoch order; every process draws the same indices and keeps its share.
                if cursor + args.batch_size > len(order):
                    order, cursor = torch.randperm(len(pairs), generator=order_gen), 0
                batch = order[cursor : cursor + args.batch_size][rank * mine : (rank + 1) * mine].tolist()
                cursor += args.batch_size

                # 4b. Per micro-batch: chosen and rejected in one forward pass, the reference's log-probs (cached or
                #     one no-grad pass), the per-pair loss (+ RPO's NLL), averaged over the whole step's pairs.
                sums = dict.fromkeys(("loss", "nll", "chosen", "rejected", "correct", "logps_chosen", "logps_rejected"),
                                     0.0)
                for k in range(0, mine, micro):
                    rows = batch[k : k + micro]
                    micro_pairs = [pairs[i] for i in rows]
                    tensors = collate(micro_pairs)
                    tokens = torch.tensor([[len(c) for _, c, _ in micro_pairs], [len(r) for _, _, r in micro_pairs]],
                                          dtype=torch.float32, device=device)  # [2, m]: completion token counts
                    sync = k + micro >= mine or not ddp
                    with (policy.no_sync() if not sync else torch.enable_grad()), autocast:
                        logp = policy(*tensors).view(2, -1)
                        ref = (None, None)
                        if uses_ref:
                            ref = (train_ref[rows].T.to(device) if train_ref is not None else
                                   reference_logprobs(*tensors).float().view(2, -1))
                        chosen, rejected = pair_logratios(logp[0], logp[1], ref[0], ref[1], tokens[0], tokens[1],
                                                          args.loss_type, args.ipo_logps)
                        losses = preference_loss(chosen, rejected, args.loss_type, args.beta, args.label_smoothing,
                                                 args.simpo_gamma)
                        nll = -logp[0] / tokens[0]  # RPO: the chosen completion's per-token NLL (arXiv:2404.19733)
                        per_pair = losses + args.rpo_alpha * nll
                        (per_pair.sum() / args.batch_size * world).backward()  # DDP averages gradients over processes
                    chosen, rejected = args.beta * chosen, args.beta * rejected  # implicit rewards
                    for name, x in (("loss", per_pair), ("nll", nll), ("chosen", chosen), ("rejected", rejected),
                                    ("correct", (chosen > rejected).float()), ("logps_chosen", logp[0]),
                                    ("logps_rejected", logp[1])):
                        sums[name] += float(x.detach().sum())
                    tokens_since_log += sum(2 * len(p) + len(c) + len(r) for p, c, r in micro_pairs)  # both sequences
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                lr = scheduler.get_last_lr()[0]  # the rate of this step's update (logged below)
                scheduler.step()
                seconds_since_log += time.perf_counter() - t_step
                steps_timed, seconds_timed = steps_timed + 1, seconds_timed + time.perf_counter() - t_step

                # 4c. Log with TRL's meanings: implicit rewards, their margin and accuracy, the policy's log-probs.
                if step % args.log_every == 0 or step == args.total_steps:
                    local = torch.tensor(list(sums.values()), device=device)
                    if ddp:
                        dist.all_reduce(local)
                    s = dict(zip(sums, (v / args.batch_size for v in local.tolist())))
                    final = {"step": step, "train/loss": s["loss"], "train/nll": s["nll"],
                             "rewards/chosen": s["chosen"], "rewards/rejected": s["rejected"],
                             "rewards/margins": s["chosen"] - s["rejected"], "rewards/accuracies": s["correct"],
                             "logps/chosen": s["logps_chosen"], "logps/rejected": s["logps_rejected"],
                             "train/grad_norm": float(grad_norm), "train/lr": lr,
                             "perf/step_s": seconds_since_log / (step - last_log_step),
                             "perf/tokens_per_s": tokens_since_log * world / max(seconds_since_log, 1e-9)}
                    log(final)
                    tokens_since_log, seconds_since_log, last_log_step = 0, 0.0, step
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

    # 5. Final evaluation, the trained model (LoRA merged into it), the curves.
    if not stop.requested:
        final.update(evaluate(step))
        checkpoint(step)
        if rank == 0:
            merged = copy.deepcopy(raw_model).merge_and_unload() if args.lora_r else raw_model
            save_checkpoint(run_dir / "final", merged, tokenizer)
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
