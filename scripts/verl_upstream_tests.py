"""Run verl 0.9.1's own policy-loss tests against echotrain's verl plugin, plus a differential check.

    python scripts/verl_upstream_tests.py [--sdist PATH] [--workdir DIR]

1. Fetches verl 0.9.1's source distribution from PyPI (``pip download --no-deps --no-binary :all:
   verl==0.9.1``; it carries verl's ``tests/``), unless ``--sdist`` names a downloaded one.
2. Runs verl's policy-loss and loss-aggregation unit tests (``tests/trainer/ppo/
   test_rollout_corr_integration.py``, ``test_loss_aggregation_on_cpu.py``) twice in fresh
   processes: with verl's own losses (baseline), and with verl's loss names pointed at the
   plugin's (``vanilla`` -> ``echotrain_vanilla``, ``gspo`` -> ``echotrain_gspo_token``, in
   ``POLICY_LOSS_REGISTRY`` and as ``core_algos`` attributes).
3. Differential check: the plugin's losses against verl's originals on the same inputs (value and
   gradient): random batches, log-ratios of +-30, dual-clip active, asymmetric clips, 1/2/4
   data-parallel ranks with verl's ``global_batch_info``, and GSPO with a sequence ratio above
   ``clip_ratio_c`` (issue 9, case 11).

Every difference must be one of the documented ones (design/objectives.md §8), listed in
``EXPECTED``; anything else is reported as UNEXPECTED and the exit status is 1. Needs the installed
``verl==0.9.1`` (``pip install --no-deps``) and network access to PyPI for step 1.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.9.1"
TEST_FILES = ("tests/trainer/ppo/test_rollout_corr_integration.py", "tests/trainer/ppo/test_loss_aggregation_on_cpu.py")
# verl tests whose outcome differs with the plugin, and why (design/objectives.md §8)
EXPECTED = {
    "test_policy_loss_with_rollout_is": "the plugin refuses rollout_is_weights (verl's rollout correction)",
    "test_metrics_only_mode": "the plugin refuses rollout_is_weights (verl's rollout correction)",
    "test_exact_icepop_matches_filtered_weighted_ppo_loss": "the plugin refuses rollout_is_weights",
}


def fetch_sdist(workdir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"verl=={VERSION}", "-d", str(workdir)], check=True)
    return next(workdir.glob(f"verl-{VERSION}.tar.gz"))


def extract_tests(sdist: Path, workdir: Path) -> list[Path]:
    """Copy verl's test files into ``workdir/verl_tests`` (outside the sdist's ``verl/`` package, so
    the installed verl is the one imported)."""
    out = workdir / "verl_tests"
    out.mkdir(exist_ok=True)
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        paths = []
        for rel in TEST_FILES:
            member = tar.extractfile(f"{root}/{rel}")
            if member is None:
                raise SystemExit(f"{rel} not in {sdist}")
            dst = out / Path(rel).name
            dst.write_bytes(member.read())
            paths.append(dst)
    return paths


def swap_in_plugin() -> None:
    """Point verl's ``vanilla`` / ``gspo`` at the plugin's losses (registry and module attributes)."""
    import verl.trainer.ppo.core_algos as core

    from echotrain.integrations.verl import make_verl_policy_loss

    swap = {"vanilla": make_verl_policy_loss("vanilla"), "gspo": make_verl_policy_loss("gspo_token")}
    for name, fn in swap.items():
        core.POLICY_LOSS_REGISTRY[name] = fn
        setattr(core, f"compute_policy_loss_{name}", fn)


def run_pytest(mode: str, files: list[str]) -> dict[str, str]:
    """In this process: verl's tests with (``plugin``) or without (``baseline``) the swap."""
    import pytest

    if mode == "plugin":
        swap_in_plugin()
    outcomes: dict[str, str] = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
                outcomes[report.nodeid.split("::")[-1]] = report.outcome

    pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", *files], plugins=[Collect()])
    return outcomes


# --------------------------------------------------------------------------- differential check


def differential() -> list[tuple[str, float, str]]:
    """(case, max |difference| of value and gradient, status) for the plugin vs verl's originals."""
    import torch
    import verl.trainer.ppo.core_algos as core
    from verl.workers.config import ActorConfig

    from echotrain.integrations.verl import make_verl_policy_loss

    ours = {"vanilla": make_verl_policy_loss("vanilla"), "gspo": make_verl_policy_loss("gspo_token")}
    theirs = {"vanilla": core.compute_policy_loss_vanilla, "gspo": core.compute_policy_loss_gspo}

    def actor(low, high, **info):
        return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low,
                           clip_ratio_high=high, clip_ratio_c=3.0, global_batch_info=info)

    def batch(seed, noise, B=16, T=9):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T) < lengths[:, None]).to(torch.float64)
        old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
        lp = old + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
        return old, lp, adv, mask

    def compare(loss, agg, low, high, old, lp, adv, mask, dp):
        B = mask.shape[0]
        info = dict(dp_size=dp, batch_num_tokens=int(mask.sum()), global_batch_size=B, loss_scale_factor=9)
        grads, values = [], []
        for fn in (ours[loss], theirs[loss]):
            x = lp.clone().requires_grad_(True)
            total = 0.0
            for rows in torch.arange(B).chunk(dp):
                v, _ = fn(old[rows], x[rows], adv[rows], mask[rows], loss_agg_mode=agg, config=actor(low, high, **info))
                (v / dp).backward()
                total += float(v.detach()) / dp
            grads.append(x.grad)
            values.append(total)
        diff = max(abs(values[0] - values[1]) / max(1.0, abs(values[1])),
                   float((grads[0] - grads[1]).abs().max() / grads[1].abs().max().clamp(min=1e-300)))
        return diff

    rows = []
    aggs = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    for loss in ("vanilla", "gspo"):
        for agg in aggs:
            for dp in (1, 2, 4):
                for case in ("random", "dual_clip", "asymmetric", "log_ratio_30"):
                    noise = 0.02 if loss == "gspo" else (1.0 if case == "dual_clip" else 0.3)
                    old, lp, adv, mask = batch(11, noise)
                    low, high = (0.05, 0.6) if case == "asymmetric" else ((3e-3, 4e-3) if loss == "gspo" else (0.2, 0.28))
                    if case == "log_ratio_30":
                        lp = lp.clone()
                        lp[0, 0], lp[1, 0] = old[0, 0] + 30, old[1, 0] - 30
                    if loss == "gspo" and case == "dual_clip":
                        lp = lp.clone()
                        lp[2] = torch.where(mask[2].bool(), old[2] + 2.0, lp[2])  # s = e^2 > c = 3
                        adv = adv.clone()
                        adv[2] = -mask[2]
                    diff = compare(loss, agg, low, high, old, lp, adv, mask, dp)
                    name = f"{loss} {agg} dp={dp} {case}"
                    expected = loss == "gspo" and case == "log_ratio_30"
                    tol = 1e-6  # verl divides seq-mean-token-mean by (length + 1e-8)
                    if diff <= tol:
                        status = "equal" if not expected else "UNEXPECTED (expected a clamp difference)"
                    else:
                        status = ("expected difference: GSPO log-ratio clamp (ours per token +-20, verl mean <= 10)"
                                  if expected else "UNEXPECTED")
                    rows.append((name, diff, status))
    # issue 9 case 11 by hand: old -2, new 0, A = -1, 4 tokens, token-mean -> verl 7.389, grad 1.847
    old = torch.full((1, 4), -2.0, dtype=torch.float64)
    adv = -torch.ones(1, 4, dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    x = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    v, m = ours["gspo"](old, x, adv, mask, loss_agg_mode="token-mean", config=actor(0.2, 0.2))
    v.backward()
    ok = abs(float(v.detach()) - math.exp(2)) < 1e-9 and float((x.grad - math.exp(2) / 4).abs().max()) < 1e-9
    rows.append(("gspo no dual-clip: loss e^2 = 7.389, grad 1.847/token", abs(float(v.detach()) - math.exp(2)),
                 "equal" if ok and m["actor/pg_clipfrac_lower"] == 0 else "UNEXPECTED"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", type=Path, help="a downloaded verl-0.9.1.tar.gz (default: fetch from PyPI)")
    ap.add_argument("--workdir", type=Path, help="where to download and extract (default: a temp dir)")
    ap.add_argument("--run-pytest", choices=("baseline", "plugin"), help=argparse.SUPPRESS)
    ap.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_pytest:  # child process
        print("RESULT " + json.dumps(run_pytest(args.run_pytest, args.files)))
        return 0
    import verl

    if getattr(verl, "__version__", VERSION) != VERSION:
        print(f"warning: installed verl is {verl.__version__}, the tests are {VERSION}'s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="verl_upstream_"))
    workdir.mkdir(parents=True, exist_ok=True)
    sdist = args.sdist or fetch_sdist(workdir)
    files = [str(p) for p in extract_tests(sdist, workdir)]
    results = {}
    for mode in ("baseline", "plugin"):
        out = subprocess.run([sys.executable, __file__, "--run-pytest", mode, *files], capture_output=True, text=True,
                             cwd=workdir / "verl_tests")
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(out.stdout[-3000:], out.stderr[-3000:])
            raise SystemExit(f"{mode} run produced no result")
        results[mode] = json.loads(line[len("RESULT "):])
    bad = 0
    print(f"verl {VERSION} upstream tests ({', '.join(TEST_FILES)}):")
    for name in sorted(results["baseline"]):
        base, plug = results["baseline"][name], results["plugin"].get(name, "missing")
        if base == plug:
            status = "same"
        elif name in EXPECTED:
            status = f"expected difference: {EXPECTED[name]}"
        else:
            status, bad = "UNEXPECTED", bad + 1
        print(f"  {name:60s} verl={base:7s} plugin={plug:7s} {status}")
    print("differential check (relative max |diff| of value and gradient; max over the 4 shared loss_agg_modes "
          "x 1/2/4 data-parallel ranks):")
    summary: dict[str, tuple[float, set[str], int]] = {}
    for name, diff, status in differential():
        bad += status.startswith("UNEXPECTED")
        parts = name.split(" ")
        key = f"{parts[0]} {parts[-1]}" if len(parts) == 4 else name
        worst, statuses, n = summary.get(key, (0.0, set(), 0))
        summary[key] = (max(worst, diff), statuses | {status}, n + 1)
    for key, (worst, statuses, n) in summary.items():
        print(f"  {key:60s} {n:3d} runs  {worst:9.2e}  {'; '.join(sorted(statuses))}")
    print(f"{'OK' if not bad else 'FAILED'}: {bad} unexpected difference(s)")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
