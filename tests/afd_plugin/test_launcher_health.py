"""How `afd demo`, `afd launch` and the end-to-end tests poll a server's /health while it
starts (afd_plugin.deploy.servers): nothing listening, an answer, a port the poll must not take."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path
from unittest import mock

import pytest

from afd_plugin.deploy.servers import Server, ServerSpec, free_port


def _server(port: int, tmp_path: Path) -> Server:
    return Server(ServerSpec(name="s", model="m", port=port), tmp_path)


@pytest.mark.parametrize("code", [200, 503])
def test_health_status_is_what_the_server_answers(code, tmp_path):
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(code if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert _server(httpd.server_address[1], tmp_path).health_status() == code
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_nothing_listening_is_none_and_the_port_stays_free(tmp_path):
    port = free_port()
    assert _server(port, tmp_path).health_status() is None
    # a poll the kernel connected to itself (source port = the server's port) counts as
    # nothing listening, and leaves the port free for the server that is starting
    real = socket.create_connection

    def to_itself(address, timeout=None, source_address=None):
        return real(address, timeout=timeout, source_address=("127.0.0.1", port))

    with mock.patch("socket.create_connection", to_itself):
        assert _server(port, tmp_path).health_status() is None
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # no TIME_WAIT left behind by the poll
        s.listen(1)
