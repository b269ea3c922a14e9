"""A real HTTP S3 endpoint on loopback for tests: moto's server mode, started per session.

The suite's S3 endpoint is SeaweedFS (tests/seaweed.py); moto serves the tier contract tests
(which run on both) and the tests marked ``moto(why)`` (conftest.py), which need what only
it has: archive restore, the fault rules below, its request log, keys SeaweedFS refuses.

moto does not verify upload checksums; the tests check bytes themselves.

Fault injection: ``S3Server.inject(Rule(...))`` (a context manager) puts rules in front of
moto, as WSGI middleware: a matching request waits ``delay`` seconds before it is handled,
and the first ``fail`` matching requests are answered ``503 SlowDown`` (not handled at all),
as a busy S3 does. The rules are per bucket, so tests sharing the session's server do not
see each other's faults. Note that ckptfs's boto3 client retries a 503 by itself
(``retries = {"max_attempts": 2}``: two retries, three requests): ``fail=3`` is one failed
store call as ckptfs sees it, ``fail=1`` one that botocore's retry hides.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class Request:
    """What a rule matches on: the method, the bucket, the object key (path-style or
    virtual-host style) and, for a server-side copy, the key copied from."""

    method: str
    bucket: str
    key: str
    copy_source: str | None

    @classmethod
    def of(cls, environ: dict[str, Any]) -> Request:
        path = unquote(environ.get("PATH_INFO", ""))
        host = environ.get("HTTP_HOST", "").split(":")[0]
        if host and not host[0].isdigit() and host.count(".") and not host.startswith("localhost"):
            bucket, key = host.split(".", 1)[0], path.lstrip("/")
        else:
            bucket, _, key = path.lstrip("/").partition("/")
        source = environ.get("HTTP_X_AMZ_COPY_SOURCE")
        if source is not None:
            source = unquote(source).lstrip("/").partition("/")[2].split("?", 1)[0]
        return cls(environ.get("REQUEST_METHOD", ""), bucket, key, source)


@dataclass
class Rule:
    """A fault of the endpoint for requests on ``bucket`` (and ``key``, as the object named
    or as a copy's source, if given; ``methods``, if given): ``delay`` seconds before each
    is handled, and ``fail`` of them answered 503 SlowDown."""

    bucket: str
    key: str | None = None
    methods: tuple[str, ...] = ()
    fail: int = 0
    delay: float = 0.0
    # what the rule did: "METHOD key" of each request it failed, and how many it matched
    failed: list[str] = field(default_factory=list)
    matched: int = 0

    def matches(self, r: Request) -> bool:
        return (r.bucket == self.bucket
                and (self.key is None or self.key in (r.key, r.copy_source))
                and (not self.methods or r.method in self.methods))


class Faults:
    """WSGI middleware in front of moto applying the active rules."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.rules: list[Rule] = []
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if not self.rules:
            return self.app(environ, start_response)
        request = Request.of(environ)
        delay, fail = 0.0, False
        with self.lock:
            for rule in self.rules:
                if not rule.matches(request):
                    continue
                rule.matched += 1
                delay += rule.delay
                if not fail and len(rule.failed) < rule.fail:
                    rule.failed.append(f"{request.method} {request.key}"
                                       + (f" <- {request.copy_source}" if request.copy_source
                                          else ""))
                    fail = True
        if delay:
            time.sleep(delay)
        if not fail:
            return self.app(environ, start_response)
        from werkzeug.wsgi import get_input_stream

        get_input_stream(environ).read()  # the body, so the connection stays usable
        start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                         ("Content-Length", str(len(SLOW_DOWN)))])
        return [b"" if request.method == "HEAD" else SLOW_DOWN]


@dataclass
class S3Server:
    endpoint: str
    _server: Any = None
    port: int = 0
    faults: Faults | None = None
    # a ``key/`` object keeps its user metadata (tests/test_tier_contract.py checks it)
    keeps_directory_metadata = True

    @contextlib.contextmanager
    def inject(self, *rules: Rule) -> Iterator[tuple[Rule, ...]]:
        """Apply ``rules`` to requests made inside the block."""
        assert self.faults is not None
        with self.faults.lock:
            self.faults.rules.extend(rules)
        try:
            yield rules
        finally:
            with self.faults.lock:
                for rule in rules:
                    self.faults.rules.remove(rule)

    @property
    def tier_credentials(self) -> dict[str, str]:
        """A tier's keys: none (moto accepts any; the environment has some, set above)."""
        return {}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"ckptfs-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self._server.stop()

    def start(self) -> None:
        """(Re)start on the same port; moto keeps its state in this process."""
        from moto.server import ThreadedMotoServer

        server = self

        class Served(ThreadedMotoServer):
            def _server_entry(self) -> None:  # moto's, with the fault rules in front
                from moto.moto_server.werkzeug_app import (
                    DomainDispatcherApplication,
                    create_backend_app,
                )
                from werkzeug.serving import make_server

                if server.faults is None:
                    server.faults = Faults(DomainDispatcherApplication(create_backend_app))
                self._server = make_server(self._ip_address, self._port, server.faults, True)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = Served(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()


def start_server() -> S3Server:
    port = free_port()
    server = S3Server(f"http://127.0.0.1:{port}", port=port)
    server.start()
    return server
