"""A local HTTP server that answers with the bodies recorded from vLLM (tests/fixtures/served).

transformers' own ``transformers serve`` cannot stand in for a served peer: its /v1/completions
ignores ``n`` and ``logprobs`` (transformers 5.24). So the default tier replays what a real vLLM
server answered (``fixtures/served/record.py``), keyed by the prompt, and injects the faults a
real endpoint shows: 429 / 503 answers, no answer in time, a dead server.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).parent / "fixtures" / "served" / "vllm_gpt2.json"


def recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


class ReplayServer:
    """Serves ``/v1/models`` and ``/v1/completions`` from the recording on 127.0.0.1.

    ``mode``: ``replay`` (the recorded answer of the prompt), ``no_logprobs`` or ``wrong_n`` (the
    recorded answers without log-probs / with 2 completions), ``hang`` (answers after
    ``hang_s``). ``fail``: HTTP statuses to answer the next requests with, first to last (200: as recorded).
    """

    def __init__(self, mode: str = "replay", fail: list[int] | None = None, hang_s: float = 5.0) -> None:
        self.fixture = recorded()
        self.mode = mode
        self.fail = list(fail or [])
        self.hang_s = hang_s
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, server.fixture["models"])

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":  # vLLM's (FastAPI's) answer to an unknown path
                    self._send(404, {"detail": "Not Found"})
                    return
                with server.lock:
                    server.requests.append((dict(self.headers), payload))
                    status = server.fail.pop(0) if server.fail else 200
                if status != 200:
                    self._send(status, {"error": {"message": f"status {status}", "code": status}})
                    return
                if payload.get("model") != "gpt2":
                    unknown = server.fixture["unknown_model"]
                    self._send(unknown["status"], unknown["body"])
                    return
                if server.mode == "hang":
                    time.sleep(server.hang_s)
                if server.mode == "no_logprobs":
                    self._send(200, server.fixture["no_logprobs"])
                elif server.mode == "wrong_n":
                    self._send(200, server.fixture["two_completions"])
                else:
                    self._send(200, server.fixture["completions"][payload["prompt"]])

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # the client's concurrent connects, on a loaded machine too

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up (the step's timeout) closed its socket: not a failure

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def prompts(self) -> list[str]:
        return [payload["prompt"] for _, payload in self.requests]

    def __enter__(self) -> ReplayServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __exit__(self, *exc: Any) -> None:
        if self.thread.is_alive():
            self.stop()


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
