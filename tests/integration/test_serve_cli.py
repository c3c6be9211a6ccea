"""`recsys serve` as README.md shows it: the command started as a process on 127.0.0.1 (port 0), then
its health, metadata and a predict request (with curl where the machine has it, as the README
does), equal to the in-process `Predictor`; SIGTERM stops it with exit code 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from embedding_ps.local import LocalStore
from recsys.config import load_config, to_toml
from recsys.serving import Predictor
from recsys.serving.export import export_model
from recsys.serving.rows import Columns, to_table
from recsys.serving.source import resolve_source
from recsys.training.trainer import Trainer
from recsys.training.worker import save_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60


def tiny_export(tmp: Path, data: Path) -> Path:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{tmp / 'run'}'", "train.max_steps=4"])
    torch.manual_seed(0)
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    trainer.train()
    save_model(trainer, store, tmp / "run" / "model")
    trainer.close()
    (tmp / "run" / "config.toml").write_text(to_toml(cfg))
    (tmp / "run" / "metrics.json").write_text(json.dumps({"steps": trainer.step}))
    export_model(resolve_source(run=tmp / "run"), tmp / "export")
    return tmp / "export"


def test_recsys_serve_command(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=8000, files=2, seed=11)
    export = tiny_export(tmp_path, data)
    rows = json.loads(json.dumps(pq.read_table(data / "part-00001.parquet").slice(0, 3).to_pylist()))
    (tmp_path / "rows.json").write_text(json.dumps({"rows": rows}))
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "recsys.cli", "serve", "--export", str(export), "--port", "0"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()              # {"url": ...} once it serves
        assert line, proc.stderr.read()[-3000:]
        url = json.loads(line)["url"]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{url}/v1/health", timeout=TIMEOUT) as r:
            assert json.loads(r.read())["status"] == "ok"
        with urllib.request.urlopen(f"{url}/v1/metadata", timeout=TIMEOUT) as r:
            assert json.loads(r.read())["columns"]["dense"] == ["I1", "I2"]
        if shutil.which("curl"):                   # README.md's command
            out = subprocess.run(["curl", "-s", "-H", "Content-Type: application/json", "-d", "@rows.json",
                                  f"{url}/v1/predict"], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=TIMEOUT, check=True).stdout
        else:
            req = urllib.request.Request(f"{url}/v1/predict", data=(tmp_path / "rows.json").read_bytes(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                out = r.read().decode()
        got = json.loads(out)["probabilities"]
        p = Predictor(export)
        np.testing.assert_allclose(got, p.predict(to_table(rows, Columns.of(p.config.data))), rtol=0, atol=1e-6)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()

    # a bad command line: one error line, exit code 2
    r = subprocess.run([sys.executable, "-m", "recsys.cli", "serve", "--export", str(tmp_path / "nope"), "--port", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and "error:" in r.stderr
