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

#: The metric keys these losses add to the clip metrics (declared where they are produced).
LOSS_METRICS = {m.name: m for m in covariance.COV_METRICS + weighted.VESPO_METRICS}
