"""`recsys` command line: parses argv, sets up logging, calls into the packages. Nothing else."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from data.paths import fill_date, parse_date
from recsys.config import ConfigError, JobConfig, load_config, load_ps_config, to_toml
from recsys.runtime import apply_environment, setup_logging
from recsys.training.procs import StopNow
from recsys.training.tune import add_tune_parser

logger = logging.getLogger("recsys")

class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line too: `error: <what> (see recsys ... --help)`, exit 2."""

    def error(self, message: str) -> None:     # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


USER_ERRORS = (("recsys.config", "ConfigError"), ("recsys.training.job", "WorkerError"),
               ("embedding_ps.shard.loop", "BindError"),
               ("recsys.training.checkpoint", "CorruptCheckpointError"),
               ("embedding_ps.shard.snapshot", "CorruptShardError"),
               ("recsys.serving.errors", "ExportError"), ("data.parquet", "DataError"),
               ("data.criteo", "CriteoFormatError"), ("recsys.rundir", "RunDirError"),
               ("recsys.init_config", "InitConfigError"), ("embedding_ps.wire.auth", "AuthConfigError"))
"""(module, class) of the errors a user's input causes (config, auth settings, data, paths, checkpoints,
exports, a trainer's error): one `error:` line and exit code 2. Looked up in sys.modules: an error of a
module that was never imported cannot have been raised, and the CLI starts without torch."""


def _user_error(e: BaseException) -> bool:
    """A user's input caused `e`: a path given on the command line or in the config, or USER_ERRORS."""
    paths = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
    return isinstance(e, paths + tuple(getattr(sys.modules[m], n) for m, n in USER_ERRORS if sys.modules.get(m)))


def _date_arg(text: str) -> str:
    try:
        parse_date(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _port_arg(text: str) -> int:
    """A TCP port: 0 (an ephemeral one) .. 65535 (a bigger number would be served modulo 65536)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0..65535 (0: an ephemeral port)")
    return port


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="job config (TOML)")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                   help="override config values (TOML syntax): --set a.b=1 c.d=2, or --set repeated")
    # `--date D` is `--set data.date='D'` (where both are given, the later one wins)
    p.add_argument("--date", dest="overrides", action="append", type=lambda d: f"data.date='{_date_arg(d)}'",
                   metavar="YYYY-MM-DD", help="the day this job is for (data.date): fills {date}, {date-N}, "
                   "{date+N} in data.*_paths and train.run_dir")


def _fill_dates(args: argparse.Namespace) -> None:
    """eval / predict: `--date` fills the date placeholders of --run, --export, --data and --out, as data.date
    fills a config's (`recsys eval --run runs/ctr/{date-1} --data s3://b/ctr/day={date}/ --date D`)."""
    for flag in ("run", "export", "data", "out"):
        value = getattr(args, flag)
        filled = []
        for v in value if isinstance(value, list) else [value]:
            try:
                filled.append(v if v is None else fill_date(v, args.date or ""))
            except ValueError as e:
                hint = "" if args.date else "; pass --date YYYY-MM-DD"
                raise ConfigError(f"--{flag} {v!r}: {e}{hint}") from None
        setattr(args, flag, filled if isinstance(value, list) else filled[0])


def _cmd_init_config(args: argparse.Namespace) -> int:
    from recsys.init_config import init_config

    text = init_config(args.data, args.label, args.out, dense=tuple(args.dense), ignore=tuple(args.ignore),
                       sample_rows=args.sample_rows, run_dir=args.run_dir)
    if args.out:
        logger.info("wrote %s; train it with: recsys train --config %s", args.out, args.out)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_print_config(args: argparse.Namespace) -> int:
    if args.explain:               # the reference of a key or a section (recsys.config_doc), no config needed
        from recsys import config_doc

        try:
            text = config_doc.section(args.explain) if "." not in args.explain else config_doc.explain(args.explain)
        except ValueError as e:
            raise ConfigError(f"--explain: {e}") from None
        sys.stdout.write(text + "\n")
        return 0
    sys.stdout.write(to_toml(load_config(args.config, args.overrides)))
    return 0


def _cmd_gen_data(args: argparse.Namespace) -> int:
    from data.synthetic import generate

    split = None                       # rows per file of --split (or onehot's default split); None: --rows in --files
    if args.split is not None:
        if args.rows is not None:
            raise ConfigError("gen-data: give --rows (and --files) or --split, not both")
        if args.preset in ("retrieval", "sequence", "daily"):
            raise ConfigError(f"gen-data --split is not supported by --preset {args.preset} (use --rows, --files)")
        try:
            split = tuple(int(x) for x in args.split.split(","))
        except ValueError:
            raise ConfigError(f"gen-data --split must be row counts separated by commas, got {args.split!r}") from None
        if min(split) < 1:
            raise ConfigError(f"gen-data --split counts must be >= 1, got {args.split!r}")
    elif args.rows is None:
        if args.preset != "onehot":
            raise ConfigError(f"gen-data --preset {args.preset} needs --rows (or --split)")
        from data.onehot import ONEHOT_SPLIT

        split = ONEHOT_SPLIT
    if args.preset == "daily":         # day partitions with ids that come and go (data/daily.py)
        from data.daily import generate_daily

        summary = generate_daily(days=args.days, rows=args.rows, out_dir=args.out, seed=args.seed,
                                 start=args.start, row_group_rows=args.row_group_rows)
    elif args.preset == "sequence":    # behavior lists for DIN: its own generator (data/sequence.py)
        from data.sequence import generate_sequence

        summary = generate_sequence(rows=args.rows, num_files=args.files, out_dir=args.out, seed=args.seed,
                                    row_group_rows=args.row_group_rows, compression=args.compression)
    else:
        rows, files = (sum(split), len(split)) if split else (args.rows, args.files)
        summary = generate(preset=args.preset, rows=rows, num_files=files, out_dir=args.out, seed=args.seed,
                           row_group_rows=args.row_group_rows, compression=args.compression, rows_per_file=split)
    logger.info("wrote %s", summary)
    return 0


def _cmd_convert_criteo(args: argparse.Namespace) -> int:
    from data.criteo import convert_criteo

    logger.info("wrote %s", convert_criteo(args.input, args.out_dir, rows_per_file=args.rows_per_file,
                                           row_group_rows=args.row_group_rows, compression=args.compression))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from recsys.demo import run_demo

    return run_demo(args.out, rows=args.rows)


def _stop_on_signals(stop: threading.Event) -> None:
    """First SIGTERM / SIGINT: set `stop` (a clean exit, 0); a second one: die by it at once."""
    from recsys.training.stopping import stop_handler

    handle = stop_handler(stop, "stopping (signal again to stop at once)", window_s=0.0, log=logger)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)


def _cmd_ps(args: argparse.Namespace) -> int:
    from embedding_ps.shard.loop import serve
    from recsys.training.jobauth import require_explicit
    from recsys.training.reshard import shard_factory

    ps = load_ps_config(args.config, args.overrides)     # a shard reads only the [ps] section
    require_explicit(ps, f"recsys ps --shard {args.shard}")
    if not 0 <= args.shard < ps.num_shards:
        raise ConfigError(f"--shard {args.shard} is outside 0..{ps.num_shards - 1} (ps.num_shards)")
    stop = threading.Event()
    _stop_on_signals(stop)
    serve(ps, args.shard, bind=args.bind, port=args.port, ready_file=args.ready_file,
          state_factory=shard_factory(args.restore, args.init_from), stop=stop)
    return 0


def _cmd_ray_submit(args: argparse.Namespace) -> int:
    from recsys.training.ray_submit import ray_submit

    return ray_submit(args.config, args.overrides, address=args.address, wait=args.wait, check=args.check,
                      submission_id=args.submission_id, out=sys.stdout)


def _cmd_reshard(args: argparse.Namespace) -> int:
    from recsys import storage
    from recsys.training.reshard import reshard_checkpoint

    if storage.is_uri(args.out) and storage.exists(args.out):
        raise FileExistsError(f"{args.out} exists; choose a new directory")
    with storage.local_copy(args.checkpoint) as src, storage.local_output(args.out) as out:   # URIs: staged
        reshard_checkpoint(src, args.shards, out)
    return 0


def _prestart(cfg: JobConfig) -> None:
    """The local launcher's zygote imports torch and the trainer while this process checks and prepares the run."""
    if cfg.cluster.engine == "local":
        from recsys.training.procs import prestart

        prestart()


def _cmd_train(args: argparse.Namespace) -> int:
    from recsys.preflight import preflight_train

    cfg = load_config(args.config, args.overrides)
    if args.init_from:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=args.init_from))
    _prestart(cfg)
    # config, data footers, the checkpoint, before any process (and before torch: bad input fails in < 1 s)
    preflight_train(cfg, resume=args.resume)
    from recsys.training.launch import launch_train

    launch_train(cfg, resume=args.resume, verbose=args.verbose, overwrite=args.overwrite)   # a graceful stop: 0 too
    return 0


def _cmd_daily(args: argparse.Namespace) -> int:
    from recsys.training.daily import run_daily

    cfg = load_config(args.config, args.overrides)
    if not cfg.data.date:
        raise ConfigError("recsys daily needs --date YYYY-MM-DD (the day to train on)")
    _prestart(cfg)
    record = run_daily(cfg, cfg.data.date, root=args.root, publish=args.publish, keep=args.keep,
                       source=getattr(args, "from"), next_day=args.next_day, resume=args.resume,
                       overwrite=args.overwrite)
    sys.stdout.write(json.dumps(record) + "\n")
    return 0


def _preflight_run_data(run: Path, data: list[str]) -> None:
    """The files to score have the run's columns (footers only), before the model is loaded."""
    from recsys.preflight import preflight_data

    config = run / "config.toml"
    if not config.exists():
        raise ConfigError(f"{run}: not a finished run, {config} is missing (give the run directory of `recsys train`)")
    preflight_data(load_config(config), data, "--data")


def _cmd_eval(args: argparse.Namespace) -> int:
    from recsys import storage
    from recsys.rundir import local_run, run_path
    from recsys.training.evaluate import evaluate_run

    _fill_dates(args)
    uri_run = args.export is None and storage.is_uri(args.run)
    out = args.out or (run_path(args.run, "eval_metrics.json") if uri_run else None)
    with contextlib.ExitStack() as stack:             # a URI run / out: staged
        local_out = None if out is None else stack.enter_context(storage.local_output(out, directory=False))
        if args.export is not None:
            from recsys.serving.offline import evaluate_export

            metrics = evaluate_export(args.export, args.data, local_out)
        else:
            run = stack.enter_context(local_run(args.run, args.last))
            _preflight_run_data(run, args.data)
            metrics = evaluate_run(run, args.data, out=local_out, last=args.last)
    sys.stdout.write(json.dumps(metrics, indent=1) + "\n")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from data.parquet import resolve_paths
    from data.remote import parquet_file
    from recsys import storage
    from recsys.rundir import local_run
    from recsys.training.evaluate import predict_run

    _fill_dates(args)
    for path in resolve_paths(tuple(args.data)) if args.keep else ():     # --keep in every file (footers only)
        with parquet_file(path) as pf:
            missing = [c for c in args.keep if c not in pf.schema_arrow.names]
        if missing:
            raise ConfigError(f"--keep {' '.join(missing)}: not a column of {path} (columns: "
                              f"{', '.join(pf.schema_arrow.names)})")
    with storage.local_output(args.out, directory=False) as out:      # a URI run / out: staged
        if args.export is not None:
            from recsys.serving.offline import predict_export

            predict_export(args.export, args.data, out, keep=tuple(args.keep))
        else:
            with local_run(args.run, args.last) as run:
                _preflight_run_data(run, args.data)
                predict_run(run, args.data, out, last=args.last, keep=tuple(args.keep))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from recsys import storage
    from recsys.preflight import preflight_export
    from recsys.rundir import local_run
    from recsys.serving.export import export_model
    from recsys.serving.source import resolve_source

    with contextlib.ExitStack() as stack:      # URIs (run, checkpoint, out): staged in local temporary copies
        run = None if args.run is None else stack.enter_context(local_run(args.run, args.last))
        checkpoint = None if args.checkpoint is None else stack.enter_context(storage.local_copy(args.checkpoint))
        out = stack.enter_context(storage.local_output(args.out))
        source = resolve_source(run=run, checkpoint=checkpoint, last=args.last)
        if storage.is_uri(args.run or args.checkpoint):     # the manifest names the URI, not the local copy
            kind = source.origin.split(" ", 1)[0]
            source = dataclasses.replace(source, origin=f"{kind} {args.run or args.checkpoint}")
        preflight_export(source.model_dir.parent, source.origin.startswith("checkpoint"), Path(out))
        manifest = export_model(source, out, precision=args.precision, since=args.since, overwrite=args.overwrite,
                                index=args.index)
    sys.stdout.write(json.dumps({"out": args.out, "kind": manifest["kind"], "step": manifest["step"],
                                 "precision": manifest["precision"], "rows": manifest["rows"]}) + "\n")
    return 0


def _cmd_export_apply(args: argparse.Namespace) -> int:
    from recsys.serving.delta import apply_delta

    manifest = apply_delta(args.base, args.delta, args.out)
    sys.stdout.write(json.dumps({"out": args.out, "step": manifest["step"], "rows": manifest["rows"]}) + "\n")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from recsys.serving.server import ServeOptions, serve
    except ModuleNotFoundError as e:
        if e.name != "aiohttp":
            raise
        raise ConfigError("recsys serve needs aiohttp: pip install 'recsys-hybrid[serve]' (or -e '.[serve]')") from None

    options = ServeOptions(export=args.export, host=args.host, port=args.port, max_batch=args.max_batch,
                           max_wait_ms=args.max_wait_ms, workers=args.workers, token_file=args.token_file,
                           max_body_bytes=int(args.max_body_mb * (1 << 20)), threads=args.threads)
    options.check()
    stop = threading.Event()
    _stop_on_signals(stop)

    def ready(url: str) -> None:               # one line on stdout once serving (the port, when --port 0)
        sys.stdout.write(json.dumps({"url": url}) + "\n")
        sys.stdout.flush()

    serve(options, stop, ready)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from recsys.training.plot import plot_run

    for path in plot_run(args.run_dir):
        logger.info("wrote %s", path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recsys", description=__doc__)
    parser.add_argument("-v", "--verbose", "--debug", dest="verbose", action="store_true",
                        help="debug logging and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, func, config: bool | None = None, **kw) -> argparse.ArgumentParser:
        """Subcommand `name` running `func`; with `config` (True: required) --config, --set and --date."""
        p = sub.add_parser(name, **kw)
        if config is not None:
            _add_config_args(p, required=config)
        p.set_defaults(func=func)
        return p

    p = command("print-config", _cmd_print_config, config=False, help="print the resolved job config as TOML")
    p.add_argument("--explain", metavar="KEY", help="what a config key means (type, default, valid values), "
                   "e.g. ps.table_defaults.lr, or every key of a section (train); docs/config.md has them all")

    p = command("init-config", _cmd_init_config, help="write a job config from your Parquet data (columns "
                                                      "classified, tables sized by their distinct ids)")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help="Parquet files, directories or globs")
    p.add_argument("--label", required=True, help="the 0/1 label column")
    p.add_argument("--out", default=None, help="the config file to write (default: print it)")
    p.add_argument("--dense", nargs="*", default=[], metavar="COL", help="integer columns that are numbers, not ids")
    p.add_argument("--ignore", nargs="*", default=[], metavar="COL", help="columns to leave out")
    p.add_argument("--sample-rows", type=int, default=1_000_000, help="rows read to count distinct ids")
    p.add_argument("--run-dir", default="", help="train.run_dir of the config (default: runs/<--out's name>)")

    p = command("gen-data", _cmd_gen_data, help="write a synthetic CTR dataset as Parquet",
                description="Writes OUT/part-00000.parquet, part-00001, ...: --rows rows in --files files of "
                            "equal rows, or --split A,B,C: file i gets the next i-th count of rows (e.g. "
                            "train, validation, test). Rows are one i.i.d. stream, the same for a --seed "
                            "whatever the split. --preset onehot (ten one-hot fields: user, item, "
                            "item_category and context ids; data/onehot.py) without --rows or --split "
                            "writes its default split 50000,6000,30000: part-00000 train, part-00001 "
                            "validation, part-00002 test.")
    p.add_argument("--preset", default="criteo-like",
                   choices=["criteo-like", "longtail", "onehot", "tiny", "retrieval", "sequence", "daily"])
    p.add_argument("--rows", type=int, default=None, help="total rows (required unless --split or --preset onehot)")
    p.add_argument("--files", type=int, default=1, help="files of equal rows (with --rows)")
    p.add_argument("--split", default=None, metavar="A,B,...",
                   help="rows of each file, in order, instead of --rows/--files (not for retrieval, sequence, daily)")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-group-rows", type=int, default=65536)
    p.add_argument("--compression", default="zstd", choices=["zstd", "snappy", "lz4", "gzip", "none"])
    p.add_argument("--days", type=int, default=3, help="--preset daily: day partitions OUT/day=YYYY-MM-DD/ "
                                                       "of --rows rows each")
    p.add_argument("--start", default="2026-11-25", help="--preset daily: the first day (YYYY-MM-DD)")

    p = command("convert-criteo", _cmd_convert_criteo, help="Criteo Display Advertising TSV -> Parquet (streaming)")
    p.add_argument("input", help="TSV file: label, 13 integer, 26 hex categorical columns")
    p.add_argument("out_dir")
    p.add_argument("--rows-per-file", type=int, default=4_000_000)
    p.add_argument("--row-group-rows", type=int, default=131072)
    p.add_argument("--compression", default="zstd", choices=["zstd", "snappy", "lz4", "gzip", "none"])

    p = command("ps", _cmd_ps, config=True, help="serve one parameter-server shard")
    p.add_argument("--shard", type=int, required=True, help="shard index in 0..ps.num_shards-1")
    p.add_argument("--bind", default=None, help="address to bind (default ps.bind, 127.0.0.1)")
    p.add_argument("--port", type=_port_arg, default=0, help="TCP port (0: an ephemeral one)")
    p.add_argument("--ready-file", default=None, help="write the shard's address here once it serves")
    p.add_argument("--restore", default=None, metavar="PS_DIR",
                   help="first load this shard's part of a saved PS (a checkpoint's model/ps; any shard count)")
    p.add_argument("--init-from", default=None, metavar="PS_DIR",
                   help="warm start: take the rows of these saved shards' tables that this config has, by name")

    p = command("train", _cmd_train, config=True, help="train: start the PS shards and trainers on this machine")
    p.add_argument("--resume", default=None, metavar="latest|PATH",
                   help="continue from the run's newest good checkpoint, or from a checkpoint directory")
    p.add_argument("--overwrite", action="store_true",
                   help="train.run_dir holds a run: move it aside (to RUN_DIR.old-TIME) and start a new one")
    p.add_argument("--init-from", default=None, metavar="RUN_DIR|CHECKPOINT",
                   help="warm start from another run's model (train.init_from): rows, optimizer state, dense "
                        "weights; a fresh data position")

    p = command("daily", _cmd_daily, config=True, help="the daily job: warm-start from yesterday's run, train on "
                                                       "day --date, evaluate on the next day, publish a full export "
                                                       "and a delta")
    p.add_argument("--root", default=None, help="runs live in ROOT/DATE (default: the config's train.run_dir)")
    p.add_argument("--publish", default=None, help="exports and published.json (default: ROOT/published)")
    p.add_argument("--keep", type=int, default=3, help="full exports kept for rollback")
    p.add_argument("--from", default=None, metavar="RUN|CHECKPOINT",
                   help="warm-start from this instead of ROOT/<the day before>")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="the day's run was cut short: continue it from its latest checkpoint, then evaluate "
                            "and publish (replacing that day's publication, if any)")
    again.add_argument("--overwrite", action="store_true",
                       help="train the day again: its run moves aside (ROOT/DATE.old-TIME) and that day's "
                            "publication is replaced")
    p.add_argument("--next-day", nargs="+", default=None, metavar="PATH",
                   help="next-day evaluation data (default: the config's data.eval_paths, e.g. day={date+1})")

    p = command("ray-submit", _cmd_ray_submit, config=True,
                help="submit `recsys train --config X` to a Ray cluster as a Ray job")
    p.add_argument("--address", required=True, metavar="http://HOST:8265",
                   help="the Ray dashboard's address (the Job Submission API)")
    wait = p.add_mutually_exclusive_group()
    wait.add_argument("--wait", dest="wait", action="store_true", default=True,
                      help="stream the job's log and exit with its exit code (default)")
    wait.add_argument("--no-wait", dest="wait", action="store_false", help="print the job id and return")
    p.add_argument("--check", action="store_true",
                   help="submit `recsys print-config` of the config instead of train (checks the cluster's install)")
    p.add_argument("--submission-id", default=None, help="the job's id (default: Ray makes one)")

    p = command("reshard", _cmd_reshard, help="write a checkpoint re-sharded into a different number of PS shards")
    p.add_argument("checkpoint", help="checkpoint directory (run_dir/checkpoints/step-*)")
    p.add_argument("--shards", type=int, required=True, help="the new ps.num_shards")
    p.add_argument("--out", required=True, help="the new checkpoint directory (must not exist)")

    def scoring(name: str, help_: str, func, out_help: str, out_required: bool) -> argparse.ArgumentParser:
        p = command(name, func, help=help_)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--run", help="run directory written by `recsys train`")
        src.add_argument("--export", metavar="DIR|URI", help="an export (recsys export): score with the serving model")
        p.add_argument("--data", required=True, action="append", help="Parquet file, directory or glob")
        p.add_argument("--out", required=out_required, default=None, help=out_help)
        p.add_argument("--last", action="store_true", help="the run's last model, not its best (RUN_DIR/best)")
        p.add_argument("--date", type=_date_arg, default=None, metavar="YYYY-MM-DD",
                       help="fills {date}, {date-N}, {date+N} in --run, --data and --out")
        return p

    scoring("eval", "evaluate a trained run (or an export) on Parquet data", _cmd_eval,
            "metrics JSON (default RUN/eval_metrics.json; with --export: none)", False)
    p = scoring("predict", "score Parquet data with a trained run (or an export)", _cmd_predict,
                "output Parquet: score + data.passthrough_columns + --keep", True)
    p.add_argument("--keep", nargs="+", default=[], metavar="COLUMN",
                   help="columns of --data to write beside each score (a row key, e.g. user_id item_id)")

    p = command("export", _cmd_export,
                help="export embeddings + dense model for serving (see recsys/serving/export.py)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory written by `recsys train`")
    src.add_argument("--checkpoint", help="checkpoint directory (config.toml, model/, manifest.json)")
    p.add_argument("--out", required=True, help="export directory (written beside it, renamed into place)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8", "int4"])
    p.add_argument("--since", type=int, default=None, metavar="STEP",
                   help="delta export: rows updated and ids evicted at steps >= STEP (a base export's step)")
    p.add_argument("--last", action="store_true", help="with --run: its last model, not its best (RUN_DIR/best)")
    p.add_argument("--overwrite", action="store_true", help="replace an export of another run at --out")
    p.add_argument("--index", default="exact", choices=["exact", "ann"],
                   help="two_tower: 'ann' also writes an ANN index of the items, which topk then searches "
                        "(docs/serving.md)")

    p = command("export-apply", _cmd_export_apply, help="apply a delta export to a base export -> a full export")
    p.add_argument("base", help="full export directory")
    p.add_argument("delta", help="delta export directory (recsys export --since)")
    p.add_argument("--out", required=True, help="the resulting full export directory")

    p = command("serve", _cmd_serve, help="HTTP JSON API over an export: predict, topk, reload, metrics "
                                          "(docs/serving.md)")
    p.add_argument("--export", required=True, metavar="DIR|URI", help="full export directory (recsys export)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs --token-file)")
    p.add_argument("--port", type=_port_arg, default=8080, help="TCP port (0: an ephemeral one)")
    p.add_argument("--max-batch", type=int, default=256, metavar="B", help="rows per micro-batch at most")
    p.add_argument("--max-wait-ms", type=float, default=0.0, metavar="W",
                   help="wait up to W ms after a batch's first request for more rows (0: take what is queued)")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="batching threads, each with its own copy of the model")
    p.add_argument("--threads", type=int, default=1, metavar="T",
                   help="torch intra-op threads (a batch of a few rows gains nothing from more)")
    p.add_argument("--token-file", default=None, help="file (mode 0600) of a bearer token every request but "
                                                      "/v1/health must send")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies get 413")

    p = command("plot", _cmd_plot, help="write PNG curves (loss, AUC, samples/s) of a run")
    p.add_argument("run_dir")

    p = command("demo", _cmd_demo, help="quickstart: generate data and run the main job")
    p.add_argument("--out", default="demo")
    p.add_argument("--rows", type=int, default=600_000)
    add_tune_parser(sub, _add_config_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    apply_environment()
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:
        if _user_error(e):           # config, data, paths, checkpoints, exports, a trainer's error: one line
            if args.verbose:
                logger.exception("details")
            sys.stderr.write(f"error: {' '.join(str(e).split())}\n")     # last, also with --debug
            return 2
        # bad data, a dead process, a missing file: the message names it; -v adds the traceback
        logger.error("%s: %s", type(e).__name__, e, exc_info=args.verbose)
        return 1
    except StopNow as e:                 # a second SIGTERM / SIGINT during `recsys train`
        logger.error("%s", e)
        return 128 + e.signum
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130


def entry() -> None:
    """The `recsys` command (and `python -m recsys.cli`): `main`, then a quick exit. Once `main` returns, all
    the command wrote is closed; the interpreter's teardown of torch's ~3,000 modules (about 1 s once torch._dynamo
    is loaded: a shard, the launcher after an export) is skipped: non-daemon threads are waited for, the atexit
    handlers run (logging's flush among them), stdio is flushed, then os._exit."""
    rc = main()
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    entry()
