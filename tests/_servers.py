"""Real servers on 127.0.0.1 for the remote and cache tests, started and stopped by the tests.

- :func:`python_server`: ``tests/_http_server.py`` in its own process (Range, counting,
  misbehaviour on demand);
- :func:`nginx_server`: Debian's ``nginx-light`` with a minimal config written to a temp dir;
- :func:`moto_s3`: ``moto_server`` (from ``moto[server]``) with signature checking switched on
  after setup, so a wrong credential is really refused. s3fs finds it through the standard
  environment: ``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).parent
BUCKET = "feedpipe-test"


def wait_until(pred: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``pred`` (bounded: fails after ``timeout`` seconds)."""
    import time

    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout}s")
        tick.wait(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _exited_or_listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    return proc.poll() is not None or _listening(port)


class PyServer:
    """A running ``_http_server.py``: ``url``, ``stats()``, ``link()``, ``reset()``, ``stop()``."""

    def __init__(self, root: str | Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_http_server.py"), str(root), *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"test HTTP server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, dict[str, int]]:
        with urllib.request.urlopen(self.url + "/__stats__", timeout=10) as r:
            return json.loads(r.read())

    def link(self) -> dict[str, int]:
        """``{"inflight_max": n}``: the most file requests the server answered at once."""
        with urllib.request.urlopen(self.url + "/__link__", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def reset(self) -> None:
        req = urllib.request.Request(self.url + "/__reset__", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def python_server(root: str | Path, *args: str) -> Iterator[PyServer]:
    s = PyServer(root, *args)
    try:
        yield s
    finally:
        s.stop()


NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log {work}/access.log;
  client_body_temp_path {work}/body;
  proxy_temp_path {work}/proxy;
  fastcgi_temp_path {work}/fastcgi;
  uwsgi_temp_path {work}/uwsgi;
  scgi_temp_path {work}/scgi;
  default_type application/octet-stream;
  server {{ listen 127.0.0.1:{port}; root {root}; autoindex on; }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None)


@contextlib.contextmanager
def nginx_server(root: str | Path, work: str | Path) -> Iterator[str]:
    """nginx serving ``root`` (single process, as the current user); yields its base URL."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    for _ in range(5):  # the free port may be taken between probing and binding
        port = _free_port()
        conf = work / "nginx.conf"
        conf.write_text(NGINX_CONF.format(work=work, port=port, root=root))
        # output to a file, never an undrained pipe: a full pipe would block nginx
        with open(work / "stderr.log", "ab") as err:
            proc = subprocess.Popen([binary, "-e", str(work / "error.log"), "-p", str(work),
                                     "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_until(functools.partial(_exited_or_listening, proc, port), 20, "nginx")
        except TimeoutError:
            proc.kill()
            raise
        if proc.poll() is None:
            break
    else:
        raise RuntimeError(f"nginx did not start: {(work / 'error.log').read_text()[-2000:]}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def moto_binary() -> str | None:
    near = Path(sys.executable).with_name("moto_server")
    return str(near) if near.exists() else shutil.which("moto_server")


@contextlib.contextmanager
def moto_s3(upload: dict[str, Path]) -> Iterator[dict[str, str]]:
    """moto_server with a bucket holding ``upload`` (key prefix -> local directory) and an IAM
    user whose key is the only one accepted once setup is done. Yields the environment that
    points s3fs at it."""
    import boto3

    binary = moto_binary()
    if binary is None:
        raise RuntimeError("moto_server is not installed")
    port = _free_port()
    proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _listening(port), 60, "moto_server")
        if proc.poll() is not None:
            raise RuntimeError("moto_server exited at start")
        kw = dict(endpoint_url=endpoint, region_name="us-east-1",
                  aws_access_key_id="AKIAIOSFODNN7EXAMPLE", aws_secret_access_key="setup")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="feedpipe")
        key = iam.create_access_key(UserName="feedpipe")["AccessKey"]
        iam.put_user_policy(UserName="feedpipe", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        s3 = boto3.client("s3", **kw)
        s3.create_bucket(Bucket=BUCKET)
        for prefix, root in upload.items():
            for p in sorted(Path(root).rglob("*")):
                if p.is_file():
                    rel = p.relative_to(root).as_posix()
                    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=p.read_bytes())
        # from now on every request must be signed with the user's key
        req = urllib.request.Request(endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=10).read()
        yield {
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "NO_PROXY": "127.0.0.1,localhost",
        }
    finally:
        _stop(proc)


def forget_s3_clients() -> None:
    """Drop s3fs's cached filesystem instances (they keep the credentials they were made with)."""
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


def _stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """Terminate a server process, killing it if it does not exit within 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
