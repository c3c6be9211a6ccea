"""Trainer entry for torchrun (multi-node): `torchrun ... -m recsys.train --config X --set ps.addresses=[...]`.

The PS shards run elsewhere (`recsys ps` on the PS hosts, docs/cluster.md); ps.addresses lists them in
shard order. `--resume latest|PATH` continues from a checkpoint (rank 0 tells the running shards to load
its rows), workers restarted by torchrun from the latest; SIGTERM / SIGINT stop after the step with a
checkpoint (docs/operations.md). The run directory must be on a filesystem every trainer and shard sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence

from recsys.runtime import apply_environment, setup_logging
from recsys.config import ConfigError, JobConfig, load_config


def main(argv: Sequence[str] | None = None) -> int:
    from recsys.rundir import local_run_dir
    from recsys.training import stopping
    from recsys.training.checkpoint import resolve_resume
    from recsys.training.jobauth import require_explicit
    from recsys.training.launch import write_run_dir
    from recsys.training.worker import report_failure, run_worker

    p = argparse.ArgumentParser(prog="python -m recsys.train", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--resume", default=None, metavar="latest|PATH")
    p.add_argument("--debug", action="store_true", help="tracebacks on stderr too")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(args.debug, role=f"trainer{rank}")
    apply_environment()
    cfg = load_config(args.config, args.overrides)
    if not cfg.ps.addresses:
        raise ConfigError(f"{args.config}: ps.addresses must list the shards for `recsys.train` "
                          f"(the local launcher `recsys train` starts its own)")
    require_explicit(cfg.ps, f"{args.config}: python -m recsys.train")
    local = local_run_dir(cfg.train.run_dir, cfg.train.scratch_dir)      # the run_dir itself unless a URI
    resolved = write_run_dir(cfg, local, fresh=False)   # every rank: same file, atomic
    resume = args.resume
    if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "latest"          # torchrun restarted the workers: continue where the job was
    checkpoint = resolve_resume(cfg.train.run_dir, resume) if resume else None
    stopping.install(signal.SIGTERM, signal.SIGINT)
    try:
        run_worker(str(resolved), list(cfg.ps.addresses), str(local),
                   None if checkpoint is None else str(checkpoint), load_shards=True)
    except Exception as e:         # one line on stderr, the traceback in run_dir/logs/trainer-R.log
        line = report_failure(e, local, rank, args.debug)
        sys.stderr.write(f"error: {line}\n")
        if rank == 0 and stop_shards_after(e, cfg):
            sys.stderr.write("the shards were told to exit: a restart would fail the same way\n")
        return 2
    return 0


def stop_shards_after(error: BaseException, cfg: JobConfig) -> bool:
    """The job's own error (bad data or config: every restart would fail the same way) ends the shards
    started by hand for it, which would otherwise wait for trainers that never come; a lost peer or
    shard (worth torchrun's restart) does not. Returns whether they were told to exit."""
    from data.parquet import DataError
    from embedding_ps.client.client import PSClient

    if not isinstance(error, (DataError, ConfigError)) or not cfg.ps.addresses:
        return False
    try:
        with PSClient(dataclasses.replace(cfg.ps, timeout_s=10.0, retries=0), list(cfg.ps.addresses)) as client:
            client.shutdown()
    except Exception:  # noqa: BLE001 - the job's error is the one to report
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
