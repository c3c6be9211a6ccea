"""The local launcher's processes: PS shards and trainers forked from one preloaded process.

    launcher ──Popen──> zygote (python -m recsys.training.procs: imports torch, the shard and the
             <──pipes──>        trainer once, then waits)
                        zygote ──fork──> ps shard 0..N-1   (`recsys ps ...`, its log as stdout / stderr)
                               ──fork──> trainer rank 0..W-1 (`worker.worker_main`, RANK / WORLD_SIZE /
                                                              MASTER_ADDR / MASTER_PORT set; gloo / NCCL)

Why: a local job would otherwise import torch three times on the way to its first step (launcher, then
shard and trainer side by side; docs/operations.md, and BENCHMARKS.md "benchmarks/startup.py"). Each
child is a fork, in milliseconds, of an interpreter that has imported everything and run nothing (no
torch op, so no OpenMP threads: PLATFORM-NOTES' fork hazard does not arise), with the launcher's
environment and working directory of the moment it is asked for (not the zygote's).

The pipes carry JSON lines, nothing pickled: requests (`Zygote.start`), events `{"id", "pid"}` once
forked and `{"id", "exit"}` when reaped (-N: signal N), by which the launcher's `ForkedProcess` handles
learn their children's exit codes (the zygote is their parent).

Lifetimes: one zygote a job (`job_zygote`: it serves the job's restarts too, and ends with it); it
dies with the launcher (PR_SET_PDEATHSIG) and exits when its request pipe closes; each child dies
with the zygote (its `deathsig`), so a killed launcher leaves no process. `run_trainers` is the
trainer group.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

PRELOAD = ("torch", "torch.distributed", "recsys.cli", "recsys.training.worker", "embedding_ps.shard.loop",
           "recsys.training.reshard")
"""What the zygote imports before it forks anything: everything a shard and a trainer import first."""

TARGETS = {"shard": ("recsys.cli:entry", "recsys-ps"),
           "trainer": ("recsys.training.worker:worker_main", "recsys-trainer"),
           "probe": ("recsys.training.procs:probe", "recsys-probe")}
"""The only functions a child runs (a request names one by key), and the /proc/PID/comm it gets
(benchmarks/cpu_time.py tells roles by it)."""

START_TIMEOUT_S = 300.0  # a request waits this for its fork (the zygote may still be importing, on a loaded machine)


class StopNow(BaseException):
    """A second SIGTERM / SIGINT (or a SIGHUP / SIGQUIT) while a job runs: stop everything at once,
    without a checkpoint."""

    def __init__(self, signum: int) -> None:
        what = "second " if signum in (signal.SIGTERM, signal.SIGINT) else ""
        super().__init__(f"stopped at once by a {what}{signal.Signals(signum).name}; nothing was saved")
        self.signum = signum


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """The kernel sends `sig` to this process when its parent (thread) dies, even by SIGKILL (a
    preexec_fn: the child of a Popen dies with its caller)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def set_name(name: str) -> None:
    """This process's name as `ps -o comm`, `top` and /proc/PID/comm show it (15 bytes at most): a fork
    of the zygote would otherwise show the zygote's `python` command line and name."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def child_env(threads: int | None) -> dict[str, str]:
    """This process's environment for a child: OpenMP workers that do not spin (they starve 2 cores),
    and `threads` of them (None: the child sets its own)."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


class ForkedProcess:
    """A child of the zygote, seen from the launcher (subprocess.Popen's members that the launcher uses).
    args: what it was asked to run (for a shard, its `recsys` command line)."""

    def __init__(self, zygote: "Zygote", ident: int, pid: int, args: list) -> None:
        self._zygote, self._id, self.pid, self.args = zygote, ident, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self._id, self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class Zygote:
    """The launcher's end of the zygote: `start` forks a child there and returns its handle. The zygote
    dies with the thread that made it (PR_SET_PDEATHSIG): make it in the thread that runs the job."""

    def __init__(self) -> None:
        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        env = child_env(None)        # (libgomp reads OMP_WAIT_POLICY once, when torch loads, in the zygote)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "recsys.training.procs", str(cmd_r), str(evt_w)], pass_fds=(cmd_r, evt_w),
                env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL))
        finally:
            os.close(cmd_r)
            os.close(evt_w)
        self._cmd = os.fdopen(cmd_w, "wb", buffering=0)
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._next = 0
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self.closed = False
        threading.Thread(target=self._read, args=(evt_r,), name="zygote-events", daemon=True).start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as events:
            for line in events:
                event = json.loads(line)
                with self._changed:
                    if "pid" in event:
                        self._pids[event["id"]] = event["pid"]
                    else:
                        self._exits[event["id"]] = event["exit"]
                    self._changed.notify_all()
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def start(self, target: str, args: Sequence, env: dict[str, str], log: str | None = None,
              session: bool = False, deathsig: int = signal.SIGTERM) -> ForkedProcess:
        """Fork a child running TARGETS[target][0](*args) with environment `env` and this process's working
        directory; `log`: its stdout and stderr (appended), else this process's; `session`: in a new
        session (a Ctrl-C to the terminal's group does not reach it); `deathsig`: what it gets when the
        zygote dies."""
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r} (one of {sorted(TARGETS)})")
        cwd = None
        with contextlib.suppress(FileNotFoundError):     # removed: the child keeps the zygote's
            cwd = os.getcwd()
        with self._lock:
            self._next += 1
            ident = self._next
            request = {"id": ident, "target": target, "args": list(args), "env": env, "cwd": cwd,
                       "log": log, "session": session, "deathsig": int(deathsig)}
            try:
                self._cmd.write(json.dumps(request).encode() + b"\n")
            except BrokenPipeError:
                self.closed = True
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._changed:
            while ident not in self._pids:
                if self.closed or self.proc.poll() is not None:
                    raise RuntimeError(f"the process that starts shards and trainers (pid {self.proc.pid}) exited "
                                       f"with code {self.proc.poll()} before it started a {target}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {target} process started within {START_TIMEOUT_S:.0f} s")
                self._changed.wait(0.1)
            pid = self._pids[ident]
        return ForkedProcess(self, ident, pid, list(args))

    def exit_code(self, ident: int, pid: int) -> int | None:
        """The child's exit code, None while it runs. Once the zygote is gone no event comes: a child
        that no longer exists counts as killed (SIGKILL)."""
        with self._changed:
            if ident in self._exits:
                return self._exits[ident]
        return None if self.alive() or not _gone(pid) else -signal.SIGKILL

    def close(self) -> None:
        """End the zygote (its children are the caller's to stop first)."""
        with contextlib.suppress(OSError):
            self._cmd.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()                  # nothing of its own to save; it may still be importing
        self.proc.wait(timeout=30)


def _gone(pid: int) -> bool:
    """No process `pid`, or only its zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use (or again if it died)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            _zygote = Zygote()
        return _zygote


def zygote_pid() -> int | None:
    """The pid of this process's zygote, None if none runs (starts nothing)."""
    z = _zygote
    return z.proc.pid if z is not None and z.alive() else None


prestart = zygote
"""Start the zygote now, so that it imports while this process does other work (`recsys train`)."""


@contextlib.contextmanager
def job_zygote() -> Iterator[Zygote]:
    """A job's zygote (the one `prestart` began, or a new one), ended with the job: no process of a run
    outlives it."""
    global _zygote
    z = zygote()
    try:
        yield z
    finally:
        with _zygote_lock:
            if _zygote is z:
                _zygote = None
        z.close()


class TrainersFailed(RuntimeError):
    """A trainer exited with a non-zero code; `failures`: rank -> (exit code, pid) of every rank that
    had failed when the first failure was seen (-N: killed by signal N)."""

    def __init__(self, failures: dict[int, tuple[int, int]]) -> None:
        self.failures = dict(sorted(failures.items()))
        super().__init__("; ".join(f"trainer rank {r} (pid {pid}) exited with code {code}"
                                   for r, (code, pid) in self.failures.items()))


def run_trainers(world: int, args: Sequence, check: Callable[[], None] = lambda: None,
                 stop_timeout_s: float = 30.0, target: str = "trainer") -> None:
    """Run `world` trainer processes (worker_main(*args); `target`: another of TARGETS) on this
    machine until every one exits 0.

    Each gets RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE and a MASTER_ADDR / MASTER_PORT (rank
    0 hosts the process group's store). `check()` runs at every poll and may raise (a dead shard).
    The first non-zero exit stops the others (SIGTERM, SIGKILL after `stop_timeout_s`) and raises
    TrainersFailed; SIGHUP / SIGQUIT raise StopNow (main thread); whatever ends the wait stops every
    trainer that still runs."""
    z = zygote()
    port = free_port()
    procs: list[ForkedProcess] = []
    old = {}
    if threading.current_thread() is threading.main_thread():
        def _handle(signum: int, frame: object) -> None:
            raise StopNow(signum)
        old = {sig: signal.signal(sig, _handle) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        for rank in range(world):
            env = {**child_env(None),              # (its threads: train.num_threads)
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                   "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")   # as torch elastic set it: a hung peer aborts
            procs.append(z.start(target, args, env, deathsig=signal.SIGKILL))
        while True:
            check()
            codes = [p.poll() for p in procs]
            failed = {r: (c, p.pid) for r, (c, p) in enumerate(zip(codes, procs)) if c not in (None, 0)}
            if failed:
                raise TrainersFailed(failed)
            if all(c == 0 for c in codes):
                return
            time.sleep(0.05)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        stop(procs, stop_timeout_s)


def stop(procs: Sequence, timeout_s: float = 10.0) -> None:
    """SIGTERM every process that runs, wait up to `timeout_s` in all, SIGKILL the rest."""
    for p in procs:
        p.send_signal(signal.SIGTERM)       # (a no-op for one that has exited)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=5)


def probe(code: int = 0, sleep_s: float = 0.0) -> None:
    """A child that says what it sees (one JSON line on stdout: pid, parent, session, working
    directory, environment, torch's threads, whether CUDA was initialized before the fork: it must not
    be, or CUDA refuses to work in the child), sleeps, and exits with `code`: what the tests check a
    fork against."""
    import torch

    sys.stdout.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
                                 "cwd": os.getcwd(), "env": dict(os.environ),
                                 "threads": torch.get_num_threads(), "name": open("/proc/self/comm").read().strip(),
                                 "cuda_initialized": torch.cuda.is_initialized()}) + "\n")
    sys.stdout.flush()
    time.sleep(sleep_s)
    raise SystemExit(code)


# ---- the zygote itself (python -m recsys.training.procs CMD_FD EVENT_FD) ----

def _run_child(request: dict, zygote_pid: int) -> int:
    """In the forked child: become what the request asks for, run its target, return the exit code."""
    if request["session"]:
        os.setsid()
    die_with_parent(request["deathsig"])
    target, comm = TARGETS[request["target"]]
    set_name(comm)
    if os.getppid() != zygote_pid:            # the zygote died before the prctl
        return 1
    if request["cwd"] is not None:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["log"]:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import numpy as np
    import torch

    np.random.seed(int.from_bytes(os.urandom(4), "little"))     # as a fresh interpreter's would be
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    args = request["args"]
    if request["target"] == "shard":          # recsys.cli.entry reads sys.argv (atexit handlers, then os._exit)
        sys.argv, args = ["recsys", *args], []
    fn(*args)
    return 0


def _fork(request: dict, fds: tuple[int, int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        code = _run_child(request, os.getppid())
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            sys.stderr.write(f"{e.code}\n")
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _serve(cmd_fd: int, evt_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # a Ctrl-C is the launcher's to handle
    set_name("recsys-zygote")
    for name in PRELOAD:
        importlib.import_module(name)
    children: dict[int, int] = {}                   # pid -> request id
    buf = b""

    def emit(event: dict) -> None:
        os.write(evt_fd, json.dumps(event).encode() + b"\n")

    while True:
        ready, _, _ = select.select([cmd_fd], [], [], 0.05)
        if ready:
            data = os.read(cmd_fd, 1 << 20)
            if not data:
                return                              # the launcher is done (or gone)
            *lines, buf = (buf + data).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = _fork(request, (cmd_fd, evt_fd))
                children[pid] = request["id"]
                emit({"id": request["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                emit({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
