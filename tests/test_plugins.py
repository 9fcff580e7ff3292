"""Plugins (docs/design/architecture.md, "Plugins"): a package outside echotrain registers a policy
loss with a setting of its own, a task and a metric, and ``echotrain train`` runs them through the
real CLI with ``plugins=[...]``; the entry-point route; the errors (one line, exit 2, nothing loaded)."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from echotrain import plugins
from echotrain.cli import main

# model=testbed: the cached testbed policy (slow when it must be built; tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_testbed")

PKG = Path(__file__).resolve().parent / "fixtures" / "plugin_pkg"
PLUGIN_FILE = PKG / "echotrain_example_plugin.py"
_TINY = ["model=testbed", "steps=2", "prompts_per_step=4", "num_generations=4", "max_new_tokens=4",
         "num_mini_batches=1", "micro_batch_size=8", "eval_prompts=4", "num_threads=1", "save_every=0",
         "save_final_model=false", "plots=false", "progress=false", "lr=1e-3"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_plugin_loss_task_and_metric_train_from_the_cli(tmp_path, monkeypatch):
    """The recipe as a user runs it: module name found in the working directory, a loss setting
    through loss_options, the plugin's task and metric; config.yaml keeps plugins for --resume."""
    monkeypatch.chdir(PKG)
    monkeypatch.syspath_prepend(str(PKG))
    run = tmp_path / "run"
    rc = main(["train", *_TINY, "task=small_sums", "loss_mode=scaled_vanilla", "loss_options.my_scale=0.5",
               "plugins=[echotrain_example_plugin]", f"output_dir={run}"])
    assert rc == 0
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["scaled/scale"] == 0.5 for r in records)  # the plugin's metric, with its setting's value
    assert all(0 <= r["accuracy"] <= 1 and "pg_clipfrac" in r for r in records)
    saved = (run / "config.yaml").read_text()
    assert "echotrain_example_plugin" in saved and "my_scale: 0.5" in saved


def test_plugin_loss_gradient_is_scaled_exactly(tmp_path):
    """my_scale=0.5 halves vanilla's first-step gradient exactly (one mini-batch, no clipping)."""
    common = [*_TINY, "task=small_sums", "max_grad_norm=0", "eval_prompts=0", "steps=1", "preset=dapo",
              f"plugins=[{PLUGIN_FILE}]", "seed=3"]
    assert main(["train", *common, "loss_mode=vanilla", f"output_dir={tmp_path / 'a'}"]) == 0
    assert main(["train", *common, "loss_mode=scaled_vanilla", "loss_options.my_scale=0.5",
                 f"output_dir={tmp_path / 'b'}"]) == 0
    (a,), (b,) = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert a["grad_norm"] > 0 and b["grad_norm"] == 0.5 * a["grad_norm"]


@pytest.mark.parametrize("tokens, message", [
    (["plugins=[no_such_plugin_module]"], "plugins: no module named 'no_such_plugin_module'"),
    (["plugins=[./missing_plugin.py]"], "no such file"),
    ([f"plugins=[{PLUGIN_FILE}]", "loss_options.my_scael=0.5"], "has 'my_scael', which no registered policy loss declares"),
    ([f"plugins=[{PLUGIN_FILE}]", "loss_options.my_scale=-1"], "my_scale must be a number > 0"),
    ([f"plugins=[{PLUGIN_FILE}]", "loss_mode=vanilla", "loss_options.my_scale=2"],
     "loss_options.my_scale is a setting of loss_mode='scaled_vanilla'"),
])
def test_plugin_errors_are_one_line_exit_2(tokens, message, tmp_path, capsys):
    rc = main(["train", *_TINY, "task=small_sums", "loss_mode=scaled_vanilla", *tokens, f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_entry_point_group_is_imported_once(monkeypatch):
    """An installed package's ``echotrain.plugins`` entry point: a module, or a callable called once."""
    calls = []
    module_name = "echotrain_entry_point_probe"
    probe = type(sys)(module_name)
    probe.register = lambda: calls.append("register")
    monkeypatch.setitem(sys.modules, module_name, probe)
    eps = importlib.metadata.EntryPoints([
        importlib.metadata.EntryPoint("probe", f"{module_name}:register", plugins.ENTRY_POINT_GROUP)])
    seen = []
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: seen.append(group) or (eps if group == plugins.ENTRY_POINT_GROUP else []))
    monkeypatch.setattr(plugins, "_ENTRY_POINTS_LOADED", False)
    assert plugins.load_entry_points() == ["probe"] and calls == ["register"]
    assert plugins.load_entry_points() == [] and calls == ["register"]  # once per process
    assert seen == [plugins.ENTRY_POINT_GROUP]


def test_parse_plugins_forms():
    assert plugins.parse_plugins(None) == [] and plugins.parse_plugins("") == []
    assert plugins.parse_plugins("[a, b.c]") == ["a", "b.c"] == plugins.parse_plugins("a,b.c")
    assert plugins.parse_plugins(["x.py"]) == ["x.py"]
    with pytest.raises(plugins.PluginError, match="each entry"):
        plugins.parse_plugins([""])
    assert plugins.load_plugin(str(PLUGIN_FILE)) is plugins.load_plugin(str(PLUGIN_FILE))  # idempotent


def test_eval_takes_plugins_before_the_task(capsys):
    rc = main(["eval", "--plugins", str(PLUGIN_FILE), "--task", "small_sums", "--model", "testbed", "--prompts", "2",
               "--n", "1", "--max-new-tokens", "4", "--threads", "1", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["task"] == "small_sums" and res["num_prompts"] == 2
    assert main(["eval", "--plugins", "no_such_plugin_module", "--task", "small_sums"]) == 2
    assert "plugins: no module named 'no_such_plugin_module'" in capsys.readouterr().err


def test_compare_cells_carry_the_plugins(tmp_path):
    """A comparison's cells are resolved like ``echotrain train`` (plugins first), and each cell's
    config (what its ``echotrain train`` subprocess reads) keeps them."""
    from echotrain.compare.config import expand_cells, load_spec

    from echotrain.train.config import ConfigError

    data = {"output_dir": str(tmp_path), "seeds": [0], "baseline": "vanilla",
            "base": {"model": "testbed", "task": "small_sums", "plugins": [str(PLUGIN_FILE)]},
            "arms": {"mine": {"loss_mode": "scaled_vanilla", "loss_options": {"my_scale": 0.25}},
                     "vanilla": {"loss_mode": "vanilla"}}}
    cells = expand_cells(load_spec(None, [], data=data))
    mine = [c for c in cells if c.base_arm == "mine"][0].config
    assert mine.plugins == [str(PLUGIN_FILE)] and mine.policy_loss_config().my_scale == 0.25
    with pytest.raises(ConfigError, match="arm 'vanilla' .*loss_options.my_scale is a setting of loss_mode='scaled"):
        expand_cells(load_spec(None, ["loss_options.my_scale=0.5"], data=data))  # given to every arm
