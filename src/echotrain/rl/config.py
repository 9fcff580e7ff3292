"""``PolicyLossConfig``: the policy-loss settings, each declared once, named as in verl.

One dataclass for all loss modes, whose fields are the settings the losses share (token clip,
dual-clip, aggregation, log-ratio clamp, rollout correction). Each field carries its default, its
help text (``metadata["help"]``), its valid choices (``metadata["choices"]``) and its check
(``metadata["check"]``); :class:`echotrain.train.TrainConfig` and
:class:`echotrain.integrations.trl.EchoGRPOConfig` add these fields to themselves with
:func:`with_policy_loss_fields` and validate them with :func:`check_setting`, and the verl adapter
takes its fallbacks from a :class:`PolicyLossConfig`, so none of them restates a default or a
check. A plain ``dict`` with the same keys is accepted wherever a config is (see
:func:`as_policy_loss_config`).

A loss's own settings are declared in its registration, without editing this file:
``register_policy_loss("mine", settings={"my_scale": loss_setting(1.0, "help", check=...)})`` adds
``my_scale`` to :data:`LOSS_SETTINGS`. The built-in losses do the same in their modules with
``flat=True`` (SAPO's ``tau_pos``, KL-Cov's ``ppo_kl_coef`` ...): the name is then also a flat key,
an alias of ``loss_options.NAME`` kept because verl's and TRL's configs name the settings so, a
keyword of :class:`PolicyLossConfig` and a field of the config classes
(:func:`with_policy_loss_fields`). Its value lives in the config's ``loss_options`` mapping (trainer key
``loss_options.my_scale=0.5``, YAML ``loss_options: {my_scale: 0.5}``, a dict config
``{"my_scale": 0.5}``), and the loss reads it as ``config.my_scale`` like any field (the declared
default when unset). Checked like the fields: unknown names and failing values raise.

"Unset" has one meaning: ``norm_constant=None`` is the maximum response length of the run
(the trainer's ``max_new_tokens``, TRL's ``max_completion_length``, verl's ``loss_scale_factor``);
the pure functions of :mod:`echotrain.rl` raise if it is still None where it is needed.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from echotrain.rl.correction_names import ROLLOUT_CORRECTIONS, parse_rollout_correction
from echotrain.registry import Registry
from echotrain.rl.validation import check_choice

#: Provisional ECHO batch band (eps_b_low, eps_b_high) on R. Ours: no published value exists.
#: With the default ``batch_ratio="geo"``, log R is the batch mean of the token log-ratios,
#: an estimate of -KL(pi_old || pi), so 1 - R_geo ~ KL: a PPO-sized band of 0.2 would need a
#: KL of ~0.2 and never fires. In a synthetic look (``python benchmarks/bench_objectives.py
#: --echo-band-look``, table in docs/benchmarks.md) 1 - R_geo = 0.01 is reached when about 10-15%
#: of the tokens would leave a +-0.2 token band; 0.01 therefore bounds the step's KL at ~0.01.
#: ``arith`` R stays within ~1e-3 of 1 whatever the drift (E_old[rho] = 1), so it rarely fires.
#: Provisional: the trainer's sweep of R on real runs must confirm or replace it.
ECHO_DEFAULT_BATCH_BAND: tuple[float, float] = (0.01, 0.01)

BATCH_RATIOS = ("geo", "arith")
#: ECHO's token-level clip on top of the batch clip (docs/design/objectives.md §4, "open choices").
ECHO_TOKEN_CLIPS = ("ppo", "none", "truncate")
BA_SCOPES = ("group", "batch")
#: Rejection statistics of the ``rejection`` correction (verl 0.9.1's ``rollout_rs`` options).
RS_STATISTICS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                 "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

#: A field's check: value -> None if valid, else what is wrong ("must be ...").
Check = Callable[[Any], "str | None"]


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _eps(upper: str | None = None) -> Check:
    """Check of a clip half-width: finite, >= 0 and, with ``upper``, < 1 (``upper`` says why)."""

    def check(v: Any) -> str | None:
        if not (_is_real(v) and v >= 0):
            return "must be a finite float >= 0"
        if upper is not None and v >= 1:
            return f"must be < 1 ({upper})"
        return None

    return check


def _positive_threshold(optional: bool = False) -> Check:
    """Check of a threshold: a finite float > 0 (or None if ``optional``)."""

    def check(v: Any) -> str | None:
        if optional and v is None:
            return None
        return None if _is_real(v) and v > 0 else "must be a finite float > 0" + (" (or none)" if optional else "")

    return check


#: Float-noise tolerance of the ``behav_imp_weight_cap`` comparison, in nats of log(pi_prox / mu):
#: a token is masked only when log w > log(cap) + CAP_LOG_TOLERANCE. The learner's recomputed
#: float32 log-prob and the sampler's differ by rounding alone on an on-policy step (testbed,
#: float32, 3 steps: mean 4e-7 nats, largest 5e-5 on an unlikely token), which under a strict
#: ``w > cap`` masked ~21% of the tokens at cap = 1; 1e-3 is 20x the largest of that noise, a cap
#: moved by a factor 1.001, and below a real drift (bfloat16 rounding alone is ~1e-2).
#: Ours: AReaL's cap is a strict comparison. Read by echotrain.rl.correction.decoupled.
CAP_LOG_TOLERANCE = 1e-3


def _rollout_correction_check(v: Any) -> str | None:
    """Check of ``rollout_correction``: None or a comma-separated list of registered names."""
    if v is None:
        return None
    if not isinstance(v, str):
        return "must be a registered correction name, a comma-separated list of them, or none"
    try:
        parse_rollout_correction(v)
    except ValueError as exc:
        return f"is invalid ({exc}); valid names: {sorted(ROLLOUT_CORRECTIONS)}"
    return None


def _is_bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be a bool"


def _positive(v: Any) -> str | None:
    return None if _is_real(v) and v > 0 else "must be a finite float > 0"


def _non_negative(v: Any) -> str | None:
    return None if _is_real(v) and v >= 0 else "must be a finite float >= 0"


def _finite(v: Any) -> str | None:
    return None if _is_real(v) else "must be a finite float"


def _fraction(v: Any) -> str | None:
    return None if _is_real(v) and 0 < v <= 1 else "must be a share in (0, 1]"


#: The checks a loss's declared settings use (``loss_setting(..., check=...)``): value -> None if
#: valid, else what is wrong.
check_bool, check_positive, check_non_negative, check_finite_float, check_fraction = (
    _is_bool, _positive, _non_negative, _finite, _fraction)
#: ``check_clip_width(upper=None)``: the check of a clip half-width (finite, >= 0, < 1 with ``upper``
#: saying why).
check_clip_width = _eps


def _setting(default: Any, help: str, check: Check | None = None, choices: tuple | None = None) -> Any:
    """A :class:`PolicyLossConfig` field: its default, help text, valid choices and check."""
    return field(default=default, metadata={"help": help, "choices": choices, "check": check})


@dataclass(frozen=True)
class LossSetting:
    """A setting declared by a policy-loss registration (not a :class:`PolicyLossConfig` field).

    Attributes:
        default: the value when ``loss_options`` does not set it.
        help: one line for ``echotrain train --help``.
        check: value -> None if valid, else what is wrong ("must be ...").
        choices: the valid values, or None.
        type: the value's type as an annotation string ("float", "bool", "float | None"), which
            the trainer's key coercion reads.
        flat: the setting's name is also a flat key (an alias of ``loss_options.NAME``): the
            trainer's and TRL's config classes, ``PolicyLossConfig(NAME=...)`` and dict configs take it
            by name, as verl's and TRL's configs name it. For the built-in losses, whose settings
            were flat keys before they moved into their registrations; a plugin's stay in
            ``loss_options`` (the config classes are built when echotrain.rl is imported).
    """

    default: Any
    help: str
    check: Check | None = None
    choices: tuple | None = None
    type: str = "Any"
    flat: bool = False


_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str"}


def loss_setting(default: Any, help: str, check: Check | None = None, choices: tuple | None = None, *,
                 type: str | None = None, flat: bool = False) -> LossSetting:
    """A :class:`LossSetting` for ``register_policy_loss(name, settings={...})``.

    ``type`` defaults to the default's type (bool, int, float or str), else "Any"; a flat
    setting becomes a typed config key, so give it for any other default (e.g. ``"float | None"``).

    Raises:
        ValueError: a flat setting without ``type`` whose default's type is none of those.
    """
    if type is None:
        if flat and builtins.type(default) not in _TYPE_NAMES:
            raise ValueError(f"loss_setting: give type= for a flat setting whose default is a "
                             f"{builtins.type(default).__name__}")
        type = _TYPE_NAMES.get(builtins.type(default), "Any")
    return LossSetting(default, help, check, tuple(choices) if choices is not None else None, type, flat)



def flat_loss_settings() -> dict[str, LossSetting]:
    """The declared settings (:data:`LOSS_SETTINGS`) that are also flat keys (``flat=True``), in
    registration order; a live read."""
    return {name: LOSS_SETTINGS[name] for name in LOSS_SETTINGS if LOSS_SETTINGS[name].flat}


#: setting name -> :class:`LossSetting`, filled by policy-loss registrations that declare
#: ``settings=``; the loss that declared each is its registration info ``loss_mode``.
LOSS_SETTINGS: Registry[LossSetting] = Registry("policy-loss setting", "loss_options")
#: loss_mode -> the check of its declared settings taken together (``register_policy_loss(...,
#: settings_check=)``): ``values`` (any object with the settings as attributes: a PolicyLossConfig,
#: a TrainConfig) -> None if valid, else what is wrong; run by :func:`cross_field_problem`.
SETTINGS_CHECKS: dict[str, Check] = {}


def _check_loss_options(v: Any) -> str | None:
    """Check of ``loss_options``: a mapping of declared :data:`LOSS_SETTINGS` to valid values."""
    if not isinstance(v, Mapping):
        return "must be a mapping of declared loss settings to values"
    for name, value in v.items():
        if name not in LOSS_SETTINGS:
            return (f"has {name!r}, which no registered policy loss declares; declared: "
                    f"{sorted(LOSS_SETTINGS) or 'none'}")
        s = LOSS_SETTINGS[name]
        if s.choices and value not in s.choices:
            return f"{name}={value!r} is unknown; valid: {sorted(s.choices)}"
        problem = s.check(value) if s.check else None
        if problem:
            return f"{name} {problem}"
    return None


def check_loss_option(name: str, value: Any) -> None:
    """Validate ``value`` for the declared loss setting ``name`` (its choices, then its check), with
    :func:`check_setting`'s messages.

    Raises:
        ValueError: ``name`` is not declared (listing the declared ones); ``"<name>=<value> is
            unknown; valid: [...]"``; ``"<name> must be ..., got <value>"``.
    """
    if name not in LOSS_SETTINGS:
        raise ValueError(f"loss_options has {name!r}, which no registered policy loss declares; declared: "
                         f"{sorted(LOSS_SETTINGS) or 'none'}")
    s = LOSS_SETTINGS[name]
    if s.choices:
        check_choice(name, value, s.choices)
    problem = s.check(value) if s.check else None
    if problem:
        raise ValueError(f"{name} {problem}, got {value!r}")


def _frozen(value: Any) -> Any:
    """A hashable stand-in for ``value``: mappings as sorted item tuples, lists as tuples, sets as frozensets."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_frozen(v) for v in value)
    return value


@dataclass(frozen=True, init=False)
class PolicyLossConfig:
    """Configuration of the policy losses in :data:`echotrain.rl.POLICY_LOSSES`.

    Field names are verl's (``actor_rollout_ref.actor.*``) where verl has the field. Each
    field's help text is ``dataclasses.fields(PolicyLossConfig)[i].metadata["help"]`` (printed by
    ``echotrain train --help``). The settings a loss declares in its registration live in
    ``loss_options`` and read as attributes (``config.tau_pos``); those declared ``flat`` are also
    keyword arguments, ``PolicyLossConfig(tau_pos=1.2)`` = ``PolicyLossConfig(loss_options={"tau_pos":
    1.2})`` (a flat keyword wins over the same key in ``loss_options``). ``loss_options`` keeps only
    values that differ from the declared default, so equal settings give equal configs.

    Raises:
        ValueError: a value that fails its field's check, naming the field (at construction).
        TypeError: a keyword that is neither a field nor a declared flat setting.
    """

    clip_ratio_low: float = _setting(
        0.2, "Token clip eps_low: ratio floor 1 - eps_low (PPO, arXiv 1707.06347). PPO/GRPO/DAPO: 0.2; GSPO: 3e-4 "
        "on its sequence ratio (arXiv 2507.18071). Also, as in verl: the DPPO divergence threshold for A < 0 "
        "(dppo_tv: probability drop, dppo_kl: binary KL) and GMPO's log-ratio clip (paper: 0.4).",
        _eps("ratio floor 1 - eps_low > 0"))
    clip_ratio_high: float = _setting(
        0.2, "Token clip eps_high: ratio ceiling 1 + eps_high. GRPO 0.2; DAPO clip-higher 0.28 (arXiv 2503.14476); "
        "GSPO 4e-4. DPPO: the threshold for A > 0; GMPO: the upper log-ratio clip (paper 0.4).", _eps())
    clip_ratio_c: float | None = _setting(
        None, "Dual-clip constant c (> 1) capping the loss of negative-advantage tokens at -A*c (Dual-clip PPO, "
        "arXiv 1912.09729; verl uses 3.0). Empty/none disables dual-clip (our default). dppo_tv/dppo_kl read it, as "
        "verl does, as the cap of their truncated IS weight (none: 20, verl's fallback; DPPO arXiv 2602.04879 §5.4 "
        "recommends a large cap).",
        lambda v: None if v is None or (_is_real(v) and v > 1) else
        "must be > 1 for dual-clip PPO (or None to disable)")
    ba_scope: str = _setting(
        "group", "Balanced Aggregation (arXiv 2605.04077) scope: per prompt group (default) or pooled over the "
        "batch.", choices=BA_SCOPES)
    ba_count_zero_adv: bool = _setting(
        True, "Balanced Aggregation: zero-advantage responses count in the group size G (default).", _is_bool)
    norm_constant: float | None = _setting(
        None, "Constant C of seq-mean-token-sum-norm (Dr. GRPO, arXiv 2503.20783). Unset (none) = the maximum "
        "response length of the run (max_new_tokens; TRL: max_completion_length; verl: loss_scale_factor); never "
        "the padded width of a batch.",
        lambda v: None if v is None or (_is_real(v) and v > 0) else "must be > 0 (or none: the max response length)")
    log_ratio_clamp: float = _setting(
        20.0, "log rho is clamped to +-this before exp, with zero gradient beyond (verl uses 20).",
        lambda v: None if _is_real(v) and v > 0 else "must be finite and > 0")  # inf: exp overflows
    loss_options: dict = field(default_factory=dict, metadata={
        "help": "Settings a policy loss declares in its registration (register_policy_loss(name, settings=...)), "
        "e.g. a plugin's loss: loss_options.KEY=VALUE on the command line, a mapping in YAML; read by the loss as "
        "config.KEY (unset: the declared default). The built-in losses' settings are flat keys of their own "
        "(tau_pos=..., listed here).", "choices": None, "check": _check_loss_options})

    # ---- behaviour-policy (rollout) correction: echotrain.rl.correction, docs/design/objectives.md §10
    rollout_correction: str | None = _setting(
        None, "Behaviour-policy correction stage applied to every policy loss, given the sampler's per-token "
        "log-probs rollout_log_prob (echotrain.rl.correction): a registered name or a comma-separated chain of them "
        "(token_is, seq_is, token_mask, seq_mask, rejection, offpolicy_mask, decoupled; weights multiply, masks "
        "combine). Empty/none (default): no correction, today's loss bit-identical. verl: "
        "algorithm.rollout_correction.rollout_is / rollout_rs.", _rollout_correction_check)
    rollout_is_threshold: float = _setting(
        2.0, "Upper threshold C on the importance weight pi_old/pi_rollout for token_is / seq_is (truncation, "
        "min(w, C); TIS, Yao et al. 2025) and token_mask / seq_mask (weights above C are masked; IcePop, MIS). verl "
        "rollout_is_threshold (default 2.0; typical 1.5-5 token, 2-10 sequence).", _positive_threshold())
    rollout_is_threshold_lower: float | None = _setting(
        None, "Lower threshold on the importance weight: token_is / seq_is raise weights below it to it, token_mask "
        "/ seq_mask mask them (IcePop band [0.5, 5], arXiv 2510.18855). Empty/none: no lower threshold. Must be <= "
        "rollout_is_threshold. verl: the lower half of rollout_is_threshold=\"lower_upper\" (IcePop only).",
        _positive_threshold(optional=True))
    rollout_is_batch_normalize: bool = _setting(
        False, "Divide the correction weights by their mean over the optimizer step's kept tokens (token-level "
        "weights) or sequences (sequence-level) so they average 1 (self-normalised IS); step-global, exact under "
        "micro-batches and ranks. verl rollout_is_batch_normalize (default False).", _is_bool)
    rollout_rs: str = _setting(
        "token_k1", "Statistic of the rejection correction (verl rollout_rs, one option): token_k1/k2/k3 per token, "
        "seq_sum_*, seq_mean_* (k1/k2/k3) or seq_max_* (k2/k3) per sequence, with k1 = log(pi_rollout/pi_old), "
        "k2 = (log r)^2/2, k3 = r - 1 - log r, r = pi_old/pi_rollout (Schulman 2020). Rejected tokens leave the loss "
        "and its normalisers (response_mask).", choices=RS_STATISTICS)
    rollout_rs_threshold: float = _setting(
        2.0, "Rejection upper threshold (verl rollout_rs_threshold): for k2/k3 statistics an upper bound on the "
        "divergence; for k1 statistics an upper bound on the ratio exp(k1) = pi_rollout/pi_old (of the sequence "
        "product for seq_sum, the geometric mean for seq_mean).", _positive_threshold())
    rollout_rs_threshold_lower: float | None = _setting(
        None, "Rejection lower ratio bound for k1 statistics (verl: the lower half of rollout_rs_threshold="
        "\"lower_upper\"); empty/none: 1 / rollout_rs_threshold as in verl. Unused by k2/k3. Must be <= "
        "rollout_rs_threshold.", _positive_threshold(optional=True))
    behav_imp_weight_cap: float | None = _setting(
        None, "decoupled PPO: tokens whose behaviour weight pi_prox/pi_behav (= exp(old_log_prob - "
        "rollout_log_prob)) exceeds this cap get weight 0 (AReaL behav_imp_weight_cap, arXiv 2505.24298), "
        f"compared with a float-noise tolerance of {CAP_LOG_TOLERANCE:g} nats (CAP_LOG_TOLERANCE, ours): "
        "on-policy tokens, whose two log-probs differ by rounding only, are not masked even at cap 1. "
        "Empty/none: no cap.", lambda v: None if v is None or (_is_real(v) and v >= 1) else
        "must be a finite float >= 1 (or none for no cap)")
    offpolicy_mask_delta: float = _setting(
        0.1, "offpolicy_mask (DeepSeek-V3.2 off-policy sequence masking, arXiv 2512.02556): a negative-advantage "
        "sequence whose mean token KL estimate (1/|o|) sum log(pi_rollout/pi_old) exceeds delta gets weight 0. "
        "No published value; 0.1 is ours.", _eps())

    def __hash__(self) -> int:
        """Equal configs hash equally (usable as a cache key or set member): ``loss_options``, a
        mapping, is hashed as its sorted items (lists as tuples)."""
        return hash(tuple((f.name, _frozen(getattr(self, f.name))) for f in dataclasses.fields(self)))

    def __init__(self, **values: Any) -> None:
        options = dict(values.pop("loss_options", None) or {})
        for key in [k for k in values if k not in POLICY_LOSS_FIELDS]:
            if key in LOSS_SETTINGS and LOSS_SETTINGS[key].flat:
                options[key] = values.pop(key)
            else:
                raise TypeError(f"PolicyLossConfig.__init__() got an unexpected keyword argument {key!r}")
        for f in dataclasses.fields(self):
            if f.name != "loss_options":
                object.__setattr__(self, f.name, values.get(f.name, f.default))
        object.__setattr__(self, "loss_options", options)
        self.__post_init__()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "loss_options" and isinstance(self.loss_options, Mapping):
                for key, value in self.loss_options.items():
                    check_loss_option(key, value)
            else:
                check_setting(f, getattr(self, f.name))
        object.__setattr__(self, "loss_options", {k: v for k, v in self.loss_options.items()
                                                  if not _is_default(k, v)})
        problem = cross_field_problem(self)
        if problem:
            raise ValueError(problem)

    def __getattr__(self, name: str) -> Any:
        """A declared loss setting (:data:`LOSS_SETTINGS`): its ``loss_options`` value, else its default.

        Raises:
            AttributeError: ``name`` is neither a field nor a declared loss setting.
        """
        if name.startswith("__") or name == "loss_options":
            raise AttributeError(name)
        if name in LOSS_SETTINGS:
            return self.loss_options.get(name, LOSS_SETTINGS[name].default)
        raise AttributeError(f"PolicyLossConfig has no setting {name!r} (fields and declared loss settings: "
                             f"{sorted(POLICY_LOSS_FIELDS) + sorted(LOSS_SETTINGS)})")


def _is_default(name: str, value: Any) -> bool:
    """``value`` is the declared default of the loss setting ``name`` (same type and value)."""
    default = LOSS_SETTINGS[name].default
    return builtins.type(value) is builtins.type(default) and value == default


def cross_field_problem(values: Any) -> str | None:
    """What is wrong between settings (``values``: a :class:`PolicyLossConfig` or any object with
    its attributes, e.g. a TrainConfig), or None: lower thresholds above their upper ones, then
    each loss's own rule (:data:`SETTINGS_CHECKS`, e.g. Clip-Cov's band clip_cov_lb < clip_cov_ub)."""
    for low, high in (("rollout_is_threshold_lower", "rollout_is_threshold"),
                      ("rollout_rs_threshold_lower", "rollout_rs_threshold")):
        lo, hi = getattr(values, low), getattr(values, high)
        if lo is not None and _is_real(lo) and _is_real(hi) and lo > hi:
            return f"{low}={lo!r} must be <= {high}={hi!r} (thresholds in the wrong order)"
    for check in SETTINGS_CHECKS.values():
        problem = check(values)
        if problem:
            return problem
    return _on_policy_kept_problem(values)


def _on_policy_kept_problem(values: Any) -> str | None:
    """An IS or rejection band that excludes the on-policy ratio 1, so a correction would cut or
    remove every token even with no train/inference gap (a run that silently trains on nothing):
    the bands of the corrections in ``rollout_correction`` must contain 1."""
    try:
        names = set(parse_rollout_correction(getattr(values, "rollout_correction")))
    except ValueError:
        return None  # the field's own check names the problem
    bands = []
    if names & {"token_is", "seq_is", "token_mask", "seq_mask"}:
        bands.append(("rollout_is_threshold_lower", "rollout_is_threshold"))
    if "rejection" in names and str(getattr(values, "rollout_rs")).endswith("k1"):
        bands.append(("rollout_rs_threshold_lower", "rollout_rs_threshold"))  # k1: a band on the ratio
    for low, high in bands:
        lo, hi = getattr(values, low), getattr(values, high)
        if _is_real(hi) and hi < 1:
            return f"{high}={hi!r} must be >= 1: the on-policy ratio 1 must stay inside the band of rollout_correction"
        if lo is not None and _is_real(lo) and lo > 1:
            return f"{low}={lo!r} must be <= 1: the on-policy ratio 1 must stay inside the band of rollout_correction"
    return None


def check_setting(f: dataclasses.Field, value: Any) -> None:
    """Validate ``value`` for the :class:`PolicyLossConfig` field ``f`` (its choices, then its check).

    Raises:
        ValueError: ``"<name>=<value> is unknown; valid: [...]"`` or ``"<name> must be ..., got <value>"``.
    """
    if f.metadata.get("choices"):
        check_choice(f.name, value, f.metadata["choices"])
    problem = f.metadata["check"](value) if f.metadata.get("check") else None
    if problem:
        raise ValueError(f"{f.name} {problem}, got {value!r}")


def policy_loss_fields(exclude: tuple[str, ...] = (), keep: tuple[str, ...] | None = None,
                       **metadata: Any) -> list[tuple[str, Any, dataclasses.Field]]:
    """``(name, type, Field)`` of every :class:`PolicyLossConfig` setting not in ``exclude``: fresh
    fields with the same default and metadata (only the keys in ``keep`` if given, plus
    ``metadata``), for another dataclass; the declared flat loss settings
    (:func:`flat_loss_settings`) follow ``loss_options``, with their default, help, choices and check."""
    out = []
    for f in dataclasses.fields(PolicyLossConfig):
        if f.name not in exclude:
            meta = {k: v for k, v in f.metadata.items() if keep is None or k in keep}
            if f.default_factory is not dataclasses.MISSING:  # loss_options: a fresh dict per instance
                fld = field(default_factory=f.default_factory, metadata={**meta, **metadata})
            else:
                fld = field(default=f.default, metadata={**meta, **metadata})
            out.append((f.name, f.type, fld))
        if f.name == "loss_options":
            for name, s in flat_loss_settings().items():
                if name not in exclude:
                    meta = {"help": s.help, "choices": s.choices, "check": s.check, "loss_mode":
                            LOSS_SETTINGS.info(name)["loss_mode"]}
                    meta = {k: v for k, v in meta.items() if keep is None or k in keep}
                    out.append((name, s.type, field(default=s.default, metadata={**meta, **metadata})))
    return out


def with_policy_loss_fields(after: str | None = None, exclude: tuple[str, ...] = (),
                            keep: tuple[str, ...] | None = None, **metadata: Any):
    """Class decorator, applied under ``@dataclass``: add every :class:`PolicyLossConfig` field
    (default and metadata: help, choices, check, or only the keys in ``keep``; ``metadata``
    added) to the class, right after its field ``after`` (None: at the end), except those in
    ``exclude``.

    The class gets ``policy_loss_keys``: the names added (fields and flat loss settings), the
    keywords of :class:`PolicyLossConfig` it describes.

    Raises:
        ValueError: ``after`` is not a field of the class, or a field is declared twice.
    """

    def wrap(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        extra = policy_loss_fields(exclude, keep, **metadata)
        clash = sorted(set(own) & {name for name, _, _ in extra})
        if clash:
            raise ValueError(f"{cls.__name__} restates PolicyLossConfig field(s) {clash}")
        if after is not None and after not in own:
            raise ValueError(f"{cls.__name__} has no field {after!r} to add the PolicyLossConfig fields after")
        annotations: dict[str, Any] = {}
        for name, typ in own.items():
            annotations[name] = typ
            if name == after:
                annotations.update({n: t for n, t, _ in extra})
        annotations.update({n: t for n, t, _ in extra})  # after=None: at the end (no-op otherwise)
        for name, _, fld in extra:
            setattr(cls, name, fld)
        cls.__annotations__ = annotations
        cls.policy_loss_keys = tuple(name for name, _, _ in extra)  # what policy_loss_config() reads back
        return cls

    return wrap


def flat_values(config: PolicyLossConfig) -> dict[str, Any]:
    """Every setting of ``config`` under its flat key, as the trainer's and TRL's config classes
    hold them: each :class:`PolicyLossConfig` field, then each flat loss setting (its value, or
    its default); ``loss_options`` keeps only the settings without a flat key."""
    flat = flat_loss_settings()
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values["loss_options"] = {k: v for k, v in config.loss_options.items() if k not in flat}
    values.update({name: getattr(config, name) for name in flat})
    return values


POLICY_LOSS_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(PolicyLossConfig)}
_FIELDS = tuple(POLICY_LOSS_FIELDS)


def as_policy_loss_config(config: PolicyLossConfig | Mapping[str, Any] | None) -> PolicyLossConfig:
    """Return ``config`` as a :class:`PolicyLossConfig` (None -> defaults; dicts converted).

    Raises:
        TypeError: not a PolicyLossConfig, mapping or None.
        ValueError: unknown keys (the message lists the valid ones) or invalid values.
    """
    if config is None:
        return PolicyLossConfig()
    if isinstance(config, PolicyLossConfig):
        return config
    if isinstance(config, Mapping):
        values = dict(config)
        options = dict(values.pop("loss_options", None) or {})
        options.update({k: values.pop(k) for k in list(values) if k not in _FIELDS and k in LOSS_SETTINGS})
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown PolicyLossConfig key(s) {unknown}; valid: {sorted(_FIELDS)} and the declared "
                             f"loss settings {sorted(LOSS_SETTINGS)}")
        return PolicyLossConfig(**values, loss_options=options)
    raise TypeError(f"config must be a PolicyLossConfig, a dict or None, got {type(config).__name__}")
