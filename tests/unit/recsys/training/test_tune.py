"""`recsys tune` without Ray: the space file, its check against the config, a trial's command, and
results.csv / best.toml / trials.png from a stand-in for Tune's ResultGrid (tests/integration/test_tune.py
runs a real search)."""

from __future__ import annotations

import csv
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from recsys import cli
from recsys.config import ConfigError, load_config
from recsys.training.tune import best_of, best_row, collect, plot_trials, write_best, write_results
from recsys.tune_space import Param, check_space, distinct_trials, read_space, trial_overrides

ROOT = Path(__file__).resolve().parents[4]
TINY = ROOT / "configs" / "tiny.toml"
DEFAULTS = ["ps.tables=[]", "ps.table_defaults.dim=8"]   # tiny's tables from [ps.table_defaults]


def space(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.toml"
    p.write_text(text)
    return p


def test_the_space_file_reads_every_kind(tmp_path: Path) -> None:
    params = read_space(space(tmp_path, """
"ps.table_defaults.lr" = { loguniform = [0.01, 0.3] }
"model.dropout" = { choice = [0.0, 0.2] }
"train.dense_lr" = { uniform = [0.001, 0.01] }
"data.batch_size" = { randint = [128, 512] }
"train.epochs" = { qrandint = [2, 6, 2] }
"train.seed" = { grid = [0, 1] }
"""))
    assert params == [Param("ps.table_defaults.lr", "loguniform", (0.01, 0.3)),
                      Param("model.dropout", "choice", (0.0, 0.2)),
                      Param("train.dense_lr", "uniform", (0.001, 0.01)),
                      Param("data.batch_size", "randint", (128, 512)),
                      Param("train.epochs", "qrandint", (2, 6, 2)),
                      Param("train.seed", "grid", (0, 1))]
    assert params[0].corners() == [0.01, 0.3] and params[4].corners() == [2, 6]


@pytest.mark.parametrize("text, match", [
    ('"model.dropout" = 0.2', r"'model.dropout': expected one of"),
    ('"model.dropout" = { normal = [0, 1] }', r"expected one of"),
    ('"model.dropout" = { choice = [] }', r"choice takes a list of one or more values"),
    ('"train.dense_lr" = { loguniform = [0.0, 0.1] }', r"loguniform needs low < high and low > 0"),
    ('"train.dense_lr" = { uniform = [0.1, 0.01] }', r"uniform needs low < high"),
    ('"train.epochs" = { randint = [1.5, 3] }', r"randint takes integers"),
    ("[model]\ndropout = { choice = [0.0] }", r"'model': expected one of .*a config key in quotes"),
    ("", r"no keys to search"),
])
def test_a_bad_space_file_is_one_error_naming_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        read_space(space(tmp_path, text))


def test_keys_and_values_are_checked_against_the_config() -> None:
    base = check_space([Param("ps.table_defaults.lr", "loguniform", (0.01, 0.3)),
                        Param("model.dropout", "choice", (0.0, 0.5))], TINY, DEFAULTS, "s.toml")
    assert base == load_config(TINY, DEFAULTS)
    with pytest.raises(ConfigError, match=r"s.toml: unknown config key: no config key 'model.dropuot' "
                                          r"\(did you mean model.dropout"):
        check_space([Param("model.dropuot", "choice", (0.0, 0.5))], TINY, DEFAULTS, "s.toml")
    with pytest.raises(ConfigError, match=r"s.toml: model.dropout = 1.5: .*model.dropout"):
        check_space([Param("model.dropout", "choice", (0.0, 1.5))], TINY, DEFAULTS, "s.toml")
    with pytest.raises(ConfigError, match=r"'train.prefetch_batches' is the old name of train.pull_ahead_batches"):
        check_space([Param("train.prefetch_batches", "choice", (1, 2))], TINY, DEFAULTS, "s.toml")
    # tiny.toml's own tables each set lr: a table default reaches none of them
    with pytest.raises(ConfigError, match=r"ps.table_defaults.lr: its values \[0.01, 0.3\] all give the same "
                                          r"config .*every table sets its own value"):
        check_space([Param("ps.table_defaults.lr", "loguniform", (0.01, 0.3))], TINY, [], "s.toml")


def test_a_bad_key_exits_2_with_one_line_before_ray_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)      # reaching `import ray` would be exit 1, not 2
    bad = space(tmp_path, '"model.dropuot" = { choice = [0.0, 0.2] }\n')
    args = ["tune", "--config", str(TINY), "--space", str(bad), "--out", str(tmp_path / "t")]
    assert cli.main(args + [f"--set={s}" for s in DEFAULTS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "'model.dropuot'" in err[-1]
    assert not (tmp_path / "t").exists()
    good = space(tmp_path, '"model.dropout" = { choice = [0.0, 0.2] }\n')
    args = ["tune", "--config", str(TINY), "--space", str(good), "--out", str(tmp_path / "t")]
    assert cli.main(args + [f"--set={s}" for s in DEFAULTS]) == 1          # no Ray: one line, exit 1
    assert "recsys tune needs Ray Tune (the [ray] extra" in caplog.text


def test_a_trial_is_the_base_config_with_its_values_and_own_run_dir(tmp_path: Path) -> None:
    pytest.importorskip("ray.tune")
    from recsys.training.tune_trial import JobSpec, job_command

    assert trial_overrides({"train.dense_lr": np.float64(0.5), "model.top_mlp": [8, 4], "train.epochs": np.int64(3),
                            "model.arch": "dcn"}) == ['model.arch="dcn"', "model.top_mlp=[8, 4]",
                                                      "train.dense_lr=0.5", "train.epochs=3"]
    spec = JobSpec(config="base.toml", overrides=("train.epochs=2",), trials_dir=str(tmp_path), cwd=".",
                   metric="val/auc")
    run = tmp_path / "t_00001"
    cmd = job_command(spec, {"model.dropout": 0.2}, run)
    assert cmd[1:] == ["-m", "recsys.cli", "train", "--config", "base.toml", "--set", "train.epochs=2",
                       "--set", "model.dropout=0.2", "--set", f'train.run_dir="{run}"']
    (run / "logs").mkdir(parents=True)                    # a trial started again after a Ctrl-C, no checkpoint
    assert job_command(spec, {}, run)[-1] == "--overwrite"
    (run / "checkpoints" / "step-0000000008").mkdir(parents=True)     # stopped with a checkpoint: continue it
    assert job_command(spec, {}, run)[-2:] == ["--resume", "latest"]


def _result(run: Path, trial_id: str, config: dict, vals: list[tuple[int, float]], *, finished: bool = False,
            error: BaseException | None = None, stopped: bool = False) -> SimpleNamespace:
    (run / trial_id).mkdir(parents=True)
    if stopped:                                   # the driver's callback marks a trial ASHA stopped
        (run / f"{trial_id}.stopped").touch()
    (run / trial_id / "metrics.jsonl").write_text("".join(
        f'{{"step": {s}, "loss/train": 0.5}}\n{{"step": {s}, "val/auc": {v}, "val/logloss": 0.5}}\n' for s, v in vals))
    return SimpleNamespace(path=f"/ray/{trial_id}", config=config, error=error,
                           metrics={"job_finished": 1} if finished else {"val/auc": vals[-1][1] if vals else None})


def test_results_csv_best_toml_and_the_plot(tmp_path: Path) -> None:
    trials = tmp_path / "trials"
    params = [Param("train.dense_lr", "loguniform", (0.001, 0.1)), Param("model.dropout", "choice", (0.0, 0.5))]
    grid = [_result(trials, "a_00001", {"train.dense_lr": 0.01, "model.dropout": 0.5}, [(8, 0.61)], stopped=True),
            _result(trials, "a_00000", {"train.dense_lr": 0.002, "model.dropout": 0.0}, [(8, 0.70), (16, 0.74), (24, 0.73)],
                    finished=True),
            _result(trials, "a_00002", {"train.dense_lr": 0.05, "model.dropout": 0.0}, [],
                    error=RuntimeError("Traceback ...\n  File x\nRuntimeError: trial a_00002: job exited 2: error: x")),
            _result(trials, "a_00003", {}, [(8, 0.65)])]       # a Ctrl-C: neither done nor stopped by ASHA
    (trials / "a_00003.json").write_text('{"train.dense_lr": 0.003, "model.dropout": 0.5}')   # a restored trial's values
    rows = collect(grid, params, tmp_path, "val/auc", "max")
    assert [(r["trial_id"], r["status"], r["best"], r["best_step"]) for r in rows] == [
        ("a_00000", "terminated", 0.74, 16), ("a_00001", "stopped", 0.61, 8), ("a_00002", "error", None, None),
        ("a_00003", "unfinished", 0.65, 8)]
    assert rows[3]["train.dense_lr"] == 0.003
    assert rows[2]["error"] == "RuntimeError: trial a_00002: job exited 2: error: x"
    write_results(tmp_path / "results.csv", rows, params, "val/auc")
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["trial_id", "status", "train.dense_lr", "model.dropout", "best_val/auc", "best_step",
                              "run_dir", "error"]
    assert table[0]["status"] == "terminated" and float(table[0]["best_val/auc"]) == 0.74
    assert table[1]["status"] == "stopped" and table[1]["model.dropout"] == "0.5"
    assert table[2]["status"] == "error" and table[2]["best_val/auc"] == "" and "error: x" in table[2]["error"]
    best = best_row(rows, "max")
    assert best["trial_id"] == "a_00000" and best_row(rows[2:3], "max") is None
    write_best(tmp_path / "best.toml", best, params, str(TINY), DEFAULTS, tmp_path / "best-run", "val/auc")
    cfg = load_config(tmp_path / "best.toml")       # complete: loads with no base config or overrides
    assert cfg == load_config(TINY, [*DEFAULTS, "train.dense_lr=0.002", "model.dropout=0.0",
                                     f"train.run_dir='{tmp_path / 'best-run'}'"])
    pytest.importorskip("matplotlib")
    assert plot_trials(tmp_path / "trials.png", rows, "val/auc").stat().st_size > 1000


def test_all_trials_failing_is_exit_1_and_a_ctrl_c_says_how_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray.tune")
    import ray

    from recsys.training import tune

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    sp = space(tmp_path, '"model.dropout" = { choice = [0.0, 0.5] }\n')
    monkeypatch.setattr(tune, "_fit", lambda params, spec, root, *a: [
        _result(root / "trials", "b_00000", {"model.dropout": 0.5}, [], error=RuntimeError("Trace\nx: boom"))])
    with pytest.raises(RuntimeError, match=r"all 1 trials failed \(first: x: boom\)"):
        tune.run_tune(str(TINY), DEFAULTS, str(sp), str(tmp_path / "t"), trials=1, max_concurrent=1)
    assert read_csv_rows(tmp_path / "t" / "results.csv")[0]["error"] == "x: boom"
    monkeypatch.setattr(tune, "_fit", lambda params, spec, root, *a: [
        _result(root / "trials", "c_00000", {"model.dropout": 0.5}, [(8, 0.6)])])      # no record: cut short
    assert tune.run_tune(str(TINY), DEFAULTS, str(sp), str(tmp_path / "t2"), trials=1, max_concurrent=1) == 130
    assert f"run the same command again (--out {tmp_path / 't2'}) to resume" in capsys.readouterr().err
    assert not (tmp_path / "t2" / "best.toml").exists()
    with pytest.raises(ConfigError, match=r"--metric 'loss/train': trials report validation metrics"):
        tune.run_tune(str(TINY), DEFAULTS, str(sp), str(tmp_path / "t3"), trials=1, max_concurrent=1,
                      metric="loss/train")


def read_csv_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_trials_validate_every_epoch_and_stop_early_unless_the_config_says() -> None:
    from recsys.training.tune import trial_defaults

    assert trial_defaults(str(TINY), DEFAULTS) == ['train.validate_every="epoch"', "train.early_stop_patience=2"]
    # patience without validate_every does not load alone; the default mends it
    assert trial_defaults(str(TINY), ["train.early_stop_patience=5"]) == ['train.validate_every="epoch"']
    assert trial_defaults(str(TINY), ["train.validate_every=4", "train.early_stop_patience=1"]) == []
    with pytest.raises(ConfigError, match=r"train.validate_every needs validation data: set data.eval_paths"):
        trial_defaults(str(TINY), ["data.eval_paths=[]"])
    with pytest.raises(ConfigError, match=r"model.dropout"):
        trial_defaults(str(TINY), ["model.dropout=2.0"])


def test_best_of_follows_the_mode() -> None:
    lines = [{"step": 1, "val/logloss": 0.5}, {"step": 2, "val/logloss": 0.4}, {"step": 3, "val/logloss": float("nan")}]
    assert best_of(lines, "val/logloss", "min") == (0.4, 2)
    assert best_of(lines, "val/logloss", "max") == (0.5, 1)
    assert best_of([], "val/auc", "max") == (None, None)


def test_the_readme_commands_parse() -> None:
    text = (ROOT / "README.md").read_text()
    commands = [line.split("#")[0].strip() for line in text.splitlines() if line.startswith("recsys tune ")]
    assert commands, "README shows no recsys tune command"
    for command in commands:
        args = cli.build_parser().parse_args(shlex.split(command)[1:])
        assert args.func.__name__ == "_cmd_tune" and Path(ROOT / args.config).exists() and (ROOT / args.space).exists()


def test_a_space_of_discrete_keys_never_runs_a_trial_twice() -> None:
    """choice / randint / qrandint only: --trials distinct combinations, or each of them once when there
    are fewer; with a real range or a grid, Ray Tune samples (None)."""
    params = [Param("model.dropout", "choice", (0.0, 0.2, 0.5)), Param("ps.table_defaults.dim", "choice", (8, 16))]
    every = {(d, k) for d in (0.0, 0.2, 0.5) for k in (8, 16)}
    points = distinct_trials(params, trials=8)
    assert len(points) == 6 and {(p["model.dropout"], p["ps.table_defaults.dim"]) for p in points} == every
    few = distinct_trials(params, trials=4, seed=3)
    assert len(few) == 4 and len({tuple(p.values()) for p in few}) == 4 and all(tuple(p.values()) in every for p in few)
    assert [list(p) for p in few] == [["model.dropout", "ps.table_defaults.dim"]] * 4    # the space's key order
    ints = distinct_trials([Param("data.batch_size", "randint", (256, 259)), Param("train.epochs", "qrandint", (2, 7, 2)),
                            Param("model.dropout", "choice", (0.1, 0.1))], trials=100)
    assert sorted((p["data.batch_size"], p["train.epochs"]) for p in ints) == \
        [(b, e) for b in range(256, 260) for e in (2, 4, 6)]                             # 12, each once
    assert distinct_trials(params + [Param("train.dense_lr", "loguniform", (1e-3, 1e-2))], trials=8) is None
    assert distinct_trials(params + [Param("train.seed", "grid", (0, 1))], trials=8) is None
    assert distinct_trials([Param("data.batch_size", "randint", (1, 10**6))], trials=8) is None     # too many to list
