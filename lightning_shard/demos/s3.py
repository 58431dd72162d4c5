"""A local S3 server for trying checkpoints on S3 without an account: ``moto`` in server mode on localhost.

    with local_s3_server(bucket="ckpt"):
        trainer = L.Trainer(strategy=ShardStrategy(...), callbacks=[ModelCheckpoint(dirpath="s3://ckpt/run")])

Sets ``AWS_ENDPOINT_URL`` (and test credentials) for this process and the ranks it starts, as boto users do for
any S3-compatible endpoint, and restores the environment on exit. Needs
``pip install 'moto[server]!=5.2.0,!=5.2.1' s3fs`` (those two moto releases answer CompleteMultipartUpload with
an XML root that pyarrow's S3 client, which Ray's storage uses, rejects).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_shard.demos.ranks import free_port


@contextmanager
def local_s3_server(
    bucket: str = "ckpt", timeout_s: float = 30.0, log: str | os.PathLike[str] | None = None
) -> Iterator[Any]:
    """Start moto's S3 server, create ``bucket``; yield an ``s3fs.S3FileSystem`` on it.

    ``log``: a file that receives the server's request log and any error it answers with (discarded if None).
    """
    import s3fs  # optional: s3fs (the s3 extra)

    port = free_port()
    with open(log or os.devnull, "ab") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not start on port {port}") from None
                time.sleep(0.1)
        fs = s3fs.S3FileSystem()
        fs.mkdir(bucket)
        yield fs
    finally:
        server.terminate()
        server.wait(timeout=30)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
