"""Bradley-Terry reward model: a sequence classifier trained on preference pairs, for ppo.py via rewards.py.

InstructGPT (arXiv:2203.02155, Sec. 3.5, Eq. 1): a language model with its unembedding replaced by a
scalar head scores r(x, y) for prompt x and response y, and is trained on pairs where y_c was preferred
to y_r by maximising the Bradley-Terry log-likelihood
    loss = -E[ log sigmoid(r(x, y_c) - r(x, y_r)) ].                                       (Eq. 1)
Options:
    `--margin-column`: Llama 2's margin (arXiv:2307.09288, Eq. 2), -log sigmoid(r_c - r_r - m), for data
        that says how much better y_c is;
    `--center-rewards-coef`: + coef * (r_c + r_r)^2, which keeps the scores near zero (arXiv:2312.09244,
        Sec. 3; TRL's center_rewards_coefficient, which suggests 0.01).
The score head is new (the checkpoint is a causal LM): it is initialised N(0, 1/(H+1)) as in OpenAI's
lm-human-preferences ("The N+ Implementation Details of RLHF with PPO", arXiv:2403.17031), so the initial
scores are of order 1 rather than HF's 0.02-std head giving scores near 0. After training, the mean and
std of the scores of the training prompts' chosen completions are written into the saved config
(`reward_mean`, `reward_std`), so that PPO can use whitened scores (the same paper's reward normalisation):
    rewards.make_reward({"type": "reward_model", "model": "runs/<run>/final", "normalize": True}).

Run:
    python reward_model.py                                        # embedded: models/tiny-arith on data/arith prefs
    python reward_model.py --center-rewards-coef 0.01 --margin-column margin   # (data with a margin column)
    python reward_model.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset my/hub-prefs --dataset-split train \
        --eval-split test --max-length 1024 --micro-batch-size 4 --learning-rate 1e-5 --lora-r 16   # any HF model
    torchrun --nproc-per-node 2 reward_model.py                  # data parallel (DDP), gloo on CPU, nccl on GPU
    # InstructGPT's pipeline: SFT -> reward model -> PPO scored by it (a reward spec with options goes in a file)
    python sft.py && python reward_model.py --model-name-or-path runs/<sft-run>/final
    echo '{"type": "reward_model", "model": "runs/<rm-run>/final", "normalize": true}' > rm_reward.json
    python ppo.py --model-name-or-path runs/<sft-run>/final --reward rm_reward.json

Deviations and choices:
- The text scored is `prompt + response`, tokenised as the tokenizer does by default (its own special
  tokens, no EOS appended), and the score is read at its last real token: exactly what
  `AutoModelForSequenceClassification.from_pretrained(final)(**tokenizer(prompt + response))` gives, and what
  the `reward_model` reward computes on PPO's decoded completions (which carry no EOS). Appending EOS (as
  the N+ paper does) would break with tokenizers whose pad token is their EOS (GPT-2, Qwen2.5 base): HF's
  classifier reads the rightmost token that is not the pad id. Batches are right-padded with position ids
  counted over real tokens, so padding on either side gives the same scores.
- Prefix sharing (`--pack-pairs`, on by default; arXiv:2410.20305 does it for DPO): a pair is scored in one row,
  chosen + the rejected tokens after the prefix the two texts share, with a mask that keeps the rejected tail
  from seeing the chosen tail and positions that continue from the prefix. Every token sees what it sees in its
  own sequence, so the scores and gradients are the unpacked ones (tested); the forward runs on fewer tokens
  (0.68x on the embedded pairs, which share the prompt and the trace up to the slip). It is checked against the
  classifier's own forward on 8 pairs at start, and a model that fails the check (an attention without custom
  4D masks, such as flash-attention 2) is scored unpacked, with a notice.
- InstructGPT puts all K(K-1)/2 comparisons of a prompt in one batch; here a batch is `--batch-size`
  pairs drawn in epoch order (one comparison per row, as the data has).
- Pairs whose chosen or rejected text is longer than `--max-length` tokens are dropped (with a notice):
  truncating either would cut the response where the score is read. A pair whose two responses are
  identical is an error: it carries no preference.
- Held-out accuracy counts ties as wrong (r_c > r_r strictly).
- Dropout is switched off (TRL's RewardConfig disable_dropout default); AdamW, warmup + cosine decay.
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
import torch.nn.functional as F
import tyro
from datasets import load_dataset
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging


@dataclass
class Args:
    # --- experiment / tracking
    exp_name: str = "reward_model"
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
    """local folder or Hugging Face id of the causal LM (or reward model) to start from, and its tokenizer"""
    dataset: str = "data/arith"
    """local folder of `<split>.jsonl` files, a JSON-lines file, or a Hugging Face dataset id"""
    dataset_split: str = "prefs"
    """split with the training preference pairs"""
    eval_split: Optional[str] = "prefs_test"
    """split with held-out pairs for eval/pref_accuracy (None: no eval)"""
    prompt_column: str = "prompt"
    """column holding the prompt"""
    chosen_column: str = "chosen"
    """column holding the preferred response"""
    rejected_column: str = "rejected"
    """column holding the other response"""
    margin_column: Optional[str] = None
    """column of the training split holding a margin m >= 0 per pair (Llama 2's -log sigmoid(r_c - r_r - m))"""
    max_length: int = 128
    """longest prompt + response in tokens; longer pairs are dropped"""
    eval_limit: int = 500
    """evaluate on at most this many held-out pairs"""
    lora_r: int = 0
    """rank of LoRA adapters on every linear layer (0: train all weights); the score head is trained in full;
    needs `pip install peft`"""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""

    # --- algorithm
    center_rewards_coef: float = 0.0
    """coefficient of (r_c + r_r)^2 added to the loss, keeping scores near 0 (0: off; TRL suggests 0.01)"""

    # --- optimisation
    learning_rate: float = 1e-3
    """peak learning rate of AdamW"""
    total_steps: int = 300
    """optimiser steps (the default: 4.8 epochs of the 4,000 embedded pairs); changed on --resume, the lr decay
    continues from where it is and reaches 0 at the new last step"""
    batch_size: int = 64
    """preference pairs per optimiser step, over all processes and micro-batches"""
    micro_batch_size: int = 0
    """pairs per forward/backward pass (each pass scores 2x as many sequences); gradient accumulation covers
    the rest of the batch (0: the largest divisor of each process's batch up to 128)"""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """after warmup: cosine or linear decay to 0 at the last step, or constant"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    pack_pairs: bool = True
    """score each pair in one row that holds the prefix its two texts share once (the same scores from fewer
    tokens; checked against the plain forward at start, which is used instead when a model cannot take the mask)"""
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
    """steps between held-out evaluations (0: only at start and end)"""
    save_every: int = 0
    """steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: Optional[str] = None
    """checkpoint folder (runs/<run>/checkpoints/step_N) to continue from, in its run directory, with the run's own
    arguments; flags given here that differ from their defaults may change the cadence (--total-steps, --log-every,
    --eval-every, --save-every, --eval-limit, tracking, --device), any other is refused"""
    run_name: tyro.conf.Suppress[str] = ""
    """set at run time: {dataset}__{exp_name}__{seed}__{time}"""


# ----------------------------------------------------------------------------- math


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor] = None,
                    center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair Bradley-Terry loss. chosen, rejected, margin: [B] scores -> [B] float32:

        -log sigmoid(r_c - r_r - m)      (Eq. 1 of arXiv:2203.02155; the margin m is Eq. 2 of arXiv:2307.09288)
        + center_coef * (r_c + r_r)^2    (reward centring, arXiv:2312.09244)
    """
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.float()
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen.float() + rejected.float()) ** 2
    return loss


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The classifier's score of each sequence, read at its last real token: input_ids, attention_mask [B, T]
    (padded on either side) -> [B] float32. Position ids count real tokens only, so left padding shifts nothing
    even for models with absolute positions; the classifier itself reads the rightmost token that is not the pad
    id, which is the last real token as long as no sequence ends in the pad id (checked in `tokenize_pairs`)."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0].float()


def init_score_head(model, new_keys: set[str]) -> list[str]:
    """Initialise the parameters the checkpoint did not have (the score head): weights N(0, 1/(H+1)) with H the
    hidden size, biases 0 (arXiv:2403.17031, after lm-human-preferences). -> their names."""
    for name in sorted(new_keys):
        param = model.get_parameter(name)
        with torch.no_grad():
            if name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 1 / math.sqrt(param.shape[-1] + 1))
    return sorted(new_keys)


def tokenize_pairs(tokenizer, prompts, chosen, rejected, margins, max_length: int, what: str):
    """-> ([(chosen_ids, rejected_ids, margin)], pairs dropped as too long). Each text is prompt + response as the
    tokenizer encodes it by default, and must not end in the pad id (the classifier would read an earlier token)."""
    enc = lambda texts: tokenizer(texts, add_special_tokens=True)["input_ids"]  # noqa: E731
    c_ids = enc([p + c for p, c in zip(prompts, chosen)])
    r_ids = enc([p + r for p, r in zip(prompts, rejected)])
    pairs, dropped = [], 0
    for i, (c, r) in enumerate(zip(c_ids, r_ids)):
        if c == r:
            raise ValueError(f"{what}, row {i}: chosen and rejected are the same text, which states no preference: "
                             f"remove the row")
        if len(c) > max_length or len(r) > max_length:
            dropped += 1
            continue
        if c[-1] == tokenizer.pad_token_id or r[-1] == tokenizer.pad_token_id:
            raise ValueError(f"{what}, row {i}: a response ends in the pad token {tokenizer.pad_token!r}, where the "
                             f"classifier would not read its score: strip it from the data")
        pairs.append((c, r, float(margins[i]) if margins is not None else 0.0))
    if not pairs:
        raise ValueError(f"{what}: every pair is longer than --max-length {max_length} tokens: raise --max-length")
    return pairs, dropped


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, T] right-padded with pad_id, attention mask [B, T])."""
    width = max(len(x) for x in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, x in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    return ids, mask


def collate_pairs(pairs, pad_id: int):
    """Pairs -> (ids [2B, T] right-padded: the B chosen then the B rejected, attention mask [2B, T], margins [B])."""
    ids, mask = right_pad([c for c, _, _ in pairs] + [r for _, r, _ in pairs], pad_id)
    return ids, mask, torch.tensor([m for _, _, m in pairs], dtype=torch.float32)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens two token lists have in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pack_pairs(pairs, pad_id: int):
    """Pairs -> one row per pair holding their shared token prefix once (arXiv:2410.20305's prefix sharing):
    row = chosen + rejected[n:], where n is the length of the prefix both texts' tokens share. The rejected tail
    sees the prefix and itself but not the chosen tail, and its positions continue from the prefix, so every
    token sees exactly what it sees in its own sequence: the scores are those of `collate_pairs`, from fewer tokens.
    -> (ids [B, T] right-padded, allowed [B, T, T] bool (query, key), position ids [B, T],
        ends [B, 2]: the columns of the chosen and the rejected text's last token, margins [B])."""
    rows, split, shared = [], [], []
    for c, r, _ in pairs:
        n = shared_prefix(c, r)
        rows.append(c + r[n:])
        split.append(len(c))
        shared.append(n)
    ids, real = right_pad(rows, pad_id)
    width = ids.shape[1]
    col = torch.arange(width)
    split, shared, length = torch.tensor(split)[:, None], torch.tensor(shared)[:, None], real.sum(1, keepdim=True)
    tail = col >= split  # [B, T]: the rejected tail (and the padding after it)
    position_ids = torch.where(tail, col - split + shared, col)
    query, key = col[None, :, None], col[None, None, :]
    hidden_chosen = tail[:, :, None] & (key >= shared[:, :, None]) & (key < split[:, :, None])
    allowed = (key <= query) & ~hidden_chosen
    # the rejected text ends at the row's last real token, or inside the prefix when it has no tail of its own
    ends = torch.cat([split - 1, torch.where(length > split, length - 1, shared - 1)], dim=1)
    return ids, allowed, position_ids, ends, torch.tensor([m for _, _, m in pairs], dtype=torch.float32)


class PairScorer(torch.nn.Module):
    """r(x, y_c) and r(x, y_r) of a batch of pairs -> [B, 2] float32, from `pack_pairs` rows (packed=True: the
    classifier's backbone with the pairs' attention mask, its score head read at the two ends) or from
    `collate_pairs` rows (the classifier as it is). One module, so that DDP sees one forward either way."""

    def __init__(self, model, packed: bool):
        super().__init__()
        self.model, self.packed = model, packed

    def forward(self, ids, attention, position_ids=None, ends=None):
        if not self.packed:  # [2B, T]: the B chosen then the B rejected texts
            return sequence_scores(self.model, ids, attention).view(2, -1).T
        classifier = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        if classifier.config._attn_implementation != "sdpa":  # eager attention adds its mask to the logits
            dtype = next(classifier.parameters()).dtype
            attention = torch.zeros(attention.shape, dtype=dtype, device=ids.device).masked_fill(
                ~attention, torch.finfo(dtype).min)
        hidden = classifier.base_model(input_ids=ids, attention_mask=attention[:, None], position_ids=position_ids,
                                       use_cache=False).last_hidden_state
        rows = torch.arange(len(ids), device=ids.device)[:, None]
        return classifier.score(hidden[rows, ends]).squeeze(-1).float()

@torch.no_grad()
def check_packing(model, pairs, pad_id: int, device) -> Optional[str]:
    """Packed scoring of a few pairs against the classifier's own forward (eval mode, no autocast) -> why packing
    cannot be used with this model, or None. Packing needs a `score` head on a backbone that takes a custom 4D
    attention mask (e.g. flash-attention 2 does not)."""
    classifier = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(getattr(classifier, "score", None), torch.nn.Module) or classifier.base_model is classifier:
        return f"{type(classifier).__name__} has no `score` head on a separate backbone"
    pairs, was_training = pairs[:8], model.training
    model.eval()
    try:
        plain = PairScorer(model, packed=False)(*(t.to(device) for t in collate_pairs(pairs, pad_id)[:2]))
        ids, allowed, position_ids, ends, _ = pack_pairs(pairs, pad_id)
        packed = PairScorer(model, packed=True)(ids.to(device), allowed.to(device), position_ids.to(device),
                                                ends.to(device))
    except Exception as e:  # noqa: BLE001 (an attention implementation that refuses a 4D mask)
        return f"its packed forward fails ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    tol = 1e-4 if next(classifier.parameters()).dtype == torch.float32 else 5e-2
    diff = float((packed - plain).abs().max())
    if not diff <= tol * (1 + float(plain.abs().max())):
        return f"its packed scores differ from its plain scores by {diff:.3g} (attention ignores the custom mask?)"
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


@torch.no_grad()
def score_sequences(model, rows: list[list[int]], pad_id: int, device, autocast, batch_size: int = 256,
                    progress: bool = False) -> torch.Tensor:
    """Scores of token lists in eval mode -> [N] float32 on the CPU."""
    model.eval()
    out = []
    for i in tqdm(range(0, len(rows), batch_size), desc="score", leave=False, disable=not progress):
        ids, mask = right_pad(rows[i : i + batch_size], pad_id)
        with autocast:
            out.append(sequence_scores(model, ids.to(device), mask.to(device)).cpu())
    model.train()
    return torch.cat(out)


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
                         f"(choose with --prompt-column/--chosen-column/--rejected-column/--margin-column)")
    if len(ds) == 0:
        raise ValueError(f"{what} is empty: it needs at least one row")


def pair_problem(columns: list[str], margin_column: Optional[str]) -> Callable[[dict], Optional[str]]:
    """A check of one row of preference data: -> what is wrong with it and the fix, or None."""
    def problem(row: dict) -> Optional[str]:
        missing = [c for c in columns if c not in row]
        if missing:
            return (f"has no column {missing}; its columns: {sorted(row)} (choose with --prompt-column/"
                    f"--chosen-column/--rejected-column/--margin-column)")
        if row[columns[1]] == row[columns[2]]:
            return f"'{columns[1]}' and '{columns[2]}' are the same text, which states no preference: remove the row"
        if margin_column is not None and (isinstance(row[margin_column], bool)
                                          or not isinstance(row[margin_column], (int, float))):
            return f"margin '{margin_column}' is {row[margin_column]!r}, not a number"
        return None

    return problem


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
                keys=("train/loss", "train/accuracy", "eval/pref_accuracy", "eval/margin")) -> None:
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
RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "eval_limit",
                     "track", "wandb_project_name", "wandb_entity", "device", "pack_pairs")
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


def check_jsonl(file: Path, problem: Optional[Callable[[dict], Optional[str]]] = None) -> None:
    """Every line of a JSON-lines file is a JSON object (passing `problem`'s check), and there is at least one:
    name the file and line if not."""
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
            wrong = problem(row) if problem else None
            if wrong:
                raise ValueError(f"{file}, line {i}: {wrong}")
            n += 1
    if n == 0:
        raise ValueError(f"{file} is empty: it needs at least one JSON line")


def check_dataset(dataset: str, splits: dict[str, Callable[[dict], Optional[str]]]) -> None:
    """The dataset and its splits exist and parse, and their rows pass each split's check, before anything is
    loaded (a hub dataset's rows are checked once loaded)."""
    path = Path(dataset).expanduser()
    if path.is_dir():
        for split, problem in splits.items():
            file = path / f"{split}.jsonl"
            if not file.exists():
                have = sorted(f.stem for f in path.glob("*.jsonl"))
                raise ValueError(f"split '{split}' not found: {file} does not exist (splits in {path}: {have})")
            check_jsonl(file, problem)
    elif path.is_file():
        for problem in splits.values():
            check_jsonl(path, problem)
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
    """Every check that needs no model loading (local data is read once here); -> the micro-batch (pairs) each
    process uses."""
    for name in ("total_steps", "batch_size", "max_length", "log_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_every", "save_every", "warmup_steps", "eval_limit", "lora_r", "micro_batch_size"):
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
    if args.center_rewards_coef < 0:
        raise ValueError(f"--center-rewards-coef must be >= 0, got {args.center_rewards_coef}")
    if args.lora_r:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ValueError("--lora-r > 0 needs the peft package: `pip install peft` (or use --lora-r 0)") from None
    check_device(args.device, args.dtype)
    check_model_path(args.model_name_or_path)
    columns = [args.prompt_column, args.chosen_column, args.rejected_column]
    splits = {args.dataset_split: pair_problem(columns + [args.margin_column] * bool(args.margin_column),
                                               args.margin_column)}
    if args.eval_split:
        splits[args.eval_split] = pair_problem(columns, None)
    check_dataset(args.dataset, splits)
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

    # 1. Data: each pair as the token ids of prompt + chosen and prompt + rejected (and its margin).
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    columns = [args.prompt_column, args.chosen_column, args.rejected_column]

    def load_pairs(split: str, with_margin: bool, limit: Optional[int] = None):
        ds = load_split(args.dataset, split)
        margin = [args.margin_column] if with_margin and args.margin_column else []
        check_columns(ds, columns + margin, f"split '{split}'")
        ds = ds.select(range(min(len(ds), limit))) if limit is not None else ds
        return tokenize_pairs(tokenizer, *(list(ds[c]) for c in columns), list(ds[margin[0]]) if margin else None,
                              args.max_length, f"split '{split}'")

    pairs, dropped = load_pairs(args.dataset_split, with_margin=True)
    eval_pairs = []
    if args.eval_split:
        eval_pairs, eval_dropped = load_pairs(args.eval_split, with_margin=False, limit=args.eval_limit)
        dropped += eval_dropped
    if dropped and rank == 0:
        print(f"dropped {dropped} pairs longer than --max-length {args.max_length} tokens", flush=True)

    # 2. Model: the causal LM with a new scalar head (a sequence classifier with one output), or a reward model.
    weights_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the head is new on purpose: no "newly initialized" report
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=1, dtype=weights_dtype, output_loading_info=True)
    hf_logging.set_verbosity(verbosity)
    new_head = init_score_head(model, set(loading["missing_keys"])) if not args.resume else []
    model.config.pad_token_id = tokenizer.pad_token_id  # the classifier finds each sequence's end by it
    model.to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                                 target_modules="all-linear", task_type="SEQ_CLS"))
    raw_model = model
    why_not_packed = check_packing(raw_model, pairs, tokenizer.pad_token_id, device) if args.pack_pairs else None
    if why_not_packed and rank == 0:
        print(f"--pack-pairs: scoring chosen and rejected texts in rows of their own, as {why_not_packed}", flush=True)
    packed = args.pack_pairs and not why_not_packed
    model = PairScorer(raw_model, packed)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")

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
            raw_model.load_state_dict(AutoModelForSequenceClassification.from_pretrained(
                ckpt, num_labels=1, dtype=weights_dtype).state_dict())
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
    last = {"eval/pref_accuracy": None}  # the latest values the progress line shows

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
        shown = {"loss": last.get("train/loss"), "train acc": last.get("train/accuracy"),
                 "eval acc": last["eval/pref_accuracy"]}
        text = " | ".join(f"{k} {v:.3g}" for k, v in shown.items() if v is not None)
        if progress:
            bar.set_postfix_str(f"{text} | {seconds_per_step:.2f} s/step")
        else:
            print(f"step {step}/{args.total_steps} | {text} | {seconds_per_step:.2f} s/step | "
                  f"ETA {eta((args.total_steps - step) * seconds_per_step)}", flush=True)

    def evaluate(step: int) -> Optional[float]:
        acc = None
        if rank == 0 and eval_pairs:
            scores = score_sequences(raw_model, [c for c, _, _ in eval_pairs] + [r for _, r, _ in eval_pairs],
                                     tokenizer.pad_token_id, device, autocast, progress=progress)
            chosen, rejected = scores.split(len(eval_pairs))
            acc = float((chosen > rejected).float().mean())
            log({"step": step, "eval/pref_accuracy": acc, "eval/margin": float((chosen - rejected).mean()),
                 "eval/loss": float(preference_loss(chosen, rejected).mean())})
            if not progress:
                print(f"eval at step {step}: pair accuracy {acc:.4f} on {len(eval_pairs)} held-out pairs", flush=True)
            if wandb:
                decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
                wandb.log({"eval/samples": wandb.Table(
                    columns=["chosen", "rejected", "r_chosen", "r_rejected"],
                    data=[[decode(c), decode(r), float(a), float(b)]
                          for (c, r, _), a, b in list(zip(eval_pairs, chosen, rejected))[:16]])}, step=step)
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
        n_train = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
        head = f"; new score head {', '.join(new_head)} ~ N(0, 1/(H+1))" if new_head else ""
        print(f"run directory: {run_dir}  |  {len(pairs)} training pairs, {len(eval_pairs)} held-out pairs, "
              f"{n_train / 1e6:.2f}M trainable parameters on {device}, micro-batch {micro} pairs"
              f"{' packed in one row each' if packed else ''}{head}", flush=True)
    step, final = start_step, {}
    tokens_since_log, last_log_step, t_log = 0, start_step, time.perf_counter()
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
                # 4a. The next global batch of pairs in epoch order; every process draws the same indices and
                #     keeps its share.
                if cursor + args.batch_size > len(order):
                    order, cursor = torch.randperm(len(pairs), generator=order_gen), 0
                batch = [pairs[i] for i in order[cursor : cursor + args.batch_size].tolist()]
                cursor += args.batch_size
                share = args.batch_size // world
                mine = batch[rank * share : (rank + 1) * share]
                # 4b. Score chosen and rejected in one pass (one row per pair with --pack-pairs); the Bradley-Terry
                #     loss (Eq. 1) is the mean over the global batch, so each micro-batch adds its sum / batch size
                #     (DDP averages, hence x world).
                sums = {"loss": 0.0, "correct": 0.0, "margin": 0.0, "reward": 0.0}
                for k in range(0, share, micro):
                    *tensors, margins = (pack_pairs if packed else collate_pairs)(mine[k : k + micro],
                                                                                 tokenizer.pad_token_id)
                    sync = k + micro >= share or not ddp
                    with (model.no_sync() if not sync else torch.enable_grad()), autocast:
                        scores = model(*(t.to(device) for t in tensors))
                        chosen, rejected = scores[:, 0], scores[:, 1]
                        loss = preference_loss(chosen, rejected, margins.to(device) if args.margin_column else None,
                                               args.center_rewards_coef).sum() / args.batch_size
                        (loss * world).backward()
                    chosen, rejected, scores = chosen.detach(), rejected.detach(), scores.detach()
                    sums["loss"] += loss.item()
                    sums["correct"] += float((chosen > rejected).sum())
                    sums["margin"] += float((chosen - rejected).sum())
                    sums["reward"] += float(scores.sum()) / 2
                    tokens_since_log += sum(len(c) + len(r) for c, r, _ in mine[k : k + micro])  # the texts' tokens
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                lr = scheduler.get_last_lr()[0]  # the rate of this step's update (logged below)
                scheduler.step()
                steps_timed, seconds_timed = steps_timed + 1, seconds_timed + time.perf_counter() - t_step

                # 4c. Log the loss, pair accuracy and margin of this step's batch, and the timings.
                if step % args.log_every == 0 or step == args.total_steps:
                    local = torch.tensor([sums[k] for k in ("loss", "correct", "margin", "reward")] + [tokens_since_log],
                                         dtype=torch.float64, device=device)
                    if ddp:
                        dist.all_reduce(local)
                    loss_sum, correct, margin_sum, reward_sum, n_tokens = local.tolist()
                    elapsed = time.perf_counter() - t_log
                    final = {"step": step, "train/loss": loss_sum, "train/accuracy": correct / args.batch_size,
                             "train/margin": margin_sum / args.batch_size, "train/reward": reward_sum / args.batch_size,
                             "train/grad_norm": float(grad_norm), "train/lr": lr,
                             "perf/step_s": elapsed / (step - last_log_step),
                             "perf/tokens_per_s": n_tokens / max(elapsed, 1e-9)}
                    log(final)
                    tokens_since_log, last_log_step, t_log = 0, step, time.perf_counter()
                bar.update(1)
                if progress or step % args.log_every == 0:
                    report(step, seconds_timed / steps_timed)
                if args.eval_every and step % args.eval_every == 0 and step != args.total_steps:
                    evaluate(step)
                    t_log = time.perf_counter()
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

    # 5. Final evaluation; the reward model (LoRA merged into it) with the mean and std of its scores on the
    #    training prompts' chosen completions in its config, for whitened rewards in PPO; the curves.
    if not stop.requested:
        final["eval/pref_accuracy"] = evaluate(step)
        checkpoint(step)
        if rank == 0:
            merged = copy.deepcopy(raw_model).merge_and_unload() if args.lora_r else raw_model
            chosen = score_sequences(merged, [c for c, _, _ in pairs], tokenizer.pad_token_id, device, autocast,
                                     progress=progress)
            merged.config.reward_mean, merged.config.reward_std = float(chosen.mean()), float(chosen.std())
            final.update({"final/reward_mean": merged.config.reward_mean, "final/reward_std": merged.config.reward_std})
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
