"""PPO-RLHF: a policy and a separate value model, a per-token KL reward, GAE and an adaptive KL coefficient.

The RLHF loop of Ziegler et al. (arXiv:1909.08593) and InstructGPT (arXiv:2203.02155), as "The N+ Implementation
Details of RLHF with PPO" (arXiv:2403.17031, "N+"):
    1. sample a completion o of each prompt q from pi_old and score it: s = R(q, o)
    2. r_t = -beta KL_t + [t = last token] s, KL_t = log pi_old(o_t) - log pi_ref(o_t)  (Eq. 2 of arXiv:2203.02155)
    3. GAE advantages A_t, returns R_t = A_t + V_t  (Eq. 16 of arXiv:1506.02438)
    4. epochs of mini-batches: clipped surrogate, clipped value loss, entropy bonus  (Eq. 7, 9 of arXiv:1707.06347)
    5. adapt beta to the batch's KL  (Sec. 2.2 of arXiv:1909.08593)

Run:
    python ppo.py  # models/tiny-arith on data/arith, CPU
    python ppo.py --reward rm.json  # a reward model: {"type": "reward_model", "model": "runs/<rm>/final"}
    python ppo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template --dataset my/hub-dataset \
        --max-completion-length 512 --micro-batch-size 8 --learning-rate 1e-6 --lora-r 16
    torchrun --nproc-per-node 2 ppo.py  # data parallel

Deviations (why, measurements: docs/ppo.md):
- The value model is a separate network (as N+) with a zero scalar head: V = 0 at the start.
- Defaults fit the embedded 0.9M-parameter model: 2 epochs, lr 1e-4 (value 1e-3), fixed beta 0.05, k1.
- --early-stop-kl stops a step's epochs early (as CleanRL); --kl-controller step moves beta by 1.5 (the PPO paper: 2).
- Log-probs are of softmax(logits / T), the distribution sampled from (N+); advantages are whitened per process.
- --lora-r: both models get adapters; the reference is the policy with its adapters off.
"""

import atexit
import contextlib
import copy
import inspect
import math
import json
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
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer,
                          DynamicCache, GenerationConfig)
from transformers import logging as hf_logging

try:
    from kernels import clipped_policy_loss, linear_token_logprobs
    from kernels.torch_ref import kl_estimate
    from rewards import DEFAULT_SPEC, make_reward
except ModuleNotFoundError as e:
    if e.name not in ("kernels", "rewards"):
        raise
    sys.exit(f"error: {e.name} not found: copy rewards.py and kernels/ from cleanrl-llm into {Path(__file__).parent}")


@dataclass
class Algorithm:
    num_generations: int = 1
    """completions sampled per prompt"""
    prompts_per_step: int = 128
    """prompts per step, over all processes"""
    max_completion_length: int = 40
    """most new tokens per completion (also in eval)"""
    temperature: float = 0.7
    """sampling temperature (of the log-probs too)"""
    reward: str = DEFAULT_SPEC
    """reward functions name:weight,... (rewards.py) or a JSON file"""
    center_scores_per_prompt: bool = False
    """subtract each prompt's mean score (Bradley-Terry rewards; --num-generations > 1)"""
    gold_reward: Optional[str] = None
    """a reward logged as rewards/gold, not trained on (what a learned --reward approximates)"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a completion without EOS"""
    beta: float = 0.05
    """weight of the per-token KL penalty in the reward (a controller's start)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator, http://joschu.net/blog/kl-approx.html"""
    kl_controller: Literal["fixed", "adaptive", "step"] = "fixed"
    """fixed, or move beta to --kl-controller-target: gradually (adaptive) or x or / 1.5 (step)"""
    kl_controller_target: float = 0.0
    """KL per completion (summed over its tokens) --kl-controller steers to"""
    kl_horizon: int = 10000
    """adaptive controller's horizon, in completions"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE's lambda (1: whole returns)"""
    whiten_advantages: bool = True
    """advantages to mean 0, std 1 over the batch's tokens"""
    whiten_rewards: bool = False
    """per-token rewards to std 1 (mean kept) before GAE"""
    num_ppo_epochs: int = 2
    """passes over each batch of rollouts"""
    num_mini_batches: int = 1
    """mini-batches per pass, one update each"""
    clip_low: float = 0.2
    """probability ratio clipped below at 1 - this"""
    clip_high: float = 0.2
    """probability ratio clipped above at 1 + this"""
    cliprange_value: float = 0.2
    """values clipped to within this of the rollout's"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    entropy_coef: float = 0.0
    """weight of the entropy bonus"""
    early_stop_kl: Optional[float] = None
    """end a step's epochs once one's mean KL to the rollout policy exceeds this (None: never)"""
    importance_sampling_cap: Optional[float] = None
    """cap on the per-token loss weight p_old / p_sampler (None: off)"""


@dataclass
class ModelData:
    model_name_or_path: str = "models/tiny-arith"
    """folder or hub id of the model and its tokenizer"""
    value_model_name_or_path: Optional[str] = None
    """folder or hub id of the value model's backbone (None: the policy's)"""
    value_model_layers: int = 0
    """keep the value model's first N decoder layers (0: all)"""
    dataset: str = "data/arith"
    """folder of <split>.jsonl files, a JSON-lines file, or a hub id"""
    dataset_split: str = "train"
    """split of training prompts"""
    eval_split: Optional[str] = "test"
    """split of prompts and answers for greedy accuracy (None: none)"""
    prompt_column: str = "prompt"
    """prompt column: text, or chat messages (--use-chat-template)"""
    answer_column: str = "answer"
    """reference answer column (rewards' `answer`)"""
    use_chat_template: bool = False
    """wrap prompts in the tokenizer's chat template"""
    max_prompt_length: int = 256
    """longer prompts keep their last tokens"""
    eval_limit: int = 500
    """at most this many eval examples"""
    lora_r: int = 0
    """LoRA rank on each linear layer of both models (0: off)"""
    lora_alpha: float = 32.0
    """LoRA scale: the update is x alpha / r"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""


@dataclass
class Optimisation:
    learning_rate: float = 1e-4
    """peak learning rate of the policy"""
    value_learning_rate: float = 1e-3
    """peak learning rate of the value model"""
    total_steps: int = 300
    """training steps (rollout batches); may change on --resume"""
    pause_at_step: int = 0
    """stop after this step with a checkpoint, as Ctrl-C does (0: never)"""
    micro_batch_size: int = 0
    """completions per forward/backward (0: largest divisor of the mini-batch <= 128)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: cosine or linear decay to 0, or constant"""
    warmup_steps: int = 30
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm, per model"""


@dataclass
class Logging:
    log_every: int = 1
    """steps per row of metrics.jsonl"""
    eval_every: int = 50
    """steps per evaluation (0: first and last)"""
    save_every: int = 0
    """steps between checkpoints (0: at the end or a stop)"""
    save_every_minutes: float = 30.0
    """also save every this many minutes (0: off)"""
    resume: Optional[str] = None
    """runs/<run>/checkpoints/step_N to continue"""
    num_sample_completions: int = 8
    """completions per log step in the --track table"""
    output_dir: str = "runs"
    """parent of run directories"""
    run_dir: Optional[str] = None
    """a new run directory (None: one in --output-dir)"""


@dataclass
class Engineering:
    device: str = "auto"
    """cuda, cpu, or auto (cuda if available)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights dtype; auto: float32, bfloat16 autocast on CUDA"""
    generation_backend: Literal["auto", "shared", "static", "copy"] = "auto"
    """shared: one prefill per prompt; static: a static KV cache; copy: static on a bfloat16 copy; auto: on CUDA
    copy (static at --dtype bfloat16), else shared"""
    gradient_checkpointing: bool = False
    """recompute activations in backward"""
    fsdp: bool = False
    """under torchrun, shard weights, gradients, AdamW states (FSDP2), not DDP"""
    exp_name: str = "ppo"
    """part of the run directory's name"""
    seed: int = 1
    """seed of the RNGs and data order"""
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


def masked_mean(x, mask):
    """Mean of x where mask is 1. x, mask: [B, T] -> scalar."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(x, mask, shift_mean: bool = True):
    """(x - mean) / std over the real entries, unbiased (as TRL); shift_mean=False adds the mean back. x, mask: [B,
    T] -> [B, T], 0 on padding."""
    mean, n = masked_mean(x, mask), mask.sum()
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1).clamp(min=1.0)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return (whitened if shift_mean else whitened + mean) * mask


def per_token_rewards(scores, kl, mask, kl_coef: float):
    """-kl_coef KL_t at each real token, plus the score at the last (Eq. 2 of arXiv:2203.02155 per token, as N+).
    scores: [B]; kl, mask: [B, T] -> [B, T], 0 on padding."""
    rewards = -kl_coef * kl * mask
    lengths = mask.sum(dim=1).long()
    rewards[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] += scores * (lengths > 0)
    return rewards


def gae(rewards, values, mask, gamma: float, lam: float):
    """Eq. 16 of arXiv:1506.02438, V = A = 0 after the last real token; R_t = A_t + V_t.
    All [B, T] -> (advantages, returns)."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t]
        advantages[:, t] = next_advantage
    return advantages, (advantages + values) * mask


def value_loss(values, old_values, returns, mask, cliprange_value: float):
    """PPO2's clipped value loss (kept by N+), 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2), token mean.
    All [B, T] -> (loss, share of tokens the clipped term won)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    return loss, masked_mean((clipped_loss > unclipped_loss).float(), mask)


@dataclass
class KLController:
    """KL coefficient beta, updated each step from the batch's KL over n completions:
    adaptive (Sec. 2.2 of arXiv:1909.08593): beta *= 1 + clip(KL / target - 1, +-0.2) n / horizon.
    step (Sec. 4 of arXiv:1707.06347, 1.5 for its 2): beta x 1.5 above 1.5 target, / 1.5 below target / 1.5."""
    kind: str
    value: float
    target: float = 0.0
    horizon: int = 10000

    def update(self, kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        elif self.kind == "step" and kl > 1.5 * self.target:
            self.value *= 1.5
        elif self.kind == "step" and kl < self.target / 1.5:
            self.value /= 1.5


def explained_variance(values, returns, mask) -> float:
    """1 - Var(R - V) / Var(R) over real tokens (nan for a constant R). All [B, T] -> float."""
    def variance(x):
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    var_returns = variance(returns)
    return float(1.0 - variance(returns - values) / var_returns) if var_returns > 0 else float("nan")


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_ids: [B, T]; eos_ids: [K] -> (mask [B, T] float32: tokens up to the first EOS included, truncated
    [B] bool: no EOS)."""
    is_eos = torch.isin(completion_ids, eos_ids)
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()
    return (eos_before == 0).float(), ~is_eos.any(dim=1)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                        temperature: float, with_entropy: bool = False):
    """input_ids, attention_mask: [B, Tp + Tc], prompts left-padded to Tp -> log-probs [B, Tc] float32 (, entropy
    [B, Tc]), never the full logits; positions count real tokens, as in generate."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    out = linear_token_logprobs(hidden[:, prompt_width - 1 : -1], targets=input_ids[:, prompt_width:],
                                temperature=temperature, with_entropy=with_entropy, **lm_head(model, hidden.dtype))
    return tuple(x.clone() for x in out) if with_entropy else out.clone()  # not views: FSDP2 hooks the outputs


class PolicyAndValueModel(torch.nn.Module):
    """Policy and value model as one module (DDP, FSDP2), saved as the policy's folder + value_model/."""

    def __init__(self, policy, value_model, tokenizer):
        super().__init__()
        self.policy, self.value_model, self.tokenizer = policy, value_model, tokenizer

    def forward(self, input_ids, attention_mask, prompt_width: int, temperature: float):
        """As completion_logprobs -> (logp, entropy, values) [B, Tc]; V_t is read where token t is predicted."""
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        scores = self.value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False).logits
        logp, entropy = completion_logprobs(self.policy, input_ids, attention_mask, prompt_width, temperature, True)
        return logp, entropy, scores[:, prompt_width - 1 : -1, 0].to(torch.float32, copy=True)  # not a view (FSDP2)

    def save_pretrained(self, path: Path, state_dict: Optional[dict] = None, **kwargs) -> None:
        """state_dict: both models' gathered weights (--fsdp), or None."""
        for name, folder in (("policy", path), ("value_model", path / "value_model")):
            part = {k[len(name) + 1:]: v for k, v in (state_dict or {}).items() if k.startswith(name + ".")}
            getattr(self, name).save_pretrained(folder, state_dict=part or None, **kwargs)
        self.tokenizer.save_pretrained(path / "value_model")


def load_value_model(name: str, dtype: torch.dtype, layers: int = 0):
    """`name`'s backbone with a scalar head (a one-label token classifier), zero unless `name` has one (V = 0 at the
    start); layers > 0 keeps the first `layers` decoder blocks."""
    has_head = any(a.endswith("ForTokenClassification") for a in AutoConfig.from_pretrained(name).architectures or [])
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the head is set below: no "newly initialized" report
    model = AutoModelForTokenClassification.from_pretrained(name, num_labels=1, dtype=dtype)
    hf_logging.set_verbosity(verbosity)
    if not has_head:
        for p in (getattr(model, "score", None) or model.classifier).parameters():
            torch.nn.init.zeros_(p)
    if layers:  # the decoder blocks: the longest ModuleList
        del max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)[layers:]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model


def length_sorted_micro_batches(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, size: int):
    """prompt_mask: [B, Tp] (left-padded), completion_mask: [B, Tc] -> `size` rows at a time, longest first: [(rows,
    first prompt-token column, completion width)]."""
    lengths = completion_mask.sum(dim=1)
    out = []
    for rows in torch.argsort(lengths, descending=True, stable=True).split(size):
        out.append((rows, int(prompt_mask[rows].any(dim=0).float().argmax()), int(lengths[rows].max())))
    return out


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


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, T] left-padded with pad_id, attention mask [B, T])."""
    ids = [torch.tensor(r, dtype=torch.long) for r in rows]
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad(ids, batch_first=True, padding_value=pad_id, padding_side="left"),
            pad([torch.ones_like(r) for r in ids], batch_first=True, padding_side="left"))


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


def rl_prompts(args, tokenizer, split, columns: dict) -> dict:
    """Prompts tokenised once (their last --max-prompt-length tokens), the reward's inputs (the prompts, `columns`:
    {name: column}) -> {"ids", "texts", "columns"}."""
    prompts = list(split[args.prompt_column])
    texts = prompt_texts(tokenizer, prompts, args.use_chat_template, args.prompt_column)
    ids = [p[-args.max_prompt_length:] for p in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if [] in ids:
        raise ValueError(f"split '{args.dataset_split}' has an empty prompt (row {ids.index([])}): remove it")
    return dict(ids=ids, texts=texts, columns={"prompts": prompts, **{n: list(split[c]) for n, c in columns.items()}})


def eval_prompts_and_answers(args, tokenizer) -> tuple[list, list]:
    """--eval-split's first --eval-limit prompts (as text) and answers ([], [] without one)."""
    if not args.eval_split:
        return [], []
    ev = load_split(args, "eval_split", [args.prompt_column, args.answer_column],
                    "--prompt-column/--answer-column")[: args.eval_limit]  # {column: values}
    prompts = prompt_texts(tokenizer, ev[args.prompt_column], args.use_chat_template, args.prompt_column)
    return prompts, ev[args.answer_column]


class DataOrder:
    """Prompt indices in seeded random epochs, drawn on across steps and resumes."""

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
def ppo_rollout(model, tokenizer, data: dict, rows: list, gen_config, backend, eos_ids, reward, autocast, timing):
    """Step 1 for the prompts `rows` of rl_prompts' data: sample and score."""
    ids, mask = (t.to(model.device) for t in left_pad([data["ids"][i] for i in rows], tokenizer.pad_token_id))
    t0 = time.perf_counter()
    with autocast:
        completion_ids, sampler_logp = sample(sampler_copy(model) if backend == "copy" else model, ids, mask,
                                              gen_config, backend)
    t1 = time.perf_counter()
    c_mask, truncated = completion_mask(completion_ids, torch.tensor(eos_ids, device=ids.device))
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    inputs = {name: [v[i] for i in rows] for name, v in data["columns"].items()}
    trace = reward.trace(completions, **inputs,
                         completion_ids=[c[: int(m.sum())] for c, m in zip(completion_ids.tolist(), c_mask)])
    timing["generate"] += t1 - t0
    timing["score"] += time.perf_counter() - t1
    return dict(prompt_ids=ids, prompt_mask=mask, completion_ids=completion_ids, completion_mask=c_mask,
                sampler_logp=sampler_logp, truncated=truncated,
                rewards={k: torch.tensor(v, dtype=torch.float32) for k, v in trace.items()},
                prompts=[data["texts"][i] for i in rows], completions=completions, reward_inputs=inputs)


def truncated_is_weights(old_logp, sampler_logp, mask, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] each -> (min(pi_old / pi_sampler, cap) per token, 1 on padding; capped [B, T] bool): the sampler drew
    the tokens, the loss expects pi_old's."""
    ratio = torch.exp((old_logp - sampler_logp) * mask)
    return ratio.clamp(max=cap), (ratio > cap) & (mask > 0)


def ppo_reference_logprobs(ref_model, model, inputs: tuple, temperature: float):
    """pi_ref's log-probs: the frozen copy's, or with LoRA the policy's, adapters off."""
    if ref_model is not None:
        return ref_model(*inputs, temperature)
    with model.disable_adapter():
        return completion_logprobs(model, *inputs, temperature)


def ppo_micro_batches(batch: dict, rows, size: int) -> list:
    """`rows` in length-sorted micro-batches cut to their widest prompt and completion -> [(rows, (input_ids,
    attention_mask, prompt_width), completion width)]."""
    width, out = batch["prompt_ids"].shape[1], []
    for i, first, end in length_sorted_micro_batches(batch["prompt_mask"][rows], batch["completion_mask"][rows], size):
        r = rows[i]
        out.append((r, (batch["ids"][r, first : width + end], batch["attention"][r, first : width + end],
                        width - first), end))
    return out


@torch.no_grad()
def old_logprobs_and_values(actor_critic, ref_model, batch: dict, micro: int, args, autocast, run) -> dict:
    """The batch plus "ids", "attention", pi_old's "old_logp", (beta > 0) pi_ref's "ref_logp", V_old "old_values",
    "sampler_gap" (TIS: "tis", "tis_capped")."""
    mask = batch["completion_mask"]
    batch = {**batch, "ids": torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
             "attention": torch.cat([batch["prompt_mask"], mask.long()], dim=1)}
    old_logp, ref_logp, old_values = (torch.zeros_like(mask) for _ in range(3))
    with autocast:
        for r, inputs, end in ppo_micro_batches(batch, torch.arange(len(mask), device=mask.device), micro):
            old_logp[r, :end], _, old_values[r, :end] = actor_critic(*inputs, args.temperature)
            if args.beta > 0:
                ref_logp[r, :end] = ppo_reference_logprobs(ref_model, actor_critic.policy, inputs, args.temperature)
    gap = sampler_gap(run, ((old_logp - batch["sampler_logp"]).abs() * mask).sum(), mask.sum())
    batch.update(old_logp=old_logp, ref_logp=ref_logp, old_values=old_values, sampler_gap=gap)
    if args.importance_sampling_cap is not None:
        batch["tis"], batch["tis_capped"] = truncated_is_weights(old_logp, batch["sampler_logp"], mask,
                                                                 args.importance_sampling_cap)
    return batch


def compute_advantages(batch: dict, kl_coef: float, args) -> dict:
    """Steps 2-3: scores (less --missing-eos-penalty without EOS), per-token rewards, GAE, whitening -> {"scores"
    [B], "kl", "advantages", "returns"}."""
    mask = batch["completion_mask"]
    scores = batch["rewards"]["total"].to(mask.device) - args.missing_eos_penalty * batch["truncated"].float()
    kl = kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask if args.beta > 0 else 0 * mask
    rewards = per_token_rewards(scores, kl, mask, kl_coef)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, batch["old_values"], mask, args.gamma, args.lam)
    if args.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return dict(scores=scores, kl=kl, advantages=advantages, returns=returns)


PPO_STATS = ("policy_loss", "value_loss", "clip_frac", "value_clip_frac", "approx_kl", "entropy")


def ppo_update(actor_critic, optimizer, batch: dict, micro: int, args, autocast) -> dict:
    """Step 4: --num-ppo-epochs passes over --num-mini-batches shuffled mini-batches, an update each on the token
    means of clipped policy loss (x TIS weights), value loss, entropy bonus (Eq. 7, 9 of arXiv:1707.06347) -> sums."""
    mask, ddp = batch["completion_mask"], isinstance(actor_critic, torch.nn.parallel.DistributedDataParallel)
    sums = dict.fromkeys((*PPO_STATS, "tokens"), 0.0)
    for epoch in range(args.num_ppo_epochs):
        epoch_kl = torch.zeros(2, device=mask.device)  # approximate-KL token sum, tokens
        for rows in torch.randperm(len(mask)).to(mask.device).split(len(mask) // args.num_mini_batches):
            chunks = ppo_micro_batches(batch, rows, micro)
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
                    loss = pg_loss + args.vf_coef * vf_loss - args.entropy_coef * ent
                    (loss * m.sum() / mask[rows].sum()).backward()  # its share of the mini-batch's token mean
                approx_kl = masked_mean(kl_estimate(old_logp, logp.detach(), "k3"), m)  # of KL(pi_old || pi)
                tokens = float(m.sum())
                for name, x in zip(PPO_STATS, (pg_loss, vf_loss, masked_mean(clipped, m), vf_clipped, approx_kl, ent)):
                    sums[name] += x.item() * tokens
                sums["tokens"] += tokens
                epoch_kl += torch.stack([approx_kl * tokens, m.sum()])
            norms = [torch.nn.utils.clip_grad_norm_(g["params"], args.max_grad_norm) for g in optimizer.param_groups]
            optimizer.step()
            optimizer.zero_grad()
        if args.early_stop_kl is not None:  # the same KL on every process: all stop together
            if dist.is_initialized():
                dist.all_reduce(epoch_kl)
            if float(epoch_kl[0] / epoch_kl[1]) > args.early_stop_kl:
                break
    return {**sums, "grad_norm": float(norms[0]), "value_grad_norm": float(norms[1]), "ppo_epochs": epoch + 1}


def ppo_metrics(run, batch: dict, stats: dict, kl_coef: float, batch_kl: float, args) -> dict:
    """The step's metrics over all processes."""
    mask = batch["completion_mask"]
    local = {**{k: stats[k] for k in (*PPO_STATS, "tokens")}, "length": mask.sum(), "n": len(mask),
             "truncated": batch["truncated"].sum(), "capped": batch["tis_capped"].sum() if "tis" in batch else 0,
             "explained_variance": explained_variance(batch["old_values"], batch["returns"], mask) / run.world}
    totals = run.gather(torch.tensor([[float(v) for v in local.values()]], device=mask.device)).sum(0)
    sums = dict(zip(local, totals.tolist()))
    means = {f"train/{k}": sums[k] / max(sums["tokens"], 1) for k in PPO_STATS}
    loss = means["train/policy_loss"] + args.vf_coef * means["train/value_loss"]
    rewards = {f"rewards/{k}": float(run.gather(v.to(mask.device)).mean()) for k, v in batch["rewards"].items()}
    return {"train/loss": loss - args.entropy_coef * means["train/entropy"],
            "train/reward": rewards.pop("rewards/total"), **rewards,
            "train/score": float(run.gather(batch["scores"]).mean()), "train/kl": batch_kl, "train/kl_coef": kl_coef,
            "train/non_score_reward": -kl_coef * batch_kl, **means,
            "train/explained_variance": sums["explained_variance"],
            "train/value_mean": float(masked_mean(batch["old_values"], mask)),
            **{f"train/{k}": stats[k] for k in ("grad_norm", "value_grad_norm", "ppo_epochs")},
            "train/completion_length": sums["length"] / sums["n"],
            "train/truncated_frac": sums["truncated"] / sums["n"],
            "train/tis_capped_frac": sums["capped"] / max(sums["length"], 1), "train/sampler_gap": batch["sampler_gap"]}


def perf_metrics(timing: dict, tokens: int, steps: int) -> dict:
    """Seconds per step of each phase since the last log row; tokens per second."""
    per_step = {f"perf/{k}_s": v / steps for k, v in timing.items()}
    return {"perf/tokens_per_s": tokens / max(timing["step"], 1e-9), **per_step}


def sample_table(step: int, batch: dict, n: int) -> tuple[str, list, list]:
    """The --track table of the batch's first n completions."""
    rows = zip(batch["prompts"][:n], batch["completions"][:n], batch["rewards"]["total"][:n], batch["scores"][:n])
    return "train/samples", ["step", "prompt", "completion", "reward", "score"], [
        [step, p, c, float(r), float(s)] for p, c, r, s in rows]


def load_policy_and_value_model(args, device, tokenizer):
    """The policy and value model (dropout off, LoRA on both), the frozen reference (None with LoRA or beta = 0) ->
    (model, value model, reference, EOS ids)."""
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype).to(device)
    value_model = load_value_model(args.value_model_name_or_path or args.model_name_or_path, dtype,
                                   args.value_model_layers).to(device)
    for m in [*model.modules(), *value_model.modules()]:
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eos_ids = own_generation_config(model, tokenizer)
    if args.gradient_checkpointing:
        for m in (model, value_model):
            m.gradient_checkpointing_enable()
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        lora = dict(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                    target_modules="all-linear")
        model = get_peft_model(model, LoraConfig(**lora, task_type="CAUSAL_LM"))
        value_model = get_peft_model(value_model, LoraConfig(**lora, task_type="TOKEN_CLS",  # TOKEN_CLS saves the head
                                                             exclude_modules=["score", "classifier"]))
        return model, value_model, None, eos_ids
    ref_model = Forward(completion_logprobs, copy.deepcopy(model)).eval().requires_grad_(False) if args.beta else None
    return model, value_model, ref_model, eos_ids


def restore_value_model(value_model, args, run) -> None:
    """--resume: the value model from value_model/ (LoRA adapters or weights; --fsdp: the shards)."""
    path = Path(args.resume) / "value_model"
    if args.lora_r:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(value_model, load_file(path / "adapter_model.safetensors", device=str(run.device)))
    elif not run.fsdp:
        value_model.load_state_dict(load_value_model(str(path), value_model.dtype).state_dict())


def main(args: Args) -> dict:
    # 0. Check every input first (--resume: the run's own arguments); processes and seeds.
    args, overrides = resume_args(args, RESUME_MAY_CHANGE)
    micro = check_args(args)
    reward = make_reward(args.reward)
    gold = make_reward(args.gold_reward) if args.gold_reward else None
    run = Run(args, overrides, ("train/reward", "eval/accuracy") + ("train/kl",) * (args.beta > 0))
    device, world, G = run.device, run.world, args.num_generations

    # 1. Data: prompts tokenised once, the rewards' columns, the eval split; all fit the context.
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    needed = reward.required_columns | (gold.required_columns if gold else set())
    columns = {c: args.answer_column if c == "answer" else c for c in sorted(needed)}
    train = load_split(args, "dataset_split", [args.prompt_column, *columns.values()],
                       "--prompt-column/--answer-column, or a --reward/--gold-reward that does not need them")
    data = rl_prompts(args, tokenizer, train, columns)
    eval_prompts, eval_answers = eval_prompts_and_answers(args, tokenizer)
    eval_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in eval_prompts]
    for name, ids in ((args.model_name_or_path, data["ids"] + eval_ids), (args.value_model_name_or_path, data["ids"])):
        if name:  # None: the policy's
            check_context(AutoConfig.from_pretrained(name), ids, args.max_completion_length, "--max-completion-length")

    # 2. Models: policy and value model, one module for DDP / FSDP2; the frozen reference.
    model, value_model, ref_model, eos_ids = load_policy_and_value_model(args, device, tokenizer)
    check_bf16_updates(run, model, args.learning_rate)
    raw_actor_critic = actor_critic = PolicyAndValueModel(model, value_model, tokenizer)
    if run.fsdp:
        actor_critic = run.shard(actor_critic, decoder_layers(model) + decoder_layers(value_model))
        ref_model = ref_model and run.shard(ref_model, decoder_layers(ref_model))
    elif run.ddp:
        actor_critic = torch.nn.parallel.DistributedDataParallel(actor_critic)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")
    gen_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, eos_token_id=eos_ids,
                                  max_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id)

    # 3. Optimiser (a group per model), schedule, KL controller, data order; --resume restores them.
    param_groups = [{"params": [p for p in m.parameters() if p.requires_grad], "lr": lr}
                    for m, lr in ((model, args.learning_rate), (value_model, args.value_learning_rate))]
    optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    run.trained = (actor_critic, optimizer)  # what --fsdp checkpoints in shards
    lr_anchor = None  # set by a resume changing --total-steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    kl_ctl = KLController(args.kl_controller, args.beta, args.kl_controller_target, args.kl_horizon)
    order = DataOrder(len(data["ids"]), args.seed * 1000 + run.rank)
    state = run.restore(model, optimizer, scheduler)
    if state:
        restore_value_model(value_model, args, run)
        if "reward" not in overrides:  # a new --reward (retrained on this policy) starts afresh
            reward.load_state_dict(state["reward"])
        kl_ctl.value = state["kl_coef"]
        order.load(state)
        lr_anchor = state["lr_anchor"]
        if "total_steps" in overrides:  # decay from here to the new last step
            lr_anchor = (run.start, lr_factor(run.start, args.warmup_steps, overrides["total_steps"][0],
                                              args.lr_schedule, lr_anchor))

    def measure() -> tuple[dict, list]:
        if not eval_prompts:
            return {}, []
        acc, samples = greedy_accuracy(model, tokenizer, eval_prompts, eval_answers, args.max_completion_length,
                                       eos_ids, progress=run.progress)
        return {"eval/accuracy": acc}, samples

    def save() -> Path:
        return run.checkpoint(raw_actor_critic, tokenizer, {
            "optimizer": None if run.fsdp else optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "reward": reward.state_dict(), "kl_coef": kl_ctl.value, "lr_anchor": lr_anchor},
            per_rank=order.state())

    # 4. Train.
    sizes = " + ".join(f"{sum(p.numel() for p in g['params']) / 1e6:.2f}M" for g in param_groups)
    run.say(f"run directory: {run.dir}  |  {len(data['ids'])} training prompts, {len(eval_prompts)} eval prompts, "
            f"{sizes} trainable parameters (policy + value) on {device}")
    final, tokens, last_log = {}, 0, run.start
    timing = dict.fromkeys(("step", "generate", "score", "train"), 0.0)  # since the last log row
    with run:
        for step in run.steps(measure, save):
            t_step = time.perf_counter()
            run.stop = run.stop or step == args.pause_at_step  # (checked after the step)
            # 4a. Roll out G completions per prompt from pi_old, score them (Sec. 2 of arXiv:1909.08593).
            with run.whole():  # --fsdp: whole weights while sampling
                rows = [i for i in order.draw(args.prompts_per_step // world) for _ in range(G)]
                batch = ppo_rollout(model, tokenizer, data, rows, gen_config, generation_backend(args, device), eos_ids,
                                    reward, autocast, timing)
            if args.center_scores_per_prompt:  # less the prompt's mean score; rewards/<name> stay raw
                total = batch["rewards"]["total"]
                batch["rewards"]["total"] = total - total.view(-1, G).mean(1).repeat_interleave(G)
            if gold is not None:  # logged, never in the loss
                batch["rewards"]["gold"] = torch.tensor(gold(batch["completions"], **batch["reward_inputs"]))
            t_train = time.perf_counter()
            # 4b. pi_old's and pi_ref's log-probs, V_old (no gradients); the sampler's gap to pi_old.
            batch = old_logprobs_and_values(raw_actor_critic, ref_model, batch, micro, args, autocast, run)
            # 4c. Per-token rewards -beta KL_t + [t = last] s, GAE, whitened advantages.
            kl_coef = kl_ctl.value
            batch.update(compute_advantages(batch, kl_coef, args))
            # 4d. PPO epochs over shuffled mini-batches: clipped policy and value losses, entropy bonus.
            stats = ppo_update(actor_critic, optimizer, batch, micro, args, autocast)
            lr = scheduler.get_last_lr()[0]  # this step's rate (logged below)
            scheduler.step()
            # 4e. Adapt beta to the batch's KL (per completion, summed over its tokens).
            batch_kl = float(run.gather(batch["kl"].sum(dim=1)).mean())
            kl_ctl.update(batch_kl, args.prompts_per_step * G)
            timing["train"] += time.perf_counter() - t_train
            timing["step"] += time.perf_counter() - t_step
            tokens += int(batch["attention"].sum()) * world

            # 4f. Log.
            if step % args.log_every == 0 or step == args.total_steps:
                final = {"step": step, **ppo_metrics(run, batch, stats, kl_coef, batch_kl, args), "train/lr": lr,
                         **perf_metrics(timing, tokens, step - last_log)}
                run.log(final, sample_table(step, batch, args.num_sample_completions))
                warn_if_nothing_learns(run, final, float(batch["rewards"]["total"].std()) == 0)
                tokens, last_log, timing = 0, step, dict.fromkeys(timing, 0.0)

    # 5. Final evaluation, a checkpoint, the trained models (LoRA merged) in final/.
    merged = (lambda: PolicyAndValueModel(*(copy.deepcopy(m).merge_and_unload() for m in (model, value_model)),
                                          tokenizer)) if args.lora_r else raw_actor_critic
    return run.finish(final, measure, save, merged, tokenizer)


RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "save_every_minutes", "eval_limit",
                     "num_sample_completions", "track", "wandb_project_name", "wandb_entity", "device", "reward",
                     "pause_at_step")


def check_args(args: Args) -> int:
    """Checks needing no model or data -> the micro-batch each process uses."""
    value_name = args.value_model_name_or_path or args.model_name_or_path
    check_common(args, ("total_steps", "prompts_per_step", "num_generations", "max_completion_length",
                        "max_prompt_length", "log_every", "num_ppo_epochs", "num_mini_batches", "kl_horizon",
                        "learning_rate", "value_learning_rate", "temperature", "eval_limit"),
                 ("eval_every", "save_every", "warmup_steps", "lora_r", "num_sample_completions",
                  "micro_batch_size", "beta", "clip_high", "cliprange_value", "vf_coef", "entropy_coef",
                  "value_model_layers", "pause_at_step"),
                 dict.fromkeys((args.model_name_or_path, value_name)))  # each once, in order
    blocks = AutoConfig.from_pretrained(value_name).num_hidden_layers
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_process = args.prompts_per_step // world * args.num_generations
    works = max(d for d in range(1, args.num_mini_batches + 1) if per_process % d == 0)
    if args.pause_at_step >= args.total_steps and not args.resume:  # a shortened run pauses halfway
        args.notes.append(f"--pause-at-step {args.pause_at_step} >= --total-steps: pausing at {args.total_steps // 2}")
        args.pause_at_step = args.total_steps // 2
    for bad, message in (
            (args.value_model_layers > blocks, f"--value-model-layers: use 0 (all) to {blocks}, its decoder layers"),
            (args.center_scores_per_prompt and args.num_generations < 2,
             "--center-scores-per-prompt needs several completions of a prompt: --num-generations 2 or more"),
            (args.prompts_per_step % world, f"--prompts-per-step must be a multiple of the {world} processes"),
            (per_process % args.num_mini_batches, f"--num-mini-batches must divide each process's {per_process} "
                                                  f"completions: use --num-mini-batches {works}"),
            (args.kl_controller != "fixed" and not (args.kl_controller_target > 0 and args.beta > 0),
             f"--kl-controller {args.kl_controller} needs a positive --kl-controller-target (e.g. 1.0) and --beta"),
            (not (0 <= args.clip_low <= 1 and 0 <= args.gamma <= 1 and 0 <= args.lam <= 1),
             "need 0 <= --clip-low, --gamma, --lam <= 1"),
            (args.importance_sampling_cap is not None and args.importance_sampling_cap < 1,
             "--importance-sampling-cap must be >= 1 (or None: off)"),
            (args.early_stop_kl is not None and args.early_stop_kl <= 0,
             "--early-stop-kl must be positive (or None: never)")):
        if bad:
            raise ValueError(message)
    return fit_micro_batch(args.micro_batch_size, per_process // args.num_mini_batches, "each mini-batch")

# ---- plumbing: one text per name in all scripts


def warn_if_nothing_learns(run, row: dict, alike: bool):
    """Once, if the first 3 logged steps each scored all completions `alike` or had no gradient."""
    run.flat = [*getattr(run, "flat", []), alike or row["train/grad_norm"] == 0]
    if run.flat == [True] * 3:
        parts = ", ".join(f"{k[8:]} {v:.3g}" for k, v in row.items() if k.startswith("rewards/"))
        run.say(f"warning: nothing can be learned: the first 3 steps scored their completions alike (train/reward "
                f"{row['train/reward']:.3g}: {parts}) or had no gradient; try an SFT start, partial credit, more "
                "--num-generations")


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


class SampledLogprobs:
    """A logits processor: each sampled token's log-prob, scores[token] / T - logsumexp(scores / T)."""

    def __init__(self, temperature: float):
        self.temperature, self.scores, self.lse, self.logp = temperature, None, None, []

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.scores.gather(1, tokens).float() / self.temperature - self.lse

    def __call__(self, input_ids, scores):
        if self.scores is not None:
            self.logp.append(self.read(input_ids[:, -1:]))
        self.scores, self.lse = scores, torch.logsumexp(scores.float() / self.temperature, dim=-1, keepdim=True)
        return scores


def sample(model, ids, mask, gen_config, backend: str = "shared", **extra) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts -> completions [B, Tc] (padded after EOS), their sampled log-probs. shared: equal rows
    prefilled once; else a static KV cache."""
    training = model.training
    model.eval()  # (training mode: gradient checkpointing, no KV cache)
    seen, precision = SampledLogprobs(gen_config.temperature), contextlib.nullcontext()
    if backend != "shared":  # a static cache holds one dtype; bf16 autocast makes keys float32 (RoPE), values bf16
        gen_config = type(gen_config).from_dict({**gen_config.to_dict(), "cache_implementation": "static"})
        precision = torch.autocast(ids.device.type, enabled=False)
    try:
        rows, counts = torch.unique_consecutive(torch.cat([ids, mask], dim=1), dim=0, return_counts=True)
        if backend == "shared" and len(rows) < len(ids) and ids.shape[1] > 1:  # all but the last token, once a group
            unique_ids, unique_mask = rows.split(ids.shape[1], dim=1)
            cache = DynamicCache(config=model.config)
            model(input_ids=unique_ids[:, :-1], attention_mask=unique_mask[:, :-1], past_key_values=cache,
                  position_ids=(unique_mask.cumsum(1) - 1).clamp(min=0)[:, :-1])  # generate's, for left padding
            cache.batch_repeat_interleave(counts)
            extra["past_key_values"] = cache
        with precision:  # (--fsdp: whole weights, no lockstep)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                 logits_processor=[seen], synced_gpus=False, **extra)
    finally:
        model.train(training)
    completion_ids = out[:, ids.shape[1]:]
    return completion_ids, torch.cat([*seen.logp, seen.read(completion_ids[:, -1:])], dim=1)


@torch.no_grad()
@torch.autocast("cuda", enabled=False)  # LoRA's B A in float32
def sampler_copy(model):
    """The model's bfloat16 copy (made once), its weights written over in place (CUDA graphs stay valid), LoRA
    merged; --fsdp: inside Run.whole."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    if "bf16_copy" not in vars(base):  # a function: not in parameters(), state_dict(), deepcopy (LoRA merge)
        cuda = [base.device] if base.device.type == "cuda" else []
        with torch.random.fork_rng(cuda), torch.device(base.device):  # leaves the run's RNG alone
            sampler = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=torch.bfloat16)
        vars(base)["bf16_copy"] = lambda: sampler
    sampler, weights = base.bf16_copy(), dict(base.named_parameters())
    lora = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A")}  # peft's LoRA layers
    for name, p in sampler.named_parameters():
        owner, _, leaf = name.rpartition(".")
        m = lora.get(owner)
        if m is None:
            p.copy_(weights[name])
        else:
            delta = m.get_delta_weight(m.active_adapters[0]) if leaf == "weight" else 0
            p.copy_(weights[f"{owner}.base_layer.{leaf}"] + delta)
    return sampler


def generation_backend(args, device) -> str:
    if args.generation_backend != "auto":
        return args.generation_backend
    return {"auto": "copy", "bfloat16": "static"}.get(args.dtype, "shared") if device.type == "cuda" else "shared"


def check_bf16_updates(run, model, lr: float) -> None:
    """Warn if most bfloat16 weights w would not move by an AdamW step (about lr): w + lr rounds back to w."""
    w = [p.detach() for p in model.parameters() if p.requires_grad and p.dtype == torch.bfloat16]
    lost = sum(int(((p.float() + lr).to(p.dtype) == p).sum()) for p in w) / max(1, sum(p.numel() for p in w))
    if lost > 0.5:
        run.say(f"warning: --dtype bfloat16 at --learning-rate {lr:g} leaves {lost:.0%} of the weights unchanged by an "
                "update: use --dtype auto")


class Forward(torch.nn.Module):
    """fn(module, *args) as a module's forward (DDP and FSDP2 act around forward)."""

    def __init__(self, fn: Callable, module):
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def sampler_gap(run, gap_sum, tokens) -> float:
    """The mean |sampler - trainer| log-prob of the completion tokens: on the first batch, float rounding at most."""
    a = run.args
    exact = generation_backend(a, run.device) != "copy" and a.dtype != "bfloat16" and (
        run.device.type != "cuda" or a.dtype == "float32")
    total = run.gather(torch.tensor([[float(gap_sum), float(tokens)]], device=run.device)).sum(0)
    gap = float(total[0] / total[1].clamp(min=1))
    tolerance = 1e-3 if exact else 0.25
    if not getattr(run, "sampler_checked", False) and gap > tolerance:
        raise ValueError(f"the sampler and the trainer disagree: mean |log-prob gap| {gap:.3g} on the first batch "
                         f"> {tolerance}: generate does not sample softmax(logits / --temperature)")
    run.sampler_checked = True
    return gap


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
