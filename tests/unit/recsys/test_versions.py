"""The torch / fbgemm-gpu ABI pair check names the versions a user needs."""

import pytest

from embedding_ps import versions


def fake_installed(mapping):
    return lambda dist: mapping.get(dist)


def test_supported_pair_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "_installed", fake_installed({"torch": "2.13.0+cpu", "fbgemm-gpu-cpu": "1.8.0"}))
    versions.check_torch_fbgemm()


def test_installed_pair_is_supported() -> None:
    versions.check_torch_fbgemm()  # the real environment


@pytest.mark.parametrize(
    "installed, match",
    [
        ({"torch": "2.14.1", "fbgemm-gpu-cpu": "1.8.0"}, r"torch 2\.14\.1 with fbgemm-gpu-cpu 1\.8\.0 is not a supported pair"),
        ({"torch": "2.13.0", "fbgemm-gpu": "1.9.0"}, r"fbgemm-gpu 1\.9\.0 is not a supported pair"),
        ({"torch": "2.13.0"}, r"fbgemm-gpu-cpu \(or fbgemm-gpu\) is not installed"),
    ],
)
def test_mismatch_names_needed_versions(monkeypatch: pytest.MonkeyPatch, installed, match) -> None:
    monkeypatch.setattr(versions, "_installed", fake_installed(installed))
    with pytest.raises(ImportError, match=match) as e:
        versions.check_torch_fbgemm()
    assert "torch==2.13.0 fbgemm-gpu-cpu==1.8.0" in str(e.value)
