"""``lightning-shard plot``: the run's CSV logs drawn as loss and MFU over steps."""

from __future__ import annotations

import pytest

from lightning_shard.cli import main
from lightning_shard.plot import read_metrics


def _write_run(root, rows):
    log = root / "lightning_logs" / "version_0"
    log.mkdir(parents=True)
    lines = ["epoch,perf/mfu,step,train_loss"] + [",".join(map(str, row)) for row in rows]
    (log / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_plot_reads_the_csv_logs_and_writes_a_png(tmp_path, capsys):
    # Lightning's CSVLogger writes loss rows and MFUMonitor's rows separately, blanks elsewhere.
    _write_run(tmp_path, [(0, "", 9, 2.5), ("", 0.12, 10, ""), (0, "", 19, 2.1), ("", 0.13, 20, "")])
    series = read_metrics(tmp_path)
    assert series["train_loss"] == [(9, 2.5), (19, 2.1)]
    assert series["perf/mfu"] == [(10, 0.12), (20, 0.13)]
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "run.png")]) == 0
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'run.png'}" in capsys.readouterr().out


def test_plot_without_csv_logs_names_the_logger_to_use(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.csv under" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="CSVLogger"):
        read_metrics(tmp_path)


def test_plot_without_a_loss_says_which_keys_it_reads(tmp_path, capsys):
    _write_run(tmp_path, [("", 0.12, 10, "")])
    assert main(["plot", str(tmp_path)]) == 2
    assert "no training loss (train_loss" in capsys.readouterr().err
