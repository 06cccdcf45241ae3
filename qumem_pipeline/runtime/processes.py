"""Child servers on loopback (vLLM, dagster-webserver, test servers): a free port, and a stop that
leaves no process of the server's group behind."""

import os
import signal
import socket
import subprocess


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the group of `proc` (started with `start_new_session=True`), SIGKILL it after
    `timeout_s`; then SIGKILL whatever of the group outlived its leader (workers, code servers)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
