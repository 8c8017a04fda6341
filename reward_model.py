"""Bradley-Terry reward model: a sequence classifier trained on preference pairs, for ppo.py via rewards.py.

InstructGPT (arXiv:2203.02155, Sec. 3.5): a language model with a scalar head in place of its unembedding scores
r(x, y), trained on pairs where y_c was preferred to y_r:
    loss = -E[ log sigmoid(r(x, y_c) - r(x, y_r) - m) ] + c E[ (r(x, y_c) + r(x, y_r))^2 ]    (Eq. 1)
with Llama 2's margin m (arXiv:2307.09288, Eq. 2; `--margin-column`) and reward centring c (arXiv:2312.09244,
`--center-rewards-coef`); `--tie-strength` trains Davidson's (1970) ties; `--comparisons K` makes the pairs by ranking
K samples of the policy with a rule labeler. The mean and std of the training pairs' chosen scores go into
final/config.json (`reward_mean`, `reward_std`) for ppo.py's whitened rewards.

Run (more: docs/reward_model.md and docs/rlhf_pipeline.md):
    python reward_model.py  # embedded: models/tiny-arith on data/arith prefs
    torchrun --nproc-per-node 2 reward_model.py  # data parallel

Deviations (why, measurements: docs/reward_model.md):
- The new score head is initialised N(0, 1/(H+1)) as in lm-human-preferences (arXiv:2403.17031), not HF's std 0.02.
- The text scored is prompt + response as the tokenizer encodes it (no EOS appended), read at its last real token.
- One row per pair, the shared prefix once (`--pack-pairs`, arXiv:2410.20305), checked at start against plain rows.
- A batch is `--batch-size` pairs in epoch order; with `--ranking-column`, `--batch-size` rankings (InstructGPT).
- Pairs longer than `--max-length` are dropped (with a notice), not truncated.
- Held-out accuracy counts ties as wrong; dropout is off.
"""

import atexit
import contextlib
import copy
import importlib.util
import inspect
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, make_dataclass, replace
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro
from datasets import Dataset, load_dataset
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig
from transformers import AutoConfig, AutoModel, DynamicCache, logging as hf_logging

try:
    from rewards import make_reward
except ModuleNotFoundError as e:
    if e.name != "rewards":
        raise
    sys.exit(f"error: {e.name} not found: copy rewards.py from cleanrl-llm into {Path(__file__).parent}")


@dataclass
class Algorithm:
    center_rewards_coef: float = 0.0
    """weight of a loss on the pair's squared score sum: scores near 0 (0: off; TRL: 0.01)"""
    margin_column: Optional[str] = None
    """column of a per-pair margin >= 0 the chosen score must exceed the other's by (Llama 2)"""
    tie_strength: float = 0.0
    """how strongly pairs marked `tie` pull their scores together (Davidson; 0: off)"""
    tie_start_step: int = 0
    """the ties train only after this step"""
    ranking_column: Optional[str] = None
    """column of a ranking of K responses (K in column `k`): one batch element (--batch-size counts rankings),
    its pairs weighted 1/C(K,2)"""
    comparisons: int = 0
    """K >= 2: make pairs from K samples of --policy per prompt, ranked by --labeler (0: read pairs)"""
    comparison_rankings: bool = True
    """train --comparisons as rankings; --no-comparison-rankings: as independent pairs"""
    comparison_prompts: int = 2000
    """prompts of --dataset-split to sample --comparisons for"""
    policy: Optional[str] = None
    """the model --comparisons samples (None: --model-name-or-path)"""
    labeler: str = "correctness"
    """reward (rewards.py) that ranks each prompt's K samples (equal scores: a tie)"""
    temperature: float = 0.7
    """sampling temperature of --comparisons"""
    max_completion_length: int = 40
    """longest completion --comparisons samples, in tokens"""


@dataclass
class ModelData:
    model_name_or_path: str = "models/tiny-arith"
    """folder or hub id of the LM or reward model to start from (and its tokenizer)"""
    dataset: str = "data/arith"
    """folder of <split>.jsonl files, a JSON-lines file, or a hub id"""
    dataset_split: str = "prefs"
    """split of training pairs (prefs: train if a folder has no prefs.jsonl)"""
    eval_split: Optional[str] = "prefs_test"
    """split of held-out pairs for eval/pref_accuracy (None: no eval)"""
    prompt_column: str = "prompt"
    """column holding the prompt"""
    chosen_column: str = "chosen"
    """column holding the preferred response"""
    rejected_column: str = "rejected"
    """column holding the other response"""
    max_length: int = 128
    """longest prompt + response in tokens; longer pairs are dropped"""
    eval_limit: int = 500
    """at most this many eval examples"""
    lora_r: int = 0
    """LoRA rank on each linear layer (0: off; the score head trains in full); needs peft"""
    lora_alpha: float = 32.0
    """LoRA scale: the update is x alpha / r"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""


@dataclass
class Optimisation:
    learning_rate: float = 1e-3
    """peak learning rate of AdamW"""
    total_steps: int = 300
    """optimiser steps (300: 4.8 epochs of the embedded pairs); may change on resume"""
    batch_size: int = 64
    """pairs per optimiser step, over all processes"""
    micro_batch_size: int = 0
    """pairs per forward/backward (0: the largest divisor <= 128)"""
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
    log_every: int = 10
    """steps between rows of metrics.jsonl"""
    eval_every: int = 100
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
    fsdp: bool = False
    """under torchrun, shard weights, gradients, AdamW states (FSDP2), not DDP"""
    device: str = "auto"
    """cuda, cpu, or auto (cuda if available)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """weights dtype; auto: float32 with bfloat16 autocast on CUDA"""
    exp_name: str = "reward_model"
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


def bradley_terry_loss(chosen, rejected, margin=None, center_coef: float = 0.0, tie=None, nu: float = 0.0):
    """Per-pair loss, chosen, rejected, margin, tie (bool): [B] -> [B] float32: -log sigmoid(r_c - r_r - m) (Eq. 1
    of arXiv:2203.02155; m: Eq. 2 of arXiv:2307.09288) + center_coef (r_c + r_r)^2 (centring, arXiv:2312.09244).
    nu > 0: Davidson (1970; restated in arXiv:1909.07123 Sec. 1.1), strengths e^r, d = r_c - r_r:
    P(c wins) = 1 / (1 + e^-d + nu e^(-d/2)), P(tie) = nu / (e^(d/2) + e^(-d/2) + nu); a tie's loss is least at
    d = 0. nu = 0 is Bradley-Terry."""
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.float()
    loss = -torch.nn.functional.logsigmoid(diff)
    if nu:
        log_nu = torch.full_like(diff, math.log(nu))
        win = torch.logsumexp(torch.stack([torch.zeros_like(diff), -diff, log_nu - diff / 2]), 0)
        loss = win if tie is None else torch.where(
            tie, torch.logsumexp(torch.stack([diff / 2, -diff / 2, log_nu]), 0) - log_nu, win)
    if center_coef:
        loss = loss + center_coef * (chosen.float() + rejected.float()) ** 2
    return loss


def sequence_scores(model, input_ids, attention_mask) -> torch.Tensor:
    """The classifier's score at each sequence's last real token (the rightmost non-pad id): input_ids,
    attention_mask [B, T], padded on either side -> [B] float32. Position ids count real tokens only."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0].float()


@torch.no_grad()
def init_score_head(model, new_keys: set[str]) -> list[str]:
    """The parameters the checkpoint lacks (the score head): weights ~ N(0, 1/(H+1)), biases 0 (arXiv:2403.17031)."""
    for name in sorted(new_keys):
        param = model.get_parameter(name)
        if name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, 1 / math.sqrt(param.shape[-1] + 1))
    return sorted(new_keys)


def tokenize_pairs(tokenizer, prompts, chosen, rejected, margins, max_length: int, what: str, ties=None):
    """prompt + response, tokenised as the tokenizer does by default -> ([(chosen_ids, rejected_ids, margin, tie)],
    pairs dropped as too long). No text may end in the pad id (its score would be read earlier)."""
    c_ids, r_ids = (tokenizer([p + y for p, y in zip(prompts, ys)])["input_ids"] for ys in (chosen, rejected))
    pairs, dropped = [], 0
    for i, (c, r) in enumerate(zip(c_ids, r_ids)):
        if c == r:
            raise ValueError(f"{what}, row {i}: chosen and rejected are the same text (no preference): remove the row")
        if max(len(c), len(r)) > max_length:
            dropped += 1
            continue
        if tokenizer.pad_token_id in (c[-1], r[-1]):
            raise ValueError(f"{what}, row {i}: a response ends in the pad token {tokenizer.pad_token!r}, which the "
                             f"classifier skips: strip it")
        pairs.append((c, r, float(margins[i]) if margins else 0.0, bool(ties and ties[i])))
    if not pairs:
        raise ValueError(f"{what}: every pair is longer than --max-length {max_length}: raise it")
    return pairs, dropped


def ranking_pairs(scores: list[float]) -> list[tuple]:
    """A labeler's scores of K responses to a prompt -> every pair (better, worse) of unequal scores, in index order:
    a ranking's C(K,2) comparisons less its ties."""
    return [(i, j) if scores[i] > scores[j] else (j, i)
            for i, j in itertools.combinations(range(len(scores)), 2) if scores[i] != scores[j]]


def tied_pairs(scores: list[float], texts: list) -> list[tuple]:
    """The pairs `ranking_pairs` leaves out: equal scores (a tie) of different texts (strings or token ids), in index
    order."""
    return [(i, j) for i, j in itertools.combinations(range(len(scores)), 2)
            if scores[i] == scores[j] and texts[i] != texts[j]]


def tokenize_rankings(tokenizer, prompts, chosen, rejected, keys, sizes, max_length: int, what: str, ties=None):
    """Pairs tagged with their ranking's id and size K -> ([(texts, [(better, worse, tie)], 1 / C(K,2))] per ranking:
    its distinct prompt + response texts tokenised, its pairs indexing them, their weight in Eq. 1), pairs dropped as
    too long)."""
    grouped = {}
    for i, (p, c, r, key, k) in enumerate(zip(prompts, chosen, rejected, keys, sizes)):
        if type(k) is not int or k < 2:
            raise ValueError(f"{what}, row {i}: ranking size k={k!r}: must be the number of responses ranked (>= 2)")
        texts, pairs, size = grouped.setdefault(key, ({}, [], k))
        if k != size or len(pairs) == math.comb(k, 2):
            raise ValueError(f"{what}, row {i}: ranking {key!r} " + (f"says k={k} and k={size}" if k != size else
                             f"has more than C({k},2) = {math.comb(k, 2)} pairs") + ": fix its column `k`")
        pairs.append((*(texts.setdefault(p + y, len(texts)) for y in (c, r)), bool(ties and ties[i])))
    rankings, dropped = [], 0
    for texts, pairs, k in grouped.values():
        ids = tokenizer(list(texts))["input_ids"]
        if any(t and t[-1] == tokenizer.pad_token_id for t in ids):
            raise ValueError(f"{what}: a response ends in the pad token {tokenizer.pad_token!r}, which the classifier "
                             f"skips: strip it")
        kept = [(a, b, tie) for a, b, tie in pairs if max(len(ids[a]), len(ids[b])) <= max_length]
        dropped += len(pairs) - len(kept)
        used = {t: n for n, t in enumerate(sorted({t for a, b, _ in kept for t in (a, b)}))}  # texts left in a pair
        if kept:
            rankings.append(([ids[t] for t in used], [(used[a], used[b], tie) for a, b, tie in kept],
                             1 / math.comb(k, 2)))
    if not rankings:
        raise ValueError(f"{what}: every pair is longer than --max-length {max_length}: raise it")
    return rankings, dropped


def right_pad(rows: list, pad_id: int) -> tuple:
    """Token lists -> (ids [B, T] right-padded with pad_id, attention mask [B, T])."""
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad([torch.tensor(x, dtype=torch.long) for x in rows], True, pad_id),
            pad([torch.ones(len(x), dtype=torch.long) for x in rows], True))


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


def pack_texts(pairs: list[tuple], pad_id: int) -> tuple:
    """`pack_pairs` of the chosen and rejected texts -> (ids, allowed, position ids, ends [B, 2]: the columns of each
    text's last token)."""
    ids, allowed, position_ids, split, shared, length = pack_pairs([(c, r) for c, r, *_ in pairs], pad_id)
    # the rejected text ends at the row's last real token, or in the prefix if it has no tail
    ends = torch.cat([split - 1, torch.where(length > split, length - 1, shared - 1)], dim=1)
    return ids, allowed, position_ids, ends


def pair_batch(pairs: list[tuple], pad_id: int, packed: bool, device) -> list:
    """PairScorer's input on the device: `pack_texts` rows, or the B chosen then the B rejected texts right-padded."""
    batch = pack_texts(pairs, pad_id) if packed else right_pad([p[i] for i in (0, 1) for p in pairs], pad_id)
    return [t.to(device) for t in batch]


class PairScorer(torch.nn.Module):
    """r(x, y_c), r(x, y_r) of a batch of pairs -> [B, 2] float32, from `pack_texts` rows (the backbone with their
    mask, the score head read at the two ends) or plain rows (the classifier); flat: each row's score -> [N]
    (rankings). One module for DDP."""

    def __init__(self, model, packed: bool):
        super().__init__()
        self.model, self.packed = model, packed

    def forward(self, ids, attention, position_ids=None, ends=None, flat: bool = False):
        if not self.packed:  # [2B, T]: the B chosen then the B rejected texts
            scores = sequence_scores(self.model, ids, attention)
            return (scores if flat else scores.view(2, -1).T).clone()  # not views (FSDP2 hooks outputs)
        classifier = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        if classifier.config._attn_implementation != "sdpa":  # eager attention adds its mask to the logits
            dtype = next(classifier.parameters()).dtype
            attention = torch.zeros_like(attention, dtype=dtype).masked_fill(~attention, torch.finfo(dtype).min)
        hidden = classifier.base_model(input_ids=ids, attention_mask=attention[:, None], position_ids=position_ids,
                                       use_cache=False).last_hidden_state
        rows = torch.arange(len(ids), device=ids.device)[:, None]
        return classifier.score(hidden[rows, ends]).squeeze(-1).to(torch.float32, copy=True)


@torch.no_grad()
def score_sequences(model, rows: list, pad_id: int, device, autocast, batch_size: int = 256, progress: bool = False):
    """Scores of token lists in eval mode -> [N] float32 on the CPU; each distinct list once, in length order."""
    model.eval()
    distinct = sorted(set(map(tuple, rows)), key=lambda t: (len(t), t))
    out = []
    for i in tqdm(range(0, len(distinct), batch_size), desc="score", leave=False, disable=not progress):
        ids, mask = right_pad(distinct[i : i + batch_size], pad_id)
        with autocast:
            out.append(sequence_scores(model, ids.to(device), mask.to(device)).cpu())
    model.train()
    where = {t: k for k, t in enumerate(distinct)}
    return torch.cat(out)[[where[tuple(r)] for r in rows]]


def pair_metrics(model, pairs, pad_id: int, device, autocast, progress: bool = False) -> dict:
    """Held-out pairs -> pair accuracy (a tie is wrong), mean margin r_c - r_r, the loss of Eq. 1."""
    scores = score_sequences(model, [p[i] for i in (0, 1) for p in pairs], pad_id, device, autocast, progress=progress)
    chosen, rejected = scores.split(len(pairs))
    return {"eval/pref_accuracy": float((chosen > rejected).float().mean()), "eval/margin":
            float((chosen - rejected).mean()), "eval/loss": float(bradley_terry_loss(chosen, rejected).mean())}


def load_preferences(args, tokenizer, flag: str, with_margin: bool, limit: Optional[int] = None):
    """A split's first `limit` pairs, checked (`load_pairs`) and tokenised (`tokenize_pairs`; the training split with
    --ranking-column: `tokenize_rankings`); ties are left out unless --tie-strength trains them."""
    margin = args.margin_column if with_margin else None
    ranking = [args.ranking_column, "k"] if with_margin and args.ranking_column else []
    tie = ["tie"] * bool(with_margin and args.tie_strength)
    columns = [args.prompt_column, args.chosen_column, args.rejected_column, *[margin] * bool(margin), *ranking]
    ds = load_pairs(args, flag, columns + tie, margin)
    if "tie" in ds.column_names and not tie:  # a tie states no preference (Bradley-Terry, held-out accuracy)
        ds = ds.filter(lambda row: not row["tie"])
    values, what = [list(ds[c])[:limit] for c in columns], f"split '{getattr(args, flag)}'"
    ties = list(ds["tie"])[:limit] if tie else None
    if ties and all(ties):
        raise ValueError(f"{what}: every row is a tie (column `tie` true), which orders nothing: add untied rows")
    if ranking:
        return tokenize_rankings(tokenizer, *values, args.max_length, what, ties)
    return tokenize_pairs(tokenizer, *values[:3], values[3] if margin else None, args.max_length, what, ties)


@torch.no_grad()
def policy_comparisons(args, tokenizer, ds, device, progress: bool, ties: bool) -> list[dict]:
    """InstructGPT's comparisons (Sec. 3.5) by a rule: K samples of --policy per prompt of `ds`, scored by --labeler
    -> pairs rows (`ranking_pairs`; `ties`: also `tied_pairs`, column `tie`), `ranking`, `k` = K."""
    labeler = make_reward(args.labeler)
    prompts = list(ds[args.prompt_column])
    columns = {c: list(ds[c]) for c in sorted(labeler.required_columns)}
    policy = AutoModelForCausalLM.from_pretrained(args.policy or args.model_name_or_path).to(device)
    eos = own_generation_config(policy, tokenizer)
    gen = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0, eos_token_id=eos,
                           max_new_tokens=args.max_completion_length, pad_token_id=tokenizer.pad_token_id)
    rows, K = [], args.comparisons
    for i in tqdm(range(0, len(prompts), 64), desc="comparisons", leave=False, disable=not progress):
        enc = tokenizer(prompts[i : i + 64], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(device)
        completion_ids, _ = sample(policy, enc.input_ids.repeat_interleave(K, 0),
                                   enc.attention_mask.repeat_interleave(K, 0), gen)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        # texts the tokenizer makes one ("= 4", "=4") are one text to the reward model: no pair of them
        seen = tokenizer([prompts[i + k // K] + y for k, y in enumerate(texts)])["input_ids"]
        for j in range(len(enc.input_ids)):
            n, ys, seen_j = i + j, texts[j * K : (j + 1) * K], seen[j * K : (j + 1) * K]
            values = {c: v[n] for c, v in columns.items()}
            scores = labeler(ys, prompts=[prompts[n]] * K, **{c: [v] * K for c, v in values.items()})
            pairs = [(a, b, False) for a, b in ranking_pairs(scores) if seen_j[a] != seen_j[b]] + [
                (a, b, True) for a, b in tied_pairs(scores, seen_j) if ties]
            rows += [{"prompt": prompts[n], "chosen": ys[a], "rejected": ys[b], **values, "ranking": n, "k": K,
                      **({"tie": tie} if ties else {})} for a, b, tie in pairs]
    return rows


def comparison_data(args, run, tokenizer):
    """--comparisons: comparisons.jsonl (comparisons_test.jsonl: of the eval split), written once by rank 0 into the
    run directory -> (the arguments that read them as rankings, the held-out comparisons as pairs)."""
    needed = [args.prompt_column, *sorted(make_reward(args.labeler).required_columns)]
    splits = {"dataset_split": load_split(args, "dataset_split", needed, "--prompt-column, or another --labeler")}
    for i, row in enumerate(splits["dataset_split"], 1):
        if missing := [c for c in needed if row[c] is None]:
            raise ValueError(f"split '{args.dataset_split}', row {i}: no {missing}, which --comparisons needs")
    if args.eval_split:
        columns = [args.prompt_column, args.chosen_column, args.rejected_column, *needed[1:]]
        splits["eval_split"] = load_pairs(args, "eval_split", columns)
    for flag, name, limit in (("dataset_split", "comparisons", args.comparison_prompts),
                              ("eval_split", "comparisons_test", args.eval_limit)):
        path = run.dir / f"{name}.jsonl"
        if run.rank == 0 and flag in splits and not path.exists():
            rows = policy_comparisons(args, tokenizer, splits[flag].take(limit), run.device, run.progress,
                                      ties=flag == "dataset_split" and args.tie_strength > 0)
            if all(r.get("tie") for r in rows):
                raise ValueError(f"--comparisons {args.comparisons}: every sample of each of {limit} prompts of split "
                                 f"'{getattr(args, flag)}' got the same grade from --labeler, so none can be ranked: "
                                 "start from a sometimes-right policy, or sample more (--comparisons, --temperature)")
            run.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.rename(path)  # atomic
            n_ties = sum(bool(r.get("tie")) for r in rows)
            run.say(f"{path}: {len(rows) - n_ties} pairs and {n_ties} ties from {len({r['ranking'] for r in rows})} "
                    f"prompts x {args.comparisons} samples of {args.policy or args.model_name_or_path}")
    run.barrier()
    data_args = replace(args, dataset=str(run.dir), dataset_split="comparisons", eval_split=None,
                        prompt_column="prompt", chosen_column="chosen", rejected_column="rejected",
                        ranking_column="ranking" if args.comparison_rankings else None)
    held_out = load_preferences(replace(data_args, eval_split="comparisons_test"), tokenizer, "eval_split", False)[0] \
        if args.eval_split else []
    return data_args, held_out


def collate_rankings(rankings, pad_id: int):
    """Rankings -> (ids [N, T] right-padded: every ranking's texts, attention mask [N, T], better [P], worse [P]: each
    pair's rows, weights [P]: 1 / C(K,2), ties [P] bool)."""
    rows, better, worse, weights, ties = [], [], [], [], []
    for texts, pairs, weight in rankings:
        better += [len(rows) + a for a, _, _ in pairs]
        worse += [len(rows) + b for _, b, _ in pairs]
        ties += [tie for _, _, tie in pairs]
        weights += [weight] * len(pairs)
        rows += texts
    return (*right_pad(rows, pad_id), torch.tensor(better), torch.tensor(worse), torch.tensor(weights),
            torch.tensor(ties, dtype=torch.bool))


def preference_update(scorer, optimizer, items: list, micro: int, args, pad_id: int, world: int, device,
                      autocast, rankings: bool = False, nu: float = 0.0) -> tuple:
    """One optimiser step on this process's pairs (or rankings), `micro` at a time, on Eq. 1's mean over the global
    batch (a ranking's pairs weigh 1 / C(K,2)). nu: Davidson's tie strength (0: a tie adds no loss)."""
    ddp = isinstance(scorer, torch.nn.parallel.DistributedDataParallel)
    packed = (scorer.module if ddp else scorer).packed
    sums = dict.fromkeys(("loss", "correct", "margin", "reward", "pairs", "texts"), 0.0)
    if len(items) > micro:  # length-sorted micro-batches pad less; the loss, a sum, is the same
        items = sorted(items, key=lambda x: max(map(len, x[0])) if rankings else
                       len(x[0]) + len(x[1]) - shared_prefix(x[0], x[1]) if packed else max(len(x[0]), len(x[1])))
    for k in range(0, len(items), micro):
        chunk, weights, margins = items[k : k + micro], None, None
        with (scorer.no_sync() if ddp and k + micro < len(items) else torch.enable_grad()), autocast:
            if rankings:
                ids, mask, better, worse, weights, ties = (t.to(device) for t in collate_rankings(chunk, pad_id))
                scores = scorer(ids, mask, flat=True)
                chosen, rejected = scores[better], scores[worse]
            else:
                margins = torch.tensor([p[2] for p in chunk], device=device)
                scores = scorer(*pair_batch(chunk, pad_id, packed, device))
                chosen, rejected, ties = scores[:, 0], scores[:, 1], torch.tensor([p[3] for p in chunk], device=device)
            loss = bradley_terry_loss(chosen, rejected, margins, args.center_rewards_coef, ties, nu).masked_fill(
                ties & (nu == 0), 0.0)
            loss = (loss if weights is None else loss * weights).sum() / args.batch_size
            (loss * world).backward()
        chosen, rejected, scores = chosen.detach()[~ties], rejected.detach()[~ties], scores.detach()  # ties: no order
        stats = (loss.item(), (chosen > rejected).sum(), (chosen - rejected).sum(), scores.sum(), len(chosen),
                 scores.numel())
        for key, value in zip(sums, stats):
            sums[key] += float(value)
    grad_norm = torch.nn.utils.clip_grad_norm_(scorer.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    return sums, grad_norm


def load_reward_model(args: Args, tokenizer, device) -> tuple:
    """The causal LM with a new scalar head (a one-output sequence classifier), or a reward model; dropout off; LoRA
    with --lora-r -> (model, the new head's parameters)."""
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no "newly initialized" report: the head is new on purpose
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=1, dtype=dtype, output_loading_info=True)
    hf_logging.set_verbosity(verbosity)
    new_head = [] if args.resume else init_score_head(model, set(loading["missing_keys"]))
    model.config.pad_token_id = tokenizer.pad_token_id  # the classifier finds each sequence's end by it
    model.to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear",
                                                 lora_dropout=args.lora_dropout, task_type="SEQ_CLS"))
    return model, new_head


def load_preference_splits(args: Args, run, tokenizer) -> tuple:
    """Every split, checked and tokenised before the model loads (--comparisons: made first) -> (training pairs or
    rankings, held-out pairs and comparisons, whether rankings)."""
    data_args, held_out = comparison_data(args, run, tokenizer) if args.comparisons else (args, [])
    pairs, dropped = load_preferences(data_args, tokenizer, "dataset_split", with_margin=True)
    eval_pairs, eval_dropped = [], 0
    if args.eval_split:
        eval_pairs, eval_dropped = load_preferences(args, tokenizer, "eval_split", False, args.eval_limit)
    if dropped + eval_dropped:
        run.say(f"dropped {dropped + eval_dropped} pairs longer than --max-length {args.max_length} tokens")
    return pairs, eval_pairs, held_out, bool(data_args.ranking_column)


def preference_metrics(run, sums: dict) -> dict:
    """`preference_update`'s sums over every process -> the batch's metrics."""
    total = run.gather(torch.tensor([list(sums.values())], dtype=torch.float64, device=run.device)).sum(0)
    s = dict(zip(sums, total.tolist()))
    return {"train/loss": s["loss"], "train/accuracy": s["correct"] / max(s["pairs"], 1),
            "train/margin": s["margin"] / max(s["pairs"], 1), "train/reward": s["reward"] / s["texts"]}


RESUME_MAY_CHANGE = ("total_steps", "log_every", "eval_every", "save_every", "save_every_minutes", "eval_limit",
                     "track", "wandb_project_name", "wandb_entity", "device", "pack_pairs")


def main(args: Args) -> dict:
    # 0. Check every input first (--resume: the run's own arguments); processes, device, seeds.
    args, overrides = resume_args(args, RESUME_MAY_CHANGE)
    micro = check_args(args)
    run = Run(args, overrides, shown=("train/loss", "train/accuracy", "eval/pref_accuracy"))
    device, world = run.device, run.world

    # 1. Data: pairs as the token ids of prompt + chosen, prompt + rejected (and margin), or rankings.
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    pairs, eval_pairs, held_out, rankings = load_preference_splits(args, run, tokenizer)

    # 2. Model: the causal LM with a new scalar head; a row per pair if it passes the check (rankings: per text).
    model, new_head = load_reward_model(args, tokenizer, device)
    packed = not rankings and use_packing(
        run, model, lambda p: PairScorer(model, p)(*pair_batch(pairs[:8], pad_id, p, device)))
    scorer = PairScorer(model, packed)
    if run.fsdp:
        scorer = run.shard(scorer, decoder_layers(model))
    elif run.ddp:
        scorer = torch.nn.parallel.DistributedDataParallel(
            scorer, device_ids=[device] if device.type == "cuda" else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and args.dtype == "auto")

    # 3. Optimiser, schedule and data order (the same on every process); --resume restores them.
    optimizer, scheduler, lr_anchor, state = optimizer_and_schedule(args, run, scorer, model, overrides)
    order = PairOrder(len(pairs), args.seed)
    prefs = [i for i, p in enumerate(pairs) if rankings or not p[3]]  # until --tie-start-step (a ranking: masked)
    pref_order = PairOrder(len(prefs), args.seed)
    if state:
        order.load(state)
        pref_order.load(state.get("pref_order", pref_order.state()))  # none saved before --tie-start-step's time

    def measure() -> tuple[dict, list]:
        metrics = pair_metrics(model, eval_pairs, pad_id, device, autocast, run.progress) if eval_pairs else {}
        if held_out:  # the policy's held-out comparisons
            comparisons = pair_metrics(model, held_out, pad_id, device, autocast, run.progress)
            metrics.update({k.replace("pref", "comparison"): v for k, v in comparisons.items()})
        return metrics, []

    def save() -> Path:
        state = {"optimizer": None if run.fsdp else optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        state.update(lr_anchor=lr_anchor[0], **order.state(), pref_order=pref_order.state())
        return run.checkpoint(model, tokenizer, state, per_rank={})

    # 4. Train.
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    unit = "rankings" if rankings else "pairs"
    head = f"; new score head {', '.join(new_head)} ~ N(0, 1/(H+1))" if new_head else ""
    run.say(f"run directory: {run.dir}  |  {len(pairs)} training {unit}, {len(eval_pairs)} held-out pairs, "
            f"{n_train / 1e6:.2f}M trainable parameters on {device}, micro-batch {micro} {unit}"
            f"{' packed in one row each' if packed else ''}{head}")
    share = args.batch_size // world
    final, tokens, seconds, last_log = {}, 0, 0.0, run.start
    with run:
        for step in run.steps(measure, save):
            t_step = time.perf_counter()
            # 4a. The next batch in epoch order (preferences until --tie-start-step); this process's share.
            ties = step > args.tie_start_step
            drawn = order.draw(args.batch_size) if ties else [prefs[i] for i in pref_order.draw(args.batch_size)]
            mine = [pairs[i] for i in drawn][run.rank * share : (run.rank + 1) * share]
            # 4b. Score chosen and rejected in one pass; a step on Eq. 1's mean over the batch.
            sums, grad_norm = preference_update(scorer, optimizer, mine, micro, args, pad_id, world, device, autocast,
                                                rankings, args.tie_strength * ties)
            lr = scheduler.get_last_lr()[0]  # the rate of this step's update
            scheduler.step()
            tokens += sum(sum(map(len, x[0])) if rankings else len(x[0]) + len(x[1]) for x in mine)  # the texts' tokens
            seconds += time.perf_counter() - t_step

            # 4c. Log the batch's loss, pair accuracy and margin, the timings.
            if step % args.log_every == 0 or step == args.total_steps:
                final = {"step": step, **preference_metrics(run, sums), "train/grad_norm": float(grad_norm),
                         "train/lr": lr, "perf/step_s": seconds / (step - last_log),
                         "perf/tokens_per_s": tokens * world / max(seconds, 1e-9)}
                run.log(final)
                tokens, seconds, last_log = 0, 0.0, step

    # 5. The reward model (LoRA merged) and its score mean and std over the training pairs' chosen texts (rankings:
    #    every text) for ppo.py; the final evaluation, a checkpoint, final/.
    merged, stats = model, {}
    with run.whole():  # --fsdp: rank 0 scores with whole weights
        if run.rank == 0 and not run.stop:
            merged = copy.deepcopy(model).merge_and_unload() if args.lora_r else model
            texts = [t for texts, _, _ in pairs for t in texts] if rankings else [p[0] for p in pairs if not p[3]]
            if len(set(map(tuple, texts))) < 2:  # one chosen text (the rest ties): every text of the pairs
                texts = [t for p in pairs for t in p[:2]]
            chosen = score_sequences(merged, texts, pad_id, device, autocast, progress=run.progress)
            stats = {"reward_mean": float(chosen.mean()), "reward_std": float(chosen.std())}
            final.update({f"final/{k}": v for k, v in stats.items()})

    def final_model():  # the statistics: in final/config.json only
        merged.config.update(stats)
        return merged

    final_dir = run.dir / "final"
    notes = (f"reward statistics for ppo.py: {', '.join(f'{k} {v:.4g}' for k, v in stats.items())} (saved in "
             f"{final_dir}/config.json); `ppo.py --reward {final_dir / 'reward.json'}` scores with it",)
    if stats and not stats["reward_std"] > 1e-6:  # (nan: one text)
        notes += ("warning: the reward model scores every training text alike, which ppo.py cannot whiten: train "
                  "on more comparisons or for more steps",)
    out = run.finish(final, measure, save, final_model, tokenizer, notes=notes * bool(stats))
    if run.rank == 0 and not out["interrupted"]:  # rewards.make_reward's spec, whitened
        spec = {"type": "reward_model", "model": str(final_dir.resolve()), "normalize": True}
        (final_dir / "reward.json").write_text(json.dumps(spec, indent=2) + "\n")
    return out


def check_args(args: Args) -> int:
    """Checks of the flags -> the micro-batch (pairs) of a process."""
    positive = ("total_steps", "batch_size", "max_length", "log_every", "learning_rate", "comparison_prompts",
                "temperature", "max_completion_length")
    non_negative = ("eval_every", "save_every", "warmup_steps", "eval_limit", "lora_r", "micro_batch_size",
                    "center_rewards_coef", "tie_strength", "tie_start_step")
    check_common(args, positive, non_negative, (args.model_name_or_path, *[args.policy] * bool(args.policy)))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} does not split evenly over {world} processes: use a "
                         f"multiple of {world}")
    what = f"each process's pairs (--batch-size / {world} processes)" if world > 1 else "--batch-size"
    micro = fit_micro_batch(args.micro_batch_size, args.batch_size // world, what)
    if args.lora_r and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-r needs peft: `pip install peft`")
    if args.tie_strength and args.margin_column:
        raise ValueError("--tie-strength with --margin-column: a tie has no margin; drop one of them")
    if args.tie_start_step and not args.tie_strength:
        raise ValueError(f"--tie-start-step {args.tie_start_step}: the ties would never train; pass --tie-strength 1")
    if args.tie_start_step >= args.total_steps and not args.resume:  # a shortened run: 80% as the recipe's 800 of 1000
        args.notes.append(f"--tie-start-step {args.tie_start_step} >= --total-steps: the ties start after step "
                         f"{args.total_steps * 4 // 5}")
        args.tie_start_step = args.total_steps * 4 // 5
    if args.comparisons:
        if args.comparisons < 2 or args.margin_column or args.ranking_column:
            raise ValueError(f"--comparisons {args.comparisons}: " + (
                "it ranks K >= 2 samples of each prompt (0: read pairs)" if args.comparisons < 2 else
                "its pairs have no margin and are ranked by prompt: drop --margin-column and --ranking-column"))
        make_reward(args.labeler)  # a bad spec fails here
    elif not args.comparison_rankings:
        raise ValueError("--no-comparison-rankings: there are no --comparisons to train as pairs")
    elif args.ranking_column and args.margin_column:
        raise ValueError("--ranking-column with --margin-column: a ranking's pairs carry no margin; drop one of them")
    return micro

# ---- plumbing: one text per name in all scripts


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
