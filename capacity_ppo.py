"""Actor-critic PPO that learns which working-memory capacity n a task needs.

A metacognitive controller watches a stream of tasks and, before each one, picks how many
working-memory slots to spend on it, n in {4, 6, 9, 12}. More slots solve harder tasks but cost
energy from a finite budget, so the best n depends on the task's difficulty, which the controller
never sees directly: it must read it off a noisy 60-dimensional "global workspace" and its own
recent accuracy. The learner is PPO with GAE, in the CleanRL single-file style.

Papers
- PPO, clipped surrogate (Eq. 7) and the combined objective (Eq. 9): https://arxiv.org/abs/1707.06347
- GAE (Eq. 16): https://arxiv.org/abs/1506.02438
- Time limits: bootstrap at truncation, not at termination: https://arxiv.org/abs/1712.00378
- Implementation details (lr annealing, advantage normalisation, clipped value loss, orthogonal
  init, approx-KL): https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/
- k3 KL estimator: http://joschu.net/blog/kl-approx.html

Run
    python capacity_ppo.py                                   # default: about 1 min on one CPU core
    python capacity_ppo.py --capacities 2 4 8 16 --seed 2    # another capacity set
    python capacity_ppo.py --track --wandb-project-name cap  # log to Weights & Biases
    python capacity_ppo.py --resume runs/<run>/checkpoints/step_N   # continue a checkpoint
Output: runs/{run_name}/ with args.json, metrics.jsonl, curves.png, checkpoints/step_N/ and a
table of evaluation returns (learned greedy policy, oracle, each fixed capacity, random).
Expected (seeds 1, 2, 3): greedy return 35.15 / 35.27 / 35.21 against oracle 35.73 and best fixed
28.08, i.e. 0.93 / 0.94 / 0.93 of the best-fixed -> oracle gap closed, about a minute each on one core.

The environment (`CapacityEnv`, vectorised over --num-envs with torch tensors)
- Difficulty d in [0, 1]. Each environment is in one of the --regime-means regimes (by default
  four, one inside the range where each capacity is the oracle's choice). Every step the regime
  is redrawn with probability --regime-switch-prob, and d follows a mean-reverting walk:
  d' = clip(d + drift * (mu_regime - d) + difficulty_noise * eps, 0, 1).
- Accuracy of capacity n at difficulty d is a psychometric curve: a task of difficulty d needs
  n_req(d) = d * --slots-at-max-difficulty slots, and
  p(n, d) = chance + (1 - chance) * sigmoid((n - n_req(d)) / --accuracy-temperature).
  The observed accuracy is the fraction right out of --items-per-step Bernoulli(p) items.
- Energy: a step at capacity n uses n slot-steps from the episode's --energy-budget.
- Reward (the specification's terms except the energy term, see "Departures"; every weight a flag):
  r = accuracy_weight * acc - energy_cost * n - switch_penalty * [n != n_prev]
      + escalation_bonus * [n > n_prev and acc < escalation_threshold]
      + efficiency_bonus * [n < n_prev and acc > efficiency_threshold].
- Episode end: terminated when the energy budget is spent (no bootstrap), truncated after
  --max-episode-steps (bootstrap from the value of the state reached).
- Observation (workspace_dim + 7 values): the workspace tanh(signal * (2d - 1) * u + noise) with a
  fixed random sign vector u; then a noisy difficulty estimate, rolling accuracy, remaining budget
  fraction, previous capacity index / (K - 1), steps at that capacity / 10, recent error rate and
  time pressure (fraction of the step limit used).
- Oracle: sees the true d and picks argmax_n E[accuracy_weight * p(n, d) - energy_cost * n]; it is
  myopic (ignores switch terms and the budget), so a learned policy may beat it slightly.
  With the defaults (1024 evaluation episodes) the oracle returns 35.7, the best fixed capacity
  (n = 9) 28.1 and a uniform random policy 23.7: the oracle's lead over the best fixed capacity is
  63% of its lead over random, so adapting n matters.

The agent: shared trunk Linear(obs, 256)-LayerNorm-ReLU x 2, actor and critic heads
Linear(256, 128)-ReLU-Linear(128, out), orthogonal init with gain sqrt(2).

Departures from the specification (each with its reason and, where measured, its effect; seed 1,
300k steps, share of the best-fixed -> oracle gap closed at the end; default 0.925)
- Energy term: -energy_cost * n (0.05 per slot-step), not the specification's -0.1 * energy_used / n^2.
  Dividing by n^2 makes a larger capacity *cheaper*, so the term cannot express an energy cost:
  with it (--energy-term spec, energy_used = slot-steps spent so far in the episode) the fixed
  n = 12 policy returns 41.1 and fixed n = 4 -17.8 (random 4.5) on the evaluation episodes, i.e.
  always taking the largest capacity wins and there is nothing to adapt. (The oracle and the
  gap-closed metric assume the linear term.)
- Learning rate 2.5e-4 annealed linearly to 0 (CleanRL's default), not 3e-4 constant: with
  --learning-rate 3e-4 --no-anneal-lr the gap closed is 0.767 / 0.901 / 0.909 at 100k / 200k /
  300k steps against 0.836 / 0.937 / 0.925.
- Rollout 64 environments x 64 steps, 4 minibatches of 1024, not 1 environment x 2048 steps with
  minibatches of 32: vectorised environments give 10x the steps per second and large minibatches
  fewer optimizer steps. With --num-envs 1 --num-steps 2048 --num-minibatches 64 the gap closed is
  0.199 / 0.319 / 0.608 at 100k / 200k / 300k steps, and the run took 693 s against 328 s (both
  timed while the machine was shared).
- Value loss 0.5 * mean_i max(unclipped_i, clipped_i) (the element-wise max, as in baselines'
  ppo2), not the specification's vf * max(mean(unclipped), mean(clipped)): the max of the two means
  is a bug there, since it does not clip per sample (a sample whose clipped error is smaller is
  still pulled past the clip whenever the other samples make the clipped mean the larger one).
  tests/test_capacity_ppo.py has a case where the two differ. Not measured as a training run.
- Value clipping is off by default (--clip-vloss turns it on): the clip (+-clip_coef = 0.2 around
  the rollout's V) works in raw return units while returns are ~20, so the critic lagged the whole
  run. Measured (mean V vs mean GAE return at iteration 10; explained variance at the end; gap
  closed at 100k / 200k / 300k):
      seed 1  clip on:  V 4.0 vs 6.1,  EV 0.905, gap 0.922 / 0.932 / 0.931
              clip off: V 14.7 vs 16.1, EV 0.946, gap 0.836 / 0.937 / 0.925
      seed 2  clip on:  V 3.5 vs 5.5,  EV 0.868, gap 0.880 / 0.897 / 0.911
              clip off: V 14.3 vs 15.5, EV 0.923, gap 0.800 / 0.925 / 0.941
      seed 3  clip on:  V 3.7 vs 5.7,  EV 0.895, gap 0.838 / 0.907 / 0.926
              clip off: V 14.3 vs 15.6, EV 0.944, gap 0.808 / 0.927 / 0.933
  The critic tracks the returns without the clip; the policy's final gap closed is within
  +-0.02 either way (early on, at 100k steps, the clipped run was ahead on all three seeds).
- An episode starts with the smallest capacity as "previous" (so the first step may pay the
  switch penalty and earn the escalation bonus), not with the first action as previous. Not
  measured; it changes at most one step per episode, by at most 0.05 + 0.2 against returns of ~35.
- Feature scalings: previous capacity index / (K - 1) and steps at that capacity min(steps, 10) / 10,
  so every scalar lies in [0, 1] like the others (the specification feeds the raw index and step
  count). Not measured.

Other choices
- GAE lambda defaults to 0.8, not the seed's 0.95: a capacity choice pays off mostly at once, and
  with 0.95 each advantage also carries the noise of ~17 later rewards. Measured (seed 1, share of
  the best-fixed -> oracle gap closed): lambda 0.95: 0.72 after 200k steps, 0.82 after 500k;
  lambda 0.8: 0.91 after 200k. --gae-lambda 0.95 restores the seed's value.
- --total-steps, --eval-every and --save-every count environment steps (CleanRL's
  total_timesteps); metrics.jsonl's "step" is the environment step.
- Output layers are initialised with gain 0.01 (actor) and 1.0 (critic), as in CleanRL, so the
  initial policy is near uniform; hidden layers use sqrt(2) as the seed design asks.
- Ctrl-C saves a checkpoint of the state at the start of the interrupted iteration (its partial
  work is dropped) and exits cleanly; resuming any checkpoint is bit-identical to never stopping.
"""

import copy
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import tyro
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclass
class Args:
    # --- experiment / tracking ---
    exp_name: str = "capacity_ppo"
    """the name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (agent initialisation, action sampling and training environments)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms where they exist"""
    track: bool = False
    """log the run to Weights & Biases"""
    wandb_project_name: str = "cleanrl-llm"
    """the Weights & Biases project"""
    wandb_entity: str | None = None
    """the Weights & Biases entity (team); None uses your default"""
    output_dir: str = "runs"
    """where run directories are created"""
    device: str = "cpu"
    """torch device, e.g. cpu or cuda (the network is small: cpu is usually as fast)"""
    torch_threads: int = 1
    """CPU threads for torch ops; 1 is fastest for this small network, especially on a shared machine"""

    # --- environment ---
    capacities: tuple[int, ...] = (4, 6, 9, 12)
    """the working-memory capacities to choose from, strictly increasing (--capacities 4 6 9 12)"""
    num_envs: int = 64
    """number of environments stepped together"""
    max_episode_steps: int = 64
    """episode step limit (truncation)"""
    energy_budget: float = 640.0
    """energy budget of an episode in slot-steps; spending it terminates the episode"""
    regime_means: tuple[float, ...] = (0.1, 0.35, 0.6, 0.85)
    """mean difficulty of each task regime"""
    regime_switch_prob: float = 0.05
    """per-step probability of redrawing the regime"""
    difficulty_drift: float = 0.3
    """speed at which the difficulty reverts to its regime mean"""
    difficulty_noise: float = 0.05
    """standard deviation of the per-step change in difficulty"""
    slots_at_max_difficulty: float = 11.0
    """slots needed for 50% above chance at difficulty 1"""
    accuracy_temperature: float = 0.8
    """width of the psychometric curve, in slots"""
    chance_accuracy: float = 0.25
    """accuracy with no useful capacity"""
    items_per_step: int = 20
    """task items per step; the observed accuracy is the fraction right"""
    workspace_dim: int = 60
    """size of the global-workspace representation in the observation"""
    workspace_signal: float = 1.0
    """strength of the difficulty signal in each workspace unit"""
    workspace_noise: float = 0.5
    """standard deviation of the noise in each workspace unit"""
    estimate_noise: float = 0.1
    """standard deviation of the noise of the scalar difficulty estimate"""
    accuracy_weight: float = 1.0
    """reward weight of task accuracy"""
    energy_cost: float = 0.05
    """reward penalty per slot-step of energy (--energy-term linear)"""
    energy_term: Literal["linear", "spec"] = "linear"
    """linear: -energy_cost * n per step; spec: the specification's -0.1 * energy_used / n^2, with
    energy_used the slot-steps spent so far in the episode (see the module docstring)"""
    switch_penalty: float = 0.05
    """reward penalty for changing capacity"""
    escalation_bonus: float = 0.2
    """bonus for raising capacity when accuracy is below --escalation-threshold"""
    escalation_threshold: float = 0.7
    """accuracy under which raising capacity earns the escalation bonus"""
    efficiency_bonus: float = 0.1
    """bonus for lowering capacity when accuracy is above --efficiency-threshold"""
    efficiency_threshold: float = 0.95
    """accuracy over which lowering capacity earns the efficiency bonus"""

    # --- algorithm ---
    total_steps: int = 300_000
    """total environment steps of training, rounded down to whole iterations of --num-envs x --num-steps (a notice
    says so); may change on --resume"""
    num_steps: int = 64
    """steps per environment in each rollout"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.8
    """GAE lambda (the seed design used 0.95; see the module docstring)"""
    num_minibatches: int = 4
    """minibatches per epoch; must divide num_envs * num_steps"""
    update_epochs: int = 10
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient"""
    clip_vloss: bool = False
    """use the clipped value loss (clips V within +-clip_coef of the rollout's V, in return units;
    off by default: see the module docstring)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    target_kl: float | None = None
    """stop the epochs of an update early once the approx-KL exceeds this"""

    # --- optimisation ---
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip"""
    hidden_size: int = 256
    """width of the shared trunk"""
    head_size: int = 128
    """width of the actor and critic heads"""

    # --- logging / checkpointing ---
    eval_every: int = 50_000
    """evaluate every this many environment steps (0: only at the start and the end)"""
    num_eval_envs: int = 1024
    """evaluation episodes per policy (one per environment)"""
    eval_seed: int = 12345
    """seed of the fixed evaluation episodes"""
    save_every: int = 0
    """checkpoint every this many environment steps (0: only at the end)"""
    resume: str | None = None
    """checkpoint directory (runs/<run>/checkpoints/step_N) to continue from, with the run's own arguments; flags
    given here that differ from their defaults may change the cadence (--total-steps, --eval-every, --save-every,
    --num-eval-envs, tracking, --device, --torch-threads), any other is refused"""

    # --- computed at run time ---
    batch_size: tyro.conf.Suppress[int] = 0
    """num_envs * num_steps"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """batch_size // num_minibatches"""
    num_iterations: tyro.conf.Suppress[int] = 0
    """total_steps // batch_size"""
    run_name: tyro.conf.Suppress[str] = ""
    """capacity__{exp_name}__{seed}__{time}"""


SPEC_ENERGY_COEF = 0.1  # the specification's energy term, -0.1 * energy_used / n^2 (--energy-term spec)
OBS_SCALARS = 7  # difficulty estimate, rolling accuracy, budget, prev capacity, dwell, error rate, time
DWELL_SCALE = 10.0  # steps at a capacity are reported as min(steps, 10) / 10
ROLLING_ACC_RATE = 0.2  # EMA rate of the rolling accuracy
ERROR_RATE_RATE = 0.5  # EMA rate of the recent error rate (shorter window)


def validate_args(args: Args) -> None:
    """Raise ValueError naming the bad flag and the fix, before any work is done."""
    caps = list(args.capacities)
    if len(caps) < 2 or any(c <= 0 for c in caps) or any(a >= b for a, b in zip(caps, caps[1:])):
        raise ValueError(
            f"--capacities must list at least two positive integers in strictly increasing order, "
            f"e.g. --capacities 4 6 9 12 (got {caps})"
        )
    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs", "max_episode_steps",
                 "items_per_step", "num_eval_envs"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be at least 1 (got {getattr(args, name)})")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        divisors = [d for d in range(2, min(batch_size, 64) + 1) if batch_size % d == 0][:4]
        raise ValueError(
            f"--num-minibatches {args.num_minibatches} does not divide the batch size {batch_size} "
            f"(= --num-envs {args.num_envs} x --num-steps {args.num_steps}); pick a divisor such as {divisors}"
        )
    if args.total_steps < batch_size:
        raise ValueError(
            f"--total-steps {args.total_steps} is smaller than one rollout ({batch_size} = --num-envs x "
            f"--num-steps); raise --total-steps or shrink the rollout"
        )
    if not args.regime_means or any(not 0.0 <= m <= 1.0 for m in args.regime_means):
        raise ValueError(f"--regime-means must be difficulties in [0, 1], e.g. 0.1 0.35 0.6 0.85 (got {args.regime_means})")
    if not (0.0 <= args.gamma <= 1.0 and 0.0 <= args.gae_lambda <= 1.0):
        raise ValueError(f"--gamma and --gae-lambda must lie in [0, 1] (got {args.gamma}, {args.gae_lambda})")
    if args.energy_budget <= 0 or args.clip_coef <= 0 or args.learning_rate <= 0:
        raise ValueError("--energy-budget, --clip-coef and --learning-rate must be positive")
    if args.target_kl is not None and args.target_kl <= 0:
        raise ValueError(f"--target-kl must be positive, or left unset to disable (got {args.target_kl})")
    if args.eval_every < 0 or args.save_every < 0:
        raise ValueError("--eval-every and --save-every must be >= 0 (0 means only at the end)")
    if args.resume is not None:
        if not (Path(args.resume) / "trainer_state.pt").is_file():
            raise ValueError(
                f"--resume {args.resume} is not a checkpoint: expected a folder like runs/<run>/checkpoints/step_N "
                f"holding trainer_state.pt"
            )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}, but torch sees no CUDA GPU on this machine: use --device cpu")


# Flags a resumed run may change (a notice is printed); any other flag that differs from the run's own value is
# refused, since it would change the algorithm or the environment. The run directory is the checkpoint's.
RESUME_MAY_CHANGE = ("total_steps", "eval_every", "save_every", "num_eval_envs", "track", "wandb_project_name",
                     "wandb_entity", "device", "torch_threads")
RESUME_IGNORES = ("exp_name", "output_dir", "run_name", "resume", "batch_size", "minibatch_size", "num_iterations")


def resume_args(args: Args) -> tuple[Args, dict]:
    """--resume: the run's own arguments from the checkpoint, with the flags given on this command line that
    differ from their defaults applied on top (RESUME_MAY_CHANGE) or refused. -> (args, {flag: [run's, new]})."""
    saved = json.loads((Path(args.resume) / "args.json").read_text())
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in Args.__dataclass_fields__}
    defaults, out, changed = Args(), Args(**fields), {}
    for name in Args.__dataclass_fields__:
        given = getattr(args, name)
        if name in RESUME_IGNORES or given == getattr(defaults, name) or given == fields.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if name not in RESUME_MAY_CHANGE:
            raise ValueError(f"{flag} {given} differs from the run's {fields.get(name)!r} ({args.resume}/args.json): "
                             f"it would change the algorithm or the environment, so it cannot change on resume; drop "
                             f"the flag, or start a new run")
        setattr(out, name, given)
        changed[name] = [fields.get(name), given]
    out.resume = args.resume
    return out, changed


# ----------------------------------------------------------------------------------------------
# Environment math (pure functions)


def task_accuracy(capacity: torch.Tensor, difficulty: torch.Tensor, *, slots_at_max_difficulty: float,
                  temperature: float, chance: float) -> torch.Tensor:
    """Expected accuracy p(n, d) of capacity n at difficulty d (broadcasting shapes) -> same shape.

    A psychometric curve: chance + (1 - chance) * sigmoid((n - d * slots_at_max_difficulty) / temperature).
    """
    required = difficulty * slots_at_max_difficulty
    return chance + (1.0 - chance) * torch.sigmoid((capacity - required) / temperature)


def reward_terms(accuracy: torch.Tensor, capacity: torch.Tensor, prev_capacity: torch.Tensor, *,
                 accuracy_weight: float, energy_cost: float, switch_penalty: float,
                 escalation_bonus: float, escalation_threshold: float,
                 efficiency_bonus: float, efficiency_threshold: float,
                 energy_term: str = "linear", energy_used: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Signed reward terms; the reward is their sum. accuracy, capacity, prev_capacity: [N] -> each [N].

    energy_term "linear": -energy_cost * n; "spec": -SPEC_ENERGY_COEF * energy_used / n^2, with
    energy_used [N] the slot-steps spent in the episode including this step.
    """
    up = capacity > prev_capacity
    down = capacity < prev_capacity
    energy = -energy_cost * capacity if energy_term == "linear" else -SPEC_ENERGY_COEF * energy_used / capacity**2
    return {
        "accuracy": accuracy_weight * accuracy,
        "energy": energy,
        "switch": -switch_penalty * (up | down).float(),
        "escalation": escalation_bonus * (up & (accuracy < escalation_threshold)).float(),
        "efficiency": efficiency_bonus * (down & (accuracy > efficiency_threshold)).float(),
    }


def accuracy_kwargs(args: Args) -> dict:
    return dict(slots_at_max_difficulty=args.slots_at_max_difficulty, temperature=args.accuracy_temperature,
                chance=args.chance_accuracy)


def oracle_actions(difficulty: torch.Tensor, capacities: torch.Tensor, *, accuracy_weight: float,
                   energy_cost: float, **accuracy_kwargs) -> torch.Tensor:
    """Capacity index maximising expected accuracy reward minus energy at the true difficulty.

    difficulty: [N], capacities: [K] -> [N] int64.
    """
    expected = accuracy_weight * task_accuracy(capacities[None, :], difficulty[:, None], **accuracy_kwargs)
    return (expected - energy_cost * capacities[None, :]).argmax(dim=1)


class CapacityEnv:
    """Vectorised task stream; every tensor has a leading [num_envs] axis (see the module docstring).

    step() consumes the same random numbers whatever the actions, so policies evaluated from the
    same seed face the same difficulties.
    """

    def __init__(self, args: Args, num_envs: int, seed: int, device: torch.device | str = "cpu"):
        self.args, self.num_envs, self.device = args, num_envs, torch.device(device)
        self.capacities = torch.tensor(args.capacities, dtype=torch.float32, device=self.device)
        self.regime_means = torch.tensor(args.regime_means, dtype=torch.float32, device=self.device)
        # The workspace code is part of the task, not of the run: same for every seed.
        signs = torch.randint(0, 2, (args.workspace_dim,), generator=torch.Generator().manual_seed(0))
        self.workspace_code = (2.0 * signs - 1.0).to(self.device)
        self.obs_dim = args.workspace_dim + OBS_SCALARS
        self.accuracy_kwargs = accuracy_kwargs(args)
        self.reward_kwargs = dict(accuracy_weight=args.accuracy_weight, energy_cost=args.energy_cost,
                                  switch_penalty=args.switch_penalty, escalation_bonus=args.escalation_bonus,
                                  escalation_threshold=args.escalation_threshold,
                                  efficiency_bonus=args.efficiency_bonus, efficiency_threshold=args.efficiency_threshold,
                                  energy_term=args.energy_term)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.reset()

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, device=self.device)

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, device=self.device)

    def _observation_noise(self) -> torch.Tensor:
        """[N, workspace_dim + 1]: one draw per workspace unit and one for the difficulty estimate."""
        return self._randn(self.num_envs, self.args.workspace_dim + 1)

    def _fresh_state(self) -> dict[str, torch.Tensor]:
        n, dev = self.num_envs, self.device
        regime = torch.randint(0, len(self.regime_means), (n,), generator=self.generator, device=dev)
        difficulty = (self.regime_means[regime] + self.args.difficulty_noise * self._randn(n)).clamp(0.0, 1.0)
        zeros = torch.zeros(n, device=dev)
        return {
            "regime": regime,
            "difficulty": difficulty,
            "budget": torch.full((n,), self.args.energy_budget, device=dev),
            "t": zeros.clone(),
            "prev_action": torch.zeros(n, dtype=torch.long, device=dev),  # episodes start at the smallest capacity
            "dwell": zeros.clone(),
            "rolling_acc": torch.full((n,), 0.5, device=dev),
            "error_rate": torch.full((n,), 0.5, device=dev),
            "episode_return": zeros.clone(),
        }

    def _observe(self, noise: torch.Tensor) -> torch.Tensor:
        """noise: [N, workspace_dim + 1] -> observation [N, obs_dim]."""
        a, s = self.args, self.state
        workspace = torch.tanh(a.workspace_signal * (2.0 * s["difficulty"][:, None] - 1.0) * self.workspace_code
                               + a.workspace_noise * noise[:, :-1])
        scalars = torch.stack([
            (s["difficulty"] + a.estimate_noise * noise[:, -1]).clamp(0.0, 1.0),
            s["rolling_acc"],
            s["budget"].clamp(min=0.0) / a.energy_budget,
            s["prev_action"].float() / (len(a.capacities) - 1),
            s["dwell"].clamp(max=DWELL_SCALE) / DWELL_SCALE,
            s["error_rate"],
            s["t"] / a.max_episode_steps,
        ], dim=1)
        return torch.cat([workspace, scalars], dim=1)

    def reset(self) -> torch.Tensor:
        self.state = self._fresh_state()
        self.obs = self._observe(self._observation_noise())
        return self.obs

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """action: [N] capacity indices -> next_obs [N, D], reward [N], terminated [N], truncated [N], info.

        For finished episodes next_obs is the first observation of the next episode and
        info["final_obs"] the observation of the state the episode ended in.
        """
        a, s, n = self.args, self.state, self.num_envs
        capacity, prev_capacity = self.capacities[action], self.capacities[s["prev_action"]]
        # 1. solve the task: items_per_step Bernoulli(p(n, d)) items
        p = task_accuracy(capacity, s["difficulty"], **self.accuracy_kwargs)
        accuracy = (self._rand(n, a.items_per_step) < p[:, None]).float().mean(dim=1)
        energy_used = a.energy_budget - s["budget"] + capacity  # slot-steps spent in the episode, this step included
        terms = reward_terms(accuracy, capacity, prev_capacity, energy_used=energy_used, **self.reward_kwargs)
        reward = sum(terms.values())
        # 2. bookkeeping: energy, time, dwell, running statistics
        s["budget"] = s["budget"] - capacity
        s["t"] = s["t"] + 1
        s["dwell"] = torch.where(action == s["prev_action"], s["dwell"] + 1, torch.ones_like(s["dwell"]))
        s["prev_action"] = action.clone()
        s["rolling_acc"] = s["rolling_acc"] + ROLLING_ACC_RATE * (accuracy - s["rolling_acc"])
        s["error_rate"] = s["error_rate"] + ERROR_RATE_RATE * (1.0 - accuracy - s["error_rate"])
        s["episode_return"] = s["episode_return"] + reward
        terminated = s["budget"] <= 0
        truncated = (s["t"] >= a.max_episode_steps) & ~terminated
        # 3. the task stream moves on: regime switches, then mean reversion with noise
        switch = self._rand(n) < a.regime_switch_prob
        new_regime = torch.randint(0, len(self.regime_means), (n,), generator=self.generator, device=self.device)
        s["regime"] = torch.where(switch, new_regime, s["regime"])
        drift = a.difficulty_drift * (self.regime_means[s["regime"]] - s["difficulty"])
        s["difficulty"] = (s["difficulty"] + drift + a.difficulty_noise * self._randn(n)).clamp(0.0, 1.0)
        # 4. observe, then reset finished episodes (fresh draws every step keep the random stream action-free)
        noise = self._observation_noise()
        final_obs = self._observe(noise)
        done = terminated | truncated
        info = {"final_obs": final_obs, "accuracy": accuracy, "capacity": capacity, "terms": terms,
                "episode_return": s["episode_return"].clone(), "episode_length": s["t"].clone()}
        fresh = self._fresh_state()
        self.state = {k: torch.where(done, fresh[k], v) for k, v in s.items()}
        self.obs = self._observe(noise)
        return self.obs, reward, terminated, truncated, info

    def state_dict(self) -> dict:
        return {"state": {k: v.clone() for k, v in self.state.items()}, "obs": self.obs.clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.state = {k: v.to(self.device) for k, v in state["state"].items()}
        self.obs = state["obs"].to(self.device)
        self.generator.set_state(state["generator"])


# ----------------------------------------------------------------------------------------------
# PPO math (pure functions)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
                terminated: torch.Tensor, dones: torch.Tensor, gamma: float, gae_lambda: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a rollout. All inputs [T, N]; returns (advantages, returns), each [T, N].

    next_values[t] is V of the state reached after step t (for a finished episode: the state it
    ended in, not the next episode's first state). terminated[t] removes the bootstrap;
    dones[t] = terminated or truncated stops the lambda-trace at the episode boundary.
    """
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        # TD error; the bootstrap is kept at truncation, dropped at termination (arXiv:1712.00378)
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminated[t]) - values[t]
        # Eq. 16 of arXiv:1506.02438, as the backward recursion A_t = delta_t + gamma*lambda*A_{t+1}
        last = delta + gamma * gae_lambda * (1.0 - dones[t]) * last
        advantages[t] = last
    return advantages, advantages + values


def normalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """[B] -> [B] with zero mean and unit (unbiased) std."""
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def clipped_policy_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        clip_coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Eq. 7 of arXiv:1707.06347), negated for minimisation.

    new_logp, old_logp, advantages: [B] -> (loss [], approx_kl k3 [], clip_frac []).
    """
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean()  # k3, http://joschu.net/blog/kl-approx.html
        clip_frac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return loss, approx_kl, clip_frac


def value_loss(new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_coef: float, clip: bool = True) -> torch.Tensor:
    """0.5 * squared error, optionally clipped around the rollout's values (as in OpenAI baselines'
    ppo2). new_values, old_values, returns: [B] -> []."""
    unclipped = (new_values - returns) ** 2
    if not clip:
        return 0.5 * unclipped.mean()
    clipped = old_values + (new_values - old_values).clamp(-clip_coef, clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var[target - predicted] / Var[target]; nan when the target is constant."""
    var = target.var()
    return float("nan") if var == 0 else float(1.0 - (target - predicted).var() / var)


# ----------------------------------------------------------------------------------------------
# Agent


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Shared trunk, then separate actor (logits over capacities) and critic (state value) heads."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_size: int = 256, head_size: int = 128):
        super().__init__()
        self.trunk = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden_size)), nn.LayerNorm(hidden_size), nn.ReLU(),
            layer_init(nn.Linear(hidden_size, hidden_size)), nn.LayerNorm(hidden_size), nn.ReLU(),
        )
        self.actor = nn.Sequential(layer_init(nn.Linear(hidden_size, head_size)), nn.ReLU(),
                                   layer_init(nn.Linear(head_size, num_actions), std=0.01))
        self.critic = nn.Sequential(layer_init(nn.Linear(hidden_size, head_size)), nn.ReLU(),
                                    layer_init(nn.Linear(head_size, 1), std=1.0))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        """obs: [B, D] -> [B]."""
        return self.critic(self.trunk(obs)).squeeze(-1)

    def get_action_and_value(self, obs: torch.Tensor, action: torch.Tensor | None = None):
        """obs: [B, D] -> action [B], log-prob [B], entropy [B], value [B]."""
        hidden = self.trunk(obs)
        dist = torch.distributions.Categorical(logits=self.actor(hidden))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(hidden).squeeze(-1)

    def greedy(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.trunk(obs)).argmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def run_episodes(args: Args, policy, device: torch.device | str, trace: bool = False) -> dict:
    """One episode in each of args.num_eval_envs environments seeded with args.eval_seed.

    policy(obs [N, D], env) -> actions [N]. Returns the mean return, mean capacity, switch rate and
    (trace=True) the per-step difficulty, capacity and alive mask, each [T, N].
    """
    env = CapacityEnv(args, args.num_eval_envs, args.eval_seed, device)
    obs = env.reset()
    alive = torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
    total = torch.zeros(env.num_envs, device=env.device)
    difficulties, capacities, alives = [], [], []
    switches = torch.zeros((), device=env.device)
    for _ in range(args.max_episode_steps):
        difficulty, prev = env.state["difficulty"].clone(), env.state["prev_action"].clone()
        action = policy(obs, env)
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward * alive
        switches += ((action != prev) & alive).sum()
        difficulties.append(difficulty), capacities.append(info["capacity"]), alives.append(alive.clone())
        alive &= ~(terminated | truncated)
        if not alive.any():
            break
    mask = torch.stack(alives)
    out = {"return": total.mean().item(),
           "mean_capacity": (torch.stack(capacities) * mask).sum().item() / mask.sum().item(),
           "switch_rate": switches.item() / mask.sum().item()}
    if trace:
        out.update(difficulty=torch.stack(difficulties).cpu(), capacity=torch.stack(capacities).cpu(), alive=mask.cpu())
    return out


def evaluate(args: Args, agent: Agent, device: torch.device | str) -> tuple[dict, dict]:
    """Greedy agent, oracle, every fixed capacity and a uniform random policy on the same episodes.

    Returns (metrics with eval/* keys, {policy name: run_episodes output with traces}).
    """
    caps = torch.tensor(args.capacities, dtype=torch.float32, device=device)
    random_gen = torch.Generator(device=device).manual_seed(args.eval_seed + 1)
    policies = {
        "learned": lambda obs, env: agent.greedy(obs),
        "oracle": lambda obs, env: oracle_actions(env.state["difficulty"], caps, accuracy_weight=args.accuracy_weight,
                                                  energy_cost=args.energy_cost, **env.accuracy_kwargs),
        "random": lambda obs, env: torch.randint(0, len(caps), (env.num_envs,), generator=random_gen, device=device),
    }
    for i, c in enumerate(args.capacities):
        policies[f"fixed_{c}"] = lambda obs, env, i=i: torch.full((env.num_envs,), i, dtype=torch.long, device=device)
    runs = {name: run_episodes(args, policy, device, trace=name in ("learned", "oracle")) for name, policy in policies.items()}
    best_fixed = max(args.capacities, key=lambda c: runs[f"fixed_{c}"]["return"])
    ret, oracle, fixed, rand = (runs[k]["return"] for k in ("learned", "oracle", f"fixed_{best_fixed}", "random"))
    metrics = {
        "eval/return": ret, "eval/oracle_return": oracle, "eval/best_fixed_return": fixed, "eval/random_return": rand,
        "eval/best_fixed_capacity": best_fixed,
        # share of the best-fixed -> oracle gap the learned policy closes (the target is >= 0.8)
        "eval/gap_closed": (ret - fixed) / (oracle - fixed) if oracle != fixed else float("nan"),
        # how much adaptation matters: (oracle - best fixed) / (oracle - random)
        "eval/oracle_advantage": (oracle - fixed) / (oracle - rand) if oracle != rand else float("nan"),
        "eval/mean_capacity": runs["learned"]["mean_capacity"], "eval/switch_rate": runs["learned"]["switch_rate"],
    }
    metrics.update({f"eval/fixed_{c}_return": runs[f"fixed_{c}"]["return"] for c in args.capacities})
    return metrics, runs


def format_eval_table(metrics: dict, args: Args) -> str:
    rows = [("learned (greedy)", metrics["eval/return"]), ("oracle", metrics["eval/oracle_return"])]
    rows += [(f"fixed n={c}", metrics[f"eval/fixed_{c}_return"]) for c in args.capacities]
    rows += [("random", metrics["eval/random_return"])]
    lines = ["| policy | mean episode return |", "|---|---|"] + [f"| {name} | {value:.2f} |" for name, value in rows]
    lines.append(f"\ngap closed (learned - best fixed) / (oracle - best fixed): {metrics['eval/gap_closed']:.3f}")
    lines.append(f"oracle advantage (oracle - best fixed) / (oracle - random): {metrics['eval/oracle_advantage']:.3f}")
    return "\n".join(lines)


def plot_curves(path: Path, history: list[dict], runs: dict | None, args: Args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        pts = [(h["step"], h[key]) for h in history if key in h and h[key] == h[key]]
        return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    ax = axes[0, 0]
    for key, label in [("eval/return", "learned (greedy)"), ("eval/oracle_return", "oracle"),
                       ("eval/best_fixed_return", "best fixed"), ("eval/random_return", "random")]:
        ax.plot(*series(key), marker="o", label=label)
    ax.set(title="evaluation return", xlabel="env step"), ax.legend()
    axes[0, 1].plot(*series("charts/episodic_return"))
    axes[0, 1].set(title="charts/episodic_return (training)", xlabel="env step")
    ax = axes[0, 2]
    for key in ("losses/approx_kl", "losses/clipfrac", "losses/entropy"):
        ax.plot(*series(key), label=key)
    ax.set(title="PPO diagnostics", xlabel="env step", yscale="log"), ax.legend()
    axes[1, 0].plot(*series("losses/value_loss"))
    axes[1, 0].set(title="losses/value_loss", xlabel="env step", yscale="log")
    if runs is not None:
        learned, oracle = runs["learned"], runs["oracle"]
        ax = axes[1, 1]
        mask = learned["alive"]
        d, c = learned["difficulty"][mask][:4000], learned["capacity"][mask][:4000]
        jitter = 0.25 * (torch.rand(c.shape, generator=torch.Generator().manual_seed(0)) - 0.5)
        ax.scatter(d, c + jitter, s=3, alpha=0.3, label="learned (greedy)")
        grid = torch.linspace(0, 1, 201)
        caps = torch.tensor(args.capacities, dtype=torch.float32)
        best = caps[oracle_actions(grid, caps, accuracy_weight=args.accuracy_weight, energy_cost=args.energy_cost,
                                   **accuracy_kwargs(args))]
        ax.plot(grid, best, color="k", label="oracle")
        ax.set(title="capacity chosen vs true difficulty", xlabel="true difficulty", ylabel="capacity"), ax.legend()
        ax = axes[1, 2]
        steps = int(learned["alive"][:, 0].sum())
        ax.step(range(steps), learned["capacity"][:steps, 0], where="post", label="learned capacity")
        ax.step(range(steps), oracle["capacity"][:steps, 0], where="post", linestyle="--", label="oracle capacity")
        ax.set(title="one evaluation episode", xlabel="step", ylabel="capacity")
        twin = ax.twinx()
        twin.plot(range(steps), learned["difficulty"][:steps, 0], color="gray", alpha=0.6, label="true difficulty")
        twin.set(ylabel="difficulty", ylim=(0, 1))
        ax.legend(loc="upper left"), twin.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Checkpoints


def capture_state(agent: Agent, optimizer: torch.optim.Optimizer, env: CapacityEnv, iteration: int,
                  global_step: int) -> dict:
    """Copy of everything a resumed run needs to continue exactly (iteration = completed iterations)."""
    return {
        "agent": {k: v.detach().clone() for k, v in agent.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()), "env": env.state_dict(), "iteration": iteration,
        "global_step": global_step, "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }


def save_checkpoint(run_dir: Path, state: dict, args: Args) -> Path:
    """Write checkpoints/step_{global_step}/ atomically: a temporary folder, then a rename."""
    final = run_dir / "checkpoints" / f"step_{state['global_step']}"
    tmp = final.parent / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state["agent"].items()}, str(tmp / "agent.safetensors"))
    torch.save({k: v for k, v in state.items() if k != "agent"}, tmp / "trainer_state.pt")
    (tmp / "args.json").write_text(json.dumps(asdict(args), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_agent(checkpoint: str | Path, device: torch.device | str = "cpu") -> Agent:
    """Rebuild the agent of a checkpoint folder from its args.json and agent.safetensors."""
    checkpoint = Path(checkpoint)
    args = Args(**{k: tuple(v) if isinstance(v, list) else v
                   for k, v in json.loads((checkpoint / "args.json").read_text()).items()})
    agent = Agent(args.workspace_dim + OBS_SCALARS, len(args.capacities), args.hidden_size, args.head_size)
    agent.load_state_dict(load_file(str(checkpoint / "agent.safetensors"), device=str(device)))
    return agent.to(device)


# ----------------------------------------------------------------------------------------------


def main(args: Args) -> dict:
    overrides = {}
    if args.resume is not None and (Path(args.resume) / "args.json").is_file():
        args, overrides = resume_args(args)
        for name, (old, new) in overrides.items():
            print(f"resume: --{name.replace('_', '-')} {new} (the run had {old})")
    validate_args(args)
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = args.total_steps // args.batch_size
    if args.total_steps % args.batch_size:
        print(f"--total-steps {args.total_steps} is not a whole number of iterations of {args.batch_size} steps "
              f"(--num-envs x --num-steps): training {args.num_iterations * args.batch_size} steps "
              f"({args.num_iterations} iterations)")
    if args.resume is not None:
        run_dir = Path(args.resume).resolve().parent.parent
        args.run_name = run_dir.name
    else:
        args.run_name = f"capacity__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir = Path(args.output_dir) / args.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    record = asdict(args)
    if args.resume is not None:  # args.json keeps the run's arguments and lists what each resume changed
        record = json.loads((run_dir / "args.json").read_text())
        record.setdefault("resumed", []).append({"checkpoint": str(args.resume), "overrides": overrides})
    (run_dir / "args.json").write_text(json.dumps(record, indent=2))
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args),
                   name=args.run_name, dir=str(run_dir), save_code=True)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    previous_threads = torch.get_num_threads()  # restored at the end, for callers that import main
    torch.set_num_threads(args.torch_threads)
    device = torch.device(args.device)

    env = CapacityEnv(args, args.num_envs, args.seed, device)
    agent = Agent(env.obs_dim, len(args.capacities), args.hidden_size, args.head_size).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    next_obs = env.reset()
    start_iteration, global_step = 1, 0
    history: list[dict] = []
    if args.resume is not None:
        state = torch.load(Path(args.resume) / "trainer_state.pt", weights_only=False)
        agent.load_state_dict(load_file(str(Path(args.resume) / "agent.safetensors"), device=str(device)))
        optimizer.load_state_dict(state["optimizer"])
        env.load_state_dict(state["env"])
        next_obs = env.obs
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
        start_iteration, global_step = state["iteration"] + 1, state["global_step"]
        if (run_dir / "metrics.jsonl").is_file():  # keep the curves of the first part, drop what came after
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            history = [row for row in rows if row["step"] <= global_step]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))

    T, N = args.num_steps, args.num_envs
    obs = torch.zeros((T, N, env.obs_dim), device=device)
    actions = torch.zeros((T, N), dtype=torch.long, device=device)
    logprobs, rewards, values, next_values, terminateds, dones = (torch.zeros((T, N), device=device) for _ in range(6))

    metrics_file = open(run_dir / "metrics.jsonl", "a")

    def log(row: dict) -> None:
        history.append(row)
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
        if args.track:
            wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def crossed(every: int, step: int) -> bool:
        return every > 0 and step // every > (step - args.batch_size) // every

    eval_metrics, runs = evaluate(args, agent, device)
    if args.resume is None:
        log({"step": 0, **eval_metrics})
    iteration = start_iteration - 1
    start_time, start_step = time.time(), global_step
    progress = tqdm(range(start_iteration, args.num_iterations + 1), desc="capacity_ppo", unit="it")
    resume_point = capture_state(agent, optimizer, env, iteration, global_step)
    try:
        for iteration in progress:
            # what a Ctrl-C during this iteration saves, so that resuming redoes the iteration exactly
            resume_point = capture_state(agent, optimizer, env, iteration - 1, global_step)
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / args.num_iterations) * args.learning_rate

            # 1. roll out the current policy in every environment for num_steps steps
            finished_returns, finished_lengths = [], []
            term_sums: dict[str, torch.Tensor] = {}  # each reward term summed over the rollout
            for step in range(T):
                global_step += N
                obs[step] = next_obs
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                actions[step], logprobs[step], values[step] = action, logprob, value
                next_obs, reward, terminated, truncated, info = env.step(action)
                done = terminated | truncated
                rewards[step], terminateds[step], dones[step] = reward, terminated.float(), done.float()
                for name, term in info["terms"].items():
                    term_sums[name] = term_sums.get(name, 0.0) + term.sum()
                if done.any():
                    # V of the state each finished episode ended in (used only where it was truncated)
                    with torch.no_grad():
                        next_values[step, done] = agent.get_value(info["final_obs"][done])
                    finished_returns.append(info["episode_return"][done])
                    finished_lengths.append(info["episode_length"][done])

            # 2. advantages with GAE; V(s_{t+1}) is the next stored value unless the episode ended
            with torch.no_grad():
                next_values[:-1] = torch.where(dones[:-1].bool(), next_values[:-1], values[1:])
                next_values[-1] = torch.where(dones[-1].bool(), next_values[-1], agent.get_value(next_obs))
                advantages, returns = compute_gae(rewards, values, next_values, terminateds, dones,
                                                  args.gamma, args.gae_lambda)

            # 3. update_epochs passes of minibatch SGD on the clipped objective (Eq. 9 of arXiv:1707.06347)
            b_obs, b_actions, b_logprobs = obs.reshape(-1, env.obs_dim), actions.reshape(-1), logprobs.reshape(-1)
            b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
            clipfracs, approx_kls = [], []
            for epoch in range(args.update_epochs):
                permutation = torch.randperm(args.batch_size, device=device)
                for start in range(0, args.batch_size, args.minibatch_size):
                    mb = permutation[start:start + args.minibatch_size]
                    _, new_logp, entropy, new_value = agent.get_action_and_value(b_obs[mb], b_actions[mb])
                    mb_adv = normalize_advantages(b_advantages[mb]) if args.norm_adv else b_advantages[mb]
                    pg_loss, approx_kl, clip_frac = clipped_policy_loss(new_logp, b_logprobs[mb], mb_adv, args.clip_coef)
                    v_loss = value_loss(new_value, b_values[mb], b_returns[mb], args.clip_coef, args.clip_vloss)
                    entropy_loss = entropy.mean()
                    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    clipfracs.append(clip_frac.item())
                    approx_kls.append(approx_kl.item())
                if args.target_kl is not None and approx_kl.item() > args.target_kl:
                    break

            # 4. log
            row = {
                "step": global_step,
                "charts/learning_rate": optimizer.param_groups[0]["lr"],
                "charts/SPS": int((global_step - start_step) / (time.time() - start_time)),
                "charts/mean_capacity": float(torch.tensor(args.capacities)[actions.cpu()].float().mean()),
                # the critic's mean prediction next to the mean GAE return it is fitted to
                "charts/mean_value": b_values.mean().item(), "charts/mean_return": b_returns.mean().item(),
                # mean per-step reward of each term, so a reader sees which one drives the policy
                **{f"rewards/{name}": (total / (T * N)).item() for name, total in term_sums.items()},
                "rewards/total": rewards.mean().item(),
                "losses/value_loss": v_loss.item(), "losses/policy_loss": pg_loss.item(),
                "losses/entropy": entropy_loss.item(), "losses/approx_kl": approx_kls[-1],
                "losses/clipfrac": float(np.mean(clipfracs)), "losses/epochs": epoch + 1,
                "losses/explained_variance": explained_variance(b_values, b_returns),
            }
            if finished_returns:
                row["charts/episodic_return"] = torch.cat(finished_returns).mean().item()
                row["charts/episodic_length"] = torch.cat(finished_lengths).mean().item()
            # 5. evaluate and checkpoint on schedule
            if crossed(args.eval_every, global_step) or iteration == args.num_iterations:
                eval_metrics, runs = evaluate(args, agent, device)
                row.update(eval_metrics)
                progress.set_postfix(eval_return=f"{eval_metrics['eval/return']:.2f}",
                                     gap_closed=f"{eval_metrics['eval/gap_closed']:.2f}")
            log(row)
            if crossed(args.save_every, global_step) and iteration != args.num_iterations:
                save_checkpoint(run_dir, capture_state(agent, optimizer, env, iteration, global_step), args)
        final_state = capture_state(agent, optimizer, env, iteration, global_step)
    except KeyboardInterrupt:
        final_state = resume_point
        global_step = final_state["global_step"]
        print(f"\ninterrupted: saving the state at step {global_step}")
    finally:
        metrics_file.close()
        progress.close()

    checkpoint = save_checkpoint(run_dir, final_state, args)
    plot_curves(run_dir / "curves.png", history, runs, args)
    print(format_eval_table(eval_metrics, args))
    print(f"run directory: {run_dir}\ncheckpoint: {checkpoint}")
    if args.track:
        wandb.finish()
    torch.set_num_threads(previous_threads)
    return {**eval_metrics, "step": global_step, "run_dir": str(run_dir), "checkpoint": str(checkpoint)}


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except KeyboardInterrupt:  # a second Ctrl-C while the first one's checkpoint is written: quit at once
        print("\ninterrupted again: quit without saving", file=sys.stderr)
        sys.exit(130)
