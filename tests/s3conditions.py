"""Make moto honour CopySourceIfMatch, which its server ignores (moto 5.x copies whatever is
at the source): a test helper, not a fix of ckptfs.

``honour_copy_conditions(client)`` registers a botocore ``before-call`` hook on one client
(an ``S3Tier``'s): before each CopyObject or UploadPartCopy that carries
``x-amz-copy-source-if-match``, it HEADs the source with a separate client and raises the
412 ``PreconditionFailed`` ClientError a real S3 server answers when the ETag differs. The
check and the copy are two requests, so it is only as atomic as the tests need (they change
the source between the caller's look and its copy, not during the copy request).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

HEADER = "x-amz-copy-source-if-match"


def honour_copy_conditions(client: Any) -> None:
    import boto3
    from botocore.exceptions import ClientError

    checker = boto3.client("s3", endpoint_url=client.meta.endpoint_url,
                           region_name=client.meta.region_name)

    def check(params: dict[str, Any], model: Any, **_: Any) -> None:
        headers = params.get("headers", {})
        wanted = headers.get(HEADER)
        if wanted is None:
            return
        source = unquote(str(headers["x-amz-copy-source"])).lstrip("/")
        bucket, _, key = source.partition("/")
        key = key.split("?versionId=")[0]
        try:
            etag = checker.head_object(Bucket=bucket, Key=key)["ETag"]
        except ClientError:
            return  # missing: the copy itself says so (404)
        if etag != wanted:
            raise ClientError(
                {"Error": {"Code": "PreconditionFailed",
                           "Message": "At least one of the pre-conditions you specified "
                                      "did not hold"},
                 "ResponseMetadata": {"HTTPStatusCode": 412}},
                model.name)

    for operation in ("CopyObject", "UploadPartCopy"):
        client.meta.events.register(f"before-call.s3.{operation}", check)
