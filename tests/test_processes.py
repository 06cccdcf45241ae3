"""Child servers tied to their parent (`runtime.processes.popen_tied_to_parent`): a parent killed by a
signal leaves no server behind; a stop still lets the server shut down; exit codes come through."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from qumem_pipeline.runtime.processes import popen_tied_to_parent, stop_process_group

REPO_ROOT = Path(__file__).resolve().parents[1]

# a stand-in server: writes its pid, says on SIGTERM that it shut down cleanly, else sleeps
SERVER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    def bye(*_):
        open(out + ".term", "w").write("clean")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    open(out + ".tmp", "w").write(str(os.getpid()))
    os.replace(out + ".tmp", out)
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_for(path: Path, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_server_dies_with_a_parent_killed_by_sigkill(tmp_path):
    pid_file = tmp_path / "server.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from qumem_pipeline.runtime.processes import popen_tied_to_parent
        popen_tied_to_parent([sys.executable, "-c", {SERVER!r}, {str(pid_file)!r}])
        time.sleep(300)
    """)], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "QUMEM_ORPHAN_GRACE_S": "5"})
    try:
        server_pid = int(_wait_for(pid_file))
        assert _alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), "the server outlived its SIGKILLed parent"
        # it was asked first: SIGTERM, so a real server can release what it holds
        assert (tmp_path / "server.pid.term").read_text() == "clean"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_stop_lets_the_server_shut_down_and_exit_codes_come_through(tmp_path):
    pid_file = tmp_path / "server.pid"
    proc = popen_tied_to_parent([sys.executable, "-c", SERVER, str(pid_file)])
    server_pid = int(_wait_for(pid_file))
    stop_process_group(proc, timeout_s=10)
    assert not _alive(server_pid)
    assert (tmp_path / "server.pid.term").read_text() == "clean"  # not SIGKILLed first
    assert proc.returncode == 0
    assert proc.lifeline.closed

    failed = popen_tied_to_parent([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert failed.wait(timeout=20) == 3  # the guard reports the server's own exit code
    stop_process_group(failed)


# a stand-in for `python -m vllm.entrypoints.openai.api_server`: answers /health, records its pid
FAKE_API_SERVER = textwrap.dedent("""
    import argparse, http.server, os
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--host")
    args, _ = ap.parse_known_args()
    open(os.environ["FAKE_VLLM_PID_FILE"] + ".tmp", "w").write(str(os.getpid()))
    os.replace(os.environ["FAKE_VLLM_PID_FILE"] + ".tmp", os.environ["FAKE_VLLM_PID_FILE"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer((args.host, args.port), H).serve_forever()
""")


def test_vllm_managed_server_does_not_outlive_a_killed_run(tmp_path):
    """The orphan seen on a killed `qumem eval locomo --qa`: the managed server kept both cores."""
    pkg = tmp_path / "fakevllm" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    pid_file = tmp_path / "server.pid"
    run = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from qumem_pipeline.llm.vllm_managed import VLLMManagedBackend
        backend = VLLMManagedBackend("m", python=sys.executable, log_path={str(tmp_path / "v.log")!r}, startup_timeout_s=60,
                                     env={{"PYTHONPATH": {str(tmp_path / "fakevllm")!r}, "FAKE_VLLM_PID_FILE": {str(pid_file)!r}}})
        print("healthy", flush=True)
        time.sleep(300)
    """)], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "QUMEM_ORPHAN_GRACE_S": "5"},
        stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "healthy"
        server_pid = int(pid_file.read_text())
        assert _alive(server_pid)
        run.send_signal(signal.SIGKILL)  # no close(), no atexit, no finally
        run.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), "the managed vLLM server outlived its killed run"
    finally:
        if run.poll() is None:
            run.kill()
