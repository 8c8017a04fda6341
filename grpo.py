"""GRPO (DeepSeekMath, arXiv:2402.03300, Sec. 4) and its variants: Dr.GRPO, DAPO, BNPO, GSPO, CISPO, RLOO's baseline.

Sample G completions per prompt, score them, give each token of completion i the advantage A_i = (r_i - mean(r)) /
std(r) over its group (Sec. 4.1.2), maximise the clipped surrogate minus beta KL to a frozen reference (Eq. 3, 4).
Variants (equations: `policy_loss`): Dr.GRPO (arXiv:2503.20783) `--scale-rewards none --loss-type dr_grpo`; DAPO
(arXiv:2503.14476) `--clip-high 0.28 --dynamic-sampling --mask-truncated-completions --loss-type dapo`; GSPO
(arXiv:2507.18071) `--importance-sampling-level sequence`; CISPO (arXiv:2506.13585) `--loss-type cispo`; RLOO
`--baseline rloo`; high-entropy tokens only (arXiv:2506.01939) `--top-entropy-quantile 0.2`. Tool calls `--tools
calculator`: the model writes <calculator>2*21</calculator>, the result joins the context, no loss term sees it.

    python grpo.py  # models/tiny-arith on data/arith, CPU
    python grpo.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --use-chat-template --dataset my/hub-dataset \
        --max-completion-length 512 --micro-batch-size 8 --learning-rate 1e-6 --lora-r 16
    torchrun --nproc-per-node 2 grpo.py  # data parallel

Deviations (why, measurements: docs/grpo.md):
- Defaults fit the embedded 0.9M-parameter model: `--scale-rewards none`, mu = 2, beta = 0.
- At beta = 0 (not under --fsdp) zero-advantage completions skip the forward and backward pass.
- Log-probs are of softmax(logits / T), the distribution sampled from; dropout is off.
- std is the unbiased one + 1e-4; over-long prompts keep their last tokens (both as TRL).
- Under torchrun each process draws its own prompts; rewards are gathered for batch statistics.
"""

import ast
import atexit
import contextlib
import copy
import importlib.util
import inspect
import math
import json
import operator
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, make_dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro
from datasets import Dataset, load_dataset
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig
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
    num_generations: int = 8
    """completions per prompt"""
    prompts_per_step: int = 64
    """prompts per step over all processes"""
    max_completion_length: int = 40
    """most new tokens per completion (also in eval)"""
    temperature: float = 0.7
    """sampling temperature (of the log-probs too)"""
    reward: str = DEFAULT_SPEC
    """reward functions name:weight,... (rewards.py) or a JSON file"""
    scale_rewards: Literal["group", "batch", "none"] = "none"
    """divide advantages by the group's std (GRPO), the batch's, or 1 (Dr.GRPO)"""
    baseline: Literal["mean", "rloo"] = "mean"
    """subtract the group's mean reward, or the others' (RLOO)"""
    dynamic_sampling: bool = False
    """replace groups of equal rewards (DAPO)"""
    max_resample_rounds: int = 4
    """--dynamic-sampling's most extra draws per step"""
    mask_truncated_completions: bool = False
    """completions cut before EOS get no loss (DAPO)"""
    beta: float = 0.0
    """KL penalty's weight (0: no frozen reference)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator, http://joschu.net/blog/kl-approx.html"""
    num_iterations: int = 2
    """optimiser updates on each batch"""
    clip_low: float = 0.2
    """probability ratio's floor is 1 - this"""
    clip_high: float = 0.2
    """ratio's ceiling is 1 + this (DAPO: 0.28)"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] = "grpo"
    """token losses averaged per completion (grpo), process (bnpo), max length (dr_grpo), batch (dapo, cispo)"""
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    """ratio per token (GRPO), per completion (GSPO), or that with token gradients"""
    delta: Optional[float] = None
    """cap on the ratio of negative-advantage tokens (INTELLECT-2; None: none)"""
    top_entropy_quantile: float = 1.0
    """train on this fraction of tokens, of highest entropy"""
    importance_sampling_cap: Optional[float] = None
    """cap on the per-token loss weight p_old / p_sampler (None: off)"""
    tools: tuple[str, ...] = ()
    """tools the model may call: calculator, file.py:function, tag=either"""
    max_turns: int = 4
    """model turns per completion with --tools (a call in the last is not run)"""
    max_tool_output: int = 32
    """tokens of a tool's output kept (then a '...(cut)' marker)"""
    tool_result_template: str = "<result>{}</result>"
    """how a tool's output joins the context"""


@dataclass
class ModelData:
    model_name_or_path: str = "models/tiny-arith"
    """folder or hub id of the model and its tokenizer"""
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
    """LoRA rank on each linear layer (0: off); needs peft"""
    lora_alpha: float = 32.0
    """LoRA scale: the update is x alpha / r"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""


@dataclass
class Optimisation:
    learning_rate: float = 1e-4
    """peak learning rate of AdamW"""
    total_steps: int = 250
    """training steps; may change on --resume"""
    micro_batch_size: int = 0
    """completions per forward/backward (0: largest divisor of the batch <= 128)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: cosine or linear decay to 0, or constant"""
    warmup_steps: int = 30
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    gradient_checkpointing: bool = False
    """recompute activations in backward"""


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


@dataclass
class Engineering:
    device: str = "auto"
    """cuda, cpu, or auto (cuda if available)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights dtype; auto: float32, bfloat16 autocast on CUDA"""
    generation_backend: Literal["auto", "shared", "static", "copy"] = "auto"
    """shared: one prefill per prompt; static: a static KV cache; copy: static on a bfloat16 copy; auto: on CUDA
    copy (static at --dtype bfloat16), else shared"""
    fsdp: bool = False
    """under torchrun, shard weights, gradients, AdamW states (FSDP2), not DDP"""
    exp_name: str = "grpo"
    """part of the run directory's name"""
    seed: int = 1
    """seed of the RNGs and data order"""
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


def group_advantages(rewards, scale: str, baseline: str = "mean"):
    """rewards [P, G] -> advantages [P, G] float32: r_i - mean(group) (Sec. 4.1.2), x G / (G - 1) for the others'
    mean (RLOO, arXiv:2402.14740), over std(group), std(batch) (+ 1e-4) or 1 (Dr.GRPO); 0 in groups of equal rewards."""
    rewards = rewards.float()
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if baseline == "rloo":
        advantages = advantages * rewards.shape[1] / (rewards.shape[1] - 1)
    if scale == "group":
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.masked_fill(~informative_groups(rewards)[:, None], 0.0)


def informative_groups(rewards):
    """rewards: [P, G] -> [P] bool: the group's rewards are not all equal (DAPO Sec. 3.2)."""
    return rewards.amax(dim=1) > rewards.amin(dim=1)


def aggregate_loss(per_token_loss, mask, args, num_tokens: int, local_tokens: int, world: int):
    """per_token_loss, mask: [B, T] -> this micro-batch's share of the step's loss, per --loss-type:
        grpo     mean over the step's N sequences of their token means  (the 1/|o_i| of Eq. 3)
        bnpo     mean over processes of their token means (local_tokens: TRL's normaliser)
        dr_grpo  token sum / (N x --max-completion-length)  (Dr.GRPO Sec. 3)
        dapo     token sum / num_tokens, the step's tokens  (DAPO Sec. 3.3); cispo too"""
    masked = (per_token_loss * mask).sum(dim=1)
    n = args.prompts_per_step * args.num_generations
    if args.loss_type == "grpo":
        return (masked / mask.sum(dim=1).clamp(min=1.0)).sum() / n
    if args.loss_type == "bnpo":
        return masked.sum() / max(local_tokens, 1) / world
    if args.loss_type == "dr_grpo":
        return masked.sum() / (n * args.max_completion_length)
    return masked.sum() / max(num_tokens, 1)


def policy_loss(logp, old_logp, advantages, mask, ref_logp, args):
    """logp, old_logp, mask, ref_logp (None: beta = 0): [B, T]; advantages: [B, 1] -> per token (loss, kl, clipped:
    1 where the clip zeroes the gradient or cispo caps the weight). The ratio x (sg: no gradient) is per
        token           x_it = pi(o_it) / pi_old(o_it)              GRPO Eq. 3
        sequence        x_it = s_i = exp(1/|o_i| sum_t log x_it)    GSPO Eq. 7
        sequence_token  x_it = sg[s_i] pi(o_it) / sg[pi(o_it)]      GSPO-token Eq. 14
    and the loss, plus beta KL (Eq. 4; delta: the two-sided clip of INTELLECT-2, arXiv:2505.07291):
        clip   -min(min(x, delta) A, clip(x, 1 - eps_low, 1 + eps_high) A)   Eq. 3; GSPO Eq. 5
        cispo  -sg[min(x, 1 + eps_high)] A log pi(o_it)                     CISPO Eq. 4-5
    On CUDA the token-level clip loss without delta is kernels.clipped_policy_loss (same numbers)."""
    level = args.importance_sampling_level
    if logp.is_cuda and args.loss_type != "cispo" and level == "token" and args.delta is None:
        return clipped_policy_loss(logp, old_logp, advantages, ref_logp=ref_logp, clip_low=args.clip_low,
                                   clip_high=args.clip_high, beta=args.beta, kl_estimator=args.kl_estimator)
    log_ratio = logp - old_logp
    if level != "token":
        seq = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        log_ratio = seq if level == "sequence" else logp - logp.detach() + seq.detach()
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0)).expand_as(logp)
    kl = torch.zeros_like(logp) if ref_logp is None else kl_estimate(logp, ref_logp, args.kl_estimator)
    if args.loss_type == "cispo":
        weight = ratio.clamp(max=1 + args.clip_high).detach()
        return -weight * advantages * logp + args.beta * kl, kl, (ratio > 1 + args.clip_high).float()
    unclipped = (ratio if args.delta is None else ratio.clamp(max=args.delta)) * advantages
    clipped = ratio.clamp(1 - args.clip_low, 1 + args.clip_high) * advantages
    return -torch.minimum(unclipped, clipped) + args.beta * kl, kl, (clipped < unclipped).float()


def truncated_is_weights(old_logp, sampler_logp, mask, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] each -> (min(pi_old / pi_sampler, cap) per token, 1 on padding; capped [B, T] bool): the sampler drew
    the tokens, the loss expects pi_old's."""
    ratio = torch.exp((old_logp - sampler_logp) * mask)
    return ratio.clamp(max=cap), (ratio > cap) & (mask > 0)


def high_entropy_tokens(entropy: list, masks: list, rho: float) -> list:
    """entropy, masks: [B_k, T_k] per micro-batch -> [B_k, T_k] bool: entropy >= the (1 - rho)-quantile of all loss
    tokens' (arXiv:2506.01939)."""
    pooled = torch.cat([h[m > 0] for h, m in zip(entropy, masks)]).float()
    tau = torch.quantile(pooled, 1 - rho) if len(pooled) else 0.0
    return [h >= tau for h in entropy]


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


def concat_rollouts(batches: list[dict], pad_id: int, rows: list) -> dict:
    """The `rows` of the rollout batches as one (prompts re-padded left, completions right)."""
    out = {}
    for k, v in batches[0].items():
        if isinstance(v, dict):
            out[k] = concat_rollouts([b[k] for b in batches], pad_id, rows)
            continue
        items = [x for b in batches for x in b[k]]
        items = [items[i] for i in rows]
        if isinstance(v, list):
            out[k] = items
        elif v.dim() == 1:
            out[k] = torch.stack(items)
        else:
            pad = pad_id if k.endswith("ids") else 0
            side = "left" if k.startswith("prompt") else "right"
            out[k] = torch.nn.utils.rnn.pad_sequence(items, batch_first=True, padding_value=pad, padding_side=side)
    return out


def dynamic_sampling(draw, num_groups: int, group_size: int, max_rounds: int, pad_id: int) -> tuple[dict, dict]:
    """DAPO dynamic sampling (Sec. 3.2): draw(n) samples n groups, up to max_rounds more times, until num_groups have
    unequal rewards; zero-advantage groups fill a shortfall."""
    batches, good = [], torch.zeros(0, dtype=torch.bool)
    while good.sum() < num_groups and len(batches) <= max_rounds:
        batches.append(draw(num_groups - int(good.sum())))
        good = torch.cat([good, informative_groups(batches[-1]["rewards"]["total"].view(-1, group_size))])
    chosen = torch.argsort((~good).int(), stable=True)[:num_groups]  # informative groups first, in the order drawn
    rows = (chosen[:, None] * group_size + torch.arange(group_size)).flatten().tolist()
    stats = {"train/sampling_draws": len(batches), "train/informative_groups": int(good[chosen].sum())}
    return concat_rollouts(batches, pad_id, rows), stats


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
def rollout(model, tokenizer, data: dict, rows: list, gen_config, backend: str, eos_ids, reward, autocast, timing,
            tools: dict, args):
    """Steps 1-2 of Algorithm 1 (sample, score) for the prompts `rows` of load_prompts' data."""
    t0 = time.perf_counter()
    with autocast:
        sampler = sampler_copy(model) if backend == "copy" else model
        out = turns(sampler, tokenizer, [data["ids"][i] for i in rows], gen_config, backend, eos_ids, tools, args)
    t1 = time.perf_counter()
    completions = tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
    trace = reward.trace(completions, **{name: [v[i] for i in rows] for name, v in data["columns"].items()},
                         completion_ids=[c[: int(n)] for c, n in zip(out["completion_ids"].tolist(),
                                                                     out["completion_mask"].sum(1))])
    timing["generate"] += t1 - t0
    timing["score"] += time.perf_counter() - t1
    return {**out, "rewards": {k: torch.tensor(v, dtype=torch.float32) for k, v in trace.items()},
            "prompts": [data["texts"][i] for i in rows], "completions": completions}


def turns(model, tokenizer, prompts: list, gen_config, backend: str, eos_ids, tools: dict, args) -> dict:
    """Prompt ids -> the rollout's tensors, sampled turn by turn: each open row until EOS, a tool's closing tag or
    --max-completion-length (model and tool tokens); rows that stopped at a call run it, its result's tokens join
    the row (tool_mask: True), it goes on. Sampled ids stay as sampled, never decoded and encoded again."""
    n, budget, stops = len(prompts), args.max_completion_length, [f"</{t}>" for t in tools]
    (ids, logp, is_tool), calls, errors = ([[] for _ in range(n)] for _ in range(3)), [0] * n, [0] * n
    live = list(range(n))
    for turn in range(args.max_turns if tools else 1):
        x, m = (t.to(model.device) for t in left_pad([prompts[r] + ids[r] for r in live], tokenizer.pad_token_id))
        config = type(gen_config).from_dict({**gen_config.to_dict(), "stop_strings": stops or None,
                                             "max_new_tokens": budget - min(len(ids[r]) for r in live)})
        new, new_logp = sample(model, x, m, config, backend, **({"tokenizer": tokenizer} if tools else {}))
        going = []
        for r, row, row_logp in zip(live, new.tolist(), new_logp.tolist()):
            row = row[: budget - len(ids[r])]
            end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            end = call_end(tokenizer, row[:end], stops) or -end if tools else -end  # > 0: a call ends there
            ids[r] += row[: abs(end)]
            logp[r] += row_logp[: abs(end)]
            is_tool[r] += [False] * abs(end)
            if end > 0 and turn < args.max_turns - 1:
                result, failed = call_tool(tokenizer, tokenizer.decode(row[:end]), tools, args)
                result = result[: budget - len(ids[r])]
                ids[r] += result
                logp[r] += [0.0] * len(result)
                is_tool[r] += [True] * len(result)
                calls[r], errors[r] = calls[r] + 1, errors[r] + failed
                going += [r] * (len(ids[r]) < budget)
        if not (live := going):
            break
    pad = lambda rows, value=0: torch.nn.utils.rnn.pad_sequence(list(map(torch.tensor, rows)), True, value)
    out = {**dict(zip(("prompt_ids", "prompt_mask"), left_pad(prompts, tokenizer.pad_token_id))),
           "completion_ids": pad(ids, tokenizer.pad_token_id), "completion_mask": pad([[1.0] * len(r) for r in ids]),
           "sampler_logp": pad(logp), "tool_mask": pad(is_tool).bool(), "tool_calls": torch.tensor(calls),
           "tool_errors": torch.tensor(errors), "truncated": torch.tensor([r[-1] not in eos_ids for r in ids])}
    return {k: v.to(model.device) for k, v in out.items()}


def logprobs_without_adapters(model, *inputs):
    with model.disable_adapter():
        return completion_logprobs(model, *inputs)


def old_policy_terms(mb: dict, old_logp, args, reference, sums: dict):
    """pi_old's log-probs (the first update's: no weight has moved yet) -> mb's sampler gap, TIS weights, (beta > 0)
    reference log-probs."""
    mb["old_logp"] = old_logp
    sums["sampler_gap"] += float(((old_logp - mb["sampler_logp"]).abs() * mb["mask"]).sum())
    if args.importance_sampling_cap is not None:
        mb["tis"], capped = truncated_is_weights(old_logp, mb["sampler_logp"], mb["mask"], args.importance_sampling_cap)
        sums["tis_capped"] += float(capped.sum())
    if reference is not None:
        with torch.no_grad():
            mb["ref_logp"] = reference(*mb["inputs"], args.temperature)


def grpo_update(run, policy, optimizer, batch: dict, advantages, mask, args, reference, autocast, size: int) -> dict:
    """mu AdamW updates on this process's batch in length-sorted micro-batches of `size` rows -> sums for
    grpo_metrics; at beta = 0 (not --fsdp) rows of advantage 0 are skipped (if all are, one micro-batch stays)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"].long()], dim=1)
    width = batch["prompt_ids"].shape[1]
    kept = torch.arange(len(advantages), device=advantages.device)
    if args.beta == 0 and not run.fsdp:
        kept = kept[advantages != 0] if advantages.any() else kept[:size]
    chunks = []
    micro_batches = length_sorted_micro_batches(batch["prompt_mask"][kept], batch["completion_mask"][kept], size)
    for rows, first, end in micro_batches:
        r = kept[rows]
        chunks.append({"inputs": (ids[r, first : width + end], attention[r, first : width + end], width - first),
                       "mask": mask[r, :end], "advantages": advantages[r, None],
                       "sampler_logp": batch["sampler_logp"][r, :end]})
    tokens = int(run.gather(mask.sum()[None]).sum()), int(mask.sum())  # loss tokens: the step's, this process's
    sums = dict.fromkeys(("loss", "kl", "clip_frac", "entropy", "tokens", "sampler_gap", "tis_capped"), 0.0)
    ddp = run.ddp and not run.fsdp
    if args.top_entropy_quantile < 1:  # an extra forward pass: entropies before any update
        with torch.no_grad(), autocast:
            entropy = [(policy.module if ddp else policy)(*mb["inputs"], args.temperature, True)[1] for mb in chunks]
        keep = high_entropy_tokens(entropy, [mb["mask"] for mb in chunks], args.top_entropy_quantile)
        for mb, mb_keep in zip(chunks, keep):
            mb["keep"] = mb_keep
    for iteration in range(args.num_iterations):
        for k, mb in enumerate(chunks):
            sync = policy.no_sync() if ddp and k < len(chunks) - 1 else contextlib.nullcontext()  # DDP: on the last
            with sync, autocast:
                logp, entropy = policy(*mb["inputs"], args.temperature, True)
                if iteration == 0:
                    old_policy_terms(mb, logp.detach(), args, reference, sums)
                per_token, kl, clipped = policy_loss(
                    logp, mb["old_logp"], mb["advantages"], mb["mask"], mb.get("ref_logp"), args)
                if "keep" in mb:  # policy gradient of high-entropy tokens only; KL penalty on every token
                    per_token = torch.where(mb["keep"], per_token, args.beta * kl)
                if "tis" in mb:  # the sampler drew the tokens: weigh pi_old's per-token loss back to them
                    per_token = per_token * mb["tis"]
                loss = aggregate_loss(per_token, mb["mask"], args, *tokens, run.world)
                (loss * run.world).backward()  # DDP averages over processes
            sums["loss"] += loss.item()
            for name, x in (("kl", kl), ("clip_frac", clipped), ("entropy", entropy), ("tokens", mb["mask"])):
                sums[name] += float((x.detach() * mb["mask"]).sum())
        sums["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad()
    return sums


def grpo_metrics(run, args, sums: dict, batch: dict, rewards, timing: dict, steps: int) -> dict:
    """The step's metrics over all processes; perf/ over the `steps` since the last log."""
    totals = {**sums, "completion_length": float(batch["completion_mask"].sum()), "truncated_frac": float(batch[
        "truncated"].sum()), **{f"tool_{k}": float(batch[f"tool_{k}"].sum()) for k in ("mask", "calls", "errors")}}
    t = dict(zip(totals, run.gather(torch.tensor([list(totals.values())], device=rewards.device)).sum(0).tolist()))
    n_tok = max(t["tokens"], 1)
    return {"train/loss": t["loss"] / args.num_iterations, "train/reward": float(rewards.mean()),
            "train/reward_std": float(rewards.std(dim=1).mean()),
            **{f"rewards/{k}": float(run.gather(v.to(rewards.device)).mean()) for k, v in batch["rewards"].items()
               if k != "total"},
            **{f"train/{k}": t[k] / n_tok for k in ("kl", "clip_frac", "entropy")},
            "train/tis_capped_frac": t["tis_capped"] * args.num_iterations / n_tok,
            "train/grad_norm": sums["grad_norm"],
            **{f"train/{k}": t[k] / rewards.numel() for k in ("completion_length", "truncated_frac") + (
                "tool_calls",) * bool(args.tools)},
            **({"train/tool_tokens": t["tool_mask"] / rewards.numel(), "train/tool_errors": t["tool_errors"] / max(
                t["tool_calls"], 1)} if args.tools else {}),
            "train/frac_zero_std": float((~informative_groups(rewards)).float().mean()),
            "perf/tokens_per_s": timing["tokens"] * run.world / max(timing["step"], 1e-9),
            **{f"perf/{k}_s": timing[k] / steps for k in ("step", "generate", "score", "train")}}


def load_prompts(args, tokenizer, reward):
    """Training prompts (tokenised, with the reward's columns) and eval split -> (data, eval prompts, eval answers)."""
    columns = {c: args.answer_column if c == "answer" else c for c in sorted(reward.required_columns)}
    train = load_split(args, "dataset_split", [args.prompt_column, *columns.values()],
                       "--prompt-column/--answer-column, or a --reward that does not need it")
    prompts = list(train[args.prompt_column])
    texts = prompt_texts(tokenizer, prompts, args.use_chat_template, args.prompt_column)
    ids = [row[-args.max_prompt_length:] for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if not all(ids):
        raise ValueError(f"prompt {ids.index([])} of split '{args.dataset_split}' is empty: remove it")
    data = {"ids": ids, "texts": texts,
            "columns": {"prompts": prompts, **{k: list(train[c]) for k, c in columns.items()}}}
    if not args.eval_split:
        return data, [], []
    ev = load_split(args, "eval_split", [args.prompt_column, args.answer_column], "--prompt-column/--answer-column")
    ev = ev[: args.eval_limit]  # columns -> lists
    eval_prompts = prompt_texts(tokenizer, ev[args.prompt_column], args.use_chat_template, args.prompt_column)
    return data, eval_prompts, ev[args.answer_column]


def load_policy(args, run, tokenizer):
    """The policy (dropout off, LoRA with --lora-r) wrapped for DDP or FSDP2, its frozen reference (beta > 0) ->
    (model, policy, reference, EOS ids)."""
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype).to(run.device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eos_ids = own_generation_config(model, tokenizer)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    reference = None
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear",
                                                 lora_dropout=args.lora_dropout, task_type="CAUSAL_LM"))
        reference = Forward(logprobs_without_adapters, model) if args.beta > 0 else None
    elif args.beta > 0:
        reference = Forward(completion_logprobs, copy.deepcopy(model)).eval().requires_grad_(False)
    check_bf16_updates(run, model, args.learning_rate)
    policy = Forward(completion_logprobs, model)
    if run.fsdp:
        policy = run.shard(policy, decoder_layers(model))
        reference = reference and run.shard(reference, decoder_layers(reference))
    elif run.ddp:
        policy = torch.nn.parallel.DistributedDataParallel(policy)
    return model, policy, reference, eos_ids


RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "save_every_minutes", "eval_limit",
                     "num_sample_completions", "track", "wandb_project_name", "wandb_entity", "device")


def main(args: Args) -> dict:
    # 0. Check every input first (--resume: the run's own arguments).
    args, overrides = resume_args(args, RESUME_MAY_CHANGE)
    micro, tools = check_args(args)
    reward = make_reward(args.reward, {"correctness": {"tagged_only": True}} if tools else None)  # not a tool's number
    run = Run(args, overrides, shown=("train/reward", "eval/accuracy") + ("train/kl",) * (args.beta > 0))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    # 1. Data, checked against the model's context.
    data, eval_prompts, eval_answers = load_prompts(args, tokenizer, reward)
    prompt_ids = data["ids"] + [tokenizer(p, add_special_tokens=False).input_ids for p in eval_prompts]
    check_context(AutoConfig.from_pretrained(args.model_name_or_path), prompt_ids, args.max_completion_length,
                  "--max-completion-length")

    # 2. Model: the policy and (beta > 0) a frozen reference.
    model, policy, reference, eos_ids = load_policy(args, run, tokenizer)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.device.type == "cuda" and args.dtype == "auto")
    gen_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, eos_token_id=eos_ids,
                                  max_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id)

    # 3. Optimiser, schedule, data order (one per process); --resume restores them.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  betas=(0.9, 0.99), weight_decay=args.weight_decay)
    run.trained = (policy, optimizer)  # what --fsdp checkpoints in shards
    lr_anchor = None  # set by a resume changing --total-steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.warmup_steps, args.total_steps, args.lr_schedule, lr_anchor))
    order = DataOrder(len(data["ids"]), args.seed * 1000 + run.rank)
    state = run.restore(model, optimizer, scheduler)
    if state:
        reward.load_state_dict(state["reward"])
        order.load(state)
        lr_anchor = state["lr_anchor"]
        if "total_steps" in overrides:
            lr_anchor = (run.start, lr_factor(run.start, args.warmup_steps, overrides["total_steps"][0],
                                              args.lr_schedule, lr_anchor))

    def measure() -> tuple[dict, list]:
        return greedy_turns(model, tokenizer, eval_prompts, eval_answers, eos_ids, tools, args, run.progress)

    def save() -> Path:
        state = {"optimizer": None if run.fsdp else optimizer.state_dict(), "reward": reward.state_dict(),
                 "scheduler": scheduler.state_dict(), "lr_anchor": lr_anchor}
        return run.checkpoint(model, tokenizer, state, per_rank=order.state())

    def draw(n: int) -> dict:
        return rollout(model, tokenizer, data, [i for i in order.draw(n) for _ in range(G)], gen_config,
                       generation_backend(args, run.device), eos_ids, reward, autocast, timing, tools, args)

    # 4. Train.
    G, groups = args.num_generations, args.prompts_per_step // run.world
    run.say(f"run directory: {run.dir}  |  {len(data['ids'])} training prompts, {len(eval_prompts)} eval prompts, "
            f"micro-batch {micro}")
    final, last_log = {}, run.start
    timing = dict.fromkeys(("step", "generate", "score", "train", "tokens"), 0.0)  # since the last log row
    with run:
        for step in run.steps(measure, save):
            t_step = time.perf_counter()
            # 4a. Sample G completions per prompt, score them (Algorithm 1); DAPO refills all-equal groups.
            with run.whole():  # --fsdp: whole weights while sampling
                if args.dynamic_sampling:
                    batch, draws = dynamic_sampling(draw, groups, G, args.max_resample_rounds, tokenizer.pad_token_id)
                else:
                    batch, draws = draw(groups), {}
            t_train = time.perf_counter()
            # 4b. Group-relative advantages over the global batch; this process keeps its rows.
            rewards = run.gather(batch["rewards"]["total"].to(run.device)).view(-1, G)
            advantages = group_advantages(rewards, args.scale_rewards, args.baseline).view(run.world, -1)[run.rank]
            mask = batch["completion_mask"] * ~batch["tool_mask"]  # the loss mask: no tool's token is in any term
            if args.mask_truncated_completions:  # DAPO's overlong filtering (Sec. 3.4)
                mask = mask * ~batch["truncated"][:, None]
            # 4c. mu updates on this batch (Eq. 3).
            sums = grpo_update(run, policy, optimizer, batch, advantages, mask, args, reference, autocast, micro)
            gap = sampler_gap(run, sums["sampler_gap"], sums["tokens"] / args.num_iterations)  # stops a mismatch
            lr = scheduler.get_last_lr()[0]  # this step's rate
            scheduler.step()
            timing["train"] += time.perf_counter() - t_train
            timing["step"] += time.perf_counter() - t_step
            timing["tokens"] += int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())

            # 4d. Log metrics and a few completions.
            if step % args.log_every == 0 or step == args.total_steps:
                final = {"step": step, **grpo_metrics(run, args, sums, batch, rewards, timing, step - last_log),
                         "train/sampler_gap": gap, "train/lr": lr, **draws}
                n = args.num_sample_completions
                table = [[step, p, c, float(r), float(a)] for p, c, r, a in zip(
                    batch["prompts"][:n], batch["completions"], batch["rewards"]["total"], advantages)]
                run.log(final, ("train/samples", ["step", "prompt", "completion", "reward", "advantage"], table))
                warn_if_nothing_learns(run, final, final["train/frac_zero_std"] == 1)
                last_log, timing = step, dict.fromkeys(timing, 0.0)

    # 5. Final evaluation, a checkpoint, the trained model (LoRA merged) in final/.
    merged = (lambda: copy.deepcopy(model).merge_and_unload()) if args.lora_r else model
    return run.finish(final, measure, save, merged, tokenizer)


def check_args(args: Args) -> tuple[int, dict]:
    """Checks needing no model or data -> the micro-batch each process uses, the tools."""
    check_common(args, ("total_steps", "prompts_per_step", "max_completion_length", "max_prompt_length", "log_every",
                        "num_iterations", "learning_rate", "temperature", "eval_limit", "max_turns", "max_tool_output"),
                 ("eval_every", "save_every", "warmup_steps", "max_resample_rounds", "lora_r",
                  "num_sample_completions", "micro_batch_size", "beta", "clip_low", "clip_high"),
                 (args.model_name_or_path,))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cap, delta = args.importance_sampling_cap, args.delta
    for bad, message in (
            (args.num_generations < 2, "--num-generations must be >= 2: GRPO compares a prompt's completions"),
            (args.prompts_per_step % world, f"--prompts-per-step must be a multiple of the {world} processes"),
            (args.clip_low > 1, f"--clip-low must be <= 1, got {args.clip_low}"),
            (cap is not None and cap < 1, f"--importance-sampling-cap {cap} must be >= 1, e.g. 2, or None"),
            (delta is not None and (delta <= 1 + args.clip_high or args.loss_type == "cispo"),
             f"--delta {delta}: it needs a clip loss type and a value above 1 + --clip-high = {1 + args.clip_high}"),
            (not 0 < args.top_entropy_quantile <= 1, "--top-entropy-quantile must be in (0, 1]"),
            (args.lora_r and importlib.util.find_spec("peft") is None, "--lora-r needs peft: `pip install peft`"),
            ("{}" not in args.tool_result_template, "--tool-result-template needs {} where the tool's output goes")):
        if bad:
            raise ValueError(message)
    return fit_micro_batch(args.micro_batch_size, args.prompts_per_step // world * args.num_generations,
                           f"--prompts-per-step / {world} processes x --num-generations"), load_tools(args.tools)


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


def call_end(tokenizer, row: list, stops: list) -> int:
    """The length of the shortest start of `row` whose text holds a tool's closing tag (binary search); 0: none."""
    lo, hi = 1, len(row) + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if any(s in tokenizer.decode(row[:mid]) for s in stops) else (mid + 1, hi)
    return lo % (len(row) + 1)


def call_tool(tokenizer, text: str, tools: dict, args) -> tuple[list, bool]:
    """A turn's text ending in </name> -> (the token ids of tools[name](what follows the last <name>) rendered by
    --tool-result-template, whether it failed: an exception is shown to the model as 'error: ...')."""
    name = re.search("</(" + "|".join(map(re.escape, tools)) + ")>", text).group(1)
    before, opened, arguments = text[: text.index(f"</{name}>")].rpartition(f"<{name}>")
    try:
        if not opened:
            raise ValueError(f"no <{name}> before </{name}>")
        result, failed = str(tools[name](arguments)), False
    except Exception as e:  # the model sees it, and may do better
        result, failed = f"error: {e}", True
    encode = lambda t: tokenizer(t, add_special_tokens=False, split_special_tokens=True).input_ids  # no EOS inside
    if len(encode(result)) > args.max_tool_output:
        result = tokenizer.decode(encode(result)[: args.max_tool_output]) + "...(cut)"
    return encode(args.tool_result_template.replace("{}", result)), failed


OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.Pow: operator.pow, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Exact arithmetic (Fractions): + - * / ** and parentheses, parsed by ast (no eval); up to 200 characters and
    numbers of 1,000 digits."""
    size = lambda q: max(abs(q.numerator), q.denominator).bit_length() / 3.322  # digits

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if type(getattr(node, "op", None)) not in OPERATORS:
            raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]}")
        xs = [value(getattr(node, k)) for k in ("left", "right", "operand") if hasattr(node, k)]
        if isinstance(node.op, ast.Pow) and (xs[1].denominator != 1 or size(xs[0]) * abs(xs[1]) > 1000):
            raise ValueError("not an integer power, or one of over 1,000 digits")
        if isinstance(node.op, ast.Div) and xs[1] == 0:
            raise ValueError("division by zero")
        if size(out := OPERATORS[type(node.op)](*xs)) > 1000:
            raise ValueError("a number of over 1,000 digits")
        return out
    if len(expression) > 200:
        raise ValueError("over 200 characters")
    return str(value(ast.parse(expression.strip(), mode="eval").body))


def load_tools(specs: tuple) -> dict:
    """--tools: calculator, file.py:function, or tag=either -> {tag: function(arguments: str) -> str}."""
    tools = {}
    for spec in specs:
        tag, _, where = spec.rpartition("=")
        path, _, name = where.rpartition(":")
        if where != "calculator" and not (path.endswith(".py") and Path(path).is_file()):
            raise ValueError(f"--tools {spec}: {f'no file {path}' if path.endswith('.py') else 'unknown tool'}; use "
                             "calculator, file.py:function or tag=either")
        fn = calculator
        if path:
            found = importlib.util.spec_from_file_location(Path(path).stem, path)
            found.loader.exec_module(module := importlib.util.module_from_spec(found))
            if not callable(fn := getattr(module, name, None)):
                raise ValueError(f"--tools {spec}: {path} has no function {name!r}")
        tag = tag or name
        if not re.fullmatch(r"[A-Za-z_][\w.-]*", tag) or tag in tools:
            raise ValueError(f"--tools {spec}: {tag!r} is {'taken' if tag in tools else 'not a tag name'}: name it "
                             f"with <tag>={where}")
        tools[tag] = fn
    return tools


@torch.no_grad()
def greedy_turns(model, tokenizer, prompts, answers, eos_ids, tools: dict, args, progress, batch_size=128):
    """Greedy decoding through turns(), as training samples -> (eval metrics, [(prompt, completion, answer)]); tools:
    calls and tool tokens per completion, shares of completions with a call and of failed calls, accuracy by call."""
    config, samples, outs = GenerationConfig(do_sample=False, temperature=1.0, eos_token_id=eos_ids), [], []
    for i in tqdm(range(0, len(prompts), batch_size), desc="eval", leave=False, disable=not progress):
        batch = prompts[i : i + batch_size]
        outs.append(turns(model, tokenizer, tokenizer(batch, add_special_tokens=False).input_ids, config, "shared",
                          eos_ids, tools, args))
        samples += zip(batch, tokenizer.batch_decode(outs[-1]["completion_ids"], skip_special_tokens=True),
                       answers[i : i + batch_size])
    if not samples:
        return {}, []
    right = torch.tensor([answer_matches(t, a) for _, t, a in samples]).float()
    calls, errors, tokens = (torch.cat([o[k].sum(-1) if k == "tool_mask" else o[k] for o in outs]).cpu().float()
                             for k in ("tool_calls", "tool_errors", "tool_mask"))
    return {"eval/accuracy": float(right.mean()), **({} if not tools else {
        "eval/tool_calls": float(calls.mean()), "eval/call_rate": float((calls > 0).float().mean()),
        "eval/tool_errors": float(errors.sum() / calls.sum().clamp(min=1)), "eval/tool_tokens": float(tokens.mean()),
        **{f"eval/accuracy_{k}_call": float(right[m].mean()) for k, m in (("with", calls > 0), ("without", calls == 0))
           if m.any()}})}, samples


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
