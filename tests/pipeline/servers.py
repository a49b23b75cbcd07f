"""Real servers for tests, each on 127.0.0.1, a free port and its own temp folder.

- :func:`s3_server`: an S3-compatible object store (``moto[server]``, a real S3 API over HTTP).
- :func:`postgres_server`: PostgreSQL through ``initdb`` and ``pg_ctl`` (as the ``postgres``
  user when the tests run as root: PostgreSQL refuses to run as root).
- :func:`mlflow_server`: ``mlflow server`` on a backend store and an artifact destination.
- :func:`sat_serve`: ``sat serve`` (either engine) in a project folder, once its ``/ping`` answers.

Every server is a child process in its own process group, stopped by its own PID afterwards
(never by name: other test runs on the machine may run the same servers). Context managers, so
that a module-scoped fixture can hold one server for all its tests.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "S3_CREDENTIALS",
    "PostgresServer",
    "S3Server",
    "SatServe",
    "free_port",
    "mlflow_server",
    "post_images",
    "postgres_server",
    "s3_server",
    "sat_serve",
    "stop_process_group",
    "wait_for_port",
]

# moto accepts any credentials; these keep boto3, s3fs and MLflow from looking elsewhere
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before it listened on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    stop_process_group(proc)
    pytest.fail(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM the process group led by ``proc`` (its own PID), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def _server(
    cmd: list[str],
    port: int,
    what: str,
    log: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 60,
) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    try:
        wait_for_port(port, proc, what, timeout_s)
        yield proc
    finally:
        stop_process_group(proc)


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    env: dict[str, str]  # credentials plus the endpoint, for child processes

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, **_boto_credentials())

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_CREDENTIALS["AWS_DEFAULT_REGION"],
    }


@contextmanager
def s3_server(tmp: Path) -> Iterator[S3Server]:
    """``moto_server`` on 127.0.0.1; state lives in the process (gone when it stops)."""
    pytest.importorskip("moto", reason="moto[server] is not installed")
    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _server(cmd, port, "moto_server", tmp / "moto.log", env=S3_CREDENTIALS):
        url = f"http://127.0.0.1:{port}"
        env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": url, "MLFLOW_S3_ENDPOINT_URL": url}
        yield S3Server(endpoint_url=url, env=env)


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    data_dir: Path

    def uri(self, database: str, driver: str = "postgresql+psycopg") -> str:
        return f"{driver}://{self.user}@{self.host}:{self.port}/{database}"


def _as_postgres_user() -> tuple[list[str], Callable[[Path], None]]:
    """The command prefix and folder owner change that run PostgreSQL as a non-root user."""
    if os.geteuid() != 0:
        return [], lambda path: None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")

    def chown(path: Path) -> None:
        os.chown(path, user.pw_uid, user.pw_gid)

    return ["runuser", "-u", "postgres", "--"], chown


@contextmanager
def postgres_server(
    tmp: Path, databases: tuple[str, ...] = ("mlflow",)
) -> Iterator[PostgresServer]:
    """A PostgreSQL cluster with trust auth on 127.0.0.1 only; its log goes to ``tmp``.

    The cluster lives in a short folder of its own under the system temp dir (the ``postgres``
    user must reach it, and the socket path has a length limit), removed afterwards.
    """
    for tool in ("initdb", "postgres", "pg_isready"):
        if shutil.which(tool) is None:
            pytest.skip(f"PostgreSQL's {tool} is not on PATH")
    prefix, chown = _as_postgres_user()
    home = Path(tempfile.mkdtemp(prefix="sat-pg-"))
    data, sock = home / "data", home / "sock"
    try:
        for folder in (home, sock):
            folder.mkdir(exist_ok=True)
            chown(folder)
        user = "sat"
        subprocess.run(
            [*prefix, "initdb", "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
        )
        port = free_port()
        cmd = [*prefix, "postgres", "-D", str(data), "-p", str(port), "-k", str(sock)]
        cmd += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]
        with _server(cmd, port, "postgres", tmp / "postgres.log"):
            server = PostgresServer(host="127.0.0.1", port=port, user=user, data_dir=data)
            try:
                _wait_until_accepting(server)
                _create_databases(server, databases)
                yield server
            finally:  # a fast shutdown that waits until the postmaster (postmaster.pid) is gone
                stop = [*prefix, "pg_ctl", "stop", "-D", str(data), "-m", "fast", "-w"]
                subprocess.run(stop, capture_output=True, timeout=60, check=False)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _wait_until_accepting(server: PostgresServer, timeout_s: float = 60) -> None:
    """Until ``pg_isready`` says the server accepts connections: its port opens while it is
    still starting up, when a connection is refused ("the database system is starting up")."""
    cmd = ["pg_isready", "-h", server.host, "-p", str(server.port), "-U", server.user]
    deadline = time.monotonic() + timeout_s
    while subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(f"PostgreSQL on {server.host}:{server.port} not ready in {timeout_s:.0f} s")
        time.sleep(0.2)


def _create_databases(server: PostgresServer, names: tuple[str, ...]) -> None:
    import psycopg

    with psycopg.connect(server.uri("postgres", driver="postgresql"), autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')


def _auth_config(tmp: Path, user: str, password: str) -> Path:
    """MLflow's basic-auth settings, as the README's team recipe writes them."""
    path = tmp / "basic_auth.ini"
    path.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{tmp / 'basic_auth.db'}\n"
        f"admin_username = {user}\n"
        f"admin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 60\n"
    )
    return path


@contextmanager
def mlflow_server(
    tmp: Path,
    backend_store_uri: str,
    artifacts_destination: str,
    env: dict[str, str] | None = None,
    admin: tuple[str, str] | None = None,
    port: int | None = None,
) -> Iterator[str]:
    """``mlflow server`` proxying artifacts to ``artifacts_destination``; yields its URL. With
    ``admin`` (user, password): MLflow's basic authentication on, everyone else read-only. A
    ``port`` given again restarts "the same server" after it went down."""
    port = port or free_port()
    bin_dir = Path(sys.executable).parent
    cmd = [
        str(bin_dir / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        backend_store_uri,
        "--artifacts-destination",
        artifacts_destination,
        "--workers",
        "1",
    ]
    path_env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        # MLflow's job runner (GenAI jobs: six Huey consumers) halves start-up and is unused here
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    if admin is not None:
        cmd += ["--app-name", "basic-auth"]
        path_env["MLFLOW_AUTH_CONFIG_PATH"] = str(_auth_config(tmp, *admin))
        path_env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = os.urandom(16).hex()  # CSRF, required
    with _server(cmd, port, "mlflow server", tmp / "mlflow.log", {**path_env, **(env or {})}, 120):
        yield f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------- sat serve
@dataclass(frozen=True)
class SatServe:
    url: str  # http://127.0.0.1:<port>
    process: subprocess.Popen  # ``sat serve`` itself: its front door reads every body

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM to ``sat serve`` alone (it shuts down what it started, a local Ray among
        it), then SIGKILL to whatever of its process group is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=90)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _answers_ping(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> bool:
    """True once ``url``/ping answers 200; False if the server exited first (a port another
    program took between our choosing and its binding it, say); a failure past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"sat serve did not answer in {timeout_s:.0f} s: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as answer:
                if answer.status == 200:
                    return True
        except (OSError, http.client.HTTPException):  # not up yet, or not ours
            pass
        time.sleep(0.5)
    return False


@contextmanager
def sat_serve(
    cwd: Path, args: list[str], env: dict[str, str], log: Path, timeout_s: float = 300
) -> Iterator[SatServe]:
    """``sat serve ARGS --port <free>`` in ``cwd`` (its own process group, output to ``log``)
    until the block ends; a server that exits before it answers is started once more on
    another port, then the test fails with its log."""
    sat = Path(sys.executable).with_name("sat")
    for _attempt in (1, 2):
        port = free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(sat), "serve", *args, "--port", str(port)],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        served = SatServe(f"http://127.0.0.1:{port}", proc)
        try:
            if _answers_ping(proc, served.url, log, timeout_s):
                yield served
                return
        finally:
            served.stop()
    pytest.fail(f"sat serve {' '.join(args)} did not answer: {log.read_text()[-3000:]}")


def post_images(url: str, images: list[Path]) -> list[dict]:
    """Every image as a base64 row of one JSON request to ``url``/invocations, as clients send
    them; the answer's predictions, one per image in order."""
    rows = [{"image": base64.b64encode(p.read_bytes()).decode()} for p in images]
    body = json.dumps({"dataframe_records": rows}).encode()
    request = urllib.request.Request(
        f"{url}/invocations", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        predictions = json.loads(answer.read())["predictions"]
    assert len(predictions) == len(images), predictions
    return predictions
