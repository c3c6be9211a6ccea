"""`recsys ray-submit`: run `recsys train --config X` on a remote Ray cluster as a Ray job, through
Ray's Job Submission SDK (`ray.job_submission.JobSubmissionClient`, the dashboard's HTTP address,
`http://HOST:8265`). What is shipped and run, why every path must be absolute or a URI, `--check`,
`--no-wait` and the plain Ray CLI equivalent: docs/cluster.md, "Run on a Ray cluster: VMs"; the
project must already be installed on the nodes (deploy/Dockerfile). Waiting (the default), the exit
code is the job's: 0 when it succeeded, the entrypoint's own when it failed (2: bad input, see the
README's exit codes), 1 when it was stopped or failed without one. Ray is imported only in here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from operator import attrgetter
from pathlib import Path
from typing import Any, TextIO

from recsys.config import ConfigError, JobConfig, load_config, to_toml

logger = logging.getLogger(__name__)

JOB_CONFIG_NAME = "job.toml"     # the shipped config's name in the job's working directory

_PATH_KEYS = ("data.train_paths", "data.eval_paths", "data.test_paths", "data.item_paths",
              "train.run_dir", "ps.storage_root", "ps.token_file", "ps.curve_keys_dir")
"""Config keys that name files or directories the job reads or writes on the cluster."""


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    """What `JobSubmissionClient.submit_job` is given for one job."""

    entrypoint: str
    """The shell command the cluster runs, in the unpacked working directory."""
    config_text: str
    """The resolved job config, written there as `job.toml`."""
    metadata: dict[str, str]
    """Shown by `ray job list` / the dashboard: the config it came from and the command."""
    submission_id: str | None = None
    """The job's id (None: Ray makes one, `raysubmit_...`); a second submission with it is refused."""


def relative_paths(cfg: JobConfig) -> list[str]:
    """`key = value` of every path in `cfg` that is neither absolute nor a URI (`s3://...`)."""
    values = {key: attrgetter(key)(cfg) for key in _PATH_KEYS}
    return [f"{key} = {path!r}" for key, v in values.items() for path in (v if isinstance(v, tuple) else (v,))
            if path and "://" not in path and not Path(path).is_absolute()]


def build_submission(config: str | Path, overrides: Sequence[str] = (), *, check: bool = False,
                     submission_id: str | None = None) -> Submission:
    """Validate the job config (as `recsys train` would) and make the submission of it.

    Raises ConfigError for a bad config, or for a relative path in it (named with its key).
    """
    cfg = load_config(config, overrides)
    if relative := relative_paths(cfg):
        raise ConfigError(f"{config}: {'; '.join(relative)}: a job on a Ray cluster needs absolute paths or "
                          f"URIs (a relative path resolves inside Ray's temporary copy of the job's working "
                          f"directory on the node that runs it)")
    if cfg.cluster.engine != "ray":
        logger.warning("%s: cluster.engine = %r: the whole job runs on the one node that runs the "
                       "entrypoint (set cluster.engine = \"ray\" to place shards and trainers across the "
                       "cluster)", config, cfg.cluster.engine)
    elif cfg.cluster.address != "auto":
        logger.warning("%s: cluster.address = %r: inside a Ray job, \"auto\" joins the cluster that runs it",
                       config, cfg.cluster.address)
    command = "print-config" if check else "train"
    return Submission(entrypoint=f"recsys {command} --config {JOB_CONFIG_NAME}", config_text=to_toml(cfg),
                      metadata={"recsys_command": command, "recsys_config": str(config)},
                      submission_id=submission_id)


@contextmanager
def working_dir(submission: Submission) -> Iterator[str]:
    """A fresh directory holding only `job.toml`: the job's runtime_env working_dir (removed after)."""
    with tempfile.TemporaryDirectory(prefix="recsys-job-", ignore_cleanup_errors=True) as tmp:
        (Path(tmp) / JOB_CONFIG_NAME).write_text(submission.config_text)
        yield tmp


def _client(address: str) -> Any:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as e:
        raise RuntimeError(f"recsys ray-submit needs Ray: pip install -e '.[ray]' ({e})") from None
    try:
        return JobSubmissionClient(address)
    except ConnectionError as e:
        raise ConnectionError(f"cannot reach the Ray dashboard at {address} (`ray status` on the head node "
                              f"shows whether the cluster is up; the dashboard listens on port 8265): {e}") from None


def submit(submission: Submission, address: str) -> tuple[Any, str]:
    """Submit the job; returns (the client, the job's submission id). A cluster with Ray's token
    authentication that gets no (or the wrong) token is one ConfigError saying how to pass it."""
    try:
        client = _client(address)
        with working_dir(submission) as wd:     # uploaded by submit_job, so the directory can go right after
            job_id = client.submit_job(entrypoint=submission.entrypoint, runtime_env={"working_dir": wd},
                                       metadata=submission.metadata, submission_id=submission.submission_id)
    except Exception as e:
        if type(e).__name__ != "AuthenticationError":     # ray.exceptions.AuthenticationError
            raise
        raise ConfigError(f"the Ray cluster at {address} uses token authentication and refused this client "
                          f"({' '.join(str(e).split())[:200]}): set RAY_AUTH_MODE=token and give its token, in "
                          f"RAY_AUTH_TOKEN or in ~/.ray/auth_token (on the head node: `ray get-auth-token`), "
                          f"then submit again") from None
    return client, job_id


def follow(client: Any, job_id: str, out: TextIO) -> int:
    """Stream the job's log to `out` until it ends; its exit code (see the module docstring)."""
    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())
    deadline = time.monotonic() + 60.0
    while True:         # the log stream can close before the status leaves PENDING / RUNNING (up to 60 s)
        info = client.get_job_info(job_id)
        status = str(getattr(info.status, "value", info.status))
        if status not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if status == "SUCCEEDED":
        return 0
    code = info.driver_exit_code
    logger.error("job %s %s%s: %s", job_id, status.lower(), "" if code is None else f" (exit code {code})",
                 " ".join(str(info.message or "").split())[:500])
    return code if isinstance(code, int) and 0 < code < 256 else 1


def ray_submit(config: str | Path, overrides: Sequence[str], *, address: str, wait: bool = True,
               check: bool = False, submission_id: str | None = None, out: TextIO) -> int:
    """`recsys ray-submit`: submit, print the job id and how to follow it, optionally wait."""
    submission = build_submission(config, overrides, check=check, submission_id=submission_id)
    client, job_id = submit(submission, address)
    out.write(f"submitted job {job_id} to {address}: {submission.entrypoint}\n"
              f"  follow its log: ray job logs -f {job_id} --address {address}\n"
              f"  status:         ray job status {job_id} --address {address}\n"
              f"  stop it:        ray job stop {job_id} --address {address}\n")
    out.flush()
    if not wait:
        return 0
    try:
        return follow(client, job_id, out)
    except KeyboardInterrupt:
        out.write(f"stopped following; job {job_id} keeps running (ray job stop {job_id} --address {address})\n")
        return 130


__all__ = ["JOB_CONFIG_NAME", "Submission", "build_submission", "follow", "ray_submit", "relative_paths",
           "submit", "working_dir"]
