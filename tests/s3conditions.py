"""Make moto answer S3 copies the way real servers do, for the tests: a helper, not a fix of
ckptfs. Each function registers a botocore ``before-parameter-build`` hook on one client (an
``S3Tier``'s), which sees the call's own arguments and may raise the ClientError a server
would answer; botocore's error handling then proceeds as for a real reply.

- ``honour_copy_conditions``: moto 5.x ignores CopySourceIfMatch (it copies whatever is at
  the source). Before each CopyObject or UploadPartCopy that carries it, the hook HEADs the
  source with a separate client and raises the 412 ``PreconditionFailed`` a real S3 server
  answers when the ETag differs. The check and the copy are two requests: only as atomic as
  the tests need (they change the source between the caller's look and its copy request,
  not during it).
- ``refuse_plain_self_copy``: SeaweedFS refuses a CopyObject of an object onto itself unless
  MetadataDirective=REPLACE (400 InvalidRequest), even when the storage class changes; AWS
  and moto allow it, so without this hook a test could not tell.
- ``count_calls``: how many times each operation was called (which copy path ran).
"""

from __future__ import annotations

from typing import Any

_COPIES = ("CopyObject", "UploadPartCopy")


def _source(params: dict[str, Any]) -> tuple[str, str]:
    source = params["CopySource"]
    if isinstance(source, dict):
        return str(source["Bucket"]), str(source["Key"])
    bucket, _, key = str(source).lstrip("/").partition("/")
    return bucket, key.split("?versionId=")[0]


def _error(operation: str, status: int, code: str, message: str) -> Exception:
    from botocore.exceptions import ClientError

    error: Exception = ClientError({"Error": {"Code": code, "Message": message},
                                    "ResponseMetadata": {"HTTPStatusCode": status}}, operation)
    return error


def honour_copy_conditions(client: Any) -> None:
    import boto3
    from botocore.exceptions import ClientError

    checker = boto3.client("s3", endpoint_url=client.meta.endpoint_url,
                           region_name=client.meta.region_name)

    def check(params: dict[str, Any], model: Any, **_: Any) -> None:
        wanted = params.get("CopySourceIfMatch")
        if wanted is None:
            return
        bucket, key = _source(params)
        try:
            etag = checker.head_object(Bucket=bucket, Key=key)["ETag"]
        except ClientError:
            return  # missing: the copy itself says so (404)
        if etag != wanted:
            raise _error(model.name, 412, "PreconditionFailed",
                         "At least one of the pre-conditions you specified did not hold")

    for operation in _COPIES:
        client.meta.events.register(f"before-parameter-build.s3.{operation}", check)


def refuse_plain_self_copy(client: Any) -> None:
    def check(params: dict[str, Any], model: Any, **_: Any) -> None:
        if _source(params) == (params["Bucket"], params["Key"]) \
                and params.get("MetadataDirective") != "REPLACE":
            raise _error(model.name, 400, "InvalidRequest",
                         "This copy request is illegal because it is trying to copy an object "
                         "to itself without changing the object's metadata")

    client.meta.events.register("before-parameter-build.s3.CopyObject", check)


def count_calls(client: Any) -> dict[str, int]:
    counts: dict[str, int] = {}

    def seen(model: Any, **_: Any) -> None:
        counts[model.name] = counts.get(model.name, 0) + 1

    client.meta.events.register("before-parameter-build.s3", seen)
    return counts
