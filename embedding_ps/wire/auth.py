"""Authentication of PS traffic: none (loopback only), a shared token, or ZeroMQ CURVE.

A shard bound to a loopback address may run without auth. Bound to anything else (an interface
address, a host name, `0.0.0.0`, `*`) it refuses to start unless `ps.auth` is "token" or "curve".

- token: the file `ps.token_file` holds the secret (surrounding whitespace stripped, >= 16 bytes).
  The client sends it in the auth frame of every request; the shard compares it with
  `hmac.compare_digest` and answers a mismatch with an UNAUTHORIZED error reply.
- curve: `ps.curve_keys_dir` holds certificates made by `zmq.auth.create_certificates`
  (see `create_curve_keys`)::

      server.key, server.key_secret      the shard's key pair (clients need server.key)
      client.key, client.key_secret      the trainers' key pair
      authorized_clients/*.key           public keys a shard accepts (if the folder is missing:
                                         client.key alone)

  A client without the right keys never completes the handshake, so its requests time out
  (ShardUnavailableError naming the shard).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import shutil
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
    """Refuse a non-loopback bind without auth and check the auth material exists.

    Raises AuthConfigError before anything is bound.
    """
    if config.auth == "none":
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
    path = Path(config.token_file)
    try:
        mode = path.stat().st_mode
        token = path.read_bytes().strip()
    except OSError as e:
        raise AuthConfigError(f"ps.token_file {str(path)!r} cannot be read: {e}") from None
    if mode & 0o077:
        raise AuthConfigError(f"ps.token_file {str(path)!r} is readable or writable by group or others "
                              f"(mode {mode & 0o777:o}); a shared secret must not be: run chmod 600 {path}")
    if len(token) < MIN_TOKEN_BYTES:
        raise AuthConfigError(f"ps.token_file {str(path)!r} holds {len(token)} bytes; a token needs "
                              f">= {MIN_TOKEN_BYTES}")
    return token


def token_matches(expected: bytes, got: bytes | memoryview) -> bool:
    """Constant-time comparison of the configured token with a request's auth frame."""
    return hmac.compare_digest(expected, bytes(got))


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
    """Make `sock` a CURVE server that accepts only authorized client keys. Call before bind.

    Returns the running authenticator; stop it when the socket closes.
    """
    public, secret = zmq.auth.load_certificate(str(_curve_file(config, "server.key_secret")))
    allowed_dir = Path(config.curve_keys_dir) / "authorized_clients"
    if allowed_dir.is_dir():
        allowed = set(zmq.auth.load_certificates(str(allowed_dir)))
    else:
        allowed = {zmq.auth.load_certificate(str(_curve_file(config, "client.key")))[0]}
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
    zmq.auth.create_certificates(str(out), "server")
    zmq.auth.create_certificates(str(out), "client")
    (out / "authorized_clients").mkdir(exist_ok=True)
    shutil.copy(out / "client.key", out / "authorized_clients" / "client.key")
    for name in ("server.key_secret", "client.key_secret"):
        os.chmod(out / name, 0o600)
    return out


__all__ = ["AuthConfigError", "is_loopback", "check_bind_auth", "load_token", "token_matches",
           "setup_server_curve", "setup_client_curve", "create_curve_keys"]
