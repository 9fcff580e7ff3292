"""Comparison files: parsing, layering and validation before any work."""

import pytest

from echotrain.cli import main
from echotrain.compare.config import expand_cells, load_spec
from echotrain.train.config import ConfigError

BASE = {"name": "t", "output_dir": "OUT", "seeds": 2, "baseline": "grpo",
        "base": {"steps": 4, "lr": 1e-4, "model": "x"},
        "arms": {"grpo": {"preset": "grpo"}, "echo_detach": {"preset": "echo", "detach_kappa": True, "lr": 2e-4}}}


def spec(tmp_path, tokens=(), **changes):
    data = {**BASE, "output_dir": str(tmp_path / "cmp"), **changes}
    return load_spec(None, list(tokens), data=data)


def test_cells_layer_base_arm_and_command_line(tmp_path):
    cells = expand_cells(spec(tmp_path, ["steps=7", "seeds=[3,5]"]))
    assert [(c.arm, c.seed) for c in cells] == [("grpo", 3), ("echo_detach", 3), ("grpo", 5), ("echo_detach", 5)]
    grpo, echo = cells[0].config, cells[1].config
    assert grpo.loss_mode == "vanilla" and grpo.kl_coef == 0.04 and grpo.lr == 1e-4  # preset, then base
    assert echo.loss_mode == "echo" and echo.detach_kappa is True and echo.lr == 2e-4  # the arm over base
    assert grpo.steps == echo.steps == 7  # key=value over everything
    assert grpo.num_threads == 1 and grpo.progress is False
    assert cells[2].run_dir == tmp_path / "cmp" / "cells" / "grpo__s5"
    assert cells[2].config.output_dir == str(cells[2].run_dir) and cells[2].config.seed == 5


def test_sweep_expands_every_arm(tmp_path):
    s = spec(tmp_path, arms={"echo": {"preset": "echo"}, "arith": {"preset": "echo", "batch_ratio": "arith"}},
             baseline="echo[band=0.01]",
             sweep={"name": "band", "keys": ["batch_clip_low", "batch_clip_high"], "values": [0.002, 0.01]})
    cells = expand_cells(s)
    assert len(cells) == 2 * 2 * 2
    assert s.arm_labels() == ["echo[band=0.002]", "echo[band=0.01]", "arith[band=0.002]", "arith[band=0.01]"]
    c = cells[-1]
    assert c.arm == "arith[band=0.01]" and c.config.batch_clip_low == c.config.batch_clip_high == 0.01
    assert c.config.batch_ratio == "arith" and c.run_dir.name == "arith__band=0.01__s1"


def test_arm_subset(tmp_path):
    s = spec(tmp_path, ["arms=echo_detach"], baseline=None)
    assert list(s.arms) == ["echo_detach"]


@pytest.mark.parametrize("changes, tokens, match", [
    ({"bogus": 1}, (), "unknown key 'bogus'"),
    ({"arms": {"a": {"learning_rate": 1}}}, (), "did you mean 'lr'"),
    ({"arms": {"a": {"seed": 1}}}, (), "set per cell"),
    ({"baseline": "nope"}, (), "baseline='nope' is not an arm"),
    ({"seeds": 0}, (), "seeds=0"),
    ({"verdict": [{"arm": "nope"}]}, (), r"verdict\[0\].arm='nope'"),
    ({"verdict": [{"arm": "grpo", "statistic": "median"}]}, (), "statistic"),
    ({}, ("arms=grpo,zzz",), "unknown arm"),
    ({}, ("report.colour=1",), "unknown key 'report.colour'"),
    ({"sweep": {"keys": ["batch_clip_low"]}}, (), "values"),
])
def test_bad_files_are_rejected(tmp_path, changes, tokens, match):
    with pytest.raises(ConfigError, match=match):
        spec(tmp_path, tokens, **changes)


def test_every_cell_is_validated_like_train(tmp_path):
    s = spec(tmp_path, arms={"grpo": {"preset": "grpo"}, "bad": {"preset": "echo", "batch_ratio": "harmonic"}})
    with pytest.raises(ConfigError, match="arm 'bad' seed 0: batch_ratio='harmonic'"):
        expand_cells(s)


def test_cli_dry_run_and_errors(tmp_path, capsys):
    import yaml

    cfg = tmp_path / "c.yaml"
    data = {**BASE, "output_dir": str(tmp_path / "cmp"), "base": {"steps": 2, "task": "default"}}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["compare", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[3] echo_detach" in out and "new" in out
    assert (tmp_path / "cmp" / "compare.yaml").is_file()
    assert (tmp_path / "cmp" / "commands.sh").read_text().count("echotrain train --config") == 4
    assert main(["compare", str(cfg), "--dry-run", "seeds=1"]) == 0  # key=value after an option
    assert "[1] echo_detach" in capsys.readouterr().out  # seed-major order
    assert main(["compare", str(cfg), "lr=-1", "--dry-run"]) == 2
    assert "lr=-1.0: must be > 0" in capsys.readouterr().err
    assert main(["compare", str(cfg), "task=nope", "--dry-run"]) == 2
    assert main(["compare", "report"]) == 2
