"""`recsys serve`'s HTTP API (recsys/serving/server.py) on an in-process server (127.0.0.1, a port
picked by the OS, the event loop in a thread): every endpoint, answers equal to `Predictor`'s,
micro-batching, a reload under load with no failed request and no mixed-model answer, a delta
reload, bad bodies, the 100 MB body, the bearer token, and two-tower top-k equal to `ExactIndex`."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from recsys.models.two_tower import tower_data
from recsys.serving import Predictor
from recsys.serving.batcher import Served
from recsys.serving.export import export_model
from recsys.serving.retrieval import ExactIndex
from recsys.serving.rows import Columns, to_table
from recsys.serving.server import ServeOptions, Server
from recsys.serving.source import resolve_source

S1, S2 = 4, 12
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def exports(tmp_path_factory, export_data, tiny_config, train_run) -> dict[str, Path]:
    """old: the model at step S1; new: at S2; delta: S1 -> S2 (base old)."""
    root = tmp_path_factory.mktemp("serve")
    ckpt, run = train_run(root, tiny_config(export_data, root / "run", log_every=4), steps=(S1, S2), checkpoints=True)
    out = {"old": root / "old", "new": root / "new", "delta": root / "delta"}
    export_model(resolve_source(checkpoint=ckpt), out["old"])
    export_model(resolve_source(run=run), out["new"])
    export_model(resolve_source(run=run), out["delta"], since=S1)
    return out


@pytest.fixture(scope="module")
def rows(exports, export_data) -> list[dict]:
    """200 eval rows as JSON objects (every column of the file; the server takes the ones it needs)."""
    table = pq.read_table(export_data / "part-00001.parquet").slice(0, 200)
    return json.loads(json.dumps(table.to_pylist()))


def reference(export: Path, rows: list[dict], deltas: tuple = ()) -> np.ndarray:
    p = Predictor(export, deltas=list(deltas))
    return p.predict(to_table(rows, Columns.of(p.config.data)))


@contextlib.contextmanager
def running(export: Path | None = None, served: Served | None = None, **options) -> Iterator[tuple[str, Server]]:
    """A Server on 127.0.0.1:<free port> with its event loop in a thread; stopped on exit."""
    server = Server(ServeOptions(export=str(export), port=0, **options), served)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(TIMEOUT)
        yield url, server
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(TIMEOUT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT)
        loop.close()


def call(url: str, method: str, path: str, body: object = None, headers: dict | None = None,
         raw: bytes | None = None) -> tuple[int, dict | str]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        return r.status, json.loads(text) if r.getheader("Content-Type", "").startswith("application/json") else text
    finally:
        conn.close()


def test_predict_health_metadata_metrics(exports, rows) -> None:
    want = reference(exports["new"], rows)
    with running(exports["new"], max_wait_ms=1.0) as (url, _):
        status, got = call(url, "POST", "/v1/predict", {"rows": rows})
        assert status == 200 and got["step"] == S2 and got["generation"] == 0
        np.testing.assert_allclose(got["probabilities"], want, rtol=0, atol=1e-6)
        # concurrent batch-1 requests, micro-batched, each answer its own row's
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: call(url, "POST", "/v1/predict", {"rows": [rows[i]]}), range(64)))
        assert all(s == 200 for s, _ in answers)
        np.testing.assert_allclose([a["probabilities"][0] for _, a in answers], want[:64], rtol=0, atol=1e-6)

        assert call(url, "GET", "/v1/health") == (200, {"status": "ok", "step": S2, "generation": 0})
        status, meta = call(url, "GET", "/v1/metadata")
        m = json.loads((exports["new"] / "manifest.json").read_text())
        assert status == 200 and meta["run_id"] == m["run_id"] and meta["step"] == S2 and meta["precision"] == "fp32"
        assert [t["name"] for t in meta["tables"]] == ["C1", "C2", "C3", "C4", "M1"]
        assert meta["columns"]["sparse"] == ["C1", "C2", "C3", "C4", "M1"] and meta["topk"] is None
        assert meta["columns"]["id_types"] == dict.fromkeys(["C1", "C2", "C3", "C4", "M1"], "integer")
        assert meta["batching"]["max_batch"] == 256

        status, text = call(url, "GET", "/metrics")
        assert status == 200
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert lines['recsys_serve_requests_total{endpoint="/v1/predict",code="200"}'] == "65"
        assert lines["recsys_serve_rows_total"] == str(200 + 64)
        assert float(lines['recsys_serve_request_seconds_count{endpoint="/v1/predict"}']) == 65
        assert int(lines["recsys_serve_batch_rows_count"]) <= 65
        assert lines['recsys_serve_batch_rows_bucket{le="+Inf"}'] == lines["recsys_serve_batch_rows_count"]
        assert lines["recsys_serve_model_step"] == str(S2)


def test_concurrent_requests_share_batches(exports, rows) -> None:
    with running(exports["new"], max_batch=8, max_wait_ms=300.0) as (url, server):
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: call(url, "POST", "/v1/predict", {"rows": [rows[i]]}), range(8)))
        assert all(s == 200 for s, _ in answers)
        batches = server.metrics.batch_rows
        assert sum(batches.counts) < 8 and server.metrics.rows == 8     # some requests shared a batch
        # one request of more rows than --max-batch is scored whole
        status, got = call(url, "POST", "/v1/predict", {"rows": rows[:20]})
        assert status == 200 and len(got["probabilities"]) == 20


def test_calibrated_probabilities(exports, rows) -> None:
    served = Served(exports["new"])
    for p in served.predictors:          # as a model trained on negatives kept at rate 0.25 ("calibrate")
        p.score_rate = 0.25
    p = Predictor(exports["new"])
    from data.decode import decode_table
    logits = p.logits(decode_table(p.config.data, to_table(rows[:10], Columns.of(p.config.data))))
    want = torch.sigmoid(logits + math.log(0.25)).numpy()
    with running(exports["new"], served=served) as (url, _):
        status, got = call(url, "POST", "/v1/predict", {"rows": rows[:10]})
    assert status == 200
    np.testing.assert_allclose(got["probabilities"], want, rtol=0, atol=1e-6)
    assert not np.allclose(want, torch.sigmoid(logits).numpy(), atol=1e-3)


def test_reload_under_load_every_answer_is_one_models(exports, rows, monkeypatch) -> None:
    old, new = reference(exports["old"], rows), reference(exports["new"], rows)
    assert np.abs(old - new).min() > 1e-4, "the two models must tell apart on every row"
    predict = Predictor.predict

    def slow(self, data):           # batches of 5 ms or more: the swaps land while batches run
        time.sleep(0.005)
        return predict(self, data)

    monkeypatch.setattr(Predictor, "predict", slow)
    answers, errors, stop = [], [], threading.Event()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            idx = rng.choice(len(rows), size=int(rng.integers(1, 4)), replace=False).tolist()
            try:
                status, body = call(url, "POST", "/v1/predict", {"rows": [rows[i] for i in idx]})
            except OSError as e:
                errors.append(repr(e))
                continue
            (answers if status == 200 else errors).append((idx, body))

    with running(exports["old"], max_wait_ms=2.0) as (url, _):
        threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        try:
            for gen, name in enumerate(("new", "old", "new"), start=1):      # generations 0, 2: old; 1, 3: new
                deadline = time.monotonic() + TIMEOUT
                while sum(a[1]["generation"] == gen - 1 for a in answers) < 20 and time.monotonic() < deadline:
                    time.sleep(0.02)
                status, meta = call(url, "POST", "/v1/reload", {"export": str(exports[name])})
                assert status == 200 and meta["generation"] == gen
            deadline = time.monotonic() + TIMEOUT
            while sum(a[1]["generation"] == 3 for a in answers) < 20 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            stop.set()
            for t in threads:
                t.join(TIMEOUT)
    assert not errors, errors[:3]
    gens = [body["generation"] for _, body in answers]
    assert all(gens.count(g) >= 20 for g in range(4)), [gens.count(g) for g in range(4)]
    for idx, body in answers:                 # all rows of an answer from the model it names, never a mix
        want = (old if body["generation"] % 2 == 0 else new)[idx]
        np.testing.assert_allclose(body["probabilities"], want, rtol=0, atol=1e-6)
        assert body["step"] == (S1 if body["generation"] % 2 == 0 else S2)


def test_reload_delta_and_failed_reload(exports, rows) -> None:
    with running(exports["old"]) as (url, _):
        status, body = call(url, "POST", "/v1/reload", {"export": str(exports["old"] / "nope")})
        assert status == 400 and body["field"] == "export" and "still serving generation 0" in body["error"]
        status, body = call(url, "POST", "/v1/reload", {"delta": str(exports["new"])})     # a full export
        assert status == 400 and body["field"] == "delta"
        np.testing.assert_allclose(call(url, "POST", "/v1/predict", {"rows": rows[:5]})[1]["probabilities"],
                                   reference(exports["old"], rows[:5]), rtol=0, atol=1e-6)
        status, meta = call(url, "POST", "/v1/reload", {"delta": str(exports["delta"])})
        assert status == 200 and meta["step"] == S2 and meta["deltas"] == [str(exports["delta"])]
        status, got = call(url, "POST", "/v1/predict", {"rows": rows})
        assert status == 200 and got["generation"] == 1
        np.testing.assert_allclose(got["probabilities"], reference(exports["old"], rows, (exports["delta"],)),
                                   rtol=0, atol=1e-6)
        assert call(url, "POST", "/v1/reload", {"export": 3})[1]["field"] == "export"
        assert call(url, "POST", "/v1/reload", {})[0] == 400


def raw_request(url: str, head: bytes, body_part: bytes) -> bytes:
    """Send a request's head and part of its body on a socket; the first bytes of the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(head + body_part)
        return s.recv(4096)


def test_bad_bodies_name_the_field(exports, rows) -> None:
    row = rows[0]
    cases = [
        ({"rows": [dict(row, I1="3")]}, "I1", "a string is not a number"),
        ({"rows": [dict(row, C2=1.5)]}, "C2", "a number is not an id"),
        ({"rows": [dict(row, M1=[1, True])]}, "M1", "a list is not an id"),
        ({"rows": [dict(row, C1=2**64)]}, "C1", "outside int64"),
        ({"rows": [{k: v for k, v in row.items() if k != "C3"}]}, "C3", "missing column 'C3'"),
        ({"rows": [row, 5]}, "rows", "rows[1]: an integer"),
        ({"rows": []}, "rows", "non-empty"),
        ({"row": [row]}, "rows", "missing"),
        ([row], "body", "a JSON object"),
        ({"rows": [dict(row, C1=-5)]}, "C1", "negative"),          # the data decoder's check, as for Parquet
        # the model was trained on integer ids (data.id_types, filled in by training): "7" is not the id 7
        ({"rows": [dict(row, C1="7")]}, "C1", "string ids (string), but data.id_types says integer"),
        ({"rows": [dict(row, M1=["7", "8"])]}, "M1", "string ids (list<item: string>), but data.id_types says"),
    ]
    with running(exports["new"]) as (url, _):
        for body, field, says in cases:
            status, got = call(url, "POST", "/v1/predict", body)
            assert (status, got["field"]) == (400, field), (body, got)
            assert says in got["error"], got
        for raw, says in ((b"{not json", "not JSON"), (b'{"rows": [{"I1": NaN}]}', "NaN")):
            status, got = call(url, "POST", "/v1/predict", raw=raw)
            assert status == 400 and got["field"] == "body" and says in got["error"]
        # a bad request in a batch with good ones fails alone
        with ThreadPoolExecutor(4) as pool:
            res = list(pool.map(lambda b: call(url, "POST", "/v1/predict", b),
                                [{"rows": [rows[1]]}, {"rows": [dict(row, C1=-5)]}, {"rows": [dict(row, C1="x")]},
                                 {"rows": [dict(row, C1=None)]}]))
        assert [s for s, _ in res] == [200, 400, 400, 200]
        assert call(url, "GET", "/v1/nope")[1] == {"error": "Not Found", "field": "path"}
        assert call(url, "GET", "/v1/predict")[0] == 405
        status, got = call(url, "POST", "/v1/topk", {"rows": [row], "k": 5})
        assert status == 404 and "not two_tower" in got["error"]

        # 100 MB announced: 413 from the headers, nothing of the body needed
        head = (b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000000\r\n\r\n")
        t0 = time.monotonic()
        answer = raw_request(url, head, b'{"rows": [' + b" " * 1000)
        assert answer.startswith(b"HTTP/1.1 413") and b'"field": "body"' in answer, answer[:300]
        assert time.monotonic() - t0 < 5
        # chunked (no length): refused once past the cap, before the body ends
        head = b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b" " * (1 << 20)
        answer = raw_request(url, head, (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 9)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
        assert call(url, "GET", "/v1/health")[0] == 200          # still serving


def test_bearer_token(exports, rows, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789\n")
    os.chmod(token_file, 0o644)
    from embedding_ps.wire.auth import AuthConfigError
    with pytest.raises(AuthConfigError, match="chmod 600"):
        Server(ServeOptions(export=str(exports["new"]), token_file=str(token_file)))
    with pytest.raises(AuthConfigError, match="without --token-file"):
        Server(ServeOptions(export=str(exports["new"]), host="0.0.0.0"))
    os.chmod(token_file, 0o600)
    with running(exports["new"], token_file=str(token_file)) as (url, _):
        good = {"Authorization": "Bearer s3cret-token-0123456789"}
        for path, method, body in (("/v1/predict", "POST", {"rows": rows[:1]}), ("/v1/metadata", "GET", None),
                                   ("/metrics", "GET", None), ("/v1/reload", "POST", {"export": "x"})):
            status, got = call(url, method, path, body)
            assert status == 401 and got["field"] == "Authorization", path
            assert call(url, method, path, body, {"Authorization": "Bearer s3cret-token-012345678X"})[0] == 401
        assert call(url, "GET", "/v1/health")[0] == 200
        status, got = call(url, "POST", "/v1/predict", {"rows": rows[:1]}, good)
        assert status == 200 and len(got["probabilities"]) == 1
        assert call(url, "GET", "/v1/metadata", None, good)[0] == 200


# -- two-tower top-k ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_tower(tmp_path_factory, two_tower_trainer) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("serve-tt")
    torch.manual_seed(0)
    cfg, store, trainer, train, save = two_tower_trainer(tmp, rows=1024)
    train(range(3))
    run = save(tmp / "run")
    trainer.close()
    export_model(resolve_source(run=run), tmp / "export")
    return tmp / "export", tmp / "data" / "part-00001.parquet"


def test_topk_equals_exact_index(two_tower) -> None:
    export, data = two_tower
    table = pq.read_table(data).slice(0, 40)
    p = Predictor(export)
    index = ExactIndex(p.index.ids, p.index.vectors)
    user_rows = json.loads(json.dumps(table.to_pylist()))
    want_ids, want_scores = index.search(p.user_vectors(to_table(user_rows, Columns.of(tower_data(p.config, p.config.model.user_features)))), 10)
    with running(export) as (url, _):
        status, meta = call(url, "GET", "/v1/metadata")
        assert meta["topk"]["num_items"] == p.index.ids.size
        with ThreadPoolExecutor(4) as pool:        # batch-1 requests, some micro-batched, k of 3 and 10
            res = list(pool.map(lambda i: call(url, "POST", "/v1/topk", {"rows": [user_rows[i]], "k": 3 + 7 * (i % 2)}),
                                range(40)))
        status, bad = call(url, "POST", "/v1/topk", {"rows": user_rows[:1], "k": 0})
        assert status == 400 and bad["field"] == "k"
        status, whole = call(url, "POST", "/v1/topk", {"rows": user_rows, "k": 10})
    assert status == 200
    np.testing.assert_array_equal(np.array(whole["ids"]), want_ids)          # recall 1.0, same order
    np.testing.assert_allclose(np.array(whole["scores"]), want_scores, rtol=0, atol=1e-5)
    for i, (s, got) in enumerate(res):
        k = 3 + 7 * (i % 2)
        assert s == 200 and len(got["ids"][0]) == k
        assert set(got["ids"][0]) == set(want_ids[i, :k].tolist())           # recall 1.0 against ExactIndex


def test_a_bad_value_is_an_error_even_under_on_bad_rows_skip(exports, rows, monkeypatch) -> None:
    """Training may skip bad rows (data.on_bad_rows = "skip"); serving never drops one (it would shift
    the answers of a batch): the request gets a 400 naming the column, the others their own answers."""
    import dataclasses

    import recsys.serving.batcher as batcher

    class Skipping(Predictor):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.config = dataclasses.replace(self.config, data=dataclasses.replace(self.config.data,
                                                                                    on_bad_rows="skip"))

    monkeypatch.setattr(batcher, "Predictor", Skipping)
    served = Served(exports["new"])
    assert served.predictors[0].config.data.on_bad_rows == "skip"
    want = reference(exports["new"], rows[:4])
    with running(exports["new"], served=served, max_wait_ms=50.0) as (url, _):
        with ThreadPoolExecutor(4) as pool:
            res = list(pool.map(lambda i: call(url, "POST", "/v1/predict", {"rows": [dict(rows[i], C2=-1) if i == 1 else rows[i]]}),
                                range(4)))
    assert [s for s, _ in res] == [200, 400, 200, 200] and res[1][1]["field"] == "C2"
    np.testing.assert_allclose([res[i][1]["probabilities"][0] for i in (0, 2, 3)], want[[0, 2, 3]], rtol=0, atol=1e-6)
