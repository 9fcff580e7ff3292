"""`echotrain train --help` names every registered preset (it listed five of eight: issue 40's re-run)."""

from __future__ import annotations

from echotrain.cli import main
from echotrain.rl import PRESETS


def test_train_help_names_every_preset(capsys):
    try:
        main(["train", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = " ".join(capsys.readouterr().out.split())
    epilog = out.split("Presets: ", 1)[1].split(" each also", 1)[0]
    assert [p.strip(" ,") for p in epilog.split(", ")] == list(PRESETS)
    key_help = out.split("preset='echo'", 1)[1].split("output_dir=", 1)[0]
    assert all(f"{name} (" in key_help for name in PRESETS)
