"""The client a node keeps for its tracker loads certificate authorities only where TLS
is used: an https tracker is verified; a plain-http one costs no CA bundle."""

from __future__ import annotations

import ssl

from meshnet.auth.node_http import NodeAuth
from meshnet.node.announce import tracker_client


def test_the_tracker_client_verifies_tls_and_loads_its_authorities_only_for_https() -> None:
    auth = NodeAuth("node-1", "k" * 64)
    for url, verified in (("https://tracker.example:8443", True), ("http://127.0.0.1:8000", False)):
        with tracker_client(url, auth) as client:
            transport = client._transport  # the pool's TLS context: what the client holds
            context = transport._pool._ssl_context  # type: ignore[attr-defined]
            assert (context.verify_mode == ssl.CERT_REQUIRED) is verified, url
            assert (context.cert_store_stats()["x509_ca"] > 0) is verified, url
            assert not client.follow_redirects  # an http tracker never sends it to https
