"""CPU time of a benchmark's processes over its timed window (Linux /proc), for the train benchmarks.

On the 2-core machine our trainer(s) and shard(s) share the cores that an in-process baseline has
to itself, so CPU seconds per step, summed over every process of a configuration, is what decides
the throughput once the cores are busy, and it moves far less than samples/s when other jobs
share the machine. `ProcessCpuSampler` samples this process (minus its own sampling thread) and
every descendant (trainers, shard processes, Ray/elastic helpers) every `period_s`; `cpu_between`
interpolates each process's CPU seconds at two wall-clock times (e.g. the first and last timed
metrics line of a run) and sums them per role.

    with ProcessCpuSampler() as s:
        launch_train(cfg)
    per_role = s.cpu_between(t0, t1)      # {"trainer": s, "ps": s, "launcher": s, "other": s}
"""

from __future__ import annotations

import bisect
import os
import threading
import time

from recsys.training.procs import TARGETS    # torch-free: the names the zygote gives its forks

_HZ = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[int, float]:
    """(ppid, utime + stime seconds) from a /proc/.../stat file."""
    with open(path) as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _HZ


_COMM_ROLES = {TARGETS["shard"][1]: "ps", TARGETS["trainer"][1]: "trainer"}
"""Names (/proc/PID/comm) the local launcher's zygote gives the shards and trainers it forks (the
zygote itself and other forks are recsys-*: other)."""


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "other"
    if comm in _COMM_ROLES:
        return _COMM_ROLES[comm]
    if comm.startswith("recsys-"):
        return "other"
    if "recsys.cli ps" in cmd:
        return "ps"
    if "spawn_main" in cmd or "-m recsys.train " in cmd + " ":    # mp.spawn / torchrun workers (and DMP ranks)
        return "trainer"
    return "other"


class ProcessCpuSampler:
    """Samples (wall time, CPU seconds) of this process and its descendants in a thread."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.series: dict[int, list[tuple[float, float]]] = {}
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._tid = 0

    def __enter__(self) -> ProcessCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _descendants(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    ppid, _ = _stat(f"/proc/{name}/stat")
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(name))
        out, i = [os.getpid()], 0
        while i < len(out):
            out += children.get(out[i], [])
            i += 1
        return out[1:]

    def _sample(self) -> None:
        now = time.time()
        me = os.getpid()
        try:
            _, mine = _stat(f"/proc/{me}/stat")
            _, sampler = _stat(f"/proc/{me}/task/{self._tid}/stat")
            # the two reads are a few ticks apart (the sampler's own ticks land between them), so the
            # difference can dip: keep it monotone, as a CPU counter is (a dip read as negative CPU)
            s = self.series.setdefault(me, [])
            s.append((now, max(mine - sampler, s[-1][1] if s else 0.0)))
            self.roles[me] = "launcher"
        except (OSError, IndexError, ValueError):
            pass
        for pid in self._descendants():
            try:
                _, cpu = _stat(f"/proc/{pid}/stat")
            except (OSError, IndexError, ValueError):
                continue             # exited
            if self.roles.get(pid, "other") == "other":    # until exec: a fork shows its parent's cmdline
                self.roles[pid] = _role(pid)
            self.series.setdefault(pid, []).append((now, cpu))

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period_s)
        self._sample()

    def cpu_between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between wall-clock times t0 < t1 (unix seconds), summed over
        its processes; a process's CPU is interpolated linearly between its samples."""
        out: dict[str, float] = {}
        for pid, s in self.series.items():
            used = _at(s, t1) - _at(s, t0)
            out[self.roles[pid]] = out.get(self.roles[pid], 0.0) + used
        return out


def _at(series: list[tuple[float, float]], t: float) -> float:
    """CPU seconds at time t: 0 before the first sample, the last value after the last one."""
    times = [x[0] for x in series]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return 0.0 if t < times[0] else series[0][1]
    if i == len(series):
        return series[-1][1]
    (ta, ca), (tb, cb) = series[i - 1], series[i]
    return ca + (cb - ca) * (t - ta) / max(tb - ta, 1e-9)
