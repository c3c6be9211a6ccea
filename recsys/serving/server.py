"""`recsys serve`: an HTTP JSON API over an export, micro-batched (batcher.py), on aiohttp.

The command line, the endpoints and their bodies, the errors, the token and the non-loopback rule,
reload, and why aiohttp: docs/serving.md, "`recsys serve`: the HTTP API".
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import json
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from embedding_ps.wire.auth import AuthConfigError, is_loopback, read_secret
from recsys.config import ConfigError
from recsys.serving.batcher import MicroBatcher, Served
from recsys.serving.rows import RequestError, check_rows, json_type
from recsys.serving.serve_metrics import Metrics

logger = logging.getLogger(__name__)

MAX_K = 10_000
SWITCH_INTERVAL_S = 0.0005
OPEN_PATHS = frozenset({"/v1/health"})          # answered without the token (liveness probes)


@dataclasses.dataclass
class ServeOptions:
    export: str
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch: int = 256
    max_wait_ms: float = 0.0
    workers: int = 1
    token_file: str | None = None
    max_body_bytes: int = 8 << 20
    max_rows: int = 65536
    threads: int = 1                # torch intra-op threads (serve() sets them; batches are small)

    def check(self) -> None:
        if min(self.max_batch, self.workers, self.threads, self.max_body_bytes) < 1 or self.max_wait_ms < 0:
            raise ConfigError("--max-batch, --workers and --threads must be >= 1, --max-wait-ms >= 0, "
                              "--max-body-mb > 0")
        if self.token_file is None and not is_loopback(self.host):
            raise AuthConfigError(f"--host {self.host}: refusing to serve a non-loopback address without "
                                  f"--token-file (a bearer token), or bind 127.0.0.1")


def _error(status: int, message: str, field: str) -> web.Response:
    return web.json_response({"error": message, "field": field}, status=status)


def _reject_constant(name: str) -> None:
    raise RequestError(f"{name} is not a JSON number", "body")


class Server:
    """The aiohttp application over a MicroBatcher; `start` binds, `stop` closes (both in the event loop)."""

    def __init__(self, options: ServeOptions, served: Served | None = None) -> None:
        options.check()
        self.options = options
        self.token = None if options.token_file is None else read_secret(options.token_file, "--token-file")
        self._initial = served
        self.metrics = Metrics()
        self.batcher: MicroBatcher | None = None
        self._reload_lock: asyncio.Lock | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- life cycle --------------------------------------------------------------------------------

    async def start(self) -> str:
        o = self.options
        served = self._initial or await asyncio.to_thread(Served, o.export, (), o.workers)
        self._initial = None
        _freeze_heap()
        self.batcher = MicroBatcher(served, o.max_batch, o.max_wait_ms, self.metrics.batch)
        self.batcher.start()
        self._reload_lock = asyncio.Lock()
        app = web.Application(client_max_size=o.max_body_bytes, middlewares=[self._middleware])
        app.router.add_post("/v1/predict", self._predict)
        app.router.add_post("/v1/topk", self._topk)
        app.router.add_get("/v1/health", self._health)
        app.router.add_get("/v1/metadata", self._metadata)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/reload", self._reload)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, o.host, o.port, backlog=1024)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        logger.info("serving %s (step %d, %s) on %s", served.export, served.step, served.metadata["precision"],
                    self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.batcher is not None:
            await self.batcher.close()

    # -- middleware: token, JSON errors, metrics ---------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            if self.token is not None and request.path not in OPEN_PATHS and not self._authorized(request):
                response = _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                  "Authorization")
                response.headers["WWW-Authenticate"] = "Bearer"
            else:
                response = await handler(request)
        except RequestError as e:
            response = _error(e.status, str(e), e.field)
        except web.HTTPRequestEntityTooLarge:
            response = _error(413, f"the body is over {self.options.max_body_bytes} bytes (--max-body-mb)", "body")
            response.force_close()
        except web.HTTPException as e:            # 404, 405 from the router
            response = _error(e.status, e.reason, "path" if e.status == 404 else "method")
        except Exception as e:                    # noqa: BLE001 - a bug: a JSON 500, the server goes on
            logger.exception("%s %s failed", request.method, request.path)
            response = _error(500, f"{type(e).__name__}: {e}", "")
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        self.metrics.request(endpoint, response.status, time.perf_counter() - t0)
        return response

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, got = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(self.token, got.strip().encode())

    async def _body(self, request: web.Request) -> object:
        """The request's JSON, refused (413) by its Content-Length before reading, or once over the cap."""
        if request.content_length is not None and request.content_length > self.options.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(self.options.max_body_bytes, request.content_length)
        raw = await request.read()                 # aiohttp stops at client_max_size (chunked bodies)
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"the body is not JSON: {e}", "body") from None

    # -- endpoints ---------------------------------------------------------------------------------

    async def _predict(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rows = check_rows(body, self.batcher.served.columns, self.options.max_rows)
        probs, by = await self._submit("predict", rows)
        return web.json_response({"probabilities": probs.tolist(), "step": by.step, "generation": by.generation})

    async def _topk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        served = self.batcher.served
        if served.user_columns is None:
            raise RequestError(f"the served export ({served.metadata['arch']}) is not two_tower: no item "
                               f"vectors to search", "path", 404)
        k = body.get("k", 10) if isinstance(body, dict) else 10
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise RequestError(f"\"k\" must be an integer in 1..{MAX_K}, got {json_type(k)} {k!r}", "k")
        rows = check_rows(body, served.user_columns, self.options.max_rows)
        (ids, scores), by = await self._submit("topk", rows, k)
        return web.json_response({"ids": ids.tolist(), "scores": scores.tolist(), "step": by.step,
                                  "generation": by.generation})

    async def _submit(self, kind: str, rows: list[dict], k: int = 0) -> tuple:
        try:
            return await self.batcher.submit(kind, rows, k)
        except RequestError:
            raise
        except Exception as e:                    # noqa: BLE001 - logged in the batch thread
            raise RequestError(f"{type(e).__name__}: {e}", "", 500) from None

    async def _health(self, request: web.Request) -> web.Response:
        s = self.batcher.served
        return web.json_response({"status": "ok", "step": s.step, "generation": s.generation})

    async def _metadata(self, request: web.Request) -> web.Response:
        o = self.options
        return web.json_response(dict(self.batcher.served.metadata, step=self.batcher.served.step, batching={
            "max_batch": o.max_batch, "max_wait_ms": o.max_wait_ms, "workers": o.workers,
            "max_rows": o.max_rows, "max_body_bytes": o.max_body_bytes}))

    async def _metrics(self, request: web.Request) -> web.Response:
        s = self.batcher.served
        text = self.metrics.render(generation=s.generation, step=s.step, queued=self.batcher.queued)
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def _reload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict) or len({"export", "delta"} & body.keys()) != 1:
            raise RequestError("the body must be {\"export\": DIR} (a full export) or {\"delta\": DIR}", "export")
        field = "export" if "export" in body else "delta"
        path = body[field]
        if not isinstance(path, str) or not path:
            raise RequestError(f"\"{field}\" must be a path or URI string, got {json_type(path)}", field)
        async with self._reload_lock:
            old = self.batcher.served
            export, deltas = (path, []) if field == "export" else (old.export, old.deltas + [path])
            try:
                new = await asyncio.to_thread(Served, export, deltas, self.options.workers, old.generation + 1)
            except (ValueError, OSError) as e:     # ExportError, a missing path, a delta of another base
                raise RequestError(f"reload failed, still serving generation {old.generation}: {e}", field) from None
            self.batcher.served = new
            _freeze_heap()
        logger.info("reloaded: %s%s at step %d (generation %d)", export, f" + {deltas}" if deltas else "",
                    new.step, new.generation)
        return web.json_response(dict(new.metadata, step=new.step))


def _freeze_heap() -> None:
    """Collect, then move every object alive now (the model, torch, the libraries) out of the cyclic
    collector's sight (`gc.freeze`; why: docs/serving.md, on `gc.freeze`). The previous freeze is undone
    first, so a reloaded-away model can be freed."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def serve(options: ServeOptions, stop: threading.Event, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until `stop` is set (the CLI's SIGTERM / SIGINT)."""
    import torch

    torch.set_num_threads(options.threads)
    # the batch thread's Python (rows -> Arrow -> decode) holds the GIL up to the switch interval (5 ms by
    # default) while the event loop waits to answer: a shorter one cut p99 at 8 clients
    # (benchmarks/history/2026-11-28.md)
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def main() -> None:
        server = Server(options)
        try:
            url = await server.start()
            if on_ready is not None:
                on_ready(url)
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        finally:
            await server.stop()

    try:                     # the serve extra's event loop: more requests/s (BENCHMARKS.md, "benchmarks/serve.py")
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


__all__ = ["ServeOptions", "Server", "serve"]
