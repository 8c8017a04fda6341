"""PPO-RLHF: a policy and a separate value model, a per-token KL reward, GAE and an adaptive KL coefficient.

The classic RLHF loop (Ziegler et al., arXiv:1909.08593; InstructGPT, arXiv:2203.02155), following "The N+
Implementation Details of RLHF with PPO" (Huang et al., arXiv:2403.17031; "N+" below, Sec. 4 and 7):
    1. sample a completion o for each prompt q from pi_old, and score it: s = R(q, o)  (- the missing-EOS penalty)
    2. per-token reward  r_t = -beta KL_t + [t = last token] s,  KL_t = log pi_old(o_t) - log pi_ref(o_t)
                                                                (Eq. 2 of arXiv:2203.02155, spread over tokens)
    3. GAE with the value model's V_t:  delta_t = r_t + gamma V_t+1 - V_t,  A_t = sum_l (gamma lam)^l delta_t+l,
       R_t = A_t + V_t                                          (Eq. 16 of arXiv:1506.02438)
    4. several epochs of shuffled mini-batches minimising (Eq. 7 and 9 of arXiv:1707.06347)
         -min(rho A, clip(rho, 1-eps, 1+eps) A) + vf_coef 0.5 max((V-R)^2, (clip(V, V_old +- eps_v) - R)^2)
         - entropy_coef H,   rho = pi(o_t) / pi_old(o_t)
    5. adapt beta to the batch's KL (Sec. 2.2 of arXiv:1909.08593).

Run:
    python ppo.py                                                 # embedded: models/tiny-arith on data/arith
    python ppo.py --kl-controller adaptive --kl-target 1.0        # Ziegler's adaptive KL coefficient
    python ppo.py --reward rm_reward.json  # a learned reward model: {"type": "reward_model", "model": "runs/<rm-run>/final"}
    python ppo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template \
        --dataset my/hub-dataset --dataset-split train --eval-split test --max-completion-length 512 \
        --prompts-per-step 64 --micro-batch-size 8 --learning-rate 1e-6 --lora-r 16   # any HF causal LM
    torchrun --nproc-per-node 2 ppo.py                           # data parallel (DDP), gloo on CPU, nccl on GPU

Deviations and choices:
- The value model is a separate network (as in N+), so the value loss's gradient never reaches the policy's
  weights: `AutoModelForTokenClassification` with one label, i.e. the causal-LM backbone of
  `--value-model-name-or-path` (default: the policy's checkpoint) and a scalar linear head. A head that the
  checkpoint does not have starts at zero (weight and bias): V = 0 until the critic learns, so the first
  advantages are the whitened rewards-to-go rather than a random head's noise (N+ initialises the critic from
  the trained reward model instead; pass one with --value-model-name-or-path). It is saved as safetensors in
  `value_model/` inside each checkpoint and `final/`. Cost: a second model's memory, optimiser state and
  forward/backward passes (README measures it).
- V_t is read at the hidden state that predicts completion token t (the state before the token), as log-probs
  are. The value after the last real token is 0 (the episode ends), padding gets neither reward nor loss.
- Defaults are chosen for the embedded model (README): 128 prompts x 1 completion a step, 2 PPO epochs of one
  mini-batch, temperature 0.7, lr 1e-4 (policy) and 1e-3 (value model: it starts from a zero head and must catch
  up), 30 warmup steps, cosine decay over 300 steps, fixed beta 0.05 with k1 (the KL estimator of the papers).
  This 0.9M-parameter model is fragile (see grpo.py's docstring): large batches and a small policy lr.
- One training step = one batch of rollouts, then `--num-ppo-epochs` passes over `--num-mini-batches` shuffled
  mini-batches, each one AdamW update of both models (one optimizer, two parameter groups, each clipped to
  `--max-grad-norm` on its own); the lr schedule advances once per step. Losses are token means over the
  mini-batch (N+ uses the same masked mean), accumulated over micro-batches exactly.
- `--target-kl` stops the remaining epochs of a step once an epoch's mean approximate KL(pi_old || pi) (the k3
  estimator) exceeds it (as CleanRL; Stable-Baselines3 checks every mini-batch).
- The KL the controller sees, and `train/kl`, is the batch mean of each completion's summed per-token KL
  (a sequence-level KL, as in Ziegler et al. and N+); `--kl-horizon` counts completions (N = batch size).
- `--kl-controller step` is this project's rule: x1.5 above 1.5 x target, /1.5 below target / 1.5 (the
  adaptive-penalty rule of Sec. 4 of arXiv:1707.06347 with a factor of 1.5 instead of 2).
- Log-probs are of softmax(logits / --temperature), the distribution sampled from (N+).
- Advantages (and, with `--whiten-rewards`, rewards) are whitened per process over its real tokens with the
  unbiased variance (as N+); padding does not move the mean or the std.
- Dropout is off in both models (as N+), prompts longer than `--max-prompt-length` keep their last tokens.
- With `--lora-r` both models get adapters; the value head trains in full. The reference is the policy with its
  adapters off.
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
import tyro
from datasets import load_dataset
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from kernels import clipped_policy_loss, linear_token_logprobs
from rewards import DEFAULT_SPEC, make_reward


@dataclass
class Args:
    # --- experiment / tracking
    exp_name: str = "ppo"
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
    value_model_name_or_path: Optional[str] = None
    """local folder or Hugging Face id the value model's backbone (and head, if it has one) starts from
    (None: the policy's --model-name-or-path)"""
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
    """rank of LoRA adapters on every linear layer of both models (0: train all weights); needs `pip install peft`"""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""

    # --- algorithm
    num_generations: int = 1
    """completions sampled per prompt"""
    prompts_per_step: int = 128
    """prompts per training step (over all processes); the batch is prompts_per_step x num_generations completions"""
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
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a completion that reaches --max-completion-length without EOS"""
    beta: float = 0.05
    """KL coefficient of the per-token reward -beta KL_t (the start value for the adaptive and step controllers)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token estimator of KL(pi || pi_ref), http://joschu.net/blog/kl-approx.html (k1 = log pi - log pi_ref)"""
    kl_controller: Literal["fixed", "adaptive", "step"] = "fixed"
    """fixed beta; adaptive (Ziegler et al. Sec. 2.2, needs --kl-target); step (x or / 1.5, needs --kl-target)"""
    kl_target: float = 0.0
    """target batch KL (mean over completions of the summed per-token KL) for the adaptive and step controllers"""
    kl_horizon: int = 10000
    """adaptive controller: completions over which beta moves by at most a factor e^0.2 (Ziegler's horizon)"""
    gamma: float = 1.0
    """discount factor of the per-token rewards"""
    lam: float = 0.95
    """GAE lambda (arXiv:1506.02438)"""
    whiten_advantages: bool = True
    """normalise advantages to mean 0, std 1 over the batch's real tokens"""
    whiten_rewards: bool = False
    """scale the per-token rewards to std 1 over the batch's real tokens (mean kept) before GAE"""
    num_ppo_epochs: int = 2
    """passes over each batch of rollouts"""
    num_mini_batches: int = 1
    """mini-batches per pass, one AdamW update each; must divide each process's completions"""
    clip_low: float = 0.2
    """epsilon_low: the ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """epsilon_high: the ratio is clipped above at 1 + clip_high"""
    cliprange_value: float = 0.2
    """the new value may move at most this far from the rollout's value before its loss is clipped"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus"""
    target_kl: Optional[float] = None
    """stop a step's remaining epochs once an epoch's mean approximate KL(pi_old || pi) exceeds this (None: never)"""

    # --- optimisation
    learning_rate: float = 1e-4
    """peak learning rate of AdamW for the policy"""
    value_learning_rate: float = 1e-3
    """peak learning rate of AdamW for the value model"""
    total_steps: int = 300
    """training steps (batches of rollouts); changed on --resume, the lr decay continues from where it is
    and reaches 0 at the new last step"""
    micro_batch_size: int = 0
    """completions per forward/backward pass, grouped by length so each is padded to its own longest;
    gradient accumulation covers the rest of a mini-batch (0: the largest divisor of the mini-batch up to 128)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: cosine or linear decay to 0 at the last step, or constant"""
    warmup_steps: int = 30
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm, for each model on its own"""
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


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x over the entries where mask is 1. x, mask: [B, T] -> scalar, or [B] / [T] along `dim`."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten x over its real entries (as in N+, arXiv:2403.17031): (x - mean) / sqrt(var + 1e-8), with the
    unbiased variance; shift_mean=False adds the mean back (only the scale changes). Padding (mask 0) does not move
    the mean or the std, and comes out as 0. x, mask: [B, T] -> [B, T]."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1).clamp(min=1.0)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def per_token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html).

    logp, ref_logp: [B, T] -> [B, T]: k1 = log pi - log pi_ref, k2 = (log pi - log pi_ref)^2 / 2,
    k3 = pi_ref/pi - log(pi_ref/pi) - 1 (the same estimators as kernels.clipped_policy_loss).
    """
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)  # as the kernels clamp it, so k3's exp stays finite
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}: choose k1, k2 or k3")


def penalise_missing_eos(scores: torch.Tensor, truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores [B], truncated [B] bool (no EOS within the length limit) -> scores minus `penalty` where truncated."""
    return scores - penalty * truncated.float()


def per_token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """The reward of each completion token: -kl_coef KL_t at every real token, plus the score at the last real
    token (Eq. 2 of arXiv:2203.02155 as a per-token reward, as in N+); nothing on padding.

    scores: [B], kl: [B, T], mask: [B, T] (1 up to and including the last real token) -> rewards [B, T].
    """
    rewards = -kl_coef * kl * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    has_tokens = mask.sum(dim=1) > 0
    rewards[torch.arange(len(scores)), last] += scores * has_tokens
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over completion tokens (Eq. 16 of arXiv:1506.02438):
    delta_t = r_t + gamma V_t+1 - V_t,  A_t = delta_t + gamma lam A_t+1, with V = 0 and A = 0 after the last real
    token (the episode ends there); returns R_t = A_t + V_t, the value model's regression targets.

    rewards, values, mask: [B, T], right-padded -> (advantages [B, T], returns [B, T]), 0 on padding.
    """
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t]
        advantages[:, t] = next_advantage
    return advantages, (advantages + values) * mask


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2's, kept by N+): per token 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps) - R)^2),
    then the mean over real tokens (the max is taken per token, never of the two means).

    values, old_values, returns, mask: [B, T] -> (loss scalar, fraction of real tokens where the clipped term won).
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    return loss, masked_mean((clipped_loss > unclipped_loss).float(), mask)


class KLController:
    """The KL coefficient beta of the per-token reward, updated once per step from the batch's KL.

    fixed:    beta stays.
    adaptive: e = clip(KL / target - 1, -0.2, 0.2), beta <- beta (1 + e n / horizon), n = completions in the batch
              (Sec. 2.2 of arXiv:1909.08593: the proportional controller, K_beta = n / horizon).
    step:     beta x 1.5 when KL > 1.5 target, beta / 1.5 when KL < target / 1.5 (Sec. 4 of arXiv:1707.06347,
              with 1.5 for its factor 2).
    """

    def __init__(self, kind: str, beta: float, target: float = 0.0, horizon: int = 10000):
        self.kind, self.value, self.target, self.horizon = kind, beta, target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        elif self.kind == "step":
            if kl > 1.5 * self.target:
                self.value *= 1.5
            elif kl < self.target / 1.5:
                self.value /= 1.5

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over real tokens: 1 is a perfect critic, 0 one no better than a constant, < 0 worse.
    values, returns, mask: [B, T] -> float (nan when the returns do not vary)."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float(1.0 - var_residual / var_returns) if var_returns > 0 else float("nan")


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens belong to each completion: everything up to and including its first EOS.

    completion_ids: [B, T]; eos_ids: [K] -> (mask [B, T] float32, truncated [B] bool: no EOS in T tokens).
    """
    is_eos = torch.isin(completion_ids, eos_ids)
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # EOS tokens strictly before t
    return (eos_before == 0).float(), ~is_eos.any(dim=1)



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



def completion_values(value_model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_width: int) -> torch.Tensor:
    """The value model's V_t for each completion token, read at the hidden state that predicts it (the state
    before the token, as log-probs are). input_ids, attention_mask: [B, Tp + Tc] as in completion_logprobs
    -> values [B, Tc] float32."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    scores = value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).logits
    return scores[:, prompt_width - 1 : -1, 0].float()


class ActorCritic(torch.nn.Module):
    """Policy and value model as DistributedDataParallel sees them: one forward, one gradient synchronisation."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, input_ids, attention_mask, prompt_width: int, temperature: float):
        logp, entropy = completion_logprobs(self.policy, input_ids, attention_mask, prompt_width, temperature,
                                            with_entropy=True)
        return logp, entropy, completion_values(self.value_model, input_ids, attention_mask, prompt_width)


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


def load_value_model(name: str, dtype: torch.dtype):
    """The value model: the causal-LM backbone of `name` with a scalar head (a token classifier with one label).
    A checkpoint without such a head (a causal LM) gets a zero head: V = 0 everywhere at the start, so the first
    advantages are the plain GAE of the rewards rather than of a random critic's noise."""
    has_head = any(a.endswith("ForTokenClassification") for a in AutoConfig.from_pretrained(name).architectures or [])
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no report of the head that is "newly initialized": it is set below
    try:
        model = AutoModelForTokenClassification.from_pretrained(name, num_labels=1, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    if not has_head:
        head = model.score if hasattr(model, "score") else model.classifier
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
    return model


def save_checkpoint(path: Path, model, tokenizer, state: Optional[dict] = None, value_model=None) -> None:
    """Write into a temporary folder, then rename: a killed run never leaves half a checkpoint. The value model
    goes to `value_model/` inside it."""
    tmp, old = path.with_name(f".tmp-{path.name}"), path.with_name(f".old-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if value_model is not None:  # with its own copy of the tokenizer, so the folder is a complete model folder
        value_model.save_pretrained(tmp / "value_model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "value_model")
    if state is not None:
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(state["args"], indent=2))
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def plot_curves(metrics_file: Path, out: Path,
                keys=("train/reward", "eval/accuracy", "train/kl", "train/value_loss", "train/explained_variance")) -> None:
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
    for name in ("total_steps", "prompts_per_step", "num_generations", "max_completion_length", "max_prompt_length",
                 "log_every", "num_ppo_epochs", "num_mini_batches", "kl_horizon"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_every", "save_every", "warmup_steps", "eval_limit", "lora_r", "top_k", "num_sample_completions",
                 "micro_batch_size"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} does not split evenly over {world} processes: "
                         f"use a multiple of {world}, e.g. {world * max(1, args.prompts_per_step // world)}")
    per_process = args.prompts_per_step // world * args.num_generations
    what = (f"each process's completions (--prompts-per-step / {world} processes x --num-generations)" if world > 1
            else "--prompts-per-step x --num-generations")
    if per_process % args.num_mini_batches:
        works = [d for d in range(1, min(args.num_mini_batches, per_process) + 1) if per_process % d == 0][-1]
        raise ValueError(f"{what} = {per_process} is not divisible by --num-mini-batches {args.num_mini_batches}: "
                         f"use --num-mini-batches {works}")
    micro = fit_micro_batch(args.micro_batch_size, per_process // args.num_mini_batches,
                            f"each mini-batch ({what} / --num-mini-batches)")
    if args.learning_rate <= 0 or args.value_learning_rate <= 0:
        raise ValueError(f"--learning-rate and --value-learning-rate must be positive, got {args.learning_rate}, "
                         f"{args.value_learning_rate}")
    if not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise ValueError(f"need --temperature > 0 and 0 < --top-p <= 1, got {args.temperature}, {args.top_p}")
    if args.beta < 0:
        raise ValueError(f"--beta must be >= 0 (the KL coefficient of the per-token reward), got {args.beta}: "
                         f"use e.g. --beta 0.05, or 0 for no KL penalty")
    if args.kl_controller != "fixed" and not args.kl_target > 0:
        raise ValueError(f"--kl-controller {args.kl_controller} steers beta towards a KL target and needs a positive "
                         f"--kl-target (the mean summed KL of a completion, e.g. --kl-target 1.0), got {args.kl_target}")
    if args.kl_controller != "fixed" and args.beta == 0:
        raise ValueError(f"--kl-controller {args.kl_controller} multiplies beta, which stays 0: start it positive, "
                         f"e.g. --beta 0.05")
    if not (0 <= args.clip_low <= 1) or args.clip_high < 0 or args.cliprange_value < 0:
        raise ValueError(f"need 0 <= --clip-low <= 1, --clip-high >= 0 and --cliprange-value >= 0, got "
                         f"{args.clip_low}, {args.clip_high}, {args.cliprange_value}")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        raise ValueError(f"need 0 <= --gamma <= 1 and 0 <= --lam <= 1, got {args.gamma}, {args.lam}")
    if args.vf_coef < 0 or args.entropy_coef < 0:
        raise ValueError(f"need --vf-coef >= 0 and --entropy-coef >= 0, got {args.vf_coef}, {args.entropy_coef}")
    if args.target_kl is not None and args.target_kl <= 0:
        raise ValueError(f"--target-kl must be positive (or None: no early stop), got {args.target_kl}")
    if args.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ValueError("--lora-r > 0 needs the peft package: `pip install peft` (or use --lora-r 0)") from None
    check_device(args.device, args.dtype)
    check_model_path(args.model_name_or_path)
    if args.value_model_name_or_path:
        try:
            check_model_path(args.value_model_name_or_path)
        except ValueError as e:
            raise ValueError(f"--value-model-name-or-path: {e}") from None
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

    # 2. Models: the policy and the value model (optionally with LoRA adapters), and a frozen reference when beta > 0.
    weights_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=weights_dtype).to(device)
    value_model = load_value_model(args.value_model_name_or_path or args.model_name_or_path, weights_dtype).to(device)
    for m in [*model.modules(), *value_model.modules()]:
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eos_ids = sorted({tokenizer.eos_token_id} | set(np.atleast_1d(model.generation_config.eos_token_id or []).tolist()))
    eos_tensor = torch.tensor(eos_ids, device=device)
    if args.gradient_checkpointing:
        for m in (model, value_model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        # the value head is trained in full (TOKEN_CLS saves it with the adapters), never given adapters itself
        model, value_model = (get_peft_model(m, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                                           lora_dropout=args.lora_dropout, target_modules="all-linear",
                                                           exclude_modules=exclude, task_type=task))
                              for m, task, exclude in ((model, "CAUSAL_LM", None),
                                                       (value_model, "TOKEN_CLS", ["score", "classifier"])))
    elif args.beta > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    raw_model, raw_value = model, value_model
    actor_critic = ActorCritic(model, value_model)
    if ddp:
        actor_critic = torch.nn.parallel.DistributedDataParallel(
            actor_critic, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")
    gen_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  max_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos_ids)

    def reference_logprobs(ids, mask, prompt_width):
        if ref_model is not None:
            return completion_logprobs(ref_model, ids, mask, prompt_width, args.temperature)
        with raw_model.disable_adapter():  # LoRA: the reference is the base model without adapters
            return completion_logprobs(raw_model, ids, mask, prompt_width, args.temperature)

    # 3. Optimiser (both models, a parameter group each), schedule, KL controller and data order (one per process);
    #    restore them all on --resume.
    policy_params = [p for p in raw_model.parameters() if p.requires_grad]
    value_params = [p for p in raw_value.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": policy_params, "lr": args.learning_rate},
                                   {"params": value_params, "lr": args.value_learning_rate}],
                                  betas=(0.9, 0.99), weight_decay=args.weight_decay)
    lr_anchor = None  # set when a resumed run changes --total-steps (lr_factor)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    kl_ctl = KLController(args.kl_controller, args.beta, args.kl_target, args.kl_horizon)
    order_gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    order, cursor, start_step = torch.randperm(len(prompt_ids), generator=order_gen), 0, 0
    if args.resume:
        ckpt = Path(args.resume)
        if args.lora_r:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            for m, folder in ((raw_model, ckpt), (raw_value, ckpt / "value_model")):
                set_peft_model_state_dict(m, load_file(folder / "adapter_model.safetensors", device=str(device)))
        else:
            raw_model.load_state_dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=weights_dtype).state_dict())
            raw_value.load_state_dict(load_value_model(str(ckpt / "value_model"), weights_dtype).state_dict())
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        reward.load_state_dict(state["reward"])
        kl_ctl.load_state_dict(state["kl_controller"])
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
                "reward": reward.state_dict(), "kl_controller": kl_ctl.state_dict(), "lr_anchor": lr_anchor,
                "args": asdict(args)}, value_model=raw_value)
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
        n_policy, n_value = (sum(p.numel() for p in params) for params in (policy_params, value_params))
        print(f"run directory: {run_dir}  |  {len(prompt_ids)} training prompts, {len(eval_prompts)} eval prompts, "
              f"{n_policy / 1e6:.2f}M + {n_value / 1e6:.2f}M trainable parameters (policy + value model) on {device}, "
              f"micro-batch {micro}", flush=True)
    groups = args.prompts_per_step // world
    G = args.num_generations
    mini = groups * G // args.num_mini_batches
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
                # 4a. Roll out: a completion (or G) for each prompt from pi_old, scored (Sec. 2 of arXiv:1909.08593).
                batch = sample_groups(groups)
                t_train = time.perf_counter()
                mask = batch["completion_mask"]
                ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                attention = torch.cat([batch["prompt_mask"], mask.long()], dim=1)
                width = batch["prompt_ids"].shape[1]
                scores = penalise_missing_eos(batch["rewards"]["total"].to(device), batch["truncated"],
                                              args.missing_eos_penalty)

                def micro_batches(rows: torch.Tensor) -> list:
                    """Rows of the batch -> [(rows, first prompt column, completion width)], `micro` rows each."""
                    return [(rows[sub], first, end) for sub, first, end in
                            length_sorted_micro_batches(batch["prompt_mask"][rows], mask[rows], micro)]

                # 4b. Log-probs of pi_old and pi_ref and the values V_old at every completion token, without gradients
                #     (recomputed rather than taken from `generate`, as N+ does).
                old_logp, ref_logp, old_values = (torch.zeros_like(mask) for _ in range(3))
                with torch.no_grad(), autocast:
                    for r, first, end in micro_batches(torch.arange(len(mask), device=device)):
                        inputs = (ids[r, first : width + end], attention[r, first : width + end], width - first)
                        old_logp[r, :end] = completion_logprobs(raw_model, *inputs, args.temperature)
                        old_values[r, :end] = completion_values(raw_value, *inputs)
                        if args.beta > 0:
                            ref_logp[r, :end] = reference_logprobs(*inputs)

                # 4c. Per-token rewards (-beta KL_t, the score at the last token), GAE (Eq. 16 of arXiv:1506.02438),
                #     whitened advantages.
                kl = per_token_kl(old_logp, ref_logp, args.kl_estimator) * mask if args.beta > 0 else torch.zeros_like(mask)
                kl_coef = kl_ctl.value
                rewards = per_token_rewards(scores, kl, mask, kl_coef)
                if args.whiten_rewards:
                    rewards = masked_whiten(rewards, mask, shift_mean=False)
                advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
                if args.whiten_advantages:
                    advantages = masked_whiten(advantages, mask)

                # 4d. PPO epochs over shuffled mini-batches, one AdamW update of both models each: the clipped policy
                #     loss (Eq. 7 of arXiv:1707.06347), the clipped value loss and the entropy bonus (Eq. 9), token
                #     means over the mini-batch; --target-kl stops the remaining epochs.
                sums = dict.fromkeys(("policy_loss", "value_loss", "clip_frac", "value_clip_frac", "approx_kl",
                                      "entropy", "tokens"), 0.0)
                for epoch in range(args.num_ppo_epochs):
                    epoch_kl = torch.zeros(2, device=device)  # approximate-KL token sum, tokens
                    for rows in torch.randperm(len(mask)).to(device).split(mini):
                        chunks, n_tokens = micro_batches(rows), mask[rows].sum()
                        for k, (r, first, end) in enumerate(chunks):
                            sync = k == len(chunks) - 1 or not ddp
                            m = mask[r, :end]
                            with (actor_critic.no_sync() if not sync else torch.enable_grad()), autocast:
                                logp, entropy, values = actor_critic(ids[r, first : width + end],
                                                                     attention[r, first : width + end], width - first,
                                                                     args.temperature)
                                per_token, _, clipped = clipped_policy_loss(logp, old_logp[r, :end], advantages[r, :end],
                                                                            clip_low=args.clip_low, clip_high=args.clip_high)
                                vf_loss, vf_clipped = value_loss(values, old_values[r, :end], returns[r, :end], m,
                                                                 args.cliprange_value)
                                pg_loss, ent = masked_mean(per_token, m), masked_mean(entropy, m)
                                share = m.sum() / n_tokens  # this micro-batch's part of the mini-batch's token mean
                                ((pg_loss + args.vf_coef * vf_loss - args.entropy_coef * ent) * share).backward()
                            log_ratio = logp.detach() - old_logp[r, :end]
                            approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, m)  # k3 of KL(pi_old || pi)
                            tokens = float(m.sum())
                            for name, x in (("policy_loss", pg_loss), ("value_loss", vf_loss), ("entropy", ent),
                                            ("clip_frac", masked_mean(clipped, m)), ("value_clip_frac", vf_clipped),
                                            ("approx_kl", approx_kl)):
                                sums[name] += x.item() * tokens
                            sums["tokens"] += tokens
                            epoch_kl += torch.stack([approx_kl * tokens, m.sum()])
                        grad_norm = torch.nn.utils.clip_grad_norm_(policy_params, args.max_grad_norm)
                        value_grad_norm = torch.nn.utils.clip_grad_norm_(value_params, args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    epochs_run = epoch + 1
                    if args.target_kl is not None:  # every process sees the same KL, so all stop together
                        if ddp:
                            dist.all_reduce(epoch_kl)
                        if float(epoch_kl[0] / epoch_kl[1]) > args.target_kl:
                            break
                lr = scheduler.get_last_lr()[0]  # the rate of this step's updates (logged below)
                scheduler.step()

                # 4e. The KL controller sees the batch's KL: the mean over completions of the summed per-token KL.
                batch_kl = float(gather(kl.sum(dim=1)).mean())
                kl_ctl.update(batch_kl, args.prompts_per_step * G)
                timing["train"] += time.perf_counter() - t_train
                timing["step"] += time.perf_counter() - t_step
                steps_timed, seconds_timed = steps_timed + 1, seconds_timed + time.perf_counter() - t_step
                tokens_since_log += int(attention.sum())

                # 4f. Log rewards per component, KL, losses, clipping, the critic's fit and timings.
                if step % args.log_every == 0 or step == args.total_steps:
                    lengths = mask.sum(dim=1)
                    keys = ("policy_loss", "value_loss", "clip_frac", "value_clip_frac", "approx_kl", "entropy")
                    local = torch.tensor([*(sums[k] for k in keys), sums["tokens"], float(lengths.sum()),
                                          float(batch["truncated"].sum()), len(lengths),
                                          explained_variance(old_values, returns, mask)], device=device)
                    if ddp:
                        dist.all_reduce(local)
                    *token_sums, n_tok, len_sum, n_trunc, n_seq, ev_sum = local.tolist()
                    means = {f"train/{k}": v / max(n_tok, 1) for k, v in zip(keys, token_sums)}
                    n_steps = step - last_log_step
                    final = {"step": step, "train/loss": means["train/policy_loss"] + args.vf_coef * means[
                                 "train/value_loss"] - args.entropy_coef * means["train/entropy"],
                             "train/reward": float(gather(batch["rewards"]["total"].to(device)).mean()),
                             **{f"rewards/{k}": float(gather(v.to(device)).mean()) for k, v in batch["rewards"].items()
                                if k != "total"},
                             "train/score": float(gather(scores).mean()), "train/kl": batch_kl,
                             "train/kl_coef": kl_coef, "train/non_score_reward": -kl_coef * batch_kl, **means,
                             "train/explained_variance": ev_sum / world,
                             "train/value_mean": float(masked_mean(old_values, mask)),
                             "train/grad_norm": float(grad_norm), "train/value_grad_norm": float(value_grad_norm),
                             "train/lr": lr, "train/ppo_epochs": epochs_run,
                             "train/completion_length": len_sum / n_seq, "train/truncated_frac": n_trunc / n_seq,
                             "perf/tokens_per_s": tokens_since_log * world / max(timing["step"], 1e-9),
                             **{f"perf/{k}_s": v / n_steps for k, v in timing.items()}}
                    log(final)
                    if wandb and args.num_sample_completions:
                        n = args.num_sample_completions
                        table = zip(batch["prompts"][:n], batch["completions"][:n], batch["rewards"]["total"][:n],
                                    scores[:n])
                        wandb.log({"train/samples": wandb.Table(
                            columns=["step", "prompt", "completion", "reward", "score"],
                            data=[[step, p, c, float(rw), float(s)] for p, c, rw, s in table])}, step=step)
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

    # 5. Final evaluation, the trained models (LoRA merged into them), the curves.
    if not stop.requested:
        final["eval/accuracy"] = evaluate(step)
        checkpoint(step)
        if rank == 0:
            merged = [copy.deepcopy(m).merge_and_unload() if args.lora_r else m for m in (raw_model, raw_value)]
            save_checkpoint(run_dir / "final", merged[0], tokenizer, value_model=merged[1])
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
