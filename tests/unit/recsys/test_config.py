"""Typed TOML config: every rule raises ConfigError naming file, dotted key and value."""

from pathlib import Path

import pytest

from recsys.config import ConfigError, JobConfig, load_config, to_toml

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_defaults_load() -> None:
    cfg = load_config(None)
    assert isinstance(cfg, JobConfig)
    assert cfg.ps.num_shards == 1 and cfg.data.batch_size == 4096


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path, ["data.date='2026-11-26'"])     # a dated config (daily.toml) needs --date
    assert cfg.ps.tables, f"{path.name} defines no tables"
    assert cfg.data.sparse_columns


def test_configs_dir_is_not_empty() -> None:
    assert len(list((ROOT / "configs").glob("*.toml"))) >= 1


def test_values_are_read(tmp_path: Path) -> None:
    p = write(tmp_path, """
[data]
batch_size = 128
sparse_columns = ["a", "b"]
weight_columns = {b = "b_w"}
[ps]
num_shards = 3
[[ps.tables]]
name = "a"
dim = 8
optimizer = "adam"
[model]
bottom_mlp = [16, 8]
""")
    cfg = load_config(p)
    assert cfg.data.batch_size == 128
    assert cfg.data.sparse_columns == ("a", "b")
    assert cfg.data.weight_columns == {"b": "b_w"}
    assert cfg.ps.num_shards == 3
    assert cfg.ps.tables[0].optimizer == "adam" and cfg.ps.tables[0].dim == 8
    assert cfg.model.bottom_mlp == (16, 8)


def test_unknown_key_names_file_dotted_key_and_valid_keys(tmp_path: Path) -> None:
    p = write(tmp_path, "[ps]\nnum_shard = 2\n")
    with pytest.raises(ConfigError, match=r"job\.toml: unknown key 'ps\.num_shard'; valid: num_shards, "):
        load_config(p)


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'trainer'; valid: data, ps, model, train"):
        load_config(write(tmp_path, "[trainer]\nx = 1\n"))


def test_unknown_key_in_array_of_tables(tmp_path: Path) -> None:
    p = write(tmp_path, '[[ps.tables]]\nname = "a"\ndim = 4\nlearning_rate = 0.1\n')
    with pytest.raises(ConfigError, match=r"unknown key 'ps\.tables\[0\]\.learning_rate'"):
        load_config(p)


@pytest.mark.parametrize(
    "text, match",
    [
        ('[data]\nbatch_size = "big"\n', r"data\.batch_size must be an integer, got 'big'"),
        ("[data]\nbatch_size = 1.5\n", r"data\.batch_size must be an integer, got 1\.5"),
        ("[data]\nshuffle = 1\n", r"data\.shuffle must be true or false, got 1"),
        ("[data]\nsparse_columns = \"a\"\n", r"data\.sparse_columns must be a list, got 'a'"),
        ("[data]\nsparse_columns = [1]\n", r"data\.sparse_columns\[0\] must be a string, got 1"),
        ("[train]\ndense_lr = \"x\"\n", r"train\.dense_lr must be a number"),
        ("[ps]\ntables = 3\n", r"ps\.tables must be a list, got 3"),
    ],
)
def test_wrong_type(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


def test_bad_choice_names_key_value_and_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ps\.mode must be one of 'sync', 'async', got 'fast'"):
        load_config(write(tmp_path, '[ps]\nmode = "fast"\n'))


@pytest.mark.parametrize(
    "text, match",
    [
        ("[ps]\nnum_shards = 0\n", r"job\.toml: ps\.num_shards must be >= 1, got 0"),
        ("[data]\nbatch_size = 0\n", r"data\.batch_size must be >= 1, got 0"),
        ('[[ps.tables]]\nname = "t"\ndim = 0\n', r"ps\.tables\[t\]\.dim must be >= 1, got 0"),
        ('[[ps.tables]]\nname = "t"\ndim = 4\nkind = "hashed"\n', r"num_embeddings must be >= 1"),
        ("[train]\nnum_trainers = 0\n", r"train\.num_trainers must be >= 1, got 0"),
        ("[model]\ndropout = 1.5\n", r"model\.dropout must be in \[0, 1\), got 1\.5"),
        ('[[ps.tables]]\nname = "t"\ndim = 4\ncapacity = -1\n', r"ps\.tables\[t\]\.capacity must be >= 0, got -1"),
        ('[[ps.tables]]\nname = "t"\ndim = 4\nrow_counters = false\nttl_steps = 3\n',
         r"ps\.tables\[t\]\.row_counters = false, but ttl_steps = 3"),
    ],
)
def test_range_errors(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


def test_missing_required_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ps\.tables\[0\].*dim"):
        load_config(write(tmp_path, '[[ps.tables]]\nname = "t"\n'))


def test_cross_section_rule(tmp_path: Path) -> None:
    text = '[[ps.tables]]\nname = "t"\ndim = 4\n[model]\nfeature_tables = {f = "nope"}\n'
    with pytest.raises(ConfigError, match=r"model\.feature_tables\.f = 'nope' is not a table"):
        load_config(write(tmp_path, text))


def test_overrides_go_through_validation(tmp_path: Path) -> None:
    p = write(tmp_path, "[ps]\nnum_shards = 2\n")
    cfg = load_config(p, ["ps.num_shards=4", "model.arch=dcn", "data.sparse_columns=['x','y']",
                          "train.dense_lr=0.05"])
    assert cfg.ps.num_shards == 4 and cfg.model.arch == "dcn"
    assert cfg.data.sparse_columns == ("x", "y") and cfg.train.dense_lr == 0.05
    with pytest.raises(ConfigError, match=r"ps\.num_shards must be >= 1, got 0"):
        load_config(p, ["ps.num_shards=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'ps\.num_shard'"):
        load_config(p, ["ps.num_shard=3"])
    with pytest.raises(ConfigError, match=r"model\.arch must be one of"):
        load_config(p, ["model.arch=resnet"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(p, ["ps.num_shards"])


def test_override_errors_name_the_override_not_the_file(tmp_path: Path) -> None:
    """A bad `--set` is blamed on itself (it was blamed on the config file, which holds no such key);
    an error of the file's own keys still names the file."""
    p = write(tmp_path, "[ps]\nnum_shards = 2\n")
    with pytest.raises(ConfigError, match=r"^--set train\.epoch=3: unknown key 'train\.epoch'"):
        load_config(p, ["train.seed=1", "train.epoch=3"])
    with pytest.raises(ConfigError, match=r"^--set train\.epochs=x: train\.epochs must be an integer"):
        load_config(p, ["train.epochs=x"])
    with pytest.raises(ConfigError, match=r"^--set ps\.table_defaults\.lrr=3: unknown key 'ps\.table_defaults\.lrr'"):
        load_config(p, ["ps.table_defaults.lrr=3"])
    bad = write(tmp_path, "[train]\nepoch = 3\n")
    with pytest.raises(ConfigError, match=r"job\.toml: unknown key 'train\.epoch'"):
        load_config(bad, ["train.seed=1"])


def test_set_takes_several_overrides_at_once() -> None:
    """`--set a=1 b=2` (as the README writes `[--set k=v ...]`) and `--set a=1 --set b=2` alike."""
    from recsys.cli import build_parser
    args = build_parser().parse_args(["train", "--config", "x.toml", "--set", "train.seed=1", "train.epochs=2",
                                      "--set", "ps.num_shards=3"])
    assert args.overrides == ["train.seed=1", "train.epochs=2", "ps.num_shards=3"]


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: no such config file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"job\.toml: not valid TOML"):
        load_config(write(tmp_path, "[ps\n"))


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_resolved_toml_round_trips(tmp_path: Path, path: Path) -> None:
    cfg = load_config(path, ["train.dense_lr=0.002", "data.date='2026-11-26'"])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


def test_print_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recsys.cli import main

    p = write(tmp_path, "[ps]\nnum_shards = 2\n")
    assert main(["print-config", "--config", str(p), "--set", "ps.num_shards=5"]) == 0
    out = capsys.readouterr().out
    assert "num_shards = 5" in out
    assert main(["print-config", "--config", str(p), "--set", "ps.bogus=1"]) == 2


@pytest.mark.parametrize(
    "text, match",
    [
        ('[data]\nsparse_columns = ["a", "b"]\n[[ps.tables]]\nname = "a"\ndim = 8\n[[ps.tables]]\nname = "b"\ndim = 4\n',
         r"must share one dim, got \[4, 8\]"),
        ('[data]\nsparse_columns = ["a"]\ndense_columns = ["x"]\n[[ps.tables]]\nname = "a"\ndim = 8\n[model]\nbottom_mlp = [16, 4]\n',
         r"model\.bottom_mlp must end in the tables' dim 8 for dlrm, got \[16, 4\]"),
        ('[data]\nsparse_columns = ["a"]\n[[ps.tables]]\nname = "a"\ndim = 16\n[[ps.tables]]\nname = "a1"\ndim = 1\n'
         '[model]\nlinear_feature_tables = {a = "a1"}\n', r"only used by deepfm and wide_deep, not 'dlrm'"),
        ('[data]\nsparse_columns = ["a"]\n[[ps.tables]]\nname = "a"\ndim = 16\n[[ps.tables]]\nname = "a1"\ndim = 2\n'
         '[model]\narch = "deepfm"\nlinear_feature_tables = {a = "a1"}\n', r"table 'a1' must have dim 1, got 2"),
        ('[data]\nsparse_columns = ["a"]\nweight_columns = {a = "w"}\n[[ps.tables]]\nname = "a"\ndim = 16\n'
         '[model]\ntable_pooling = {a = "mean"}\n', r"per-id weights need sum pooling"),
    ],
)
def test_cross_section_rules(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "text, match",
    [
        ("[train]\ncheckpoint_every = -1\n", r"train\.checkpoint_every must be >= 0, got -1"),
        ("[train]\ncheckpoint_every_s = -0.5\n", r"train\.checkpoint_every_s must be >= 0, got -0\.5"),
        ("[train]\nkeep_checkpoints = 0\n", r"train\.keep_checkpoints must be >= 1, got 0"),
        ("[train]\nmax_restarts = -2\n", r"train\.max_restarts must be >= 0, got -2"),
        ('[train]\ntrace_column = "row_id"\n', r"train\.trace_column = 'row_id' must be one of data\.passthrough_columns"),
    ],
)
def test_checkpoint_keys_validated(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


def test_cuda_needs_a_gpu_per_local_trainer(tmp_path: Path) -> None:
    import torch

    from recsys.training.launch import check_devices

    cfg = load_config(None, ["train.device='cuda'", f"train.num_trainers={torch.cuda.device_count() + 1}"])
    with pytest.raises(ValueError, match=r"train\.num_trainers = \d+, but this machine has \d+ GPU"):
        check_devices(cfg)
    check_devices(load_config(None, ["train.num_trainers=4"]))        # cpu: any count


def test_load_ps_config_reads_only_the_ps_section(tmp_path: Path) -> None:
    """What a shard reads (`recsys ps`): the [ps] section, checked like the whole job; other
    sections are not read (moved here from embedding_ps, which reads no config files)."""
    from recsys.config import load_ps_config

    good = tmp_path / "job.toml"
    good.write_text('[data]\nx = 1\n[ps]\nnum_shards = 2\nmode = "async"\ntimeout_s = 5\n'
                    '[[ps.tables]]\nname = "t"\ndim = 8\noptimizer = "adam"\n')
    cfg = load_ps_config(good)
    assert cfg.num_shards == 2 and cfg.timeout_s == 5.0 and cfg.tables[0].optimizer == "adam"
    assert load_ps_config(good, ["ps.num_shards=3"]).num_shards == 3
    bad = {"[ps]\nnum_shard = 2\n": r"unknown key 'ps.num_shard'; valid: num_shards, addresses",
           "[ps]\nmode = \"fast\"\n": r"ps.mode must be one of 'sync', 'async', got 'fast'",
           "[ps]\nretries = \"2\"\n": r"ps.retries must be an integer, got '2'",
           "[[ps.tables]]\nname = \"t\"\ndim = 8\ndimm = 3\n": r"unknown key 'ps.tables\[0\].dimm'; valid: name, dim",
           "[ps]\nnum_shards = 0\n": r"ps.num_shards must be >= 1, got 0"}
    for text, match in bad.items():
        good.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_ps_config(good)
    with pytest.raises(ConfigError, match="no such config file"):
        load_ps_config(tmp_path / "missing.toml")


def test_quickstart_ships_as_package_data() -> None:
    """`recsys demo` reads the package copy (works from an installed package); the checkout's
    configs/quickstart.toml is the same file."""
    from importlib import resources

    from recsys.demo import QUICKSTART

    assert QUICKSTART == resources.files("recsys") / "configs" / "quickstart.toml"
    assert QUICKSTART.read_bytes() == (ROOT / "configs" / "quickstart.toml").read_bytes()
    with resources.as_file(QUICKSTART) as path:
        load_config(path)


def test_shards_are_confined_to_the_run_directory(tmp_path: Path) -> None:
    """A shard (`recsys ps`, which the launcher also runs, on the run's resolved config.toml) is
    confined to ps.storage_root, by default the job's train.run_dir."""
    from recsys.config import load_ps_config

    job = tmp_path / "job.toml"
    job.write_text('[train]\nrun_dir = "runs/x"\n[ps]\nnum_shards = 1\n')
    assert load_ps_config(job).storage_root == "runs/x"
    assert load_config(job).ps.storage_root == ""            # resolved where the shard starts
    job.write_text('[ps]\nnum_shards = 1\n')
    assert load_ps_config(job).storage_root == "runs/default"
    job.write_text('[train]\nrun_dir = "runs/x"\n[ps]\nstorage_root = "/data/ps"\n')
    assert load_ps_config(job).storage_root == "/data/ps"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_config_floats_must_be_finite(tmp_path: Path, value: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f'[ps]\ntables = [{{ name = "t", dim = 4, lr = {value} }}]\n')
    with pytest.raises(ConfigError, match=r"ps.tables\[0\].lr must be a finite number"):
        load_config(job)
    with pytest.raises(ConfigError, match="train.dense_lr must be a finite number"):
        load_config(None, [f"train.dense_lr={value}"])


@pytest.mark.parametrize("override,message", [
    ("ps.num_shards=10000", "ps.num_shards must be <= 4096"),
    ("train.num_trainers=5000", "train.num_trainers must be <= 1024"),
    ("data.batch_size=100000000", "data.batch_size must be in 1..16777216"),
])
def test_counts_that_start_processes_or_allocate_are_bounded(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


# ---------------------------------------------------------------------------- grouped optimizer keys (#29 item 7)
def test_grouped_optimizer_equals_the_flat_keys(tmp_path: Path) -> None:
    flat = load_config(write(tmp_path, '[ps]\ntables = [{ name = "a", dim = 4, optimizer = "adam", lr = 0.02, '
                                       'beta1 = 0.8, weight_decay = 0.001 }]\n'))
    grouped = load_config(write(tmp_path, '[ps]\ntables = [{ name = "a", dim = 4, optimizer = { name = "adam", '
                                          'lr = 0.02, beta1 = 0.8, weight_decay = 0.001 } }]\n'))
    assert grouped == flat and grouped.ps.tables[0].beta1 == 0.8
    defaults = load_config(write(tmp_path, '[data]\nsparse_columns = ["c"]\n[ps.table_defaults]\ndim = 4\n'
                                           'optimizer = { name = "ftrl", lr = 0.1, ftrl_l1 = 0.5 }\n'))
    t = defaults.ps.tables[0]
    assert (t.name, t.optimizer, t.lr, t.ftrl_l1) == ("c", "ftrl", 0.1, 0.5)
    text = to_toml(flat)                                             # print-config writes the grouped form
    assert 'optimizer = {name = "adam", lr = 0.02, eps = 1e-08, beta1 = 0.8, beta2 = 0.999' in text
    assert "ftrl_beta" not in text and load_config(write(tmp_path, text)) == flat


@pytest.mark.parametrize("table, match", [
    ('optimizer = { name = "adagrad", beta1 = 0.8 }', r"ps.tables\[0\].optimizer.beta1 does not apply to "
                                                      r"optimizer 'adagrad' \(it takes lr, eps"),
    ('optimizer = { lr = 0.1 }', r"ps.tables\[0\].optimizer.name must be one of 'sgd'"),
    ('lr = 0.5, optimizer = { name = "sgd", lr = 0.1 }', r"ps.tables\[0\]: lr is set twice"),
])
def test_grouped_optimizer_errors_name_the_key(tmp_path: Path, table: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, f'[ps]\ntables = [{{ name = "a", dim = 4, {table} }}]\n'))


def test_renamed_key_still_loads_with_a_note(tmp_path: Path, caplog) -> None:
    """train.prefetch_batches (a name data.prefetch_batches shares with another meaning) is now
    train.pull_ahead_batches: the old name loads, says so once, and print-config writes the new one."""
    text = '[ps]\nmode = "async"\nmax_staleness = 4\n[train]\nprefetch_batches = 3\n'
    with caplog.at_level("WARNING", logger="recsys.config"):
        cfg = load_config(write(tmp_path, text))
    assert cfg.train.pull_ahead_batches == 3
    assert [r.getMessage() for r in caplog.records if "is now train.pull_ahead_batches" in r.getMessage()]
    assert "pull_ahead_batches = 3" in to_toml(cfg) and "\nprefetch_batches = 3" not in to_toml(cfg)
    with pytest.raises(ConfigError, match="prefetch_batches and train.pull_ahead_batches are both set"):
        load_config(write(tmp_path, text + "pull_ahead_batches = 1\n"))
