"""The arithmetic of the toy PPO recipe: reward, advantages, losses. Pure torch, no Megatron.

Shapes: B sequences, R response tokens. Token t of the response is sampled from the state
made of the prompt and the response tokens before it; `values[:, t]` estimates the return
from that state.
"""

from __future__ import annotations

import torch

__all__ = [
    "gae",
    "policy_loss",
    "token_rewards",
    "value_loss",
    "whiten",
]


def token_rewards(responses: torch.Tensor, target_token: int) -> torch.Tensor:
    """Reward 1 for each response token equal to `target_token`, else 0. [B, R] float32.

    The mean over a sequence is its reward: the fraction of target tokens.
    """
    return (responses == target_token).to(torch.float32)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response; the state after it is terminal.

    Returns (advantages, returns), both [B, R]; returns = advantages + values are the critic's
    targets.
    """
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance over the whole batch (PPO's advantage normalisation)."""
    return (x - x.mean()) / (x.std(unbiased=False) + eps)


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float,
) -> torch.Tensor:
    """PPO's clipped surrogate, averaged over tokens (a scalar to minimise)."""
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


def value_loss(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """Half the mean squared error of the critic's values against the GAE returns."""
    return 0.5 * ((values - returns) ** 2).mean()
