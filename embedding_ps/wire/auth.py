"""Authentication of PS traffic: a shared token, ZeroMQ CURVE, or none (loopback only, by choice).

Both kinds authenticate a peer during ZeroMQ's handshake, through ZAP (`zmq.auth`): a peer without
the secret never delivers a byte of a request. The files, the checks and what "auto" means:
docs/wire.md, "Authentication".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import shutil
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from embedding_ps.wire.config import PSConfig

logger = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16


class AuthConfigError(ValueError):
    """Auth is missing or misconfigured for the requested bind; the message says what to set."""


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a host name, "*" or an interface name: reachable from outside


def check_bind_auth(config: PSConfig, host: str, shard_index: int) -> None:
    """Refuse a non-loopback bind without auth and check the auth material exists: AuthConfigError
    before anything is bound."""
    if config.auth in ("none", "auto"):
        if not is_loopback(host):
            raise AuthConfigError(
                f"ps shard {shard_index}: refusing to bind {host!r} without authentication; set "
                f"ps.auth = 'token' (with ps.token_file) or 'curve' (with ps.curve_keys_dir), or bind "
                f"127.0.0.1")
        return
    if config.auth == "token":
        load_token(config)
    else:
        _curve_file(config, "server.key_secret")


def load_token(config: PSConfig) -> bytes:
    """The shared token of ps.token_file (stripped). Raises AuthConfigError if unusable."""
    return read_secret(config.token_file, "ps.token_file")


def read_secret(path: str | os.PathLike, what: str) -> bytes:
    """A secret file's bytes (surrounding whitespace stripped): >= MIN_TOKEN_BYTES, mode 600 (not
    readable or writable by group or others). AuthConfigError naming `what` (the key or flag) otherwise."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_bytes().strip()
    except OSError as e:
        raise AuthConfigError(f"{what} {str(path)!r} cannot be read: {e}") from None
    if mode & 0o077:
        raise AuthConfigError(f"{what} {str(path)!r} is readable or writable by group or others "
                              f"(mode {mode & 0o777:o}); a shared secret must not be: run chmod 600 {path}")
    if len(token) < MIN_TOKEN_BYTES:
        raise AuthConfigError(f"{what} {str(path)!r} holds {len(token)} bytes; a token needs "
                              f">= {MIN_TOKEN_BYTES}")
    return token


PLAIN_USER = b"recsys-ps"
"""The PLAIN user name of every client (the token is the password)."""
NO_JOB = "0" * 8
"""The job tag without auth (`job_tag`)."""


def job_tag(config: PSConfig, token: bytes | None = None) -> str:
    """8 hex digits naming this job's shared-memory segments (`embedding_ps.wire.shm`): a hash of
    the job's token (`token`, already loaded by the caller: `load_token`), or of the shards' CURVE
    public key, "00000000" without auth. A shard opens only segments carrying its own job's tag."""
    if config.auth == "token":
        secret = token if token is not None else load_token(config)
    elif config.auth == "curve":
        secret = _curve_file(config, "server.key").read_bytes()
    else:
        return NO_JOB
    return hashlib.sha256(b"recsys-ps-segments\0" + secret).hexdigest()[:8]


class _TokenAuthenticator(ThreadAuthenticator):
    """ZAP handler accepting PLAIN peers that give the job's token; constant-time, never logs it
    (pyzmq's own PLAIN check compares with == and logs the password at debug level)."""

    def __init__(self, ctx: zmq.Context, token: bytes) -> None:
        super().__init__(ctx)
        # pyzmq hands the credentials over decoded (undecodable bytes replaced): compare the same form
        self._token = token.decode(self.encoding, "replace").encode(self.encoding)
        self._refused, self._said = 0, 0.0

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        given = password.encode(self.encoding) if isinstance(password, str) else bytes(password)
        if username in (PLAIN_USER, PLAIN_USER.decode()) and hmac.compare_digest(self._token, given):
            return True, b"OK"
        self._refused += 1                      # a refused peer reconnects every 100 ms: say it every 10 s
        if time.monotonic() - self._said >= 10.0:
            logger.warning("refused a client with a wrong or missing ps token (%d refusals so far)", self._refused)
            self._said = time.monotonic()
        return False, b"wrong token"


def setup_server_plain(ctx: zmq.Context, sock: zmq.Socket, token: bytes) -> ThreadAuthenticator:
    """Make `sock` a PLAIN server that accepts only peers giving `token`. Call before bind; returns
    the running authenticator (stop it when the socket closes)."""
    authenticator = _TokenAuthenticator(ctx, token)
    authenticator.start()
    sock.plain_server = True
    sock.zap_domain = b"recsys-ps"
    return authenticator


def setup_client_plain(sock: zmq.Socket, token: bytes) -> None:
    """Give a client socket the job's token as its PLAIN password. Call before connect."""
    sock.plain_username = PLAIN_USER
    sock.plain_password = token


def _curve_file(config: PSConfig, name: str) -> Path:
    path = Path(config.curve_keys_dir) / name
    if not path.is_file():
        raise AuthConfigError(f"ps.auth = 'curve': {str(path)!r} is missing (ps.curve_keys_dir = "
                              f"{config.curve_keys_dir!r}); make keys with embedding_ps.wire.auth.create_curve_keys")
    return path


class _AllowedKeys:
    """ZAP credentials provider: accepts exactly the given z85 public keys."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            logger.warning("refused a CURVE client with an unknown public key")
        return ok


def setup_server_curve(ctx: zmq.Context, sock: zmq.Socket, config: PSConfig) -> ThreadAuthenticator:
    """Make `sock` a CURVE server that accepts only authorized client keys; as `setup_server_plain`:
    call before bind, stop the returned authenticator when the socket closes."""
    public, secret = zmq.auth.load_certificate(str(_curve_file(config, "server.key_secret")))
    allowed_dir = Path(config.curve_keys_dir) / "authorized_clients"
    allowed = (set(zmq.auth.load_certificates(str(allowed_dir))) if allowed_dir.is_dir()
               else {zmq.auth.load_certificate(str(_curve_file(config, "client.key")))[0]})
    if not allowed:
        raise AuthConfigError(f"ps.auth = 'curve': no public keys (*.key) in {str(allowed_dir)!r}")
    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(allowed))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return authenticator


def setup_client_curve(sock: zmq.Socket, config: PSConfig) -> None:
    """Give a client socket its key pair and the shard's public key. Call before connect."""
    public, secret = zmq.auth.load_certificate(str(_curve_file(config, "client.key_secret")))
    server_public, _ = zmq.auth.load_certificate(str(_curve_file(config, "server.key")))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def create_curve_keys(directory: str | os.PathLike) -> Path:
    """Write server.key(_secret), client.key(_secret) and authorized_clients/client.key."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for who in ("server", "client"):
        zmq.auth.create_certificates(str(out), who)
        os.chmod(out / f"{who}.key_secret", 0o600)
    (out / "authorized_clients").mkdir(exist_ok=True)
    shutil.copy(out / "client.key", out / "authorized_clients" / "client.key")
    return out


__all__ = ["AuthConfigError", "NO_JOB", "PLAIN_USER", "is_loopback", "check_bind_auth", "load_token",
           "read_secret", "job_tag", "setup_server_plain", "setup_client_plain", "setup_server_curve",
           "setup_client_curve", "create_curve_keys"]
