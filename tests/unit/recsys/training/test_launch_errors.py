"""The launcher's reading of trainer errors after a failed attempt: a killed trainer whose death the
launcher saw after its peers' errors (they only lost their connection to it) is still a kill."""

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from recsys.rundir import wait_for_shards
from recsys.training.launch import ShardDied, ShardWatchdog, shard_error, silent_ranks

GLOO_RESET = ("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:17098: Connection reset "
              "by peer. This is typically caused by a remote worker hanging")


def write_error(run_dir: Path, rank: int, error: str, t: float) -> None:
    (run_dir / "errors").mkdir(parents=True, exist_ok=True)
    (run_dir / "errors" / f"trainer-{rank}.json").write_text(
        json.dumps({"rank": rank, "time": t, "error": error, "log": "x"}))


def test_a_rank_without_error_while_the_others_lost_it_is_silent(tmp_path: Path) -> None:
    t0 = time.time()
    write_error(tmp_path, 0, GLOO_RESET, t0 + 1)
    assert silent_ranks(tmp_path, 2, since=t0) == [1]
    write_error(tmp_path, 2, "RuntimeError: Connection closed by peer [127.0.0.1]:5000", t0 + 1)
    assert silent_ranks(tmp_path, 4, since=t0) == [1, 3]


def test_an_error_of_its_own_is_not_a_kill(tmp_path: Path) -> None:
    t0 = time.time()
    write_error(tmp_path, 0, GLOO_RESET, t0 + 1)
    write_error(tmp_path, 1, "ValueError: column 'label' missing in part-0.parquet", t0 + 1)
    assert silent_ranks(tmp_path, 3, since=t0) == []            # rank 1's own error is the cause
    assert silent_ranks(tmp_path / "none", 2, since=t0) == []     # no error at all: nothing to tell


def test_errors_of_an_earlier_attempt_do_not_count(tmp_path: Path) -> None:
    t0 = time.time()
    write_error(tmp_path, 0, GLOO_RESET, t0 - 10)                 # the attempt before this one
    assert silent_ranks(tmp_path, 2, since=t0) == []
    write_error(tmp_path, 1, GLOO_RESET, t0 + 1)
    assert silent_ranks(tmp_path, 2, since=t0) == [0]


def test_a_rank_that_returned_from_its_job_is_not_silent(tmp_path: Path) -> None:
    # rank 1 returned (exit code 0) while rank 0 was still in a collective: a bug of the job, not a
    # kill; restarting would only repeat it
    from recsys.training.worker import report_exit
    t0 = time.time()
    write_error(tmp_path, 0, GLOO_RESET, t0 + 1)
    report_exit(tmp_path, 1)
    assert silent_ranks(tmp_path, 2, since=t0) == []
    assert silent_ranks(tmp_path, 3, since=t0) == [2]               # rank 2 still said nothing
    assert silent_ranks(tmp_path, 2, since=time.time() + 5) == []   # (no error of this attempt either)


def test_an_exit_record_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    from recsys.training.worker import report_exit
    (tmp_path / "exits").write_text("a file where the directory should be")
    report_exit(tmp_path, 0)                                       # logged, not raised
    assert silent_ranks(tmp_path, 1, since=0.0) == []


def test_the_launcher_names_the_job_s_own_error_before_a_peer_s_earlier_teardown_error(tmp_path: Path) -> None:
    # rank 0's data error unwinds through its process group's teardown; rank 1, failing on the closed
    # connection, can write its error first (seen in a full run: "OSError: [Errno 9] Bad file descriptor")
    from recsys.training.job import read_worker_error
    from recsys.training.worker import report_failure
    report_failure(OSError(9, "Bad file descriptor"), tmp_path, 1)
    report_failure(ValueError("part-00000.parquet: column 'label' row 500: 7 is not 0 or 1"), tmp_path, 0)
    assert read_worker_error(tmp_path).startswith("part-00000.parquet: column 'label' row 500")
    assert "[trainer rank 0;" in read_worker_error(tmp_path)
    report_failure(ValueError("the training loss is nan"), tmp_path, 2)     # two own errors: the earliest
    assert "[trainer rank 0;" in read_worker_error(tmp_path)
    write_error(tmp_path / "old", 1, "OSError: [Errno 9] Bad file descriptor", 2.0)   # records without "own"
    write_error(tmp_path / "old", 0, "RuntimeError: boom", 1.0)
    assert "[trainer rank 0;" in read_worker_error(tmp_path / "old")


# -- shards and trainers start together: the trainers wait for the ready files, the watchdog for deaths


def test_trainers_read_the_addresses_as_the_ready_files_appear(tmp_path: Path) -> None:
    files = [tmp_path / "ps-0.ready", tmp_path / "ps-1.ready"]

    def serve_later() -> None:
        for i, f in enumerate(files):
            time.sleep(0.2)
            f.write_text(f"tcp://127.0.0.1:{5000 + i}\n")

    t = threading.Thread(target=serve_later)
    t.start()
    try:
        assert wait_for_shards(files, timeout_s=30) == ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]
    finally:
        t.join(timeout=10)


def test_a_shard_that_never_serves_is_named_with_its_log(tmp_path: Path) -> None:
    (tmp_path / "ps-0.ready").write_text("tcp://127.0.0.1:5000")
    with pytest.raises(TimeoutError, match=r"ps shard 1 not ready after 0 s; see .*ps-1.log"):
        wait_for_shards([tmp_path / "ps-0.ready", tmp_path / "ps-1.ready"], timeout_s=0.2)


@pytest.mark.parametrize("served", [False, True])
def test_the_watchdog_names_a_shard_that_died_and_whether_it_had_served(tmp_path: Path, served: bool) -> None:
    """A dead shard ends the job: the trainer group's poll (`check`) raises ShardDied."""
    ready = tmp_path / "ps-0.ready"
    if served:
        ready.write_text("tcp://127.0.0.1:5000")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    watchdog = ShardWatchdog([proc], [ready])
    try:
        proc.wait(timeout=30)
        with pytest.raises(ShardDied, match="ps shard 0 exited with code 3"):
            watchdog.check()
        assert watchdog.dead == (0, 3, served)
        with pytest.raises(ShardDied):       # and stays dead
            watchdog.check()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_watchdog_is_quiet_while_the_shards_run(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watchdog = ShardWatchdog([proc], [tmp_path / "ps-0.ready"])
        watchdog.check()
        assert watchdog.dead is None and not watchdog.serving
        (tmp_path / "ps-0.ready").write_text("tcp://127.0.0.1:5000")
        watchdog.check()
        assert watchdog.serving
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_launcher_line_carries_the_shard_s_own_error(tmp_path: Path) -> None:
    """#28: a shard that refused to start (a changed table dim on resume) was named only in ps-0.log."""
    log = tmp_path / "ps-0.log"
    log.write_text("2026-11-28 INFO ps shard 0/1 restoring\n"
                   "error: /ckpt/model/ps/shard0: table 'C1' has dim 8 there, 16 in ps.tables\n")
    assert shard_error(log) == ": /ckpt/model/ps/shard0: table 'C1' has dim 8 there, 16 in ps.tables"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nMemoryError: cannot allocate\n")
    assert shard_error(log) == ": MemoryError: cannot allocate"
    log.write_text("2026-11-28 00:24:56,116 ERROR recsys: ValueError: /ckpt/shard0/manifest.json: table 0 saved "
                   "with dim=8, config has dim=16\n")
    assert shard_error(log) == ": ValueError: /ckpt/shard0/manifest.json: table 0 saved with dim=8, config has dim=16"
    log.write_text("2026-11-28 INFO ps shard 0 stopping\n")
    assert shard_error(log) == "" and shard_error(tmp_path / "none.log") == ""



def test_a_changed_table_layout_on_resume_is_refused_before_any_process(tmp_path: Path) -> None:
    """#28 item 4: a changed table dim on resume is one ConfigError (exit 2) naming the table and key,
    from the checkpoint's own config, before a shard starts (it was only the shard's refusal)."""
    from recsys.config import ConfigError, load_config, to_toml
    from recsys.training.checkpoint import check_resume_tables

    ckpt = tmp_path / "step-0000000010"
    ckpt.mkdir()
    saved = load_config(Path(__file__).resolve().parents[4] / "configs" / "tiny.toml")
    (ckpt / "config.toml").write_text(to_toml(saved))
    check_resume_tables(saved, ckpt)                                             # the same tables: fine
    tables = tuple(dataclasses.replace(t, dim=2 * t.dim) for t in saved.ps.tables)     # every table (one dim)
    t0 = tables[0]
    model = dataclasses.replace(saved.model, bottom_mlp=(*saved.model.bottom_mlp[:-1], t0.dim))   # DLRM: ends in dim
    changed = dataclasses.replace(saved, ps=dataclasses.replace(saved.ps, tables=tables), model=model)
    with pytest.raises(ConfigError, match=rf"ps.tables\[{t0.name}\].dim = {t0.dim}, but the checkpoint "
                                          rf".*step-0000000010 saved it with dim = {t0.dim // 2}"):
        check_resume_tables(changed, ckpt)


def test_resume_latest_of_a_finished_run_without_checkpoints_is_refused(tmp_path: Path) -> None:
    """`recsys train --resume latest` on a run that finished (metrics.json) and kept no checkpoint had
    nothing to continue and trained it again from step 0 over it: refused, nothing written. An
    unfinished run without a checkpoint still starts from step 0 (the warning), and library use
    (overwrite None: `recsys daily --resume` retrains a finished day in place) takes it as it is."""
    from recsys.config import load_config
    from recsys.rundir import RunDirError
    from recsys.training.job import prepared_run

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(Path(__file__).resolve().parents[4] / "configs" / "tiny.toml", [f"train.run_dir='{run}'",
                                                                                      "data.train_paths=[]"])
    (run / "metrics.jsonl").write_text("{}\n")                               # killed before a checkpoint
    with prepared_run(cfg, "latest", overwrite=False) as (_, _, _, checkpoint, _):
        assert checkpoint is None
    (run / "metrics.json").write_text('{"steps": 10}')                        # finished
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(RunDirError, match=r"holds a finished run \(metrics.json\) that kept no checkpoint: "
                                          r"--resume latest has nothing to continue"):
        with prepared_run(cfg, "latest", overwrite=False):
            pass
    assert sorted(p.name for p in run.iterdir()) == before
    with prepared_run(cfg, "latest", overwrite=None) as (_, _, _, checkpoint, _):
        assert checkpoint is None
