"""A real local HTTP server shaped like the OpenAI chat-completions API, serving scripted replies.

    python tests/fake_openai_server.py --port 0 --script script.json [--log requests.jsonl]

Prints `PORT <n>` on its first stdout line once listening. The script is JSON:

    {"model": "fake-model",
     "rules": [{"match": "substring of the request's messages", "responses": [R, R, ...]}],
     "default": [R, ...]}

Each request is matched to the first rule whose `match` occurs in its messages' text; that rule's
responses are served in order, one per request it matches (the last one repeats). A response R:

    {"status": 500}                       -> HTTP 500 with an error body
    {"status": 429, "retry_after": 1}     -> HTTP 429 with a Retry-After header
    {"hang": 5}                           -> sleep 5 s before answering (a client timeout)
    {"drop": true}                        -> close the connection without an answer
    {"truncate": true}                    -> HTTP 200 headers, then half the body, then close (mid-response)
    {"exit": true}                        -> the server process dies at once (a crash), no answer
    {"echo_memory": true}                 -> a completion with one memory citing the transcript's
                                             first user turn: deterministic, content-dependent output
    {"garbage": "not json at all"}        -> HTTP 200 whose body is not JSON
    {"content": "raw assistant text"}     -> a normal completion carrying this text
    {"json": {...}}                       -> a normal completion carrying json.dumps(value)
    optional on normal ones: "cached_tokens": n, "finish_reason": "length",
      "token_delay": s     seconds per token (a slow engine): streamed, one chunk every s seconds;
                           not streamed, the whole answer after tokens x s
      "stall_after": k, "stall": s   streamed: after k tokens, s seconds without a byte (a wedged engine)
      "queue": s           streamed: the headers at once, then s seconds before the first event (as vLLM:
                           a request waiting in a full engine's queue gets its first event with its first token)

Streaming (`"stream": true` in the request, as vLLM): server-sent events in chunked transfer
encoding, one `chat.completion.chunk` per token (a token = ~4 characters of the content), the
finish chunk, a usage chunk when `stream_options.include_usage` is set, then `data: [DONE]`.
`truncate` cuts a stream after half its tokens. Like vLLM, a generation whose client disconnects
is aborted at once (the socket is watched while waiting between tokens).

Every request received is appended to --log as a JSON line (path, body, response, key: the prompt key the --gen-log uses), for assertions;
several server processes may share one log (a server that dies and comes back). With --gen-log,
every generation also appends {"key", "event": "start", "live_before"} when it starts (live_before:
generations of the same prompt already running) and {"key", "event": "end", "how": "finished" |
"client_disconnected" | "truncated"} when it ends: what a test needs to prove a retry never ran
next to the generation it replaced.
GET /v1/models lists the model; GET /health answers 200.
"""

import argparse
import hashlib
import json
import os
import re
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, script: dict, log_path: str | None, gen_log_path: str | None = None) -> None:
        self.model = script.get("model", "fake-model")
        self.rules = script.get("rules", [])
        self.default = script.get("default") or [{"json": {"memories": []}}]
        self.counters: dict[int, int] = {}
        self.lock = threading.Lock()
        self.log_path = log_path
        self.gen_log_path = gen_log_path
        self.live: dict[str, int] = {}  # prompt key -> generations of it running now

    def generation_started(self, key: str) -> None:
        with self.lock:
            n = self.live.get(key, 0)
            self.live[key] = n + 1
        self._gen_log({"key": key, "event": "start", "live_before": n, "t": time.time()})

    def generation_ended(self, key: str, how: str, echo: bool = False) -> None:
        """`how` is "finished" only once the whole answer is written to the socket: what a client can count as
        received (`echo`: the answer was the scripted valid memory echo)."""
        with self.lock:
            self.live[key] -= 1
        self._gen_log({"key": key, "event": "end", "how": how, "echo": echo, "t": time.time()})

    def _gen_log(self, entry: dict) -> None:
        if self.gen_log_path:
            with self.lock, open(self.gen_log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

    def pick(self, text: str) -> dict:
        with self.lock:
            for i, rule in enumerate(self.rules):
                if rule["match"] in text:
                    n = self.counters.get(i, 0)
                    self.counters[i] = n + 1
                    seq = rule["responses"]
                    return seq[min(n, len(seq) - 1)]
            n = self.counters.get(-1, 0)
            self.counters[-1] = n + 1
            return self.default[min(n, len(self.default) - 1)]

    def log(self, entry: dict) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep stderr quiet
            pass

        def _hang_up(self) -> None:
            """Close the socket mid-exchange, as a crashed server or a cut connection would."""
            self.close_connection = True
            try:
                self.connection.shutdown(2)
            except OSError:
                pass

        def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/health", "/v1/health"):
                self._send(200, b"{}")
            elif self.path.rstrip("/") == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": state.model, "object": "model"}]}).encode())
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                self._send(400, b'{"error": {"message": "bad json"}}')
                return
            text = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
            resp = state.pick(text)
            key = hashlib.sha256(text.encode()).hexdigest()[:16]  # the generation log's key for this prompt
            state.log({"path": self.path, "body": body, "response": resp, "key": key, "t": time.time()})
            if resp.get("exit"):
                # let answers already being written reach their clients, so the server-side log of
                # answered requests is exactly what clients received; then die without answering
                time.sleep(0.2)
                os._exit(3)
            if "hang" in resp:
                time.sleep(float(resp["hang"]))
            if resp.get("drop"):
                self._hang_up()
                return
            if "status" in resp and resp["status"] != 200:
                headers = {}
                if "retry_after" in resp:
                    headers["Retry-After"] = str(resp["retry_after"])
                msg = {"error": {"message": f"scripted {resp['status']}", "type": "server_error"}}
                self._send(int(resp["status"]), json.dumps(msg).encode(), headers)
                return
            if resp.get("truncate") and not body.get("stream"):
                body_bytes = json.dumps(_completion(body, state.model, '{"memories": []}', resp)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body_bytes)))
                self.end_headers()
                self.wfile.write(body_bytes[: len(body_bytes) // 2])
                self.wfile.flush()
                self._hang_up()
                return
            if "garbage" in resp:
                self._send(200, str(resp["garbage"]).encode())
                return
            if resp.get("echo_memory"):
                content = json.dumps(_echo_memory(text))
            else:
                content = resp["content"] if "content" in resp else json.dumps(resp.get("json", {}))
            state.generation_started(key)
            how = "client_disconnected"
            try:
                if body.get("stream"):
                    how = self._stream(body, content, resp)
                else:
                    delay = float(resp.get("token_delay", 0)) * len(_tokens(content))
                    if delay and self._wait_or_gone(delay):
                        return
                    self._send(200, json.dumps(_completion(body, state.model, content, resp)).encode())
                    how = "finished"
            except (BrokenPipeError, ConnectionResetError):
                how = "client_disconnected"
                self.close_connection = True
            finally:
                state.generation_ended(key, how, echo=bool(resp.get("echo_memory")))

        def _wait_or_gone(self, seconds: float) -> bool:
            """Sleep `seconds` unless the client hangs up first (True): vLLM aborts such a request."""
            deadline = time.monotonic() + seconds
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                readable, _, _ = select.select([self.connection], [], [], left)
                if readable:
                    try:
                        peek = self.connection.recv(1, socket.MSG_PEEK)
                    except OSError:
                        peek = b""
                    if not peek:
                        self.close_connection = True
                        return True
                    time.sleep(max(0.0, deadline - time.monotonic()))  # bytes, not a hang-up: keep waiting
                    return False

        def _chunk(self, payload: bytes) -> None:
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()

        def _event(self, obj) -> None:
            self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        def _stream(self, body: dict, content: str, resp: dict) -> str:
            """Server-sent events, one chunk per token; returns how the generation ended."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            model = body.get("model", state.model)
            base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
            if resp.get("queue") and self._wait_or_gone(float(resp["queue"])):
                return "client_disconnected"
            self._event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})
            toks = _tokens(content)
            cut = len(toks) // 2 if resp.get("truncate") else None
            delay = float(resp.get("token_delay", 0))
            for i, tok in enumerate(toks):
                if cut is not None and i == cut:
                    self._hang_up()
                    return "truncated"
                if "stall_after" in resp and i == int(resp["stall_after"]) and self._wait_or_gone(float(resp["stall"])):
                    return "client_disconnected"
                if delay and self._wait_or_gone(delay):
                    return "client_disconnected"
                self._event({**base, "choices": [{"index": 0, "delta": {"content": tok}, "finish_reason": None}]})
            self._event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": resp.get("finish_reason", "stop")}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({**base, "choices": [], "usage": _usage(body, len(toks), resp)})
            self._event(b"[DONE]")
            self._chunk(b"")
            return "finished"

    return Handler


def _tokens(content: str) -> list[str]:
    """The content cut into ~4-character tokens (as many as the usage reports)."""
    n = max(1, len(content) // 4)
    step = len(content) / n
    return [content[round(i * step):round((i + 1) * step)] for i in range(n)]


def _usage(body: dict, completion_tokens: int, resp: dict) -> dict:
    text = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
    prompt_tokens = max(1, len(text) // 4)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if "cached_tokens" in resp:
        usage["prompt_tokens_details"] = {"cached_tokens": int(resp["cached_tokens"])}
    return usage


_TURN_LINE = re.compile(r"^\[(\d+)\] ([^\n]*?): (.*)$", re.M)


def _echo_memory(text: str) -> dict:
    """One memory quoting the first user turn of the transcript (none when there is no user turn)."""
    for m in _TURN_LINE.finditer(text):
        if "(user)" in m.group(2) or m.group(2) == "user":
            return {"memories": [{"content": f"The user said: {m.group(3)[:120]}", "evidence_turn_ids": [int(m.group(1))]}]}
    return {"memories": []}


def _completion(body: dict, model: str, content: str, resp: dict) -> dict:
    """A chat.completion payload carrying `content`, with usage estimated from the text lengths."""
    usage = _usage(body, len(_tokens(content)), resp)
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", model),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": resp.get("finish_reason", "stop")}],
        "usage": usage,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--script", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--gen-log", default=None)
    args = ap.parse_args()
    with open(args.script, encoding="utf-8") as f:
        script = json.load(f)
    state = State(script, args.log, args.gen_log)
    # a real server's listen backlog (uvicorn: 2048), not socketserver's 5: a client opening 64
    # connections at once must not see resets that no production server would give it
    ThreadingHTTPServer.request_queue_size = 1024
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())


# -- helper for tests: start the server as a real child process --------------------------------
class RunningFakeServer:
    def __init__(self, script: dict, workdir, python: str | None = None, port: int = 0) -> None:
        """`port`: 0 = any free port; a fixed one lets a test bring a dead server back at the same URL."""
        import subprocess
        from pathlib import Path

        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.script_path = workdir / "script.json"
        self.script_path.write_text(json.dumps(script), encoding="utf-8")
        self.log_path = workdir / "requests.jsonl"
        self.gen_log_path = workdir / "generations.jsonl"
        self.proc = subprocess.Popen(
            [python or sys.executable, __file__, "--port", str(port), "--script", str(self.script_path), "--log",
             str(self.log_path), "--gen-log", str(self.gen_log_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def answered(self) -> list[dict]:
        """Requests the server answered with a completion (what a client could have kept)."""
        ok = ("echo_memory", "json", "content")
        return [r for r in self.requests() if any(k in r.get("response", {}) for k in ok)
                and r["response"].get("status", 200) == 200 and "hang" not in r["response"]]

    def requests(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def generations(self) -> list[dict]:
        """Start/end events of every generation (see the module docstring), in the order they happened."""
        if not self.gen_log_path.exists():
            return []
        return [json.loads(x) for x in self.gen_log_path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
