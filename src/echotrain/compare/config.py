"""The ``echotrain compare`` configuration: arms x sweep values x seeds, each cell a TrainConfig.

A comparison file (``configs/compare/*.yaml``) is a mapping::

    name: testbed                       # label of the study
    output_dir: runs/compare/testbed    # comparison directory (cells/, report/, compare.yaml)
    seeds: 5                            # an int n (seeds 0..n-1) or a list of seeds
    confirm_seeds: [10, 11, ..., 19]    # optional: confirmation seeds (an int n: n seeds after the
                                        # exploration seeds); verdicts use these only; run the
                                        # screening alone with phase=exploration on the command line
    baseline: grpo                      # arm the others are compared with (ratios, paired tests)
    base: {model: ..., steps: 60, ...}  # TrainConfig keys for every cell
    arms:                               # name -> TrainConfig keys (a preset plus overrides)
      grpo: {preset: grpo}
      echo_detach: {preset: echo, detach_kappa: true}
    sweep:                              # optional: every arm x every value
      name: band
      keys: [batch_clip_low, batch_clip_high]   # each value is set on all these keys
      values: [0.002, 0.01]
    report:                             # optional
      metric: eval/accuracy             # curve of the AUC / final / threshold statistics
      threshold: 0.4                    # for steps-to-threshold
      stability: {length_ratio: 0.5}    # StabilityThresholds overrides
      max_step: 80                      # read runs up to this step only (a common horizon)
      rule: paired_t                    # verdict interval: paired_t (default) | bca (>= 30 seeds)
      correction: holm                  # across the claims of the study: holm (default) | none
      alpha: 0.05                       # two-sided level of each verdict (default 0.05)
      power: 0.8                        # power of the minimal detectable effect (default 0.8)
    verdict:                            # the rule, written before the runs
      - claim: "echo beats grpo on AUC of held-out greedy accuracy"
        arm: echo
        statistic: auc                  # auc | final | steps_to_threshold | worst_grad_norm | any_flag
        direction: greater              # greater | less
        margin: 0.0
      - claim: "echo loses less than grpo from k=0 to k=8"   # a difference of differences, per seed:
        arm: echo_k8                    # (echo_k8 - echo_k0) vs (grpo_k8 - grpo_k0)
        arm_ref: echo_k0
        baseline: grpo_k8
        baseline_ref: grpo_k0
    suite: {name: math, limit: 20}      # optional: an eval suite after each cell (skipped if absent)
    selection: {p_max: 0.2, claims: 1, fallback: first}  # optional: which claims the screening sends on to the
                                        # confirmation seeds (echotrain compare select; defaults shown)

Selecting arms on the command line (``arms=a,b``) drops the claims that name an unselected arm
(listed in ``CompareSpec.dropped_verdicts``, printed by ``echotrain compare`` and shown in the
report); ``verdict=none`` drops every claim. A claim without ``baseline`` compares with the
file's ``baseline`` (a ``baseline=`` override does not re-point written claims; it only fills in
for a file that names none).

Cell values, each layer overriding the one before: ``base`` -> arm -> sweep value -> command-line
``key=value`` -> ``seed`` and ``output_dir`` (set by compare). Every cell is resolved with
:func:`echotrain.train.config.resolve_config` (so validated exactly like ``echotrain train``)
before any cell runs. With a sweep, the cell's arm label is ``<arm>[<name>=<value>]``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from echotrain.compare.select import check_selection
from echotrain.compare.stats import ALPHA, BCA_MIN_N, CLAIM_DIRECTIONS, CORRECTIONS, POWER, RULES
from echotrain.train.config import FIELDS, ConfigError, TrainConfig, resolve_config

TOP_KEYS = ("name", "output_dir", "seeds", "confirm_seeds", "baseline", "base", "arms", "sweep", "report", "verdict",
            "suite", "selection", "description", "command", "dropped_verdicts", "overridden")
# description, command, dropped_verdicts, overridden: informational (the report shows them; compare writes the
# last three: overridden = {key: {"file", "ran"}}, the file's settings the command line changed)
REPORT_KEYS = ("metric", "threshold", "stability", "max_step", "rule", "correction", "alpha", "power")
#: report keys of the verdict rule: default, valid values (see echotrain.compare.stats)
RULE_DEFAULTS = {"rule": "paired_t", "correction": "holm", "alpha": ALPHA, "power": POWER}
STATISTICS = ("auc", "final", "steps_to_threshold", "worst_grad_norm", "any_flag")
CLAIM_KEYS = ("claim", "arm", "baseline", "statistic", "direction", "margin", "arm_ref", "baseline_ref")
#: ``phase=`` values: which seeds' cells an invocation runs (verdicts always use the confirmation seeds)
PHASES = ("all", "exploration", "confirmation")
#: keys compare sets per cell; not allowed in base / arms / sweep
CELL_KEYS = ("seed", "output_dir")
_NAME_OK = re.compile(r"^[A-Za-z0-9_.+\-]+$")


@dataclass
class Cell:
    """One arm x sweep value x seed: a resolved TrainConfig and its run directory."""

    arm: str  # arm label (with the sweep value, if any)
    base_arm: str  # the arm name in the file
    seed: int
    sweep: dict[str, Any]  # {"name": ..., "value": ...} or {}
    config: TrainConfig
    run_dir: Path

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass
class CompareSpec:
    """A parsed comparison file plus command-line overrides (see the module docstring)."""

    name: str
    output_dir: Path
    seeds: list[int]  # exploration seeds (all seeds when confirm_seeds is empty)
    baseline: str | None
    base: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    sweep: dict[str, Any] | None
    report: dict[str, Any]
    verdict: list[dict[str, Any]]
    suite: dict[str, Any] | None
    overrides: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    confirm_seeds: list[int] = field(default_factory=list)  # the seeds verdicts use, when given
    dropped_verdicts: list[dict[str, Any]] = field(default_factory=list)  # {"claim", "reason"}
    phase: str = "all"  # the seeds whose cells run: all | exploration | confirmation
    selection: dict[str, Any] = field(default_factory=dict)  # echotrain.compare.select's rule (p_max, claims)
    #: the file's own seeds / confirm_seeds / arms (before the command line), for :meth:`overridden`
    file_values: dict[str, Any] = field(default_factory=dict)

    def overridden(self) -> dict[str, dict[str, Any]]:
        """``{key: {"file": value in the file, "ran": value run}}`` for the file's settings that the
        command line changed (seeds, confirm_seeds, arms, and any TrainConfig key of ``base``; a
        key the file leaves to its default reads ``default``): what a description written for the
        file no longer describes."""
        out: dict[str, dict[str, Any]] = {}
        ran = {"seeds": self.seeds, "confirm_seeds": self.confirm_seeds, "arms": list(self.arms)}
        for k, v in ran.items():
            if k in self.file_values and self.file_values[k] != v:
                out[k] = {"file": self.file_values[k], "ran": v}
        from echotrain.train.config.coerce import coerce

        def typed(k: str, v: Any) -> Any:  # "2" and 2 are the same steps
            try:
                return coerce(k, v)
            except (ConfigError, TypeError, ValueError):
                return v

        for k, v in self.overrides.items():
            file_value = typed(k, self.base[k]) if k in self.base else "default"
            if file_value != typed(k, v):
                out[k] = {"file": file_value, "ran": typed(k, v)}
        return out

    def all_seeds(self) -> list[int]:
        """Exploration seeds, then confirmation seeds (the order cells run in)."""
        return list(self.seeds) + list(self.confirm_seeds)

    def run_seeds(self) -> list[int]:
        """The seeds of ``phase``: the cells this invocation runs (the report reads every cell)."""
        return {"all": self.all_seeds(), "exploration": list(self.seeds),
                "confirmation": list(self.confirm_seeds)}[self.phase]

    def arm_labels(self) -> list[str]:
        """Arm labels in file order (expanded by the sweep values)."""
        if not self.sweep:
            return list(self.arms)
        return [arm_label(a, self.sweep["name"], v) for a in self.arms for v in self.sweep["values"]]


def arm_label(arm: str, sweep_name: str | None = None, value: Any = None) -> str:
    """``arm`` or ``arm[name=value]``."""
    return arm if sweep_name is None else f"{arm}[{sweep_name}={value}]"


def _cell_dirname(label: str, seed: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.+\-=]", "_", label.replace("[", "__").replace("]", ""))
    return f"{safe}__s{seed}"


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return dict(value)


def _train_keys(values: dict[str, Any], where: str) -> dict[str, Any]:
    for k in values:
        if k in CELL_KEYS:
            raise ConfigError(f"{where}: {k!r} is set per cell by compare (use seeds: / output_dir: at the top level)")
        if k not in FIELDS:
            from echotrain.train.config.parse import _suggest

            raise ConfigError(f"{where}: unknown key {k!r}" + _suggest(k))
    return values


def parse_seeds(value: Any) -> list[int]:
    """``seeds``: an int n >= 1 (seeds 0..n-1) or a non-empty list of distinct ints.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(value, str):
        value = yaml.safe_load(value)
    if isinstance(value, bool):
        raise ConfigError(f"seeds={value!r}: expected an int >= 1 or a list of ints")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"seeds={value!r}: must be >= 1")
        return list(range(value))
    if isinstance(value, (list, tuple)) and value and all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"seeds={value!r}: seeds must be distinct")
        return list(value)
    raise ConfigError(f"seeds={value!r}: expected an int >= 1 or a non-empty list of ints")


def parse_confirm_seeds(value: Any, seeds: list[int]) -> list[int]:
    """``confirm_seeds``: absent / ``none`` / ``[]`` (no separate confirmation), an int n (the n
    seeds after the largest exploration seed) or a list of distinct ints not among ``seeds``.

    Raises:
        ConfigError: anything else, or a seed that is also an exploration seed.
    """
    if isinstance(value, str):
        value = yaml.safe_load(value)
    if value is None or value == [] or value == "none":
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"confirm_seeds={value!r}: must be >= 1 (or a list of seeds)")
        start = max(seeds) + 1
        return list(range(start, start + value))
    try:
        out = parse_seeds(value)
    except ConfigError:
        raise ConfigError(f"confirm_seeds={value!r}: expected an int >= 1, a list of ints or none") from None
    both = sorted(set(out) & set(seeds))
    if both:
        raise ConfigError(f"confirm_seeds: seed(s) {both} are also exploration seeds (seeds=); "
                          "confirmation needs fresh seeds")
    return out


def split_overrides(tokens: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``key=value`` tokens into comparison keys (``seeds``, ``confirm_seeds``,
    ``output_dir``, ``name``, ``baseline``, ``arms`` = comma list selecting arms, ``phase`` =
    ``exploration`` | ``confirmation`` | ``all`` (the seeds whose cells run), ``verdict=none`` =
    skip every claim, ``report.KEY``) and TrainConfig keys applied to every cell (parsed by
    :func:`echotrain.train.config.parse_overrides`).

    Raises:
        ConfigError: a token without '=' or an unknown key.
    """
    from echotrain.train.config import parse_overrides

    top: dict[str, Any] = {}
    train_tokens = []
    for tok in tokens:
        if "=" not in tok:
            raise ConfigError(f"expected key=value, got {tok!r}")
        key, _, value = tok.partition("=")
        key = key.strip()
        if key in ("seeds", "confirm_seeds", "output_dir", "name", "baseline", "arms", "phase"):
            top[key] = value
        elif key == "verdict":
            if value.strip().lower() not in ("none", "null", "off", "[]"):
                raise ConfigError(f"verdict={value!r}: only verdict=none (skip every claim) is accepted on the "
                                  "command line; claims are written in the comparison file")
            top["verdict_none"] = True
        elif key.startswith("report."):
            sub = key.split(".", 1)[1]
            if sub not in REPORT_KEYS:
                raise ConfigError(f"unknown key {key!r}; valid report keys: {', '.join(REPORT_KEYS)}")
            top.setdefault("report", {})[sub] = yaml.safe_load(value)
        elif key == "seed":
            raise ConfigError("seed= is set per cell; use seeds=N or seeds=[0,1,2]")
        else:
            train_tokens.append(tok)
    return top, parse_overrides(train_tokens)


def load_spec(path: str | Path | None, tokens: list[str] | None = None, data: dict[str, Any] | None = None) -> CompareSpec:
    """Read and check a comparison file (or ``data``) with command-line ``key=value`` tokens.

    Raises:
        ConfigError: missing file, unknown keys, bad seeds / arms / sweep / verdict entries.
    """
    if data is None:
        p = Path(str(path))
        if not p.is_file():
            raise ConfigError(f"compare config {str(path)!r}: file not found")
        data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"compare config {str(path)!r}: expected a mapping")
    data = copy.deepcopy(data)
    for k in data:
        if k not in TOP_KEYS:
            raise ConfigError(f"compare config: unknown key {k!r}; valid: {', '.join(TOP_KEYS)}")
    top, train_over = split_overrides(list(tokens or []))
    report = _mapping(data.get("report"), "report")
    report.update(top.pop("report", {}))
    arm_subset = top.pop("arms", None)
    verdict_none = top.pop("verdict_none", False)
    phase = str(top.pop("phase", "all")).strip()
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r} is not valid; valid: {', '.join(PHASES)}")
    file_baseline = data.get("baseline")
    file_seeds = data.get("seeds", 3)
    file_confirm = data.get("confirm_seeds")
    data.update(top)
    name = str(data.get("name") or (Path(str(path)).stem if path else "compare"))
    arms = _mapping(data.get("arms"), "arms")
    if not arms:
        raise ConfigError("compare config: arms: needs at least one arm (name: {preset: ..., key: value})")
    for a, vals in list(arms.items()):
        if not _NAME_OK.match(str(a)):
            raise ConfigError(f"arms: name {a!r} must be letters, digits, _ . + -")
        arms[a] = _train_keys(_mapping(vals, f"arms.{a}"), f"arms.{a}")
    all_arms = list(arms)
    if arm_subset is not None:  # select a subset, in the given order
        wanted = [s.strip() for s in str(arm_subset).split(",") if s.strip()]
        bad = [w for w in wanted if w not in arms]
        if bad:
            raise ConfigError(f"arms={arm_subset!r}: unknown arm(s) {bad}; valid: {', '.join(arms)}")
        arms = {w: arms[w] for w in wanted}
    sweep = data.get("sweep")
    if sweep is not None:
        sweep = _mapping(sweep, "sweep")
        keys = sweep.get("keys", sweep.get("key"))
        keys = [keys] if isinstance(keys, str) else keys
        if not keys or not isinstance(keys, list):
            raise ConfigError("sweep: needs keys: [TrainConfig key, ...] (or key: one key)")
        _train_keys({k: None for k in keys}, "sweep.keys")
        values = sweep.get("values")
        if not isinstance(values, list) or not values:
            raise ConfigError("sweep: needs values: [v1, v2, ...]")
        extra = set(sweep) - {"name", "key", "keys", "values"}
        if extra:
            raise ConfigError(f"sweep: unknown key(s) {sorted(extra)}; valid: name, keys, values")
        sweep = {"name": str(sweep.get("name") or keys[0]), "keys": list(keys), "values": list(values)}
    baseline = data.get("baseline")
    for k in report:
        if k not in REPORT_KEYS:
            raise ConfigError(f"report: unknown key {k!r}; valid: {', '.join(REPORT_KEYS)}")
    for k, default in RULE_DEFAULTS.items():
        report.setdefault(k, default)
    for k, valid in (("rule", RULES), ("correction", CORRECTIONS)):
        if report[k] not in valid:
            raise ConfigError(f"report.{k}={report[k]!r} is not valid; valid: {', '.join(valid)}")
    for k in ("alpha", "power"):
        v = report[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ConfigError(f"report.{k}={v!r} must be a number in (0, 1)")
    if "stability" in report:
        from echotrain.train.stability import StabilityThresholds

        try:
            StabilityThresholds(**_mapping(report["stability"], "report.stability"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"report.stability: {exc}") from None
    verdict = data.get("verdict") or []
    if not isinstance(verdict, list):
        raise ConfigError("verdict: expected a list of claims")
    seeds = parse_seeds(data.get("seeds", 3))
    confirm = parse_confirm_seeds(data.get("confirm_seeds"), seeds)
    if phase != "all" and not confirm:
        raise ConfigError(f"phase={phase}: the comparison declares no confirm_seeds (all seeds are one phase)")
    judged = confirm or seeds
    if verdict and not verdict_none and report["rule"] == "bca" and len(judged) < BCA_MIN_N:
        raise ConfigError(f"report.rule=bca needs >= {BCA_MIN_N} {'confirmation ' if confirm else ''}seeds, "
                          f"got {len(judged)}: its interval under-covers at few seeds (use rule: paired_t)")
    try:
        selection = check_selection(data.get("selection"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    spec = CompareSpec(name=name, output_dir=Path(str(data.get("output_dir") or f"runs/compare/{name}")),
                       seeds=seeds, confirm_seeds=confirm, phase=phase, baseline=str(baseline) if baseline else None,
                       base=_train_keys(_mapping(data.get("base"), "base"), "base"), arms=arms, sweep=sweep,
                       report=report, verdict=[], suite=_mapping(data.get("suite"), "suite") or None,
                       overrides=train_over, raw=data, selection=selection)
    try:  # the file's own values, for CompareSpec.overridden (the file's errors were raised above)
        fs = parse_seeds(file_seeds)
        spec.file_values = {"seeds": fs, "confirm_seeds": parse_confirm_seeds(file_confirm, fs), "arms": all_arms}
    except ConfigError:  # the file's seeds are invalid but the command line's replace them
        spec.file_values = {"arms": all_arms}
    labels = spec.arm_labels()
    file_labels = [arm_label(a, sweep["name"], v) for a in all_arms for v in sweep["values"]] if sweep else all_arms
    if spec.baseline is not None and spec.baseline not in labels:
        hint = (f" (not among arms={arm_subset}: add it there or set baseline=ARM)"
                if arm_subset is not None and spec.baseline in file_labels else "")
        raise ConfigError(f"baseline={spec.baseline!r} is not an arm{hint}; valid: {', '.join(labels)}")
    for i, c in enumerate(verdict):
        c = _mapping(c, f"verdict[{i}]")
        extra = set(c) - set(CLAIM_KEYS)
        if extra:
            raise ConfigError(f"verdict[{i}]: unknown key(s) {sorted(extra)}; valid: {', '.join(CLAIM_KEYS)}")
        c.setdefault("baseline", str(file_baseline) if file_baseline else spec.baseline)
        c.setdefault("statistic", "auc")
        c.setdefault("direction", "greater")
        c.setdefault("margin", 0.0)
        c.setdefault("claim", f"{c.get('arm')} {c['direction']} than {c['baseline']} on {c['statistic']}")
        if ("arm_ref" in c) != ("baseline_ref" in c):
            raise ConfigError(f"verdict[{i}]: arm_ref and baseline_ref come together (a difference of differences: "
                              "(arm - arm_ref) vs (baseline - baseline_ref), per seed)")
        refs = ("arm_ref", "baseline_ref") if "arm_ref" in c else ()
        for key, valid in (("arm", file_labels), ("baseline", file_labels), ("statistic", STATISTICS),
                           ("direction", CLAIM_DIRECTIONS), *((k, file_labels) for k in refs)):
            if c.get(key) not in valid:
                raise ConfigError(f"verdict[{i}].{key}={c.get(key)!r} is not valid; valid: {', '.join(map(str, valid))}")
        if not isinstance(c["margin"], (int, float)) or isinstance(c["margin"], bool) or not c["margin"] >= 0:
            raise ConfigError(f"verdict[{i}].margin={c['margin']!r} must be a number >= 0")
        if verdict_none:
            spec.dropped_verdicts.append({"claim": c["claim"], "reason": "verdict=none"})
            continue
        missing = [c[k] for k in ("arm", "baseline", *refs) if c[k] not in labels]
        if missing:  # names an arm the command line did not select
            spec.dropped_verdicts.append({"claim": c["claim"], "missing": list(dict.fromkeys(missing)),
                                          "reason": f"arm(s) {', '.join(dict.fromkeys(missing))} not selected"})
            continue
        spec.verdict.append(c)
    return spec


def expand_cells(spec: CompareSpec, threads: int = 1) -> list[Cell]:
    """Every cell of ``spec``, resolved and validated (nothing runs), seed-major (all arms of the
    first seed, then the next seed), so a study stopped early still has every arm.

    ``threads`` sets ``num_threads`` for each cell unless ``base`` / the arm sets it; cells run
    with ``progress=false`` unless set (their log goes to ``train.log``).

    Raises:
        ConfigError: naming the cell whose configuration is invalid.
    """
    cells = []
    sweep_values = [(spec.sweep["name"], v) for v in spec.sweep["values"]] if spec.sweep else [(None, None)]
    # seed-major: every arm's first seed first, so a study stopped early still covers every arm
    for seed in spec.run_seeds():
        for arm, arm_vals in spec.arms.items():
            for sname, svalue in sweep_values:
                label = arm_label(arm, sname, svalue)
                values = {"num_threads": threads, "progress": False, **spec.base, **arm_vals}
                if sname is not None:
                    values.update({k: svalue for k in spec.sweep["keys"]})
                values.update(spec.overrides)
                run_dir = spec.output_dir / "cells" / _cell_dirname(label, seed)
                values.update(seed=seed, output_dir=str(run_dir))
                try:
                    cfg = resolve_config(values)
                except ConfigError as exc:
                    raise ConfigError(f"arm {label!r} seed {seed}: {exc}") from None
                cells.append(Cell(arm=label, base_arm=arm, seed=seed,
                                  sweep={"name": sname, "value": svalue} if sname else {}, config=cfg,
                                  run_dir=run_dir))
    return cells
