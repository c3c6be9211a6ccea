"""Trainer entry for torchrun (multi-node): `torchrun ... -m recsys.train --config X --set ps.addresses=[...]`.

The PS shards run elsewhere (`recsys ps` on the PS hosts); ps.addresses lists them in shard order.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recsys.config import ConfigError, load_config


def main(argv: Sequence[str] | None = None) -> int:
    from pathlib import Path

    from recsys.training.launch import write_run_dir
    from recsys.training.worker import run_worker

    p = argparse.ArgumentParser(prog="python -m recsys.train", description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if not cfg.ps.addresses:
        raise ConfigError(f"{args.config}: ps.addresses must list the shards for `recsys.train` "
                          f"(the local launcher `recsys train` starts its own)")
    resolved = write_run_dir(cfg, Path(cfg.train.run_dir), fresh=False)   # every rank: same file, atomic
    run_worker(str(resolved), list(cfg.ps.addresses), str(cfg.train.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
