"""A real HTTP comparator for the tests: a tiny causal LM behind the generic JSON format (CoMLRL
1.4.3's) on 127.0.0.1, in a thread of the test process.

POST {"prompt", "agent_idx", "num_return_sequences", "max_new_tokens", "temperature", "top_p",
"top_k", "batch_item", ...} -> {"completions": [...]}. Sampling is seeded by the request's content,
so the same request always gets the same answer (runs against it are reproducible). Faults for the
tests: ``server.fail_next`` answers that many requests with HTTP 500, ``server.stall_next`` holds
that many requests for ``server.stall_seconds`` (longer than the client's timeout), and
``server.faults`` is a queue of named faults, one per request (see ``FAULTS``):

    redirect    307 to ``server.redirect_to`` (e.g. a :class:`CaptureServer` on another port)
    drip        the whole answer, status line included, one byte every ``server.drip_seconds``
    truncated   a Content-Length larger than the body sent, then the connection closes
    bad_status  a status line that is not HTTP
    not_json    200 with bytes that are neither UTF-8 nor JSON
    huge        200 with a body of ``server.huge_bytes`` bytes
    echo        401 whose body echoes every request header (a key among them)
    long        200 with completions far longer than max_new_tokens
    busy        429 with ``Retry-After: server.retry_after``
    surrogates  200 with completions that JSON spells with lone surrogates (``"\\ud800"``)
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class _Served:
    """A server on a thread of the test process (``self.httpd``, ``self.thread``), as a context."""

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class ComparatorServer(_Served):
    def __init__(self, model_path, seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.seed, self.lock = seed, threading.Lock()
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_next = self.stall_next = 0
        self.stall_seconds = 3.0
        self.faults: list[str] = []
        self.retry_after = "1"
        self.redirect_to, self.drip_seconds, self.huge_bytes = "", 0.2, 1 << 20
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    fail, stall = server.fail_next > 0, server.stall_next > 0
                    server.fail_next -= fail
                    server.stall_next -= stall
                    fault = server.faults.pop(0) if server.faults else None
                if fault is not None:
                    return FAULTS[fault](self, server, body)
                if stall:  # the client has given up by now: answer nothing more
                    time.sleep(server.stall_seconds)
                    return
                if fail:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": "injected failure"}')
                    return
                payload = server.answer(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        class Server(ThreadingHTTPServer):
            daemon_threads, block_on_close = False, True  # server_close() waits for every request

            def handle_error(self, request, client_address):  # a client that timed out: expected here
                pass

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/generate"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answer(self, body: dict) -> bytes:
        return json.dumps({"completions": self.generate(body)}).encode()

    def generate(self, body: dict) -> list[str]:
        digest = hashlib.sha256(json.dumps([self.seed, body["prompt"], body["agent_idx"]]).encode()).digest()
        generator_seed = int.from_bytes(digest[:8], "little") % (2 ** 62)
        ids = self.tokenizer(body["prompt"], return_tensors="pt")["input_ids"]
        with self.lock, torch.no_grad():
            torch.manual_seed(generator_seed)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      max_new_tokens=body["max_new_tokens"], temperature=body["temperature"] or 1.0,
                                      top_p=body["top_p"] or 1.0, top_k=body["top_k"] or 0,
                                      num_return_sequences=body["num_return_sequences"],
                                      pad_token_id=self.tokenizer.eos_token_id)
        return self.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


def _send(handler, status: int, body: bytes, headers: dict = None, length: int = None) -> None:
    handler.send_response(status)
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body) if length is None else length))
    handler.end_headers()
    handler.wfile.write(body)


def _drip(handler, server, body):
    payload = server.answer(body)
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    handler.close_connection = True
    try:
        for byte in raw:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(server.drip_seconds)
    except OSError:  # the client gave up: what the test wants
        pass


def _truncated(handler, server, body):
    handler.close_connection = True
    _send(handler, 200, b'{"completions": ["cut', length=4096)


def _bad_status(handler, server, body):
    handler.close_connection = True
    handler.wfile.write(b"SPEAKING-NOT-HTTP 2 hello\r\n\r\n")


def _echo(handler, server, body):
    echoed = json.dumps({"error": "unauthorized", "you_sent": dict(handler.headers)}).encode()
    _send(handler, 401, echoed, {"Content-Type": "application/json"})


def _long(handler, server, body):
    words = " ".join(f"w{i}" for i in range(400))
    _send(handler, 200, json.dumps({"completions": [words] * body["num_return_sequences"]}).encode())


FAULTS = {
    "redirect": lambda h, s, b: _send(h, 307, b"", {"Location": s.redirect_to}),
    "drip": _drip,
    "truncated": _truncated,
    "bad_status": _bad_status,
    "not_json": lambda h, s, b: _send(h, 200, b"\xff\xfe not json"),
    "huge": lambda h, s, b: _send(h, 200, b"[" + b"1," * (s.huge_bytes // 2) + b"1]"),
    "echo": _echo,
    "long": _long,
    "busy": lambda h, s, b: _send(h, 429, b'{"error": "slow down"}', {"Retry-After": str(s.retry_after)}),
    "surrogates": lambda h, s, b: _send(h, 200, b'{"completions": ' + b'["half \\ud800 pair", "\\udfff alone"]' * 1
                                        + b'}'),
}


class CaptureServer(_Served):
    """Another origin (another port) that records the headers of every request it gets."""

    def __init__(self):
        self.headers: list[dict] = []
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                capture.headers.append(dict(self.headers))
                _send(self, 200, json.dumps({"completions": ["captured"]}).encode())

            do_GET = do_POST

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/collect"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
