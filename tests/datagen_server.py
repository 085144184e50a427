"""Servers for the datagen tests: a real `transformers serve` of a tiny Qwen3, and a scripted one.

`TransformersServe` runs the real OpenAI-compatible server on loopback (start, kill, restart).
`ScriptedServer` is a small real HTTP server (stdlib, one thread per request) whose answer is
chosen by the last user message: it produces the garbage, errors and delays a real server
produces only under failure, and records what it was asked and how many requests overlapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

SCRIPTED_MODEL = "scripted-model"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build_tiny_chat_model(directory: Path, tokenizer_dir: Path) -> Path:
    """A random tiny Qwen3 (vocab 2048, hidden 64, 2 layers) saved with the tiny tokenizer in one dir.

    The weights are initialised wider than usual (std 0.2) so that greedy answers depend on the
    prompt, and the output rows of special and whitespace-only tokens are zeroed so that answers
    are visible text (a server strips both, which would leave an empty answer).
    """
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    silent = [token for token in range(config.vocab_size) if not tokenizer.decode([token]).strip()]
    silent += tokenizer.all_special_ids
    with torch.no_grad():
        model.lm_head.weight[silent] = 0.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class TransformersServe:
    """`transformers serve MODEL_DIR` on a loopback port, as a subprocess we can kill and restart."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 180.0) -> None:
        executable = Path(sys.executable).parent / "transformers"
        command = [str(executable), "serve", str(self.model_dir), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--device", "cpu"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"transformers serve not up after {timeout_s} s: {self.log_path.read_text()[-2000:]}"
        )

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as a crashed inference server does."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def model_id(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"]

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        """One greedy completion, asked directly (what datagen should have received)."""
        body = {"model": self.model_id(), "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
        return response.json()["choices"][0]["message"]["content"]


class ScriptedServer:
    """An OpenAI-compatible HTTP server whose answers are scripted by the last user message.

    Last user message (prefix) -> answer:
        "nonjson"        200 with an HTML body
        "nochoices"      200 with a JSON object without `choices`
        "empty"          200 with an empty message
        "errorbody"      200 with an `error` object (as some servers report OOM)
        "warned"         200 with `choices` and an `error` object beside them (an answer all the same)
        "http500"        500, always
        "templated500"   500 whose body echoes a chat template's `[INST] ... [/INST]` (rich markup syntax)
        "bad400"         400 with a detail
        "busy"           429, always
        "hangup"         the connection closed without an answer (a server dying mid-request)
        "badgzip"        200 whose body claims gzip but is not
        "flaky"          503 for the first two requests of that text, then a normal answer
        "think"          `<think>why</think>answer` in the content
        "reasoningfield" reasoning in `reasoning_content`, the answer in `content`
        "truncated"      `echo(messages)` with finish_reason "length" (cut at max_tokens)
        "nofinish"       `echo(messages)` with no finish_reason
        anything else    `echo(messages)`: "echo <hash of the whole conversation>", after `delay_s`
    While `broken` is set every chat request gets a 500. GET /v1/models answers `models_status` with
    `{"data": models}` (`models` is any JSON value: a list of `{"id": ...}` entries by default).
    """

    def __init__(self, delay_s: float = 0.0, port: int | None = None) -> None:
        self.delay_s = delay_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.broken = False
        self.models: Any = [{"id": SCRIPTED_MODEL}]
        self.models_status = 200
        self.requests: list[list[dict[str, Any]]] = []
        self.bodies: list[dict[str, Any]] = []  # every chat request's whole body, in arrival order
        self.active = 0
        self.peak_active = 0
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> ScriptedServer:
        handler = _handler_for(self)
        self._server = _Listener(("127.0.0.1", self.port), handler)
        # polled every 0.05 s: `stop` waits for the next poll (0.5 s by default, in every test's teardown)
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def answer(self, messages: list[dict[str, Any]]) -> tuple[int, bytes]:
        """(status, body) for a chat request; also the bookkeeping of what was asked."""
        with self._lock:
            self.requests.append(messages)
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
        try:
            return self._scripted(messages)
        finally:
            with self._lock:
                self.active -= 1

    def _scripted(self, messages: list[dict[str, Any]]) -> tuple[int, bytes]:
        if self.broken:
            return 500, b'{"detail": "broken on purpose"}'
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        if last_user.startswith("nonjson"):
            return 200, b"<html>502 Bad Gateway</html>"
        if last_user.startswith("nochoices"):
            return 200, json.dumps({"id": "x", "object": "chat.completion"}).encode()
        if last_user.startswith("empty"):
            return 200, _completion("")
        if last_user.startswith("errorbody"):
            return 200, json.dumps({"error": {"message": "CUDA out of memory"}}).encode()
        if last_user.startswith("warned"):
            answer = json.loads(_completion(echo(messages)))
            return 200, json.dumps({**answer, "error": {"message": "a warning"}}).encode()
        if last_user.startswith("templated500"):
            return 500, b"<s>[INST] templated500 [/INST] failed: [bold]out of memory[/bold]"
        if last_user.startswith("http500"):
            return 500, b"Internal Server Error"
        if last_user.startswith("bad400"):
            return 400, json.dumps({"detail": "prompt is too long"}).encode()
        if last_user.startswith("busy"):
            return 429, b"too many requests"
        if last_user.startswith("hangup"):
            return 0, b""
        if last_user.startswith("badgzip"):
            return -200, b"not gzip at all"
        if last_user.startswith("flaky"):
            with self._lock:
                self._seen[last_user] = self._seen.get(last_user, 0) + 1
                if self._seen[last_user] <= 2:
                    return 503, b"warming up"
        if last_user.startswith("think"):
            return 200, _completion("<think>why</think>answer")
        if last_user.startswith("reasoningfield"):
            return 200, _completion("answer", reasoning="why")
        finish = {"truncated": "length", "nofinish": None}.get(last_user.split(" ", 1)[0], "stop")
        time.sleep(self.delay_s)
        return 200, _completion(echo(messages), finish=finish)

    @property
    def answered(self) -> int:
        """Chat requests whose answer is made (sent, or about to be)."""
        with self._lock:
            return len(self.requests) - self.active


class _Listener(ThreadingHTTPServer):
    """One thread per request; a backlog for a hundred clients connecting at once (5 by default)."""

    daemon_threads = True
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up first (a timeout, a stopped run) is no error of the server's. Its
        traceback, formatted in this thread, could also race the main thread's `ast.parse` (CPython 3.11
        formats a traceback's carets with `ast.parse`, whose recursion state is shared: "SystemError:
        AST constructor recursion depth mismatch")."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def echo(messages: list[dict[str, Any]]) -> str:
    """The scripted answer to an ordinary conversation."""
    return f"echo {hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12]}"


def _completion(content: str, reasoning: str | None = None, finish: str | None = "stop") -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": SCRIPTED_MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    return json.dumps(body).encode()


def _handler_for(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(
                    server.models_status, json.dumps({"object": "list", "data": server.models}).encode()
                )
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions":
                self._send(404, b"{}")
                return
            with server._lock:
                server.bodies.append(body)
            self._send(*server.answer(body["messages"]))

        def _send(self, status: int, body: bytes) -> None:
            """Status 0 closes the connection without an answer; a negative status is its positive
            one with a body that claims to be gzip."""
            if status == 0:
                self.close_connection = True
                return
            self.send_response(abs(status))
            self.send_header("Content-Type", "application/json")
            if status < 0:
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep test output clean

    return Handler
