"""Child servers on loopback (vLLM, dagster-webserver, test servers): a free port, a start that ties
the server's life to its parent's, and a stop that leaves no process of the server's group behind."""

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager


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
    lifeline = getattr(proc, "lifeline", None)
    if lifeline is not None and not lifeline.closed:
        lifeline.close()


# The guard runs as the leader of the server's own session. It waits on the server and on its stdin,
# a pipe whose only writer is the parent: EOF there means the parent is gone, however it died
# (SIGKILL, OOM, a crash), and the guard stops the whole group. It ignores SIGTERM, so a group stop
# (stop_process_group) lets the server shut down gracefully while the guard waits for it.
_GUARD = r"""
import os, signal, subprocess, sys, threading
signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
def parent_gone():
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=float(os.environ.get("QUMEM_ORPHAN_GRACE_S", "20")))
        except subprocess.TimeoutExpired:
            pass
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=parent_gone, daemon=True).start()
sys.exit(server.wait())
"""


def popen_tied_to_parent(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start `cmd` in its own session under a guard that stops it when this process dies.

    Why: a server started with `start_new_session=True` (so a terminal's Ctrl-C does not reach it
    before `close()` runs) outlives a parent killed by a signal, and an orphaned vLLM keeps the cores
    and its memory busy under the rerun. The returned process is the guard: its exit code is the
    server's, and `stop_process_group` stops guard and server together."""
    read_end, write_end = os.pipe()  # non-inheritable: only this process holds the writer
    try:
        proc = subprocess.Popen([sys.executable, "-c", _GUARD, *cmd], stdin=read_end, start_new_session=True,
                                **kwargs)
    finally:
        os.close(read_end)
    proc.lifeline = os.fdopen(write_end, "wb")  # closed with this process, or at stop
    return proc


# What delta-rs, pyarrow and boto3 need to talk to moto's S3 on loopback (moto takes any credentials).
MOTO_S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


@contextmanager
def moto_s3(log=subprocess.DEVNULL, buckets: tuple[str, ...] = (), timeout_s: float = 60):
    """moto's standalone S3 server (`moto[server]`) as a child on a free loopback port, with `buckets`
    created, once it answers; yields its endpoint URL and stops it on exit (SIGTERM, SIGKILL after 10 s).
    The S3 the tests and benches write to (no network: everything on loopback)."""
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (exit {proc.poll()})")
                time.sleep(0.2)
        if buckets:
            import boto3

            s3 = boto3.client("s3", endpoint_url=endpoint, region_name=MOTO_S3_ENV["AWS_REGION"],
                              aws_access_key_id=MOTO_S3_ENV["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=MOTO_S3_ENV["AWS_SECRET_ACCESS_KEY"])
            for bucket in buckets:
                s3.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
