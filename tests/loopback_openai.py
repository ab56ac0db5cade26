"""An OpenAI-compatible completions server on 127.0.0.1 for the serving benchmark's tests, which
streams a known answer and injects faults by the order requests arrive in.

Each answer streams ``max_tokens`` events of one token, the first after ``first_delay`` seconds and
each next after ``token_delay``, then ``usage`` and ``data: [DONE]``. The n-th request (from 0) is
answered with HTTP 500 when n is in ``errors``, and its connection is closed after ``drop_after``
tokens, with no ``[DONE]``, when n is in ``drops``. It records each request's body.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackServer:
    def __init__(self, first_delay: float = 0.05, token_delay: float = 0.01, errors: frozenset = frozenset(),
                 drops: frozenset = frozenset(), drop_after: int = 2, model: str = "loopback"):
        self.first_delay, self.token_delay = first_delay, token_delay
        self.errors, self.drops, self.drop_after, self.model = errors, drops, drop_after, model
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": server.model, "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    number = len(server.bodies)
                    server.bodies.append(request)
                if number in server.errors:
                    body = b'{"error": {"message": "injected"}}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                time.sleep(server.first_delay)
                tokens = request["max_tokens"]
                for index in range(tokens):
                    if index:
                        time.sleep(server.token_delay)
                    if number in server.drops and index == server.drop_after:
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    event = {"choices": [{"index": 0, "text": f" t{index}"}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                prompt = request["prompt"]
                usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
                         "completion_tokens": tokens}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
