"""The launcher's zygote (recsys.training.procs): forks that see the caller's environment, working
directory and log, exit codes as subprocess reports them, a trainer group that stops on the first
failure, and no child that outlives the zygote. Real processes; every wait has a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from recsys.training import procs


@pytest.fixture()
def zygote():
    with procs.job_zygote() as z:
        yield z


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _report(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_child_sees_the_callers_environment_directory_and_log(zygote, tmp_path, monkeypatch) -> None:
    """The zygote started before these changes; its child still gets them (as a spawned one would)."""
    monkeypatch.setenv("RECSYS_PROBE", "after the zygote started")
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "child.log"
    child = zygote.start("probe", [0], procs.child_env(1), log=str(log), session=True)
    assert child.wait(timeout=60) == 0 and child.returncode == 0
    seen = _report(log)
    assert seen["pid"] == child.pid and seen["ppid"] == zygote.proc.pid
    assert seen["sid"] == child.pid                                    # its own session: no terminal Ctrl-C
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"]["RECSYS_PROBE"] == "after the zygote started" and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert seen["threads"] == 1
    assert seen["cuda_initialized"] is False          # the zygote never touches CUDA (a fork could not use it)
    assert seen["name"] == "recsys-probe"             # ps / top name a child by its role, not "python"
    assert Path(f"/proc/{zygote.proc.pid}/comm").read_text().strip() == "recsys-zygote"


def test_exit_codes_are_those_subprocess_reports(zygote, tmp_path) -> None:
    env = procs.child_env(1)
    assert zygote.start("probe", [3], env, log=str(tmp_path / "a.log")).wait(timeout=60) == 3
    sleeper = zygote.start("probe", [0, 60], env, log=str(tmp_path / "b.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.2)
    assert sleeper.poll() is None
    os.kill(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    other = zygote.start("probe", [0, 60], env, log=str(tmp_path / "c.log"))
    procs.stop([other], timeout_s=30)
    assert other.returncode == -signal.SIGTERM
    with pytest.raises(ValueError, match="unknown target 'python'"):
        zygote.start("python", [], env)


def test_the_trainer_group_stops_every_rank_on_the_first_failure(zygote, tmp_path, monkeypatch) -> None:
    """Rank 1 fails at once; rank 0 (sleeping) is stopped; the error names rank 1 and its code."""
    monkeypatch.chdir(tmp_path)
    started = []
    real_start = zygote.start

    def start(target, args, env, **kw):
        rank = int(env["RANK"])
        child = real_start(target, [0, 60] if rank == 0 else [5], env, log=str(tmp_path / f"r{rank}.log"), **kw)
        started.append(child)
        return child

    monkeypatch.setattr(zygote, "start", start)
    with pytest.raises(procs.TrainersFailed) as e:
        procs.run_trainers(2, [], target="probe", stop_timeout_s=20)
    assert list(e.value.failures) == [1] and e.value.failures[1] == (5, started[1].pid)
    assert "trainer rank 1" in str(e.value) and "exited with code 5" in str(e.value)
    assert started[0].returncode == -signal.SIGTERM and _gone(started[0].pid)
    ranks = [_report(tmp_path / f"r{r}.log")["env"] for r in (0, 1)]
    assert [(x["RANK"], x["WORLD_SIZE"], x["MASTER_ADDR"]) for x in ranks] == [("0", "2", "127.0.0.1"),
                                                                                ("1", "2", "127.0.0.1")]
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"]


def test_a_group_whose_ranks_all_exit_0_returns(zygote, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    checks = []
    procs.run_trainers(2, [0], target="probe", check=lambda: checks.append(1))
    assert checks                                   # the caller's check ran while it waited


def test_a_failing_check_stops_the_group(zygote, tmp_path, monkeypatch) -> None:
    """What a dead shard does (launch.ShardWatchdog.check raises): every rank is stopped."""
    monkeypatch.chdir(tmp_path)
    started = []
    real_start = zygote.start
    monkeypatch.setattr(zygote, "start", lambda *a, **kw: started.append(real_start(*a, **kw)) or started[-1])
    calls = []

    def check():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("ps shard 0 died")

    with pytest.raises(RuntimeError, match="ps shard 0 died"):
        procs.run_trainers(2, [0, 60], target="probe", check=check, stop_timeout_s=20)
    assert all(p.returncode == -signal.SIGTERM for p in started) and all(_gone(p.pid) for p in started)


def test_children_die_with_the_zygote(tmp_path) -> None:
    """A killed launcher takes the zygote with it (its PR_SET_PDEATHSIG), and the zygote its children."""
    with procs.job_zygote() as z:
        child = z.start("probe", [0, 120], procs.child_env(1), log=str(tmp_path / "c.log"))
        os.kill(z.proc.pid, signal.SIGKILL)
        assert _gone(child.pid)
        assert child.wait(timeout=30) == -signal.SIGKILL      # no event can come: counted as killed


def test_the_job_zygote_ends_with_the_job(tmp_path) -> None:
    with procs.job_zygote() as z:
        assert procs.zygote_pid() == z.proc.pid
    assert procs.zygote_pid() is None and z.proc.poll() is not None
