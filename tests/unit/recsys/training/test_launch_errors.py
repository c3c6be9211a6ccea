"""The launcher's reading of trainer errors after a failed attempt: a killed trainer whose death the
launcher saw after its peers' errors (they only lost their connection to it) is still a kill."""

import json
import time
from pathlib import Path

from recsys.training.launch import silent_ranks

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
