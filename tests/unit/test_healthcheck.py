"""``python -m fuseserve.healthcheck URL``: the containers' health check command."""

from __future__ import annotations

import http.server
import threading

from fuseserve.healthcheck import main


def test_exit_status_follows_the_http_status():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert main([f"http://127.0.0.1:{port}/ok"]) == 0
        assert main([f"http://127.0.0.1:{port}/busy"]) == 1
    finally:
        server.shutdown()
    assert main([f"http://127.0.0.1:{port}/ok"]) == 1  # nothing listening
    assert main([]) == 2
