"""SAPO: a smooth, temperature-controlled gate in place of PPO's hard clip."""

from __future__ import annotations

import torch

from echotrain.rl.aggregation import weighted_sum
from echotrain.rl.config import check_positive, loss_setting
from echotrain.rl.losses.common import ppo_kl
from echotrain.rl.objectives import PreparedInputs, prepared_policy_loss, register_policy_loss


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """f(rho) = sigmoid(tau (rho - 1)) * 4 / tau, elementwise (SAPO, arXiv 2511.20347, Eq. 5).

    f(1) = 2 / tau and f'(rho) = 4 sigmoid (1 - sigmoid), which is 1 at rho = 1: on-policy the
    gradient is the plain policy gradient; it decays smoothly as rho leaves 1.
    """
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


#: SAPO's settings (flat keys: verl's names; TRL's sapo_temperature_pos / _neg)
SAPO_SETTINGS = {
    "tau_pos": loss_setting(
        1.0, "SAPO (arXiv 2511.20347) gate temperature for tokens with A > 0: the soft gate is "
        "sigmoid(tau (rho - 1)) 4 / tau. Paper, verl and TRL (sapo_temperature_pos): 1.0.",
        check_positive, flat=True),
    "tau_neg": loss_setting(
        1.05, "SAPO gate temperature for tokens with A <= 0 (the paper sets tau_neg > tau_pos so negative updates "
        "decay faster off-policy). Paper, verl and TRL (sapo_temperature_neg): 1.05.",
        check_positive, flat=True),
}


@register_policy_loss("sapo", metrics=("ppo_kl",), reads=("tau_pos", "tau_neg"), settings=SAPO_SETTINGS)
@prepared_policy_loss("seq-mean-token-mean")
def compute_policy_loss_sapo(x: PreparedInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: l_{i,t} = -f_{i,t}(rho_{i,t}) A_{i,t} (Soft Adaptive Policy Optimization, arXiv 2511.20347, Eq. 5-6).

    f = :func:`sapo_gate` with tau = ``tau_pos`` where A > 0 and ``tau_neg`` where A <= 0
    (paper, verl and TRL: 1.0 and 1.05); the gradient -A 4 s (1 - s) rho grad log pi,
    s = sigmoid(tau (rho - 1)), fades smoothly off-policy instead of dropping to 0 at a clip.
    Default ``loss_agg_mode`` ``seq-mean-token-mean`` (the paper's; verl's ``sapo`` always uses
    it and ignores ``loss_agg_mode``, we honour the argument; TRL's ``sapo`` averages over every
    row, a fully masked completion included, so TRL = ours x N_nonempty / B). Inputs ``(B, T)`` as
    :func:`~echotrain.rl.compute_policy_loss` (verl's signature); returns ``(loss 0-d,
    metrics)`` with ``ppo_kl``; same errors.
    """
    lr = x.log_ratio
    tau = torch.where(x.advantages > 0, lr.new_tensor(x.cfg.tau_pos), lr.new_tensor(x.cfg.tau_neg))
    loss_mat = -sapo_gate(torch.exp(x.log_ratio), tau) * x.advantages
    return weighted_sum(loss_mat, x.mask, x.seq_weights), {"ppo_kl": ppo_kl(x.log_ratio, x.mask)}
