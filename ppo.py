"""PPO-RLHF: a policy and a separate value model, a per-token KL reward, GAE and an adaptive KL coefficient.

The RLHF loop of Ziegler et al. (arXiv:1909.08593) and InstructGPT (arXiv:2203.02155), following "The N+
Implementation Details of RLHF with PPO" (arXiv:2403.17031, "N+"):
    1. sample a completion o of each prompt q from pi_old, score it: s = R(q, o) (- the missing-EOS penalty)
    2. per-token reward r_t = -beta KL_t + [t = last token] s, KL_t = log pi_old(o_t) - log pi_ref(o_t)
                                                                          (Eq. 2 of arXiv:2203.02155, over tokens)
    3. GAE: delta_t = r_t + gamma V_t+1 - V_t, A_t = sum_l (gamma lam)^l delta_t+l, R_t = A_t + V_t
                                                                          (Eq. 16 of arXiv:1506.02438)
    4. epochs of shuffled mini-batches minimising (Eq. 7 and 9 of arXiv:1707.06347)
         -min(rho A, clip(rho, 1-eps, 1+eps) A) + vf_coef 0.5 max((V-R)^2, (clip(V, V_old +- eps_v) - R)^2) - ent_coef H
    5. adapt beta to the batch's KL (Sec. 2.2 of arXiv:1909.08593).

Run:
    python ppo.py                                                 # models/tiny-arith on data/arith, CPU
    python ppo.py --kl-controller adaptive --kl-target 1.0        # Ziegler's adaptive KL coefficient
    python ppo.py --reward rm.json      # a learned reward model: {"type": "reward_model", "model": "runs/<rm>/final"}
    python ppo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template --dataset my/hub-dataset \
        --max-completion-length 512 --prompts-per-step 64 --micro-batch-size 8 --learning-rate 1e-6 --lora-r 16
    torchrun --nproc-per-node 2 ppo.py                            # data parallel (gloo on CPU, nccl on GPU)

Deviations and choices (why, and the measurements: docs/ppo.md):
- The value model is a separate network (as N+): the policy's backbone with a scalar head that starts at zero
  (V = 0), unless --value-model-name-or-path has a head; saved in value_model/ of each checkpoint and final/.
- V_t is read at the hidden state that predicts token t, as log-probs are; V = 0 after the last real token.
- Defaults fit the 0.9M-parameter embedded model: 128 prompts x 1 completion, 2 epochs of one mini-batch,
  temperature 0.7, lr 1e-4 (policy) and 1e-3 (value), warmup 30 and cosine decay, fixed beta 0.05 with k1.
- One step = one batch of rollouts and --num-ppo-epochs x --num-mini-batches AdamW updates of both models (each
  clipped on its own); losses are token means over the mini-batch; the lr schedule advances once a step.
- --target-kl stops a step's remaining epochs once an epoch's mean k3 KL(pi_old || pi) exceeds it (as CleanRL).
- train/kl and the controller's KL: the batch mean of each completion's summed per-token KL (as N+).
- --kl-controller step: x1.5 above 1.5 target, /1.5 below target / 1.5 (Sec. 4 of arXiv:1707.06347, 1.5 for 2).
- Log-probs are of softmax(logits / T), the distribution sampled from (N+).
- Advantages (and with --whiten-rewards, rewards) are whitened per process over real tokens, unbiased variance.
- Dropout is off; over-long prompts keep their last tokens; with --lora-r both models get adapters (the value
  head trains in full) and the reference is the policy with its adapters off.
"""

import contextlib
import copy
import math
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

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
    """folder or hub id of the value model's backbone (and head, if it has one) (None: the policy's)"""
    value_model_layers: int = 0
    """keep the value model's first N decoder layers only (0: all): a smaller critic, a cheaper step"""
    dataset: str = "data/arith"
    """folder of `<split>.jsonl` files, a JSON-lines file, or a Hugging Face dataset id"""
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
    generation_backend: Literal["shared", "static"] = "shared"
    """how completions are sampled: shared (generate, each group's prompt prefilled once; fastest on CPU), generate,
    static (static KV cache, compiled on CUDA), paged (continuous batching); see docs/ppo.md"""
    sampler_logprobs: bool = False
    """pi_old's log-probs from the sampler, as TRL takes them, not from a policy forward (the first step of a run or a
    resume recomputes them and checks that the two agree): ~10% faster a step on CPU; needs float32 weights"""
    importance_sampling_cap: Optional[float] = None
    """truncated importance sampling (TIS) of the sampler's mismatch: each token's loss times min(pi_old / pi_sampler,
    cap), for backends whose numerics differ from the trainer's (bf16, compiled); None: off"""
    reward: str = DEFAULT_SPEC
    """reward spec for rewards.make_reward: `name:weight,...` or a JSON spec file"""
    center_scores_per_prompt: bool = False
    """subtract from each score the mean score of its prompt's --num-generations completions: a Bradley-Terry reward
    model is trained on comparisons within a prompt and fixes its scores only up to a constant per prompt"""
    gold_reward: Optional[str] = None
    """a reward spec logged beside --reward as rewards/gold, never trained on: with a learned --reward, the true
    reward it stands in for (e.g. correctness), to watch over-optimisation (arXiv:2210.10760)"""
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
    """training steps (batches of rollouts); may change on --resume (the lr decay then ends at the new last step)"""
    pause_at_step: int = 0
    """stop after this step with a checkpoint, as Ctrl-C does, the schedule still set by --total-steps (0: never); go
    on with --resume, e.g. with a new --reward (iterated RLHF)"""
    micro_batch_size: int = 0
    """completions per forward/backward pass, gradients accumulated over a mini-batch (0: largest divisor up to 128)"""
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
    fsdp: bool = False
    """under torchrun, shard weights, gradients and AdamW states over the processes (FSDP2) instead of DDP's copies"""
    device: str = "auto"
    """cuda, cpu, or auto (cuda when available)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights dtype; auto = float32 weights with bfloat16 autocast on CUDA"""

    # --- logging / checkpointing
    log_every: int = 1
    """steps between rows of metrics.jsonl (and printed lines when the output is not a terminal)"""
    eval_every: int = 50
    """steps between greedy evaluations (0: only at start and end)"""
    save_every: int = 0
    """steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: Optional[str] = None
    """runs/<run>/checkpoints/step_N to continue, with the run's own arguments (cadence flags may change)"""
    num_sample_completions: int = 8
    """completions per logging step in the --track table"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time: {dataset}__{exp_name}__{seed}__{time}"""


# ---- the algorithm


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x over the entries where mask is 1. x, mask: [B, T] -> scalar, or [B] / [T] along `dim`."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten x over its real entries: (x - mean) / sqrt(var + 1e-8), with the unbiased variance (as TRL; N+,
    arXiv:2403.17031, uses the biased one); shift_mean=False adds the mean back (only the scale changes). Padding
    (mask 0) does not move the mean or the std, and comes out as 0. x, mask: [B, T] -> [B, T]."""
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
    real tokens only, as `generate` does with left padding. The head's bias, logit scale (Cohere) and
    soft-capping (Gemma 2) are applied (lm_head).
    """
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    return linear_token_logprobs(hidden[:, prompt_width - 1 : -1], targets=input_ids[:, prompt_width:],
                                 temperature=temperature, with_entropy=with_entropy, **lm_head(model, hidden.dtype))


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

    def forward(self, input_ids, attention_mask, prompt_width: int, temperature: float, with_policy: bool = True):
        values = completion_values(self.value_model, input_ids, attention_mask, prompt_width)
        if not with_policy:  # the critic alone (--sampler-logprobs)
            return None, None, values
        return (*completion_logprobs(self.policy, input_ids, attention_mask, prompt_width, temperature,
                                     with_entropy=True), values)


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


def load_value_model(name: str, dtype: torch.dtype, layers: int = 0):
    """The value model: the causal-LM backbone of `name` with a scalar head (a token classifier with one label).
    A checkpoint without such a head (a causal LM) gets a zero head: V = 0 everywhere at the start, so the first
    advantages are the plain GAE of the rewards rather than of a random critic's noise. layers > 0 keeps the first
    `layers` decoder blocks, then the final norm and the head."""
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
    if layers:  # the decoder blocks are the longest ModuleList (model.layers; GPT-2's transformer.h)
        del max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)[layers:]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model


class PolicyAndValue:
    """What a checkpoint and final/ hold: the policy, and in value_model/ the value model with its own tokenizer copy
    (a complete model folder). save_pretrained as the plumbing's save_pretrained calls it."""

    def __init__(self, policy, value_model, tokenizer):
        self.policy, self.value_model, self.tokenizer = policy, value_model, tokenizer

    def state_dict(self, keep_vars: bool = False) -> dict:
        return {f"{name}.{k}": v for name in ("policy", "value_model")
                for k, v in getattr(self, name).state_dict(keep_vars=keep_vars).items()}

    def save_pretrained(self, path: Path, state_dict: Optional[dict] = None, **kwargs) -> None:
        def part(name):  # --fsdp passes the gathered weights of both
            return None if state_dict is None else {k[len(name) + 1:]: v for k, v in state_dict.items()
                                                    if k.startswith(name + ".")}
        self.policy.save_pretrained(path, state_dict=part("policy"), **kwargs)
        self.value_model.save_pretrained(path / "value_model", state_dict=part("value_model"), **kwargs)
        self.tokenizer.save_pretrained(path / "value_model")


def prompt_texts(tokenizer, values: list, use_chat_template: bool, column: str) -> list[str]:
    """The prompts as text: as they are, or (chat models) wrapped in the tokenizer's chat template."""
    if not use_chat_template:
        if not isinstance(values[0], str):
            raise ValueError(f"prompts in column '{column}' are chat messages: pass --use-chat-template")
        return list(values)
    if tokenizer.chat_template is None:
        raise ValueError(f"--use-chat-template: the tokenizer of {tokenizer.name_or_path} has no chat template")
    return [tokenizer.apply_chat_template([{"role": "user", "content": v}] if isinstance(v, str) else v,
                                          tokenize=False, add_generation_prompt=True) for v in values]


class DataOrder:
    """Prompt indices in seeded random epochs; draws go on across steps, and across a resume."""

    def __init__(self, n: int, seed: int):
        self.n, self.gen = n, torch.Generator().manual_seed(seed)
        self.order, self.cursor = torch.randperm(n, generator=self.gen), 0

    def draw(self, k: int) -> list[int]:
        picked = []
        while len(picked) < k:
            if self.cursor == len(self.order):
                self.order, self.cursor = torch.randperm(self.n, generator=self.gen), 0
            take = self.order[self.cursor : self.cursor + k - len(picked)].tolist()
            picked, self.cursor = picked + take, self.cursor + len(take)
        return picked

    def state(self) -> dict:
        return {"order_gen": self.gen.get_state(), "order": self.order, "cursor": self.cursor}

    def load(self, state: dict) -> None:
        self.gen.set_state(state["order_gen"])
        self.order, self.cursor = state["order"], int(state["cursor"])


@torch.no_grad()
def rollout(model, tokenizer, data: dict, rows: list[int], gen_config, backend: str, eos_ids, reward, autocast,
            timing: dict) -> dict:
    """Step 1 for the prompts `rows` (Sec. 2 of arXiv:1909.08593): sample (one batched generate with the KV cache)
    and score. data: {"ids", "prompts", "texts", "columns"} of the split -> the rollout batch."""
    ids, mask = (t.to(model.device) for t in left_pad([data["ids"][i] for i in rows], tokenizer.pad_token_id))
    t0 = time.perf_counter()
    with autocast:
        completion_ids, sampler_logp = sample(model, ids, mask, gen_config, backend)
    t1 = time.perf_counter()
    c_mask, truncated = completion_mask(completion_ids, eos_ids)
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    trace = reward.trace(completions, prompts=[data["prompts"][i] for i in rows],
                         completion_ids=[c[: int(m.sum())] for c, m in zip(completion_ids.tolist(), c_mask)],
                         **{name: [v[i] for i in rows] for name, v in data["columns"].items()})
    timing["generate"] += t1 - t0
    timing["score"] += time.perf_counter() - t1
    return {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": completion_ids, "completion_mask": c_mask,
            "sampler_logp": sampler_logp,
            "truncated": truncated, "rewards": {k: torch.tensor(v, dtype=torch.float32) for k, v in trace.items()},
            "prompts": [data["texts"][i] for i in rows], "completions": completions}


def truncated_is_weights(old_logp, sampler_logp, mask, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (TIS): min(pi_old / pi_sampler, cap) per token, 1 on padding -> (weights,
    capped). The sampler drew the tokens; the loss is an expectation under pi_old (the trainer's numerics)."""
    ratio = torch.exp((old_logp - sampler_logp) * mask)
    return ratio.clamp(max=cap), (ratio > cap) & (mask > 0)


def reference_logprobs(ref_model, model, inputs: tuple, temperature: float) -> torch.Tensor:
    """The frozen reference's log-probs: a copy of the initial policy, or with LoRA the policy with its adapters off.
    inputs: (input_ids, attention_mask, prompt_width) as completion_logprobs takes them."""
    if ref_model is not None:  # Forward(completion_logprobs, the copy)
        return ref_model(*inputs, temperature)
    with model.disable_adapter():
        return completion_logprobs(model, *inputs, temperature)


def micro_batches(batch: dict, rows: torch.Tensor, size: int) -> list[tuple[torch.Tensor, tuple, int]]:
    """`rows` of the batch in length-sorted micro-batches of `size`, each trimmed to its own widest prompt and
    completion -> [(rows, (input_ids, attention_mask, prompt_width) for the models, completion width)]."""
    width, out = batch["prompt_ids"].shape[1], []
    for sub, first, end in length_sorted_micro_batches(batch["prompt_mask"][rows], batch["completion_mask"][rows], size):
        r = rows[sub]
        out.append((r, (batch["ids"][r, first : width + end], batch["attention"][r, first : width + end], width - first),
                    end))
    return out


@torch.no_grad()
def old_logprobs_and_values(actor_critic, ref_model, batch: dict, micro: int, args, autocast,
                            from_sampler: bool = False) -> dict:
    """Log-probs of pi_old and (beta > 0) of pi_ref, and the values V_old, at every completion token. pi_old's are
    recomputed, or with from_sampler (--sampler-logprobs) the sampler's own (TRL and N+ take them from `generate`'s
    scores): one policy forward fewer. actor_critic: (ids, attention, prompt width, T, with_policy) -> (logp, entropy,
    values), its `.policy` the live policy. -> the batch and "ids", "attention", "old_logp", "ref_logp", "old_values"."""
    mask = batch["completion_mask"]
    batch = {**batch, "ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
             "attention": torch.cat([batch["prompt_mask"], mask.long()], dim=1)}
    old_logp, ref_logp, old_values = (torch.zeros_like(mask) for _ in range(3))
    with autocast:
        for r, inputs, end in micro_batches(batch, torch.arange(len(mask), device=mask.device), micro):
            logp, _, old_values[r, :end] = actor_critic(*inputs, args.temperature, with_policy=not from_sampler)
            old_logp[r, :end] = batch["sampler_logp"][r, :end] * mask[r, :end] if from_sampler else logp
            if args.beta > 0:
                ref_logp[r, :end] = reference_logprobs(ref_model, actor_critic.policy, inputs, args.temperature)
    out = {**batch, "old_logp": old_logp, "ref_logp": ref_logp, "old_values": old_values}
    if args.importance_sampling_cap is not None:  # TIS, as grpo.py: each token's policy loss times w
        out["tis"], out["tis_capped"] = truncated_is_weights(old_logp, batch["sampler_logp"], mask,
                                                             args.importance_sampling_cap)
    return out


def compute_advantages(batch: dict, kl_coef: float, args) -> dict:
    """Steps 2-3: the scores less the missing-EOS penalty, the per-token KL(pi_old || pi_ref) and rewards
    -kl_coef KL_t + [last token] score (Eq. 2 of arXiv:2203.02155), GAE (Eq. 16 of arXiv:1506.02438) and whitening.
    -> {"scores" [B], "kl", "advantages", "returns" [B, T]}."""
    mask, old_logp = batch["completion_mask"], batch["old_logp"]
    scores = penalise_missing_eos(batch["rewards"]["total"].to(mask.device), batch["truncated"], args.missing_eos_penalty)
    kl = per_token_kl(old_logp, batch["ref_logp"], args.kl_estimator) * mask if args.beta > 0 else torch.zeros_like(mask)
    rewards = per_token_rewards(scores, kl, mask, kl_coef)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, batch["old_values"], mask, args.gamma, args.lam)
    if args.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return {"scores": scores, "kl": kl, "advantages": advantages, "returns": returns}


PPO_STATS = ("policy_loss", "value_loss", "clip_frac", "value_clip_frac", "approx_kl", "entropy")


def ppo_update(actor_critic, optimizer, batch: dict, micro: int, args, policy_params: list, value_params: list,
               autocast) -> dict:
    """Step 4: --num-ppo-epochs passes over --num-mini-batches shuffled mini-batches, one optimiser update of both
    models each (each clipped to --max-grad-norm on its own): the clipped policy loss (Eq. 7 of arXiv:1707.06347),
    the clipped value loss and the entropy bonus (Eq. 9), token means over the mini-batch, accumulated over
    micro-batches; --target-kl stops the remaining epochs. -> token sums of PPO_STATS, "tokens", the grad norms
    of the last update, "ppo_epochs"."""
    mask, ddp = batch["completion_mask"], isinstance(actor_critic, torch.nn.parallel.DistributedDataParallel)
    sums = dict.fromkeys((*PPO_STATS, "tokens"), 0.0)
    for epoch in range(args.num_ppo_epochs):
        epoch_kl = torch.zeros(2, device=mask.device)  # approximate-KL token sum, tokens
        for rows in torch.randperm(len(mask)).to(mask.device).split(len(mask) // args.num_mini_batches):
            chunks, n_tokens = micro_batches(batch, rows, micro), mask[rows].sum()
            for k, (r, inputs, end) in enumerate(chunks):
                m, old_logp = mask[r, :end], batch["old_logp"][r, :end]
                with (actor_critic.no_sync() if ddp and k < len(chunks) - 1 else torch.enable_grad()), autocast:
                    logp, entropy, values = actor_critic(*inputs, args.temperature)
                    per_token, _, clipped = clipped_policy_loss(logp, old_logp, batch["advantages"][r, :end],
                                                                clip_low=args.clip_low, clip_high=args.clip_high)
                    if "tis" in batch:
                        per_token = per_token * batch["tis"][r, :end]
                    vf_loss, vf_clipped = value_loss(values, batch["old_values"][r, :end], batch["returns"][r, :end], m,
                                                     args.cliprange_value)
                    pg_loss, ent = masked_mean(per_token, m), masked_mean(entropy, m)
                    share = m.sum() / n_tokens  # this micro-batch's part of the mini-batch's token mean
                    ((pg_loss + args.vf_coef * vf_loss - args.entropy_coef * ent) * share).backward()
                log_ratio = logp.detach() - old_logp
                approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, m)  # k3 of KL(pi_old || pi)
                tokens = float(m.sum())
                for name, x in zip(PPO_STATS, (pg_loss, vf_loss, masked_mean(clipped, m), vf_clipped, approx_kl, ent)):
                    sums[name] += x.item() * tokens
                sums["tokens"] += tokens
                epoch_kl += torch.stack([approx_kl * tokens, m.sum()])
            grad_norm = torch.nn.utils.clip_grad_norm_(policy_params, args.max_grad_norm)
            value_grad_norm = torch.nn.utils.clip_grad_norm_(value_params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if args.target_kl is not None:  # every process sees the same KL, so all stop together
            if ddp:
                dist.all_reduce(epoch_kl)
            if float(epoch_kl[0] / epoch_kl[1]) > args.target_kl:
                break
    return {**sums, "grad_norm": float(grad_norm), "value_grad_norm": float(value_grad_norm), "ppo_epochs": epoch + 1}


def ppo_metrics(run, batch: dict, stats: dict, kl_coef: float, batch_kl: float, args) -> dict:
    """The step's metrics over all processes: rewards per component, KL, losses, clipping, the critic's fit."""
    mask = batch["completion_mask"]
    lengths = mask.sum(dim=1)
    local = torch.tensor([*(stats[k] for k in PPO_STATS), stats["tokens"], float(lengths.sum()),
                          float(batch["truncated"].sum()), len(lengths),
                          explained_variance(batch["old_values"], batch["returns"], mask),
                          float(batch["tis_capped"].sum()) if "tis" in batch else 0.0], device=mask.device)
    if run.ddp:
        dist.all_reduce(local)
    *token_sums, n_tok, len_sum, n_trunc, n_seq, ev_sum, n_capped = local.tolist()
    means = {f"train/{k}": v / max(n_tok, 1) for k, v in zip(PPO_STATS, token_sums)}
    return {"train/loss": means["train/policy_loss"] + args.vf_coef * means["train/value_loss"]
            - args.entropy_coef * means["train/entropy"],
            "train/reward": float(run.gather(batch["rewards"]["total"].to(mask.device)).mean()),
            **{f"rewards/{k}": float(run.gather(v.to(mask.device)).mean()) for k, v in batch["rewards"].items()
               if k != "total"},
            "train/score": float(run.gather(batch["scores"]).mean()), "train/kl": batch_kl, "train/kl_coef": kl_coef,
            "train/non_score_reward": -kl_coef * batch_kl, **means, "train/explained_variance": ev_sum / run.world,
            "train/value_mean": float(masked_mean(batch["old_values"], mask)), "train/grad_norm": stats["grad_norm"],
            "train/value_grad_norm": stats["value_grad_norm"], "train/ppo_epochs": stats["ppo_epochs"],
            "train/completion_length": len_sum / n_seq, "train/truncated_frac": n_trunc / n_seq,
            "train/tis_capped_frac": n_capped / max(len_sum, 1)}


RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "eval_limit", "num_sample_completions",
                     "track", "wandb_project_name", "wandb_entity", "device", "reward", "pause_at_step")


def check_args(args: Args) -> int:
    """Every check that needs no model or data loading, before any work; -> the micro-batch each process uses."""
    check_common(args, ("total_steps", "prompts_per_step", "num_generations", "max_completion_length",
                        "max_prompt_length", "log_every", "num_ppo_epochs", "num_mini_batches", "kl_horizon",
                        "learning_rate", "value_learning_rate"),
                 ("eval_every", "save_every", "warmup_steps", "eval_limit", "lora_r", "top_k", "num_sample_completions",
                  "micro_batch_size", "beta", "clip_high", "cliprange_value", "vf_coef", "entropy_coef",
                  "value_model_layers", "pause_at_step"),
                 (args.model_name_or_path,))
    if args.value_model_name_or_path:
        try:
            check_common(args, (), (), (args.value_model_name_or_path,))
        except ValueError as e:
            raise ValueError(f"--value-model-name-or-path: {e}") from None
    if args.value_model_layers:
        blocks = AutoConfig.from_pretrained(args.value_model_name_or_path or args.model_name_or_path).num_hidden_layers
        if args.value_model_layers > blocks:
            raise ValueError(f"--value-model-layers {args.value_model_layers}: the value model has {blocks} decoder "
                             f"layers; use 1 to {blocks}, or 0 for all")
    if args.pause_at_step >= args.total_steps:
        raise ValueError(f"--pause-at-step {args.pause_at_step} is not before the last step (--total-steps "
                         f"{args.total_steps}), so there is nothing to pause: use a smaller step, or 0")
    if args.center_scores_per_prompt and args.num_generations < 2:
        raise ValueError("--center-scores-per-prompt needs several completions of a prompt: --num-generations 2 or more")
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
    if not args.temperature > 0:
        raise ValueError(f"need --temperature > 0, got {args.temperature}")
    if args.top_p != 1 or args.top_k:  # refused rather than silently off-policy
        raise ValueError(f"--top-p {args.top_p} --top-k {args.top_k}: the trainer's log-probs are of the full "
                         f"softmax(logits / T), not of a truncated one, so the update would be off-policy; use "
                         f"--top-p 1 --top-k 0")
    if args.kl_controller != "fixed" and not args.kl_target > 0:
        raise ValueError(f"--kl-controller {args.kl_controller} steers beta towards a KL target and needs a positive "
                         f"--kl-target (the mean summed KL of a completion, e.g. --kl-target 1.0), got {args.kl_target}")
    if args.kl_controller != "fixed" and args.beta == 0:
        raise ValueError(f"--kl-controller {args.kl_controller} multiplies beta, which stays 0: start it positive, "
                         f"e.g. --beta 0.05")
    if not (0 <= args.clip_low <= 1 and 0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        raise ValueError(f"need 0 <= --clip-low, --gamma, --lam <= 1, got {args.clip_low}, {args.gamma}, {args.lam}")
    if args.importance_sampling_cap is not None and args.importance_sampling_cap < 1:
        raise ValueError(f"--importance-sampling-cap {args.importance_sampling_cap} must be >= 1, e.g. 2: it caps "
                         f"pi_old / pi_sampler, and below 1 it would shrink every on-policy token; or leave it off")
    if args.sampler_logprobs and (args.dtype in ("bfloat16", "float16") or args.importance_sampling_cap):
        raise ValueError("--sampler-logprobs takes pi_old's log-probs from the sampler, which equal the trainer's "
                         "only with float32 weights: not with --dtype bfloat16/float16 or --importance-sampling-cap "
                         "(which corrects their gap); drop it")
    if args.target_kl is not None and args.target_kl <= 0:
        raise ValueError(f"--target-kl must be positive (or None: no early stop), got {args.target_kl}")
    if args.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ValueError("--lora-r > 0 needs the peft package: `pip install peft` (or use --lora-r 0)") from None
    return micro


def main(args: Args) -> dict:
    # 0. Check every input before any work (a resumed run takes its own arguments from the checkpoint), then set
    #    up processes, device and seeds.
    args, overrides = resume_args(args, RESUME_MAY_CHANGE)
    micro = check_args(args)
    reward = make_reward(args.reward)
    gold = make_reward(args.gold_reward) if args.gold_reward else None
    run = Run(args, overrides, shown=("train/reward", "eval/accuracy", "train/kl"))
    device, rank, world, G = run.device, run.rank, run.world, args.num_generations

    # 1. Data: the prompts, tokenised once; the columns the reward needs, checked up front.
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    needed = reward.required_columns | (gold.required_columns if gold else set())
    columns = {c: args.answer_column if c == "answer" else c for c in sorted(needed)}
    train = load_split(args, "dataset_split", [args.prompt_column, *columns.values()],
                       "--prompt-column/--answer-column, or a --reward/--gold-reward that does not need them")
    raw_prompts = list(train[args.prompt_column])
    texts = prompt_texts(tokenizer, raw_prompts, args.use_chat_template, args.prompt_column)
    prompt_ids = [ids[-args.max_prompt_length:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    empty = [i for i, p in enumerate(prompt_ids) if not p]
    if empty:
        raise ValueError(f"{len(empty)} prompts of split '{args.dataset_split}' are empty (row {empty[0]}): remove them")
    data = {"ids": prompt_ids, "prompts": raw_prompts, "texts": texts,
            "columns": {name: list(train[col]) for name, col in columns.items()}}
    eval_prompts, eval_answers = [], []
    if args.eval_split:
        ev = load_split(args, "eval_split", [args.prompt_column, args.answer_column],
                        "--prompt-column/--answer-column")
        n = min(len(ev), args.eval_limit)
        eval_prompts = prompt_texts(tokenizer, list(ev[args.prompt_column][:n]), args.use_chat_template, args.prompt_column)
        eval_answers = list(ev[args.answer_column][:n])

    # 2. Models: the policy and the value model (optionally with LoRA adapters), and a frozen reference when beta > 0.
    weights_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=weights_dtype).to(device)
    value_model = load_value_model(args.value_model_name_or_path or args.model_name_or_path, weights_dtype,
                                   args.value_model_layers).to(device)
    for m in [*model.modules(), *value_model.modules()]:
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eos_ids = own_generation_config(model, tokenizer)
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
        ref_model = Forward(completion_logprobs, copy.deepcopy(model)).eval().requires_grad_(False)
    raw_model, raw_value = model, value_model
    raw_actor_critic = actor_critic = ActorCritic(model, value_model)
    if run.fsdp:  # each decoder layer of both models sharded over the processes, the reference too (FSDP2)
        actor_critic = run.shard(actor_critic, decoder_layers(model) + decoder_layers(value_model))
        ref_model = ref_model and run.shard(ref_model, decoder_layers(ref_model))
    elif run.ddp:
        actor_critic = torch.nn.parallel.DistributedDataParallel(
            actor_critic, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")
    gen_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  max_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=eos_ids)

    # 3. Optimiser (both models, a parameter group each), schedule, KL controller and data order (one per process);
    #    on --resume the weights, then all their states.
    policy_params = [p for p in raw_model.parameters() if p.requires_grad]
    value_params = [p for p in raw_value.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": policy_params, "lr": args.learning_rate},
                                   {"params": value_params, "lr": args.value_learning_rate}],
                                  betas=(0.9, 0.99), weight_decay=args.weight_decay)
    run.trained = (actor_critic, optimizer)  # what --fsdp checkpoints in shards
    lr_anchor = None  # set when a resumed run changes --total-steps (lr_factor)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    kl_ctl = KLController(args.kl_controller, args.beta, args.kl_target, args.kl_horizon)
    order = DataOrder(len(prompt_ids), args.seed * 1000 + rank)
    state = run.restore(raw_model, optimizer, scheduler)
    if state and args.lora_r:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapters = Path(args.resume) / "value_model" / "adapter_model.safetensors"
        set_peft_model_state_dict(raw_value, load_file(adapters, device=str(device)))
    elif state and not run.fsdp:
        raw_value.load_state_dict(load_value_model(str(Path(args.resume) / "value_model"), weights_dtype).state_dict())
    if state:
        if "reward" not in overrides:  # a new --reward (a reward model retrained on this policy) starts afresh
            reward.load_state_dict(state["reward"])
        kl_ctl.load_state_dict(state["kl_controller"])
        order.load(state)
        lr_anchor = state["lr_anchor"]
        if "total_steps" in overrides:  # the decay continues from where it is to the new last step
            lr_anchor = (run.start, lr_factor(run.start, args.warmup_steps, overrides["total_steps"][0],
                                              args.lr_schedule, lr_anchor))

    def measure() -> tuple[dict, list]:
        if not eval_prompts:
            return {}, []
        acc, samples = greedy_accuracy(raw_model, tokenizer, eval_prompts, eval_answers, args.max_completion_length,
                                       eos_ids, progress=run.progress)
        return {"eval/accuracy": acc}, samples

    def save() -> Path:
        return run.checkpoint(PolicyAndValue(raw_model, raw_value, tokenizer), tokenizer, {
            "optimizer": None if run.fsdp else optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "reward": reward.state_dict(),
            "kl_controller": kl_ctl.state_dict(), "lr_anchor": lr_anchor}, per_rank=order.state())

    # 4. Train.
    n_policy, n_value = (sum(p.numel() for p in params) for params in (policy_params, value_params))
    run.say(f"run directory: {run.dir}  |  {len(prompt_ids)} training prompts, {len(eval_prompts)} eval prompts, "
            f"{n_policy / 1e6:.2f}M + {n_value / 1e6:.2f}M trainable parameters (policy + value model) on {device}, "
            f"micro-batch {micro}")
    groups, final, tokens, last_log = args.prompts_per_step // world, {}, 0, run.start
    timing = dict.fromkeys(("step", "generate", "score", "train"), 0.0)  # seconds since the last log row
    with run:
        for step in run.steps(measure, save):
            t_step, run.stop = time.perf_counter(), run.stop or step == args.pause_at_step  # (checked after the step)
            # 4a. Roll out: a completion (or G) for each prompt from pi_old, scored (Sec. 2 of arXiv:1909.08593).
            with run.whole():  # --fsdp: whole weights while sampling, so processes may take different numbers of steps
                rows = [i for i in order.draw(groups) for _ in range(G)]
                batch = rollout(raw_model, tokenizer, data, rows, gen_config, args.generation_backend, eos_tensor,
                                reward, autocast, timing)
            if args.center_scores_per_prompt:  # the reward less its prompt's mean (rewards/<name> stay raw)
                total = batch["rewards"]["total"]
                batch["rewards"]["total"] = total - total.view(-1, G).mean(1).repeat_interleave(G)
            if gold is not None:  # logged as rewards/gold beside the reward, never in the loss
                of_rows = {k: [v[i] for i in rows] for k, v in data["columns"].items()}
                batch["rewards"]["gold"] = torch.tensor(gold(batch["completions"], prompts=[data["prompts"][i]
                                                                                           for i in rows], **of_rows))
            t_train = time.perf_counter()
            # 4b. Log-probs of pi_old and pi_ref and the values V_old at every completion token, without gradients.
            batch = old_logprobs_and_values(raw_actor_critic, ref_model, batch, micro, args, autocast,
                                            args.sampler_logprobs and getattr(run, "sampler_checked", False))
            gap = sampler_gap(run, ((batch["old_logp"] - batch["sampler_logp"]).abs() * batch["completion_mask"]).sum(),
                              batch["completion_mask"].sum())  # stops a sampler/trainer mismatch at once
            # 4c. Per-token rewards (-beta KL_t, the score at the last token), GAE, whitened advantages.
            kl_coef = kl_ctl.value
            batch.update(compute_advantages(batch, kl_coef, args))
            # 4d. PPO epochs over shuffled mini-batches: the clipped policy and value losses, the entropy bonus.
            stats = ppo_update(actor_critic, optimizer, batch, micro, args, policy_params, value_params, autocast)
            lr = scheduler.get_last_lr()[0]  # the rate of this step's updates (logged below)
            scheduler.step()
            # 4e. The KL controller sees the batch's KL: the mean over completions of the summed per-token KL.
            batch_kl = float(run.gather(batch["kl"].sum(dim=1)).mean())
            kl_ctl.update(batch_kl, args.prompts_per_step * G)
            timing["train"] += time.perf_counter() - t_train
            timing["step"] += time.perf_counter() - t_step
            tokens += int(batch["attention"].sum())

            # 4f. Log rewards per component, KL, losses, clipping, the critic's fit and timings.
            if step % args.log_every == 0 or step == args.total_steps:
                final = {"step": step, **ppo_metrics(run, batch, stats, kl_coef, batch_kl, args), "train/lr": lr,
                         "train/sampler_gap": gap,
                         "perf/tokens_per_s": tokens * world / max(timing["step"], 1e-9),
                         **{f"perf/{k}_s": v / (step - last_log) for k, v in timing.items()}}
                n = args.num_sample_completions
                run.log(final, ("train/samples", ["step", "prompt", "completion", "reward", "score"],
                                [[step, p, c, float(r), float(s)] for p, c, r, s in zip(
                                    batch["prompts"][:n], batch["completions"][:n], batch["rewards"]["total"][:n],
                                    batch["scores"][:n])]))
                tokens, last_log, timing = 0, step, dict.fromkeys(timing, 0.0)

    # 5. Final evaluation, a checkpoint, and the trained models (LoRA merged into them) in final/.
    models = (raw_model, raw_value)
    return run.finish(final, measure, save, lambda: PolicyAndValue(
        *(copy.deepcopy(m).merge_and_unload() if args.lora_r else m for m in models), tokenizer), tokenizer)


# ---- plumbing: input checks, run directory, resume, metrics, W&B, progress, Ctrl-C, checkpoints, torchrun.
# A reader need not modify it. A function here with the same name in another script is the same text there.


def answer_matches(text: str, answer) -> bool:
    """The text's <answer>...</answer> equals the reference (numerically where both parse)."""
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    got = m.group(1).strip() if m else None
    try:
        return float(got) == float(answer)
    except (TypeError, ValueError):
        return got == str(answer).strip()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts, answers, max_new_tokens, eos_ids, progress=False, batch_size=128):
    """Greedy decoding on left-padded batches -> (accuracy, [(prompt, completion, answer)])."""
    model.eval()
    samples = []
    for i in tqdm(range(0, len(prompts), batch_size), desc="eval", leave=False, disable=not progress):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(model.device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids,
                             pad_token_id=tokenizer.pad_token_id, synced_gpus=False)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        samples += zip(prompts[i : i + batch_size], texts, answers[i : i + batch_size])
    model.train()
    return sum(answer_matches(t, a) for _, t, a in samples) / max(1, len(prompts)), samples


def lm_head(model, dtype: torch.dtype) -> dict:
    """The output head as kernels.linear_token_logprobs takes it: weight, bias, and the config's logit scale (Cohere;
    Granite divides) and final soft-capping (Gemma 2, 3), so that log-probs are of the model's own logits."""
    head, config = model.get_output_embeddings(), model.config
    bias = getattr(head, "bias", None)
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    return {"weight": head.weight.to(dtype), "bias": None if bias is None else bias.to(dtype),
            "logit_scale": None if scale == 1.0 else scale, "softcap": getattr(config, "final_logit_softcapping", None)}


class SampledLogprobs:
    """Last of generate's logits processors (temperature comes after it): the log-prob each token was sampled with,
    scores[token] / T - logsumexp(scores / T), read one step later when the token is in input_ids."""

    def __init__(self, temperature: float):
        self.temperature, self.scores, self.lse, self.logp = temperature, None, None, []

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.scores.gather(1, tokens).float() / self.temperature - self.lse

    def __call__(self, input_ids, scores):
        if self.scores is not None:
            self.logp.append(self.read(input_ids[:, -1:]))
        self.scores, self.lse = scores, torch.logsumexp(scores.float() / self.temperature, dim=-1, keepdim=True)
        return scores


def sample(model, ids, mask, gen_config, backend: str = "shared") -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling call on left-padded prompts -> the completions [B, Tc] (padded after EOS) and the log-probs the
    sampler drew them with [B, Tc]. shared: transformers' generate, each run of identical rows (a group) prefilled once
    and its KV cache repeated; static: a static KV cache (on CUDA transformers compiles the decode step)."""
    from transformers import DynamicCache

    training = model.training
    model.eval()  # in training mode gradient checkpointing turns the KV cache off
    seen, extra, precision = SampledLogprobs(gen_config.temperature), {}, contextlib.nullcontext()
    if backend == "static":  # its cache takes the keys' dtype; under bf16 autocast RoPE makes keys float32 and
        # values stay bf16, which it cannot hold: so it samples in the weights' own dtype, autocast off
        gen_config = type(gen_config).from_dict({**gen_config.to_dict(), "cache_implementation": "static"})
        precision = torch.autocast(ids.device.type, enabled=False)
    rows, counts = torch.unique_consecutive(torch.cat([ids, mask], dim=1), dim=0, return_counts=True)
    if backend == "shared" and len(rows) < len(ids) and ids.shape[1] > 1:  # all but the last prompt token, once a group
        unique_ids, unique_mask = rows.split(ids.shape[1], dim=1)
        cache = DynamicCache(config=model.config)
        model(input_ids=unique_ids[:, :-1], attention_mask=unique_mask[:, :-1], past_key_values=cache,
              position_ids=(unique_mask.cumsum(1) - 1).clamp(min=0)[:, :-1])  # generate's, for left padding
        cache.batch_repeat_interleave(counts)
        extra["past_key_values"] = cache
    try:
        with precision:  # (--fsdp samples with whole weights: no lockstep)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                 logits_processor=[seen], synced_gpus=False, **extra)
    finally:
        model.train(training)
    completion_ids = out[:, ids.shape[1]:]
    return completion_ids, torch.cat([*seen.logp, seen.read(completion_ids[:, -1:])], dim=1)


class Forward(torch.nn.Module):
    """fn(module, *args) as a module's forward, so that DDP and FSDP2, which act around forward, see it (DDP syncs
    gradients; FSDP2 gathers the weights outside the decoder layers: embeddings and lm_head)."""

    def __init__(self, fn: Callable, module):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def sampler_gap(run, gap_sum, tokens) -> float:
    """The mean |sampler - trainer| log-prob of the completion tokens over all processes. On the first sampled batch,
    a gap beyond float rounding stops the run (the update would be silently off-policy): 1e-3 with float32 weights and
    no autocast; 0.25 with bfloat16 (a margin: bf16 weights on CPU give ~1e-3)."""
    exact = run.args.dtype == "float32" or (run.args.dtype == "auto" and run.device.type != "cuda")
    total = run.gather(torch.tensor([[float(gap_sum), float(tokens)]], device=run.device)).sum(0)
    gap = float(total[0] / total[1].clamp(min=1))
    tolerance = 1e-3 if exact else 0.25
    if not getattr(run, "sampler_checked", False) and gap > tolerance:
        raise ValueError(f"the sampler and the trainer disagree: mean |log-prob gap| {gap:.3g} on the first batch "
                         f"(tolerance {tolerance}): generate does not sample softmax(logits / --temperature) of the "
                         f"model's forward (a logits processor, a custom generate, a model whose cached decoding "
                         f"differs from its forward); the policy gradient would be off-policy")
    run.sampler_checked = True
    return gap


CHECKPOINT_GENERATION_CONFIG = {}  # the policy checkpoint's own generation_config (own_generation_config)


def own_generation_config(model, tokenizer) -> list[int]:
    """Sampling and greedy evaluation follow this script's flags alone: of the checkpoint's generation_config only the
    special tokens are kept (transformers fills every field a script leaves unset from it, e.g. a repetition_penalty,
    and the sampler would no longer be softmax(logits / T)); the fields dropped are named once. -> the EOS ids."""
    old = model.generation_config
    kept = ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "_from_model_config", "use_cache",
            "output_attentions", "output_hidden_states")
    eos = sorted({tokenizer.eos_token_id} | set(np.atleast_1d(old.eos_token_id or []).tolist()))
    dropped = [f"{k}={v}" for k, v in old.to_diff_dict().items() if k not in kept]
    model.generation_config = type(old)(bos_token_id=old.bos_token_id, eos_token_id=eos,
                                        pad_token_id=tokenizer.pad_token_id)
    CHECKPOINT_GENERATION_CONFIG["policy"] = old  # what save_pretrained writes: final/ keeps the checkpoint's own
    if dropped and int(os.environ.get("RANK", 0)) == 0:
        print(f"{model.name_or_path}: its generation_config sets {', '.join(dropped)}; not used: this script's flags "
              f"decide sampling and evaluation")
    return eos


def load_split(args, flag: str, columns: list[str], column_flags: str):
    """The split --<flag> names, with the columns needed: a folder's `<split>.jsonl`, or a hub dataset's split; of a
    single JSON-lines file, a fixed seeded 10% for the eval splits and the rest for training (all of it, with none).
    Bad data is one line naming the file and the line; a folder's missing splits are named together."""
    split, path, option = getattr(args, flag), Path(args.dataset).expanduser(), "--" + flag.replace("_", "-")
    file = path / f"{split}.jsonl" if path.is_dir() else path
    splits = {f: getattr(args, f) for f in vars(args) if f.endswith("_split") and getattr(args, f)}
    have = sorted(f.stem for f in path.glob("*.jsonl")) if path.is_dir() else []
    missing = {f: s for f, s in splits.items() if path.is_dir() and s not in have}
    if missing:
        fixes = [f"--{f.replace('_', '-')} {'None' if 'eval' in f else '|'.join(have) or '<split>'}" for f in missing]
        raise ValueError(f"split not found: {path} has no {', '.join(s + '.jsonl' for s in missing.values())} (its "
                         f"splits: {', '.join(have) or 'none'}): pass {' '.join(fixes)} (None skips an eval split)")
    if not path.exists():
        check_local_or_hub("dataset", args.dataset)
    try:
        if path.is_dir():
            ds = load_dataset("json", data_files={split: str(file)}, split=split)
        elif path.is_file():
            ds = load_dataset("json", data_files=str(path), split="train")
        else:
            ds = load_dataset(args.dataset, split=split)
        problem = None
    except Exception as e:  # the loader's error, or the file's first bad line
        if not file.is_file():
            raise
        problem = json_lines_problem(file, option) or f"{type(e).__name__}: {e}"
    missing = [c for c in columns if problem is None and c not in ds.column_names]
    if missing and file.is_file():  # e.g. rows that are JSON lists
        problem = json_lines_problem(file, option)
    if problem:
        raise ValueError(f"{file}{problem}")
    if missing:
        raise ValueError(f"split '{split}' has no column {missing}; available columns: {ds.column_names} (choose with "
                         f"{column_flags}" + (f", or skip this split with {option} None)" if "eval" in flag else ")"))
    if path.is_file() and any(splits.get(f) for f in splits if "eval" in f):
        if len(ds) < 2:
            raise ValueError(f"{path} has 1 row: too few to hold one out for evaluation; pass --eval-split None")
        parts = ds.train_test_split(test_size=0.1, seed=0)
        if flag == "dataset_split" and int(os.environ.get("RANK", 0)) == 0:
            print(f"{path} is one file: {len(parts['test'])} of its {len(ds)} rows (a fixed seeded 10%) are held out "
                  f"for evaluation, {len(parts['train'])} train; a folder of <split>.jsonl files chooses the splits")
        ds = parts["test" if "eval" in flag else "train"]
    return ds


def json_lines_problem(file: Path, option: str) -> Optional[str]:
    """The first line of a JSON-lines file that is not a JSON object, as ', line N: why', or None."""
    rows = [(i, line) for i, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        return " is empty: it needs at least one JSON line"
    skip = f" (or skip this split: {option} None)" if "eval" in option else ""
    for i, line in rows:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f", line {i}: not valid JSON ({e.msg} at column {e.colno}){skip}"
        if not isinstance(row, dict):
            return f", line {i}: expected a JSON object with named columns, got {type(row).__name__}{skip}"
    return None


def check_local_or_hub(kind: str, name: str) -> bool:
    """True for a local path; a hub id must be on the Hugging Face Hub (one request, before any work)."""
    if Path(name).expanduser().exists():
        return True
    hint = "a local path (e.g. models/tiny-arith, data/arith) or a hub id"
    if name.startswith((".", "/", "~")) or name.endswith((".json", ".jsonl")) or name.count("/") > 1 or Path(
            name.split("/")[0]).exists():
        raise ValueError(f"{kind} '{name}' does not exist: pass {hint}")
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "0") not in ("", "0")]
    if offline:
        raise ValueError(f"{kind} '{name}' is not a local path, and {offline[0]}=1 forbids the Hugging Face Hub: "
                         f"pass a local path or unset {offline[0]}")
    from huggingface_hub import repo_exists

    try:
        found = repo_exists(name, repo_type=kind)
    except Exception as e:  # no network, a proxy: say so now rather than after retries
        raise ValueError(f"{kind} '{name}': the Hugging Face Hub cannot be reached ({type(e).__name__}): pass {hint}")
    if not found:
        raise ValueError(f"{kind} '{name}' is not on the Hugging Face Hub (private? `hf auth login`): pass {hint}")
    return False


def check_common(args, positive: tuple[str, ...], non_negative: tuple[str, ...], model_paths: tuple[str, ...]):
    """The checks every script makes before any work: counts, device, model folders, --fsdp."""
    for name in positive + non_negative:
        low = name in positive and getattr(args, name) <= 0
        if low or getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be {'positive' if low else '>= 0'}, "
                             f"got {getattr(args, name)}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device {args.device}: use auto, cpu, cuda or cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}, but torch sees no CUDA GPU here: use --device cpu (or auto)")
    for name in model_paths:
        path = Path(name).expanduser()
        if check_local_or_hub("model", name) and not (path / "config.json").exists():
            raise ValueError(f"'{name}' is not a model folder: it has no config.json (pass a folder written by "
                             f"save_pretrained, e.g. models/tiny-arith, or a hub id)")
    if getattr(args, "fsdp", False):
        check_fsdp(args)


def check_fsdp(args) -> None:
    """--fsdp: launched by torchrun, no LoRA, and decoder layers to shard (found on a weightless copy of the model)."""
    from transformers import AutoConfig, AutoModel

    if "LOCAL_RANK" not in os.environ:
        raise ValueError("--fsdp shards the model over processes: launch with torchrun --nproc-per-node N (one process "
                         "per GPU), or drop --fsdp for a single process")
    if getattr(args, "lora_r", 0):
        raise ValueError("--fsdp with --lora-r is not supported: LoRA's few trainable weights fit on one GPU, so use "
                         "DDP (drop --fsdp), or train the full model with --fsdp (drop --lora-r)")
    if args.resume and not (Path(args.resume) / "sharded").is_dir():
        raise ValueError(f"--resume {args.resume}: this --fsdp run's checkpoint has no sharded/ folder (its weights and "
                         f"optimizer states, per process): pass a complete checkpoint of the run")
    if getattr(args, "model_config", None):
        config = AutoConfig.for_model(**json.loads(Path(args.model_config).read_text()))
    else:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    with torch.device("meta"):
        decoder_layers(AutoModel.from_config(config))


def decoder_layers(model) -> list:
    """The blocks FSDP2 shards one by one: the longest ModuleList of a single block class (model.layers, h, ...)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ValueError(f"--fsdp: no list of decoder layers found in {type(model).__name__} (a torch.nn.ModuleList of "
                         f"one block class, e.g. model.layers): drop --fsdp and use DDP for this model")
    return list(max(lists, key=len))


def fit_micro_batch(requested: int, per_process: int, what: str, cap: int = 128) -> int:
    """The micro-batch a process uses: `requested`, or with 0 the largest divisor of its batch up to `cap`."""
    works = [d for d in range(1, min(requested or cap, per_process) + 1) if per_process % d == 0][-1]
    if requested and works != requested:
        raise ValueError(f"{what} = {per_process} is not divisible by --micro-batch-size {requested}: use "
                         f"--micro-batch-size {works} (or 0, the largest divisor up to {cap})")
    return works


def resume_args(args, may_change: tuple[str, ...]):
    """--resume: the run's own arguments, with the flags given here that differ from their defaults applied on top
    (`may_change`: cadence, tracking, device) or refused. -> (args, {flag: [run's value, new value]})."""
    if not args.resume:
        return args, {}
    if not (Path(args.resume) / "trainer_state.pt").exists():
        found = sorted(Path(args.resume).glob("checkpoints/step_*"), key=lambda p: int(p.name[5:]))
        raise ValueError(f"--resume {args.resume}: no trainer_state.pt there; pass " + (
            f"one of this run's checkpoints: {', '.join(map(str, found))}" if found else "runs/<run>/checkpoints/step_N"))
    cls, saved = type(args), json.loads((Path(args.resume) / "args.json").read_text())
    defaults, changed = cls(), {}
    out = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                 if k in cls.__dataclass_fields__})  # JSON has no tuples
    for name in cls.__dataclass_fields__:
        given = getattr(args, name)
        if name in ("exp_name", "output_dir", "run_name", "resume") or given in (getattr(defaults, name),
                                                                                  getattr(out, name)):
            continue
        if name not in may_change:
            raise ValueError(f"--{name.replace('_', '-')} {given} differs from the run's {saved.get(name)!r} "
                             f"({args.resume}/args.json): it would change the algorithm or the data, so it cannot "
                             f"change on resume; drop the flag, or start a new run. Flags that may change: "
                             f"{', '.join('--' + n.replace('_', '-') for n in may_change)}")
        setattr(out, name, given)
        changed[name] = [saved.get(name), given]
    out.resume = args.resume
    step = torch.load(Path(args.resume) / "trainer_state.pt", weights_only=False, mmap=True)["step"]
    if step >= out.total_steps:
        raise ValueError(f"--resume {args.resume}: the run ended at this step (--total-steps {out.total_steps}), so "
                         f"there is nothing to do; to train on, pass a larger --total-steps")
    return out, changed


def save_pretrained(path: Path, model, tokenizer, state: Optional[dict] = None, weights: Optional[dict] = None,
                    sharded: Optional[Path] = None) -> None:
    """Write into a temporary folder, then rename: a killed run never leaves half a checkpoint. weights: the state
    dict to write (--fsdp gathers it), else the model's own; sharded: a folder moved in as sharded/ (--fsdp)."""
    tmp, old = path.with_name(f".tmp-{path.name}"), path.with_name(f".old-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
    if (tmp / "generation_config.json").exists() and "policy" in CHECKPOINT_GENERATION_CONFIG:
        CHECKPOINT_GENERATION_CONFIG["policy"].save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if sharded is not None:
        os.replace(sharded, tmp / "sharded")
    if state is not None:
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(state["args"], indent=2))
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


class Run:
    """One run as each process sees it: processes, device and seeds; with `with run:` the run directory (rank 0;
    removed if the run fails before its first step ends), W&B and Ctrl-C (the first finishes the step and saves,
    a second quits); metrics, evaluation and checkpoint cadence, the progress line, and the closing summary."""

    def __init__(self, args, overrides: dict, shown: tuple[str, ...]):
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
        self.args, self.overrides, self.shown, self.ddp = args, overrides, shown, "LOCAL_RANK" in os.environ
        self.rank, self.world = 0, 1
        if self.ddp:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(cuda if args.device == "auto" else args.device)
        self.fsdp, self.sharded, self.trained = getattr(args, "fsdp", False), [], None  # trained: (root, optimizer)
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        if not args.resume:  # rank 0's clock names the run: the ranks' clocks may straddle a second
            stamp = torch.tensor([int(time.time())], device=self.device)
            if self.ddp:
                dist.broadcast(stamp, 0)
            args.run_name = f"{Path(args.dataset).name}__{args.exp_name}__{args.seed}__{stamp.item()}"
        self.dir = Path(args.resume).parents[1] if args.resume else Path(args.output_dir) / args.run_name
        self.start = self.step = self.steps_done = 0
        self.seconds, self.first, self.last, self.wandb, self.stop = 0.0, {}, {}, None, False
        self.progress = self.rank == 0 and sys.stderr.isatty()  # a progress bar on a terminal, lines otherwise

    def restore(self, model, optimizer, scheduler) -> dict:
        """--resume: the trained weights (this process's shards under --fsdp, the LoRA adapters, or the whole model),
        the optimizer's and scheduler's states and the RNGs -> trainer_state.pt's entries ({} on a new run)."""
        if not self.args.resume:
            return {}
        path = Path(self.args.resume)
        if self.fsdp:
            self.load_sharded(path)
        elif getattr(self.args, "lora_r", 0):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors", device=str(self.device)))
        else:
            dtype = next(model.parameters()).dtype
            model.load_state_dict(type(model).from_pretrained(path, dtype=dtype).state_dict())
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
        """--fsdp: FSDP2's fully_shard on each decoder layer, then on `module` (the root, which keeps the rest: the
        embeddings, the head); on CUDA the parameters compute in bfloat16 and gradients reduce in float32."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy()
        if self.device.type == "cuda":
            mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        self.sharded.append(fully_shard(module, mesh=mesh, mp_policy=mp))
        module._get_fsdp_state()._lazy_init()  # `module` is the root even if a layer runs first (generate, evaluation)
        return module

    @contextlib.contextmanager
    def whole(self):
        """--fsdp: every process holds the whole weights of the trained model (sharded first) inside: sampling and
        evaluation run without a collective per decode step, so a process may run more steps than another; sharded
        again on leaving. The reference stays sharded. Without --fsdp, nothing."""
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

    def full_weights(self, model) -> Optional[dict]:
        """--fsdp: the model's whole state dict on rank 0's CPU (every process takes part); None elsewhere and without
        FSDP."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.fsdp:
            return None
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return whole if self.rank == 0 else None

    def load_sharded(self, path) -> None:
        """--fsdp --resume: the trained module's sharded weights and its optimizer's states, from `path`/sharded
        (torch.distributed.checkpoint), each process reading its own shards."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(*self.trained)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(Path(path) / "sharded"))
        set_state_dict(*self.trained, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on each process -> [world * n, ...] in rank order."""
        if not self.ddp:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def checkpoint(self, model, tokenizer, state: dict, per_rank: dict) -> Path:
        """checkpoints/step_N: weights, tokenizer, trainer_state.pt (`state`, step, args, RNGs, every process's
        `per_rank` tensors)."""
        path, weights = self.dir / "checkpoints" / f"step_{self.step}", self.full_weights(model)
        per_rank = {k: self.gather(torch.as_tensor(v)[None].to(self.device)).cpu()
                    for k, v in {**per_rank, "torch_rng": torch.get_rng_state()}.items()}
        sharded = path.with_name(f".tmp-sharded-{path.name}") if self.fsdp else None
        if self.fsdp:  # every process writes its shards (DCP: weights, optimizer states); rank 0 moves them in below
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(*self.trained)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(sharded))
            self.barrier()
        if self.rank == 0:
            save_pretrained(path, model, tokenizer, {**state, "step": self.step, "per_rank": per_rank, "args": asdict(
                self.args), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()}, weights, sharded)
        self.barrier()
        return path

    def barrier(self) -> None:
        if self.ddp:
            dist.barrier()

    def log(self, metrics: dict, table: Optional[tuple[str, list, list]] = None) -> None:
        """A row of metrics.jsonl and W&B (with `table`: key, columns, rows of samples), from rank 0; on CUDA a training
        row gets perf/peak_gb, the peak of torch.cuda.max_memory_allocated so far (rank 0's)."""
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

    def say(self, text: str) -> None:
        if self.rank == 0:
            tqdm.write(text) if self.progress else print(text, flush=True)

    def evaluate(self, measure: Callable[[], tuple[dict, list]]) -> dict:
        """Rank 0's measure() -> (metrics, [(prompt, completion, answer)]), logged and printed."""
        with self.whole():
            metrics, samples = measure() if self.rank == 0 else ({}, [])
        if metrics:
            self.log({"step": self.step, **metrics}, ("eval/samples", ["prompt", "completion", "answer"],
                                                      [list(s) for s in samples[:16]]))
            self.say(f"eval at step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        self.barrier()
        return metrics

    def __enter__(self):
        args = self.args
        if self.rank == 0 and args.resume:  # drop half-written checkpoints, and rows logged after this checkpoint
            for tmp in [*self.dir.glob("**/.tmp-*"), *self.dir.glob("**/.old-*")]:
                shutil.rmtree(tmp, ignore_errors=True)
            rows = [json.loads(r) for r in (self.dir / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if r["step"] <= self.start]
            (self.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            for row in rows:  # the summary's start values are the run's own, from before the resume
                self.first = {**row, **self.first}
            saved = json.loads((self.dir / "args.json").read_text())
            saved.setdefault("resumed", []).append({"step": self.start, "checkpoint": args.resume,
                                                    "overrides": self.overrides})
            (self.dir / "args.json").write_text(json.dumps(saved, indent=2))
            for name, (old, new) in self.overrides.items():
                print(f"resume: --{name.replace('_', '-')} {new} (the run had {old})")
        elif self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)  # reward_model.py --comparisons writes into it first
            (self.dir / "args.json").write_text(json.dumps(asdict(args), indent=2))
        self.bar = tqdm(total=args.total_steps, initial=self.start, unit="step", disable=not self.progress)
        if args.track and self.rank == 0:  # (no login: wandb.init says how to log in, or WANDB_MODE=offline)
            import wandb

            self.wandb = wandb
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name, config=vars(args),
                       dir=str(self.dir), resume="allow")
        self.previous = signal.signal(signal.SIGINT, self.interrupt)
        return self

    def interrupt(self, signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the second Ctrl-C quits at once
        self.stop = True
        if self.rank == 0:
            print(f"\nCtrl-C: finishing step {self.step}, then saving a checkpoint (Ctrl-C again to quit without "
                  f"saving)", file=sys.stderr, flush=True)

    def __exit__(self, kind, *exc):  # after a Ctrl-C, or if started with SIGINT ignored (`&`), Ctrl-C quits at once
        quit_at_once = self.stop or self.previous == signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler if quit_at_once else self.previous)
        self.bar.close()
        if kind and self.rank == 0 and not self.args.resume and not self.steps_done:
            shutil.rmtree(self.dir, ignore_errors=True)  # a failed start leaves no run directory

    def steps(self, measure: Callable[[], tuple[dict, list]], save: Callable[[], Path]):
        """Steps start+1 .. --total-steps, with evaluation at 0 and every --eval-every, a checkpoint every
        --save-every, and after a Ctrl-C a checkpoint and the end of the loop."""
        if self.start == 0:
            self.evaluate(measure)
        for step in range(self.start + 1, self.args.total_steps + 1):
            self.step, t0 = step, time.perf_counter()
            yield step
            self.steps_done += 1
            self.seconds += time.perf_counter() - t0
            self.report()
            if self.args.eval_every and self.step % self.args.eval_every == 0 and self.step != self.args.total_steps:
                self.evaluate(measure)
            if self.args.save_every and self.step % self.args.save_every == 0:
                save()
            if self.ddp:  # every process stops at the same step, even if the signal reached them apart
                flag = torch.tensor([float(self.stop)], device=self.device)
                dist.all_reduce(flag)
                self.stop = bool(flag.item())
            if self.stop:
                path = save()
                self.say(f"interrupted: saved {path}; continue with --resume {path}")
                return

    def report(self) -> None:
        """The key numbers on the progress bar (a terminal), or every --log-every steps as a line."""
        per_step = self.seconds / self.steps_done
        text = " | ".join(f"{k.split('/')[-1]} {self.last[k]:.3g}" for k in self.shown if k in self.last)
        self.bar.update(1)
        if self.progress:
            self.bar.set_postfix_str(f"{text} | {per_step:.2f} s/step")
        elif self.rank == 0 and self.step % self.args.log_every == 0:
            print(f"step {self.step}/{self.args.total_steps} | {text} | {per_step:.2f} s/step | ETA "
                  f"{tqdm.format_interval((self.args.total_steps - self.step) * per_step)}", flush=True)

    def finish(self, final: dict, measure, save, model, tokenizer, notes: tuple[str, ...] = ()) -> dict:
        """Unless interrupted: the final evaluation, a checkpoint, final/ (`model`, or a function making it), and the
        summary: each eval metric at the start and the end, where final/ is, and `notes` for the next step."""
        if not self.stop:
            final.update(self.evaluate(measure))
            save()
            if self.rank == 0 or self.fsdp:  # (--fsdp: every process takes part in gathering the weights)
                model = model if isinstance(model, torch.nn.Module) else model()
                weights = self.full_weights(model)
            if self.rank == 0:
                save_pretrained(self.dir / "final", model, tokenizer, weights=weights)
                print(f"done: step {self.step} in {tqdm.format_interval(self.seconds)}" + "".join(
                    f" | {k} {self.first[k]:.4g} -> {v:.4g}" for k, v in self.last.items() if k.startswith("eval/")))
                print(f"final model: {self.dir / 'final'}", *notes, sep="\n", flush=True)
        if self.wandb:
            self.wandb.finish()
        if self.ddp:
            dist.destroy_process_group()
        return {**final, "step": self.step, "run_dir": str(self.dir), "interrupted": self.stop}


def command_line(Args, main) -> None:
    """`python <script>.py --flags`: main(the flags); bad input caught by the checks here as one line that names the
    fix, not a traceback; a second Ctrl-C quits at once with code 130 (the last checkpoint written is intact)."""
    try:
        main(tyro.cli(Args))
    except KeyboardInterrupt:
        print("\ninterrupted again: quit without saving", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:
        tb = e.__traceback__
        while tb.tb_next:
            tb = tb.tb_next
        if Path(tb.tb_frame.f_code.co_filename).resolve().parent != Path(__file__).resolve().parent:
            raise  # raised inside a library, not by a check of this repository: the traceback says where
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    command_line(Args, main)
