"""A real HTTP comparator for the tests: a tiny causal LM behind the generic JSON format (CoMLRL
1.4.3's) on 127.0.0.1, in a thread of the test process.

POST {"prompt", "agent_idx", "num_return_sequences", "max_new_tokens", "temperature", "top_p",
"top_k", "batch_item", ...} -> {"completions": [...]}. Sampling is seeded by the request's content,
so the same request always gets the same answer (runs against it are reproducible). Faults for the
tests: ``server.fail_next`` answers that many requests with HTTP 500, ``server.stall_next`` holds
that many requests for ``server.stall_seconds`` (longer than the client's timeout).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class ComparatorServer:
    def __init__(self, model_path, seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.seed, self.lock = seed, threading.Lock()
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_next = self.stall_next = 0
        self.stall_seconds = 3.0
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
                if stall:  # the client has given up by now: answer nothing more
                    time.sleep(server.stall_seconds)
                    return
                if fail:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": "injected failure"}')
                    return
                payload = json.dumps({"completions": server.generate(body)}).encode()
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

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
