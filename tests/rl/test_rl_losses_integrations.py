"""The TRL adapter and the verl plugin take their loss lists from the registry: the new losses, and
a loss registered later, appear with no edit; the plugin reads the losses' declared settings
from verl's config."""

from __future__ import annotations

import pytest
import torch

from echotrain import rl
from echotrain.integrations.verl import DUAL_CLIP_LOSSES, POLICY_LOSS_NAMES, verl_core_algos


@pytest.fixture
def dummy_loss():
    @rl.register_policy_loss("dummy_for_listing", reads=("clip_ratio_c",))
    def _dummy(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, *,
               group_index=None, step=None):
        return -(log_prob * response_mask).sum(), {}

    yield "dummy_for_listing"
    rl.POLICY_LOSSES.unregister("dummy_for_listing")


def test_verl_names_follow_the_registry(dummy_loss):
    assert dict(POLICY_LOSS_NAMES) == {f"echotrain_{n}": n for n in rl.POLICY_LOSSES}
    assert POLICY_LOSS_NAMES[f"echotrain_{dummy_loss}"] == dummy_loss and len(rl.POLICY_LOSSES) > 15
    assert dummy_loss in DUAL_CLIP_LOSSES and {"vanilla", "echo", "dppo_tv", "dppo_kl"} <= set(DUAL_CLIP_LOSSES)
    assert "gspo" not in DUAL_CLIP_LOSSES and "cispo" not in DUAL_CLIP_LOSSES
    with pytest.raises(KeyError):
        POLICY_LOSS_NAMES["kl_cov"]


def test_verl_plugin_registers_new_and_later_losses(dummy_loss):
    try:
        verl_algos = verl_core_algos()
    except ImportError as exc:
        pytest.skip(str(exc))
    from echotrain.integrations.verl import register_with_verl

    names = register_with_verl()
    assert f"echotrain_{dummy_loss}" in names and "echotrain_vespo" in names
    assert verl_algos.get_policy_loss_fn("echotrain_sapo") is verl_algos.POLICY_LOSS_REGISTRY["echotrain_sapo"]


def _batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(torch.float64)
    old = -2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    lp = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return old, lp, adv, mask


@pytest.mark.parametrize("loss_mode,verl_kw,ours", [
    ("sapo", dict(tau_pos=2.0, tau_neg=3.0), dict(tau_pos=2.0, tau_neg=3.0)),
    ("kl_cov", dict(policy_loss=dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5)), dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5)),
    ("dro", dict(policy_loss=dict(dro_beta=0.7)), dict(dro_beta=0.7)),
    ("dppo_tv", dict(clip_ratio_c=2.0), dict(clip_ratio_c=2.0)),
])
def test_verl_plugin_reads_the_declared_settings_from_verls_config(loss_mode, verl_kw, ours):
    try:
        verl_core_algos()
    except ImportError as exc:
        pytest.skip(str(exc))
    from verl.workers.config import ActorConfig, PolicyLossConfig as VerlPLC

    from echotrain.integrations.verl import make_verl_policy_loss

    kw = dict(verl_kw)
    if "policy_loss" in kw:
        kw["policy_loss"] = VerlPLC(**kw["policy_loss"])
    vcfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, **kw)
    old, lp, adv, mask = _batch()
    fn = make_verl_policy_loss(loss_mode)
    for agg in ("token-mean", "token-sum", "seq-mean-token-mean"):
        got, _ = fn(old, lp, adv, mask, loss_agg_mode=agg, config=vcfg)
        cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, **ours)
        if loss_mode == "dppo_tv":
            cfg["clip_ratio_c"] = 2.0
        want, _ = rl.compute_policy_loss(loss_mode, old, lp, adv, mask.bool(), agg, cfg)
        torch.testing.assert_close(got, want)
        other, _ = rl.compute_policy_loss(loss_mode, old, lp, adv, mask.bool(), agg,
                                          dict(clip_ratio_low=0.2, clip_ratio_high=0.28))
        assert not torch.allclose(got, other)  # the setting reached the loss


def test_trl_config_takes_every_registered_loss_and_the_new_settings(tmp_path, dummy_loss):
    trl = pytest.importorskip("echotrain.integrations.trl")
    args = trl.EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_mode="vespo", vespo_k_pos=1.5,
                              tau_neg=2.0, report_to=[])
    cfg = args.policy_loss_config()
    assert cfg.vespo_k_pos == 1.5 and cfg.tau_neg == 2.0
    assert trl.EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_mode=dummy_loss,
                              report_to=[]).loss_mode == dummy_loss
    with pytest.raises(ValueError, match="tau_pos"):
        trl.EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_mode="sapo", tau_pos=0.0,
                           report_to=[])


@pytest.mark.parametrize("off_policy", [True, False])
@pytest.mark.parametrize("loss_mode", ["kl_cov", "clip_cov"])
def test_trl_accumulated_gradient_is_exact_for_the_covariance_losses(tmp_path, loss_mode, off_policy):
    """Two micro-batches through EchoGRPOTrainer._compute_loss == the whole step as one batch, also
    on-policy, where the step statistics need the current log-probs (not zeros, as ECHO may use)."""
    pytest.importorskip("trl")
    from tests.integrations.test_trl_adapter import _grads, accumulate_window, fabricated_window, make_trainer

    trainer = make_trainer(tmp_path, loss_mode=loss_mode, loss_agg_mode="token-mean", kl_cov_ratio=0.2,
                           clip_cov_ratio=0.2, clip_cov_lb=-1.0, clip_cov_ub=1.0)
    model = trainer.model
    model.train()
    mbs = fabricated_window(trainer, off_policy=off_policy)
    total, acc = accumulate_window(trainer, mbs)
    model.zero_grad()
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if k != "num_items_in_batch"}
    log_prob, _ = trainer._log_probs(model, cat)
    old = cat["old_per_token_logps"] if off_policy else log_prob.detach()
    ref, m = rl.compute_policy_loss(loss_mode, old, log_prob, cat["advantages"], cat["completion_mask"], "token-mean",
                                    trainer.policy_loss_config)
    ref.backward()
    assert m["pg_covfrac"] > 0  # tokens were selected: the comparison is not vacuous
    assert total == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    for a, b in zip(acc, _grads(model)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_reads_must_name_a_field_or_the_losses_own_setting_and_verl_forwards_both():
    """A ``reads`` typo is refused at registration; a plugin loss's own setting read from verl's
    config lands in loss_options (it is not a PolicyLossConfig field)."""
    verl_core_algos()
    from echotrain.integrations.verl import _loss_config

    with pytest.raises(ValueError, match="names neither a PolicyLossConfig field"):
        rl.register_policy_loss("typo_reads", reads=("clip_ratio_lo",))
    rl.register_policy_loss("own_setting_reads", reads=("my_gain",),
                            settings={"my_gain": rl.loss_setting(1.0, "a gain")})(
        rl.POLICY_LOSSES["vanilla"])
    try:
        cfg = _loss_config({"my_gain": 2.0}, rl.PolicyLossConfig(), "own_setting_reads")
        assert cfg.my_gain == 2.0 and cfg.loss_options == {"my_gain": 2.0}
    finally:
        from echotrain.rl.objectives import unregister_policy_loss

        unregister_policy_loss("own_setting_reads")
    assert "typo_reads" not in rl.POLICY_LOSSES
