"""The policy losses of the field beyond PPO/GSPO/ECHO, each a registration in ``POLICY_LOSSES``.

Importing :mod:`echotrain.rl` imports this package, so every loss below is registered:

- :mod:`~echotrain.rl.losses.weighted`   ``gpg``, ``cispo``, ``dro``, ``vespo`` (score function, detached weight)
- :mod:`~echotrain.rl.losses.dppo`       ``dppo_tv``, ``dppo_kl`` (divergence trust region)
- :mod:`~echotrain.rl.losses.soft_gate`  ``sapo`` (soft gate)
- :mod:`~echotrain.rl.losses.sequence`   ``geo_mean`` (GMPO), ``luspo``
- :mod:`~echotrain.rl.losses.covariance` ``clip_cov``, ``kl_cov`` (step statistics: means, exact top-k)

Names are verl 0.9.1's ``loss_mode`` where verl has the loss, TRL 1.16's ``loss_type`` otherwise
(``luspo``, ``vespo``); docs/design/objectives.md §9 describes each and its differences from
verl and TRL.
"""

from echotrain.rl.losses import covariance, dppo, sequence, soft_gate, weighted  # noqa: F401  (registers)

#: The metric keys these losses add to the existing ones (``pg_clipfrac``, ``pg_clipfrac_high``,
#: ``pg_clipfrac_low``, ``pg_clipfrac_lower``, ``ppo_kl``): name -> (reduction over micro-batches,
#: unit, meaning). All are local to the call, so the trainer's token-weighted mean applies.
LOSS_METRICS: dict[str, tuple[str, str, str]] = {
    "pg_covfrac": ("token-weighted mean", "fraction of tokens",
                   "clip_cov: tokens whose gradient is detached; kl_cov: tokens given the |log rho| penalty"),
    "pg_vespo_phi": ("token-weighted mean", "weight (1 = on-policy)", "vespo: mean gamma weight phi(w) over tokens"),
}
