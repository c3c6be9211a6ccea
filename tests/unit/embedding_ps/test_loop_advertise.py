"""The address a shard bound to a wildcard advertises (#28 item 4: a 0.0.0.0 bind advertised
`localhost` on a machine whose FQDN is localhost, which no other host can reach)."""

from __future__ import annotations

import socket

from embedding_ps.shard import loop


def test_a_specific_bind_is_advertised_as_bound() -> None:
    assert loop._advertised("tcp://10.0.0.5:7000", "10.0.0.5") == "tcp://10.0.0.5:7000"


def test_wildcard_bind_skips_loopback_names(monkeypatch) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "node-7")
    assert loop._advertised("tcp://0.0.0.0:7000", "0.0.0.0") == "tcp://node-7:7000"
    monkeypatch.setattr(socket, "getfqdn", lambda: "node-7.cluster.example")
    assert loop._advertised("tcp://0.0.0.0:7001", "*") == "tcp://node-7.cluster.example:7001"


def test_wildcard_bind_falls_back_to_an_address_then_loopback_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost.localdomain")
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("127.0.1.1", 0)),
                                                                (2, 1, 6, "", ("10.1.2.3", 0))])
    assert loop._advertised("tcp://0.0.0.0:7000", "0.0.0.0") == "tcp://10.1.2.3:7000"
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("127.0.0.1", 0))])
    with caplog.at_level("WARNING"):
        assert loop._advertised("tcp://0.0.0.0:7000", "0.0.0.0") == "tcp://127.0.0.1:7000"
    assert "clients on other hosts cannot reach" in caplog.text
