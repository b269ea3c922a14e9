"""The S3 side of real-mount tests: one fresh bucket on the test's S3 server (SeaweedFS, or
moto for a test marked ``moto``), seen the way a reader of the store sees it (the ``bucket``
fixture in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from ckptfs.store.tiers.base import CONTROL_PREFIX
from tests.mounting import tiers_config
from tests.s3server import S3Server
from tests.seaweed import Seaweed

# The suite's S3 servers: SeaweedFS (the default), moto where a test needs what only it has.
Server = S3Server | Seaweed

# Why a test stays on moto (``@pytest.mark.moto(WHY)``): what SeaweedFS lacks.
ARCHIVE = ("archive restore: SeaweedFS answers restore_object with 405 MethodNotAllowed and "
           "serves GLACIER/DEEP_ARCHIVE objects as any other")
FAULT_RULES = ("server-side faults (tests/s3server.py Rule: 503 SlowDown, delays per key) "
               "are WSGI middleware in front of moto")
UNSAFE_KEYS = ("stores keys with '..' or '.' segments and names over 255 bytes, as AWS does; "
               "SeaweedFS refuses them (400 InvalidRequest, KeyTooLongError) and stores "
               "'d//e' as 'd/e'")
REQUEST_LOG = ("counts the requests the store answered in moto's request log (werkzeug, in "
               "this process); SeaweedFS's are in another process")

MiB = 1024 * 1024
PART_SIZE = 5 * MiB  # the S3 minimum: anything larger goes multipart
PREFIX = "run1/"


def store_lines(server: Server) -> list[str]:
    """The lines of a ``[[tier]]`` that point it at ``server``: its endpoint and its keys
    (SeaweedFS checks them; moto accepts any, and the environment has some)."""
    keys = server.tier_credentials
    return [f'endpoint_url = "{server.endpoint}"',
            *(f'{name} = "{value}"' for name, value in keys.items())]


@dataclass
class Bucket:
    """One fresh bucket on the test's S3 server, seen the way a reader of the store sees it."""

    server: Server
    name: str
    client: Any = None

    def __post_init__(self) -> None:
        self.client = self.server.client()

    def config(self, path: Path, *, faults: dict[str, Any] | None = None,
               upload_concurrency: int = 4, part_concurrency: int = 4,
               log_level: str = "info", **settings: Any) -> Path:
        """A config file: hot tier + this bucket as the warm tier (optionally faulty); other
        top-level keys (``metadata_ttl="1s"``...) from ``settings``."""
        return tiers_config(
            path, f"s3://{self.name}/{PREFIX.rstrip('/')}",
            *store_lines(self.server), f"part_size = {PART_SIZE}",
            f"part_concurrency = {part_concurrency}", faults=faults,
            upload_concurrency=upload_concurrency,
            log_level=log_level,  # the daemon logs to <staging>/daemon.log
            **settings)

    def sizes(self, client: Any = None) -> dict[str, int]:
        """Every object under the prefix (key relative to it -> size), one full listing."""
        client = client or self.client
        out: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=self.name, Prefix=PREFIX):
            for obj in page.get("Contents", []):
                key = obj["Key"][len(PREFIX):]
                if not key.startswith(CONTROL_PREFIX):  # the nodes' shared state
                    out[key] = int(obj["Size"])
        return out

    def get(self, key: str, client: Any = None) -> tuple[bytes, dict[str, str], str]:
        """Body, user metadata and ETag of ``key``."""
        reply = (client or self.client).get_object(Bucket=self.name, Key=PREFIX + key)
        return reply["Body"].read(), reply.get("Metadata", {}), reply["ETag"].strip('"')

    def multipart_uploads(self) -> list[str]:
        reply = self.client.list_multipart_uploads(Bucket=self.name, Prefix=PREFIX)
        return [u["Key"] for u in reply.get("Uploads", [])]

    def empty(self) -> None:
        """Delete the bucket: SeaweedFS deletes a bucket with objects in it (its collection)
        at once; moto refuses (as AWS does) until every object is gone."""
        from botocore.exceptions import ClientError

        try:
            self.client.delete_bucket(Bucket=self.name)
            return
        except ClientError:
            if not isinstance(self.server, S3Server):
                raise
        for u in self.client.list_multipart_uploads(Bucket=self.name).get("Uploads", []):
            self.client.abort_multipart_upload(Bucket=self.name, Key=u["Key"],
                                               UploadId=u["UploadId"])
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:  # a page is at most 1,000 keys, what one delete_objects takes
                self.client.delete_objects(Bucket=self.name, Delete={"Objects": keys})
        self.client.delete_bucket(Bucket=self.name)


def crc(data: bytes) -> str:
    return f"crc32c:{crc32c.crc32c(data):08x}"
