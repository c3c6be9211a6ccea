"""`recsys gen-data --preset` offers every synthetic preset (configs' header commands use them)."""

import pytest

from data.synthetic import PRESETS
from recsys.cli import build_parser


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gen_data_accepts_every_preset(preset: str) -> None:
    args = build_parser().parse_args(["gen-data", "--preset", preset, "--rows", "10", "--out", "x"])
    assert args.preset == preset


def test_gen_data_refuses_an_unknown_preset() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gen-data", "--preset", "nope", "--rows", "10", "--out", "x"])
