"""Group Relative Policy Optimization (GRPO) with the Dr.GRPO, DAPO and BNPO loss variants.

GRPO (DeepSeekMath, arXiv:2402.03300, Sec. 4): for each prompt q sample G completions o_1..o_G from
the old policy, score them, and use the group-normalised reward as every token's advantage,
    A_i = (r_i - mean(r)) / std(r)                                    (Sec. 4.1.2, outcome supervision)
then maximise the PPO-clipped surrogate minus a KL penalty to a frozen reference (Eq. 3),
    J = E[ 1/G sum_i 1/|o_i| sum_t min(rho A_i, clip(rho, 1-eps, 1+eps) A_i) - beta KL_k3 ],
    rho = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t),   KL_k3 = pi_ref/pi - log(pi_ref/pi) - 1   (Eq. 4).
Variants (`--loss-type`, `--scale-rewards`, `--clip-high`, `--dynamic-sampling`):
    Dr.GRPO (arXiv:2503.20783, Sec. 3): no std division (`--scale-rewards none`) and a constant
        normaliser instead of 1/|o_i| (`--loss-type dr_grpo`: divide by max completion length).
    DAPO (arXiv:2503.14476, Sec. 3): clip-higher (`--clip-high 0.28`), dynamic sampling (drop groups
        whose rewards are all equal, refill), token-level loss (`--loss-type dapo`: one token mean over
        the whole step) and overlong filtering (`--mask-truncated-completions`).
    BNPO (`--loss-type bnpo`): token mean of each micro-batch.

Run:
    python grpo.py                                                # embedded: models/tiny-arith on data/arith
    python grpo.py --scale-rewards group --beta 0.04              # the paper's advantages and KL penalty
    python grpo.py --loss-type dr_grpo --scale-rewards none       # Dr.GRPO
    python grpo.py --loss-type dapo --clip-high 0.28 --dynamic-sampling --mask-truncated-completions --beta 0
    python grpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template \
        --dataset my/hub-dataset --dataset-split train --eval-split test --max-completion-length 512 \
        --micro-batch-size 8 --learning-rate 1e-6 --lora-r 16         # any HF causal LM (LoRA needs `pip install peft`)
    torchrun --nproc-per-node 2 grpo.py                          # data parallel (DDP), gloo on CPU, nccl on GPU

Deviations and choices:
- Defaults are tuned for the embedded model, measured in the README: `--scale-rewards none` (Dr.GRPO's
  unscaled advantages; with the correctness + format reward, dividing by a group's std turns a format
  difference among all-wrong completions into unit-size advantages that reinforce wrong answers),
  temperature 0.7, 64 prompts x 8 completions per step at lr 1e-4 (30 warmup steps, cosine decay), no KL. This
  0.9M-parameter model is fragile: Adam steps computed from a few sequences damage it (even SFT on
  10 gold completions per step at lr 1e-4 drops its greedy accuracy from 37% to 22% in 10 steps),
  hence the large batch and small learning rate.
- With beta = 0, completions whose advantage is 0 skip the forward and backward pass: their loss and
  gradient are exactly 0 (the normalisers still count them). bnpo keeps them (its micro-batch means
  would change).
- Each update's completions are sorted by length into micro-batches, each padded to its own longest.
- One training step = one batch of `--prompts-per-step` x `--num-generations` completions, followed by
  `--num-iterations` (mu) optimiser updates on it; the learning-rate schedule advances once per step.
  With mu = 1 the ratio is exactly 1 and pi_old = pi is never computed separately; with mu > 1 the
  old log-probs are those of the first update's forward pass (the weights have not moved yet).
- Log-probs are of softmax(logits / --temperature), the distribution sampled from (as TRL does);
  top-k / top-p truncation of the sampler is not part of them.
- The standard deviation is the unbiased one, plus 1e-4 (as TRL); a group whose rewards are all
  equal gets exactly zero advantage. `--scale-rewards batch` centres on the group mean and divides
  by the std of the whole batch (arXiv:2508.08221).
- Dropout is switched off (RL's ratios and KL assume one fixed policy; TRL's `disable_dropout`).
- Prompts longer than `--max-prompt-length` keep their last tokens (as TRL).
- Dynamic sampling draws only as many fresh prompts as groups are missing, at most
  `--max-resample-rounds` times; if still short, it tops the batch up with zero-advantage groups.
- Under torchrun each process draws its own prompts (own data order, seeded by rank) and samples
  its share of the groups; rewards are gathered so `--scale-rewards batch` and `--loss-type dapo`
  see the global batch.
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
from typing import Callable, Literal, Optional
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
import tyro
from datasets import load_dataset
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from kernels import clipped_policy_loss, linear_token_logprobs
from rewards import DEFAULT_SPEC, make_reward


@dataclass
class Args:
    # --- experiment / tracking
    exp_name: str = "grpo"
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
    dataset: str = "data/arith"
    """local folder of `<split>.jsonl` files, a JSON-lines file, or a Hugging Face dataset id"""
    dataset_split: str = "train"
    """split with the training prompts"""
    eval_split: Optional[str] = "test"
    """split with prompts and reference answers for greedy-decoding accuracy (None: no eval)"""
    prompt_column: str = "prompt"
    """column holding the prompt (a string, or a list of chat messages with --use-chat-template)"""
    answer_column: str = "answer"
    """column holding the reference answer; rewards receive it as `answer`"""
    use_chat_template: bool = False
    """wrap each prompt in the tokenizer's chat template (instruct models)"""
    max_prompt_length: int = 256
    """prompts longer than this many tokens keep their last tokens"""
    eval_limit: int = 500
    """evaluate on at most this many eval examples"""
    lora_r: int = 0
    """rank of LoRA adapters on every linear layer (0: train all weights); needs `pip install peft`"""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""

    # --- algorithm
    num_generations: int = 8
    """G, completions sampled per prompt"""
    prompts_per_step: int = 64
    """prompts per training step (over all processes); the batch is prompts_per_step x G completions"""
    max_completion_length: int = 40
    """most new tokens per completion (also the budget of the greedy evaluation)"""
    temperature: float = 0.7
    """sampling temperature; log-probs are those of the tempered distribution"""
    top_p: float = 1.0
    """nucleus sampling threshold (1: off)"""
    top_k: int = 0
    """sample among the k most likely tokens (0: off)"""
    reward: str = DEFAULT_SPEC
    """reward spec for rewards.make_reward: `name:weight,...` or a JSON spec file"""
    scale_rewards: Literal["group", "batch", "none"] = "none"
    """divide advantages by the std of the group (GRPO), of the batch, or not at all (Dr.GRPO)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill them from fresh prompts"""
    max_resample_rounds: int = 4
    """dynamic sampling: most extra generation rounds per step before topping up with dropped groups"""
    mask_truncated_completions: bool = False
    """DAPO overlong filtering: completions without EOS get no loss"""
    beta: float = 0.0
    """KL coefficient to the frozen reference model (0: no reference model is kept)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """estimator of KL(pi || pi_ref), http://joschu.net/blog/kl-approx.html (k3 is Eq. 4 of arXiv:2402.03300)"""
    num_iterations: int = 1
    """mu, optimiser updates on each batch of completions (ratio != 1 from the second on)"""
    clip_low: float = 0.2
    """epsilon_low: the ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """epsilon_high: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher uses 0.28)"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    """token aggregation: per-sequence mean, micro-batch token mean, constant normaliser, step token mean"""

    # --- optimisation
    learning_rate: float = 1e-4
    """peak learning rate of AdamW"""
    total_steps: int = 500
    """training steps (batches of completions); changed on --resume, the lr decay continues from where it is
    and reaches 0 at the new last step"""
    micro_batch_size: int = 0
    """completions per forward/backward pass, grouped by length so each is padded to its own longest;
    gradient accumulation covers the rest of the batch (0: the largest divisor of each process's batch up to 128)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: cosine or linear decay to 0 at the last step, or constant (the default cosine keeps the
    late policy from drifting between evaluations; README)"""
    warmup_steps: int = 30
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
    log_every: int = 1
    """steps between rows of metrics.jsonl (and printed lines when the output is not a terminal)"""
    eval_every: int = 50
    """steps between greedy evaluations (0: only at start and end)"""
    save_every: int = 0
    """steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: Optional[str] = None
    """checkpoint folder (runs/<run>/checkpoints/step_N) to continue from, in its run directory, with the run's own
    arguments; flags given here that differ from their defaults may change the cadence (--total-steps, --log-every,
    --eval-every, --save-every, --eval-limit, tracking, --device), any other is refused"""
    num_sample_completions: int = 8
    """completions per logging step in the --track table"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time: {dataset}__{exp_name}__{seed}__{time}"""


# ----------------------------------------------------------------------------- math


def group_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """Group-relative advantages (Sec. 4.1.2 of arXiv:2402.03300); `none` is Dr.GRPO (arXiv:2503.20783).

    rewards: [P, G], G completions of each of P prompts -> advantages [P, G] float32:
    r - mean(group), divided by std(group) + 1e-4 ("group"), std(all P*G rewards) + 1e-4 ("batch")
    or nothing ("none"). A group whose rewards are all equal gets exactly 0, never NaN.
    """
    rewards = rewards.float()
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.masked_fill(informative_groups(rewards)[:, None].logical_not(), 0.0)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """rewards: [P, G] -> [P] bool, True where the group's rewards are not all equal (DAPO Sec. 3.2)."""
    return rewards.amax(dim=1) > rewards.amin(dim=1)


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens belong to each completion: everything up to and including its first EOS.

    completion_ids: [B, T]; eos_ids: [K] -> (mask [B, T] float32, truncated [B] bool: no EOS in T tokens).
    """
    is_eos = torch.isin(completion_ids, eos_ids)
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # EOS tokens strictly before t
    return (eos_before == 0).float(), ~is_eos.any(dim=1)


def loss_mask(completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """Tokens that enter the loss: completion_mask [B, T] float, truncated [B] bool -> [B, T].

    With mask_truncated, completions cut off at the length limit count for nothing (DAPO's overlong
    filtering, Sec. 3.4 of arXiv:2503.14476): their reward says nothing about a finished answer.
    """
    return completion_mask * (~truncated)[:, None].float() if mask_truncated else completion_mask


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *, num_sequences: int,
                   num_tokens: int, max_completion_length: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss: summed over all micro-batches and processes it is

        grpo     mean over sequences of each sequence's token mean   (the 1/|o_i| of Eq. 3, arXiv:2402.03300)
        bnpo     mean over micro-batches of each micro-batch's token mean
        dr_grpo  token sum / (num_sequences x max_completion_length)  (arXiv:2503.20783, Sec. 3)
        dapo     token sum / num_tokens: one token mean over the step (arXiv:2503.14476, Sec. 3.3)

    per_token_loss, mask: [B, T]; num_sequences, num_tokens: completions and masked tokens in the
    whole step (all micro-batches and processes) -> scalar.
    """
    masked = (per_token_loss * mask).sum(dim=1)
    if loss_type == "grpo":
        return (masked / mask.sum(dim=1).clamp(min=1.0)).sum() / num_sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) * (mask.shape[0] / num_sequences)
    if loss_type == "dr_grpo":
        return masked.sum() / (num_sequences * max_completion_length)
    if loss_type == "dapo":
        return masked.sum() / max(num_tokens, 1)
    raise ValueError(f"unknown loss type {loss_type!r}: choose grpo, bnpo, dr_grpo or dapo")


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                        temperature: float, with_entropy: bool = False):
    """Log-probs of the completion tokens from the last hidden states and the lm_head, never the full logits.

    input_ids, attention_mask: [B, Tp + Tc], prompts left-padded to Tp, then the completions
    -> logp [B, Tc] float32 (, entropy [B, Tc]). Hidden state t predicts token t + 1. Positions count
    real tokens only, as `generate` does with left padding. Assumes logits = hidden @ lm_head.weight.T
    (Llama, Qwen, Mistral, GPT-2 ...; not models with logit soft-capping or an lm_head bias).
    """
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    weight = model.get_output_embeddings().weight
    return linear_token_logprobs(hidden[:, prompt_width - 1 : -1], weight.to(hidden.dtype), input_ids[:, prompt_width:],
                                 temperature=temperature, with_entropy=with_entropy)


class PolicyLogprobs(torch.nn.Module):
    """The policy as DistributedDataParallel sees it: DDP synchronises gradients of the module whose forward runs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, prompt_width: int, temperature: float):
        return completion_logprobs(self.model, input_ids, attention_mask, prompt_width, temperature, with_entropy=True)


def length_sorted_micro_batches(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, size: int):
    """Rows grouped `size` at a time by completion length (longest first), with the columns each group needs,
    so that a micro-batch is padded to its own longest prompt and completion rather than the batch's.

    prompt_mask: [B, Tp] (left-padded), completion_mask: [B, Tc]
    -> [(rows [size] long, first prompt column kept, completion columns kept)].
    """
    lengths = completion_mask.sum(dim=1)
    out = []
    for rows in torch.argsort(lengths, descending=True, stable=True).split(size):
        first = int(prompt_mask[rows].any(dim=0).float().argmax())  # the first column holding a prompt token
        out.append((rows, first, int(lengths[rows].max())))
    return out


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


# ----------------------------------------------------------------------------- rollouts


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, T] left-padded with pad_id, attention mask [B, T])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


def pad_width(x: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    """x: [B, T] -> [B, width] padded with value on the left or the right."""
    pad = (width - x.shape[1], 0) if left else (0, width - x.shape[1])
    return torch.nn.functional.pad(x, pad, value=value)


def take_rows(batch: dict, rows: torch.Tensor) -> dict:
    """Select rows (the first dimension) of every tensor, list and nested dict of a rollout batch."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, dict):
            out[k] = take_rows(v, rows)
        elif isinstance(v, torch.Tensor):
            out[k] = v[rows.to(v.device)]
        else:
            out[k] = [v[i] for i in rows.tolist()]
    return out


# prompts are padded on the left, completions on the right: the layout `generate` produces
LEFT_PADDED = {"prompt_ids": True, "prompt_mask": True, "completion_ids": False, "completion_mask": False}


def concat_rollouts(batches: list[dict], pad_id: int) -> dict:
    """Row-concatenate rollout batches whose prompt/completion widths differ, re-padding them."""
    out = {}
    for k, v in batches[0].items():
        values = [b[k] for b in batches]
        if isinstance(v, dict):
            out[k] = {name: torch.cat([x[name] for x in values]) for name in v}
        elif k in LEFT_PADDED:
            width = max(x.shape[1] for x in values)
            fill = pad_id if k.endswith("ids") else 0
            out[k] = torch.cat([pad_width(x, width, fill, LEFT_PADDED[k]) for x in values])
        elif isinstance(v, torch.Tensor):
            out[k] = torch.cat(values)
        else:
            out[k] = [x for vs in values for x in vs]
    return out


def dynamic_sampling(draw: Callable[[int], dict], num_groups: int, group_size: int, max_rounds: int,
                     pad_id: int) -> tuple[dict, int, int]:
    """DAPO dynamic sampling (arXiv:2503.14476, Sec. 3.2): keep only groups whose rewards differ.

    draw(n) -> a rollout batch of n groups (n x group_size rows, group-major) with rewards["total"].
    Draws num_groups, then refills the dropped ones from fresh prompts, at most max_rounds more draws;
    if still short, tops up with dropped (zero-advantage) groups so the batch keeps its size.
    -> (batch of num_groups groups, draws made, informative groups in the batch).
    """
    kept, dropped, n_kept, draws = [], [], 0, 0
    while n_kept < num_groups and draws <= max_rounds:
        batch = draw(num_groups - n_kept)
        draws += 1
        good = informative_groups(batch["rewards"]["total"].view(-1, group_size))
        rows = torch.arange(good.numel() * group_size).view(-1, group_size)
        if good.any():
            kept.append(take_rows(batch, rows[good].flatten()))
            n_kept += int(good.sum())
        if not good.all():
            dropped.append(take_rows(batch, rows[~good].flatten()))
    out = concat_rollouts(kept + dropped, pad_id)
    return take_rows(out, torch.arange(num_groups * group_size)), draws, min(n_kept, num_groups)


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
                         f"(choose with --prompt-column/--answer-column, or pick a --reward that does not need it)")
    if len(ds) == 0:
        raise ValueError(f"{what} is empty: it needs at least one row")


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
                keys=("train/reward", "eval/accuracy", "train/completion_length", "train/entropy")) -> None:
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
RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "eval_limit", "num_sample_completions",
                     "track", "wandb_project_name", "wandb_entity", "device")
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
    """The micro-batch a process uses: `requested`, or with 0 the largest divisor of its batch up to 128."""
    if requested == 0:
        return max(d for d in range(1, min(128, per_process) + 1) if per_process % d == 0)
    if per_process % requested:
        works = [d for d in range(1, min(requested, per_process) + 1) if per_process % d == 0][-1]
        raise ValueError(f"{what} = {per_process} is not divisible by --micro-batch-size {requested}: use "
                         f"--micro-batch-size {works} (or 0, the largest divisor up to 128)")
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


def validate(args: Args) -> int:
    """Every check that needs no model or data loading; -> the micro-batch size each process uses."""
    for name in ("total_steps", "prompts_per_step", "max_completion_length", "max_prompt_length",
                 "log_every", "num_iterations"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_every", "save_every", "warmup_steps", "eval_limit", "max_resample_rounds", "lora_r", "top_k",
                 "num_sample_completions", "micro_batch_size"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.num_generations < 2:
        raise ValueError(f"--num-generations must be >= 2, got {args.num_generations}: GRPO's advantage compares "
                         f"completions of the same prompt (--scale-rewards {args.scale_rewards} needs a group)")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} does not split evenly over {world} processes: "
                         f"use a multiple of {world}, e.g. {world * max(1, args.prompts_per_step // world)}")
    micro = fit_micro_batch(args.micro_batch_size, args.prompts_per_step // world * args.num_generations,
                            f"each process's completions (--prompts-per-step / {world} processes x --num-generations)"
                            if world > 1 else "--prompts-per-step x --num-generations")
    if args.learning_rate <= 0:
        raise ValueError(f"--learning-rate must be positive, got {args.learning_rate}")
    if not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise ValueError(f"need --temperature > 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")
    if args.beta < 0 or not (0 <= args.clip_low <= 1) or args.clip_high < 0:
        raise ValueError(f"need --beta >= 0, 0 <= --clip-low <= 1 and --clip-high >= 0, got {args.beta}, "
                         f"{args.clip_low}, {args.clip_high}")
    if args.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ValueError("--lora-r > 0 needs the peft package: `pip install peft` (or use --lora-r 0)") from None
    check_device(args.device, args.dtype)
    check_model_path(args.model_name_or_path)
    check_dataset(args.dataset, [args.dataset_split] + ([args.eval_split] if args.eval_split else []))
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
    reward = make_reward(args.reward)
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

    # 1. Data: the prompts, tokenised once; the reward's columns, checked up front.
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = load_split(args.dataset, args.dataset_split)
    columns = {c: args.answer_column if c == "answer" else c for c in sorted(reward.required_columns)}
    check_columns(train, [args.prompt_column, *columns.values()], f"split '{args.dataset_split}' (reward {args.reward!r})")

    def prompt_texts(values) -> list[str]:
        if not args.use_chat_template:
            if not isinstance(values[0], str):
                raise ValueError(f"prompts in column '{args.prompt_column}' are chat messages: pass --use-chat-template")
            return list(values)
        if tokenizer.chat_template is None:
            raise ValueError(f"--use-chat-template: the tokenizer of {args.model_name_or_path} has no chat template")
        return [tokenizer.apply_chat_template([{"role": "user", "content": v}] if isinstance(v, str) else v,
                                              tokenize=False, add_generation_prompt=True) for v in values]

    raw_prompts = list(train[args.prompt_column])
    texts = prompt_texts(raw_prompts)
    prompt_ids = [ids[-args.max_prompt_length:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    empty = [i for i, p in enumerate(prompt_ids) if not p]
    if empty:
        raise ValueError(f"{len(empty)} prompts of split '{args.dataset_split}' are empty (row {empty[0]}): remove them")
    column_values = {name: list(train[col]) for name, col in columns.items()}
    eval_prompts, eval_answers = [], []
    if args.eval_split:
        ev = load_split(args.dataset, args.eval_split)
        check_columns(ev, [args.prompt_column, args.answer_column], f"eval split '{args.eval_split}'")
        n = min(len(ev), args.eval_limit)
        eval_prompts, eval_answers = prompt_texts(list(ev[args.prompt_column][:n])), list(ev[args.answer_column][:n])

    # 2. Model: the policy (optionally with LoRA adapters) and, only when beta > 0, a frozen reference.
    weights_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=weights_dtype).to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eos_ids = sorted({tokenizer.eos_token_id} | set(np.atleast_1d(model.generation_config.eos_token_id or []).tolist()))
    eos_tensor = torch.tensor(eos_ids, device=device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    elif args.beta > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    raw_model = model
    policy = PolicyLogprobs(model)
    if ddp:
        policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")
    gen_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  max_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos_ids)

    def reference_logprobs(ids, mask, prompt_width):
        if ref_model is not None:
            return completion_logprobs(ref_model, ids, mask, prompt_width, args.temperature)
        with raw_model.disable_adapter():  # LoRA: the reference is the base model without adapters
            return completion_logprobs(raw_model, ids, mask, prompt_width, args.temperature)

    # 3. Optimiser, schedule and data order (one per process); restore them all on --resume.
    optimizer = torch.optim.AdamW([p for p in raw_model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  betas=(0.9, 0.99), weight_decay=args.weight_decay)
    lr_anchor = None  # set when a resumed run changes --total-steps (lr_factor)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    order_gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    order, cursor, start_step = torch.randperm(len(prompt_ids), generator=order_gen), 0, 0
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
        reward.load_state_dict(state["reward"])
        order_gen.set_state(state["order_gen"][rank].clone())  # clone: a row view would be read from offset 0
        order, cursor, start_step = state["order"][rank].clone(), state["cursor"][rank], state["step"]
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        torch.set_rng_state(state["torch_rng"][rank].clone())
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
        shown = {"reward": last.get("train/reward"), "acc": last["eval/accuracy"], "kl": last.get("train/kl")}
        text = " | ".join(f"{k} {v:.3g}" for k, v in shown.items() if v is not None)
        if progress:
            bar.set_postfix_str(f"{text} | {seconds_per_step:.2f} s/step")
        else:
            print(f"step {step}/{args.total_steps} | {text} | {seconds_per_step:.2f} s/step | "
                  f"ETA {eta((args.total_steps - step) * seconds_per_step)}", flush=True)

    def evaluate(step: int) -> float:
        acc = None
        if rank == 0 and eval_prompts:
            acc, samples = greedy_accuracy(raw_model, tokenizer, eval_prompts, eval_answers, args.max_completion_length,
                                           device, eos_ids, progress=progress)
            log({"step": step, "eval/accuracy": acc})
            if not progress:
                print(f"eval at step {step}: accuracy {acc:.4f} on {len(eval_prompts)} prompts", flush=True)
            if wandb:
                wandb.log({"eval/samples": wandb.Table(columns=["prompt", "completion", "answer"],
                                                       data=[list(s) for s in samples[:16]])}, step=step)
        if ddp:
            dist.barrier()
        return acc

    def gather(x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on each process -> [world * n, ...] in rank order (identity without DDP)."""
        if not ddp:
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def checkpoint(step: int) -> Path:
        path = run_dir / "checkpoints" / f"step_{step}"
        per_rank = [order_gen.get_state(), order, torch.tensor(cursor), torch.get_rng_state()]
        if ddp:  # each process has its own data order and sampling RNG
            per_rank = [gather(x[None].to(device)).cpu() for x in per_rank]
        else:
            per_rank = [x[None] for x in per_rank]
        if rank == 0:
            save_checkpoint(path, raw_model, tokenizer, {
                "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "order_gen": per_rank[0], "order": per_rank[1], "cursor": per_rank[2].tolist(),
                "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "torch_rng": per_rank[3],
                "reward": reward.state_dict(), "lr_anchor": lr_anchor, "args": asdict(args)})
        if ddp:
            dist.barrier()
        return path

    def draw_prompts(n: int) -> list[int]:
        nonlocal order, cursor
        picked = []
        while len(picked) < n:
            if cursor == len(order):
                order, cursor = torch.randperm(len(prompt_ids), generator=order_gen), 0
            take = order[cursor : cursor + n - len(picked)].tolist()
            picked += take
            cursor += len(take)
        return picked

    @torch.no_grad()
    def sample_groups(n: int) -> dict:
        """Steps 1-2 for n fresh prompts: G completions each (one batched generate with the KV cache), scored."""
        rows = [i for i in draw_prompts(n) for _ in range(args.num_generations)]
        ids, mask = left_pad([prompt_ids[i] for i in rows], tokenizer.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        t0 = time.perf_counter()
        with autocast:
            out = raw_model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        t1 = time.perf_counter()
        completion_ids = out[:, ids.shape[1]:]
        c_mask, truncated = completion_mask(completion_ids, eos_tensor)
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        trace = reward.trace(completions, prompts=[raw_prompts[i] for i in rows],
                             completion_ids=[c[: int(m.sum())] for c, m in zip(completion_ids.tolist(), c_mask)],
                             **{name: [v[i] for i in rows] for name, v in column_values.items()})
        timing["generate"] += t1 - t0
        timing["score"] += time.perf_counter() - t1
        return {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": completion_ids, "completion_mask": c_mask,
                "truncated": truncated, "rewards": {k: torch.tensor(v, dtype=torch.float32) for k, v in trace.items()},
                "prompts": [texts[i] for i in rows], "completions": completions}

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
        print(f"run directory: {run_dir}  |  {len(prompt_ids)} training prompts, {len(eval_prompts)} eval prompts, "
              f"{n_train / 1e6:.2f}M trainable parameters on {device}, micro-batch {micro}", flush=True)
    groups = args.prompts_per_step // world
    G = args.num_generations
    step, final = start_step, {}
    tokens_since_log, last_log_step = 0, start_step
    # seconds per phase since the last log line; "step" excludes evaluation and checkpointing
    timing = {"step": 0.0, "generate": 0.0, "score": 0.0, "train": 0.0}
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
                # 4a. Sample G completions for each prompt and score them (Algorithm 1 of arXiv:2402.03300);
                #     with dynamic sampling, replace groups whose rewards are all equal (DAPO).
                if args.dynamic_sampling:
                    batch, draws, n_informative = dynamic_sampling(sample_groups, groups, G, args.max_resample_rounds,
                                                                   tokenizer.pad_token_id)
                else:
                    batch, draws, n_informative = sample_groups(groups), 1, None
                t_train = time.perf_counter()
                # 4b. Group-relative advantages over the global batch; this process keeps its own rows.
                rewards = gather(batch["rewards"]["total"].to(device)).view(-1, G)
                advantages = group_advantages(rewards, args.scale_rewards).view(-1)[rank * groups * G:][: groups * G]
                mask = loss_mask(batch["completion_mask"], batch["truncated"], args.mask_truncated_completions)
                ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                attention = torch.cat([batch["prompt_mask"], batch["completion_mask"].long()], dim=1)
                width = batch["prompt_ids"].shape[1]
                num_tokens = int(gather(mask.sum()[None]).sum())
                # Without a KL term a zero-advantage completion has zero loss and gradient at every token (Eq. 3
                # with A = 0), and the normalisers above still count it: skip its forward and backward (about half
                # the batch, from groups that agree). bnpo's micro-batch means would change, so it keeps every row.
                # Each process keeps at least one micro-batch, so that DDP synchronises once per update.
                needed = advantages != 0 if args.beta == 0 and args.loss_type != "bnpo" else torch.ones_like(advantages).bool()
                if not needed.any():
                    needed[:micro] = True
                kept = needed.nonzero().squeeze(1)
                chunks = [{"ids": ids[r, first : width + end], "attention": attention[r, first : width + end],
                           "prompt_width": width - first, "mask": mask[r, :end], "advantages": advantages[r, None]}
                          for r, first, end in ((kept[rows], first, end) for rows, first, end in length_sorted_micro_batches(
                              batch["prompt_mask"][kept], batch["completion_mask"][kept], micro))]

                # 4c. mu updates on this batch: PPO-clipped loss per token (Eq. 3), aggregated per --loss-type.
                sums = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0, "tokens": 0.0}
                for iteration in range(args.num_iterations):
                    for k, mb in enumerate(chunks):
                        sync = k == len(chunks) - 1 or not ddp
                        with (policy.no_sync() if not sync else torch.enable_grad()), autocast:
                            logp, entropy = policy(mb["ids"], mb["attention"], mb["prompt_width"], args.temperature)
                            if iteration == 0:  # the weights have not moved yet: these are pi_old's log-probs
                                mb["old_logp"] = logp.detach()
                                if args.beta > 0:
                                    with torch.no_grad():
                                        mb["ref_logp"] = reference_logprobs(mb["ids"], mb["attention"], mb["prompt_width"])
                            per_token, kl, clipped = clipped_policy_loss(
                                logp, mb["old_logp"], mb["advantages"], ref_logp=mb.get("ref_logp"), clip_low=args.clip_low,
                                clip_high=args.clip_high, beta=args.beta, kl_estimator=args.kl_estimator)
                            loss = aggregate_loss(per_token, mb["mask"], args.loss_type,
                                                  num_sequences=args.prompts_per_step * G, num_tokens=num_tokens,
                                                  max_completion_length=args.max_completion_length)
                            (loss * world).backward()  # DDP averages gradients over processes
                        sums["loss"] += loss.item()
                        sums["tokens"] += float(mb["mask"].sum())
                        for name, x in (("kl", kl), ("clip_frac", clipped), ("entropy", entropy)):
                            sums[name] += float((x.detach() * mb["mask"]).sum())
                    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                lr = scheduler.get_last_lr()[0]  # the rate of this step's updates (logged below)
                scheduler.step()
                timing["train"] += time.perf_counter() - t_train
                timing["step"] += time.perf_counter() - t_step
                steps_timed, seconds_timed = steps_timed + 1, seconds_timed + time.perf_counter() - t_step
                tokens_since_log += int(attention.sum())

                # 4d. Log rewards per component, lengths, KL, clipping and timings.
                if step % args.log_every == 0 or step == args.total_steps:
                    lengths = batch["completion_mask"].sum(dim=1)
                    local = torch.tensor([sums["loss"], *(sums[k] for k in ("kl", "clip_frac", "entropy", "tokens")),
                                          float(lengths.sum()), float(batch["truncated"].sum()), len(lengths)], device=device)
                    if ddp:
                        dist.all_reduce(local)
                    loss_sum, kl_sum, clip_sum, ent_sum, n_tok, len_sum, n_trunc, n_seq = local.tolist()
                    n_steps = step - last_log_step
                    final = {"step": step, "train/loss": loss_sum / args.num_iterations,
                             "train/reward": float(rewards.mean()), "train/reward_std": float(rewards.std(dim=1).mean()),
                             **{f"rewards/{k}": float(gather(v.to(device)).mean()) for k, v in batch["rewards"].items()
                                if k != "total"},
                             "train/kl": kl_sum / max(n_tok, 1), "train/clip_frac": clip_sum / max(n_tok, 1),
                             "train/entropy": ent_sum / max(n_tok, 1), "train/grad_norm": float(grad_norm),
                             "train/lr": lr, "train/completion_length": len_sum / n_seq,
                             "train/truncated_frac": n_trunc / n_seq,
                             "train/frac_zero_std": float((~informative_groups(rewards)).float().mean()),
                             "perf/tokens_per_s": tokens_since_log * world / max(timing["step"], 1e-9),
                             **{f"perf/{k}_s": v / n_steps for k, v in timing.items()}}
                    if args.dynamic_sampling:
                        final["train/sampling_draws"] = draws
                        final["train/informative_groups"] = n_informative
                    log(final)
                    if wandb and args.num_sample_completions:
                        n = args.num_sample_completions
                        table = zip(batch["prompts"][:n], batch["completions"][:n], batch["rewards"]["total"][:n],
                                    advantages[:n])
                        wandb.log({"train/samples": wandb.Table(
                            columns=["step", "prompt", "completion", "reward", "advantage"],
                            data=[[step, p, c, float(rw), float(a)] for p, c, rw, a in table])}, step=step)
                    tokens_since_log, last_log_step = 0, step
                    timing = dict.fromkeys(timing, 0.0)
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
        final["eval/accuracy"] = evaluate(step)
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
