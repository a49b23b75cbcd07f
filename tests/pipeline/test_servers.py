"""The test servers themselves: each answers its own protocol, and stops by its PID."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.pipeline.servers import postgres_server, s3_server

pytestmark = pytest.mark.slow


def test_s3_server_stores_and_returns_an_object(tmp_path: Path) -> None:
    with s3_server(tmp_path) as s3:
        client = s3.client()
        s3.create_bucket("sat-test")
        client.put_object(Bucket="sat-test", Key="a/b.txt", Body=b"hello")
        body = client.get_object(Bucket="sat-test", Key="a/b.txt")["Body"].read()
        assert body == b"hello"
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="sat-test")["Contents"]]
        assert keys == ["a/b.txt"]


def test_postgres_server_answers_queries_and_stops(tmp_path: Path) -> None:
    import psycopg

    with postgres_server(tmp_path, databases=("mlflow",)) as pg:
        with psycopg.connect(pg.uri("mlflow", driver="postgresql")) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (41), (1)")
            assert conn.execute("SELECT sum(x) FROM t").fetchone() == (42,)
        pid = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
