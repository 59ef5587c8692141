"""A JSON HTTP server on a real loopback socket, for tests of code that talks to one (vLLM's dev
endpoints, its completions): ``reply(path, body, headers) -> dict`` answers each POST with 200 and
that JSON. The code under test is the client; the stand-in only answers."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Reply = Callable[[str, Any, Any], dict]


class JsonStandIn:
    def __init__(self, reply: Reply):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                data = json.dumps(reply(self.path, body, self.headers)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
