"""``s3://bucket/prefix[?storage_class=...]``: any S3-compatible object store, through boto3.

Invariants:
- One boto3 client per tier, created once (clients are thread-safe); its connection pool is
  as large as the thread limiter, so threads never wait for a connection. Its credentials
  come from the tier's keys, else its ``profile``, else boto3's standard chain; an error of a
  call names the endpoint and that source (``where``), never the credentials themselves.
- Every boto3 call runs in ``trio.to_thread.run_sync`` under the tier's limiter; errors are
  translated at this boundary into StoreUnavailable (transient), ObjectMissing,
  ObjectArchived or TierError (permanent).
- Files up to ``part_size`` are one PutObject; larger ones a multipart upload whose parts are
  streamed from the staging file as botocore sends them (``_PartReader``: no part is held in
  memory, so the daemon's size does not grow with part_size x parts in flight). A
  multipart upload that fails or is cancelled is aborted; ``cleanup`` aborts the ones a crash
  left behind for keys this node owns.
- Every PutObject/UploadPart carries an integrity checksum the store verifies. For a file
  whose CRC32Cs the uploader computed (``meta.checksum``, ``meta.blocks``) it is that CRC32C
  (``x-amz-checksum-crc32c``: the whole file's for a PutObject, a part's combined from its
  integrity blocks for an UploadPart, whose size is then a multiple of the block), so the
  bytes are summed once per upload, not once more by botocore; otherwise botocore's own
  (when_supported). Our whole-file CRC32C also travels as ``x-amz-meta-ckptfs-checksum``.
- Every server-side copy (``copy``, ``promote``, and transfer.py's copies between tiers
  behind one endpoint) goes through ``copy_from``, which keeps all of the source's user
  metadata and content headers at any size. Below ``copy_threshold`` it is one CopyObject;
  from there on our own multipart copy: CreateMultipartUpload carrying the source's metadata
  and the wanted storage class, UploadPartCopy of ``copy_part_size`` ranges, each pinned with
  CopySourceIfMatch to the ETag the HEAD saw (so the parts are of one version), Complete;
  aborted on any failure. (boto3's managed copy drops the user metadata when it goes
  multipart: s3transfer does not pass MetadataDirective on.)
- A pinned copy (``if_etag``) sends CopySourceIfMatch: a 412 is ``PreconditionFailed``.
- Tags (``ObjectInfo.etag``, what puts and copies return, ``if_etag``) are ETags in their
  quoted form, ``"..."``, whatever the server sent: SeaweedFS answers a CopyObject's and an
  UploadPartCopy's ETag unquoted while its HEAD and listings quote it (``_tag``).
- No request carries ``Expect: 100-continue`` (``_drop_expect``). botocore keeps the status
  line of a reply that came without "100 Continue" (a server answers an empty PUT at once:
  SeaweedFS does, for a directory marker or an empty file) on the pooled connection, and
  reads the next ``Expect`` request's reply against it: a stall of ``read_timeout`` (60 s),
  then a hidden retry (boto/botocore#3755). The cost: a refused PUT has sent its body.
- A directory marker (``key/``) carries the directory's metadata; a server that drops it
  (SeaweedFS: the marker is a directory of its filer) gives a directory of mode 0755, as a
  listing's common prefix does (``_info``).
- A directory marker's request and a request creating a key beneath it (a PutObject, a
  CompleteMultipartUpload, a CopyObject) are never in flight at once (``MarkerGate``,
  markergate.py): SeaweedFS drops a marker that lands while a write beneath it makes the
  directory. Puts and deletes of markers are logged at debug level.
- ``list_dir`` lists a subdirectory only if a key is under it: SeaweedFS lists an emptied
  directory as a common prefix for minutes after its last key is deleted (``_holding_keys``).
- A copy of an object onto itself (``promote``, an in-place storage-class transition) uses
  MetadataDirective=REPLACE with the metadata the HEAD read, pinned to its ETag: some servers
  (SeaweedFS) refuse a self-copy with COPY whatever else changes.
"""

from __future__ import annotations

import base64
import builtins
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import trio

from ckptfs.errors import StoreUnavailable, UserError
from ckptfs.store.integrity import BlockSums
from ckptfs.store.tiers.base import (
    Finish,
    Kind,
    ObjectArchived,
    ObjectInfo,
    ObjectMeta,
    ObjectMissing,
    PreconditionFailed,
    Progress,
    Tier,
    TierError,
    write_local,
)
from ckptfs.store.tiers.markergate import MarkerGate

log = logging.getLogger(__name__)
T = TypeVar("T")
MIN_PART_SIZE = 5 * 1024 * 1024
# CopyObject takes sources up to 5 GiB; above that a copy is multipart (UploadPartCopy).
COPY_THRESHOLD = 5 * 1024**3
COPY_PART_SIZE = 256 * 1024**2
MAX_PARTS = 10_000
# What a copy carries over besides the user metadata (a multipart copy must name each).
_CONTENT_HEADERS = ("ContentType", "ContentEncoding", "ContentDisposition", "ContentLanguage",
                    "CacheControl")
_TRANSIENT_CODES = {
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed", "500", "502", "503", "504",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
# What a refusal of the check at mount means, by S3 error code: the operator's next step.
_REFUSAL_HINTS = {
    "InvalidAccessKeyId": "the access key id is not known to this store",
    "SignatureDoesNotMatch": "the secret key does not belong to the access key id",
    "AccessDenied": "these credentials may not list the bucket (its policy, or the user's)",
    "ExpiredToken": "the session token has expired",
    "InvalidToken": "the session token is not valid",
    "AllAccessDisabled": "all access to this bucket is disabled",
}


def credential_source(session: Any, profile: str | None) -> str:
    """Where the session's credentials come from, as botocore names it ("env",
    "shared-credentials-file", "iam-role", ...), with the profile; "none" if none were found.

    Cheap after the client exists: creating it resolved (and cached) the credentials."""
    credentials = session.get_credentials()
    if credentials is None:
        return "none found"
    method = str(getattr(credentials, "method", None) or "unknown")
    if method == "explicit":
        return "from the tier's access_key_id"
    return f"from {method}" + (f" (profile {profile})" if profile else "")


def _aws_file(variable: str, name: str) -> str:
    return os.environ.get(variable) or f"~/.aws/{name}"


def _without_userinfo(url: str) -> str:
    """``url`` without ``user:password@``: an endpoint may carry it, an error message may not."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


class _PartReader(io.RawIOBase):
    """``length`` bytes of ``fd`` from ``offset``, as a seekable read-only file: botocore reads
    it once for the checksum and again to send it (and rewinds it to retry), in small chunks,
    with pread, so no whole part is ever in memory and the fd's position is never used.

    With ``progress``, the bytes read while the request is being sent are reported (from
    botocore's thread) as they go, and a rewind to retry reports them back; the reads that
    sign the request are not (``_not_sending`` / ``_sending``, the hooks s3transfer uses too).
    """

    def __init__(self, fd: int, offset: int, length: int,
                 progress: Progress | None = None) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0
        self._progress = progress
        self._sending = False
        self.reported = 0  # bytes reported so far (net of rewinds)

    def signal_sending(self, sending: bool) -> None:
        self._sending = sending

    def _report(self, n: int) -> None:
        if n and self._sending and self._progress is not None:
            self.reported += n
            self._progress(n)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._length

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        was, self._pos = self._pos, min(max(0, base + pos), self._length)
        self._report(self._pos - was)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:self._length - self._pos]
        if not view:
            return 0
        n = os.preadv(self._fd, [view], self._offset + self._pos)
        if n == 0:
            raise TierError(f"staging file shorter than expected at {self._offset + self._pos}")
        self._pos += n
        self._report(n)
        return n


def _not_sending(request: Any, **_: Any) -> None:
    """botocore's request-created (a retry's new request, before signing): a progress body
    stops counting."""
    if isinstance(getattr(request, "body", None), _PartReader):
        request.body.signal_sending(False)


def _sending(request: Any, **_: Any) -> None:
    """botocore's before-send (signed, about to go): a progress body counts what it sends."""
    if isinstance(getattr(request, "body", None), _PartReader):
        request.body.signal_sending(True)


class S3Tier(Tier):
    def __init__(
        self, name: str, url: str, *, endpoint_url: str | None = None, region: str | None = None,
        access_key_id: str | None = None, secret_access_key: str | None = None,
        profile: str | None = None, addressing_style: str = "auto",
        part_size: int = 16 * 1024 * 1024, part_concurrency: int = 4, threads: int = 16,
    ) -> None:
        super().__init__(name, url)
        import boto3
        from botocore.config import Config as BotoConfig
        from botocore.exceptions import ProfileNotFound

        parts = urlsplit(url)
        self.bucket = parts.netloc
        prefix = parts.path.strip("/")
        self.prefix = prefix + "/" if prefix else ""
        self.storage_class = parse_qs(parts.query).get("storage_class", ["STANDARD"])[-1]
        self.part_size = max(part_size, MIN_PART_SIZE)
        self.part_concurrency = part_concurrency
        # Copies of objects this large or larger are our own multipart copies (copy_from).
        self.copy_threshold = COPY_THRESHOLD
        self.copy_part_size = COPY_PART_SIZE
        self._limiter = trio.CapacityLimiter(threads)
        # A directory marker and the writes beneath it, one after the other (markergate.py).
        self._markers = MarkerGate()
        try:
            # The keys go to the session, not the client: then the session's credentials are
            # the ones the client signs with, and their ``method`` names where they came from.
            session = boto3.session.Session(
                profile_name=profile, aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key)
        except ProfileNotFound:
            raise UserError(f"tier {name!r}: AWS profile {profile!r} is not defined (in "
                            f"{_aws_file('AWS_CONFIG_FILE', 'config')} or "
                            f"{_aws_file('AWS_SHARED_CREDENTIALS_FILE', 'credentials')})"
                            ) from None
        self.client: Any = session.client(
            "s3",
            endpoint_url=endpoint_url,
            # The profile's region unless the tier names one; else us-east-1 (any region
            # works for an S3-compatible endpoint, and AWS redirects).
            region_name=region or session.region_name or "us-east-1",
            config=BotoConfig(
                max_pool_connections=threads,
                connect_timeout=5,
                read_timeout=60,
                retries={"max_attempts": 2, "mode": "standard"},
                request_checksum_calculation="when_supported",
                s3={"addressing_style": addressing_style},
            ),
        )
        self.client.meta.events.register("before-send.s3", _drop_expect)
        self.client.meta.events.register_first("request-created.s3", _not_sending)
        self.client.meta.events.register_last("before-send.s3", _sending)
        # Named in every error of this tier: an AccessDenied is debugged by knowing which
        # endpoint answered and which credentials were sent.
        self.where = (f"endpoint {_without_userinfo(self.client.meta.endpoint_url)}, "
                      f"credentials {credential_source(session, profile)}")

    # -- plumbing -------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix):]

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await trio.to_thread.run_sync(
                lambda: fn(*args, **kwargs), limiter=self._limiter
            )
        except Exception as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: Exception) -> Exception:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            message = f"{self.url}: {code or status}: {error.get('Message', '')}".rstrip(": ")
            if code in _MISSING_CODES or (status == "404" and code != "NoSuchBucket"):
                return ObjectMissing(message)
            if code == "InvalidObjectState":
                return ObjectArchived(message)
            if code == "PreconditionFailed" or status == "412":
                return PreconditionFailed(message)
            message += f" ({self.where})"
            if code in _TRANSIENT_CODES or status in _TRANSIENT_CODES:
                return StoreUnavailable(message)
            return TierError(message)
        if isinstance(exc, BotoCoreError):
            # Connection refused/reset, timeouts, truncated reads: the store may come back.
            return StoreUnavailable(f"{self.url}: {exc} ({self.where})")
        return exc

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, StoreUnavailable)

    # -- the interface --------------------------------------------------------------------

    async def check(self) -> None:
        try:
            await self._call(self.client.head_bucket, Bucket=self.bucket)
            return
        except StoreUnavailable as exc:
            # botocore's own text (which names the URL it tried), then where we sent it.
            raise TierError(f"store {self.url} cannot be reached: {exc.__cause__ or exc} "
                            f"({self.where})") from None
        except (ObjectMissing, TierError):
            # A reply to HEAD has no body, so no S3 error code: a missing bucket, refused
            # credentials and a server that is no S3 at all (another port of the store) all
            # read "404" or "403". A listing's reply names the error.
            pass
        try:
            await self._call(self.client.list_objects_v2, Bucket=self.bucket,
                             Prefix=self.prefix, MaxKeys=1)
        except (ObjectMissing, TierError, StoreUnavailable) as exc:
            raise TierError(self._refused(exc)) from None
        # HEAD refused, a listing allowed (a policy may grant one and not the other): usable.

    def _refused(self, exc: Exception) -> str:
        """The one line for a check the store refused: the S3 error code, what it means, the
        endpoint and the credentials' source; or that the endpoint is not an S3 server."""
        from botocore.exceptions import ClientError

        cause = exc.__cause__
        if not isinstance(cause, ClientError):
            return f"store {self.url} refused the check: {exc} ({self.where})"
        error = cause.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = str(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if not code or code.isdigit():
            endpoint = _without_userinfo(self.client.meta.endpoint_url)
            return (f"{endpoint} does not answer as an S3 server (HTTP {status or code} with "
                    f"no S3 error code to a listing of bucket {self.bucket!r}): is it the "
                    f"store's S3 port, not another service's? ({self.where})")
        if code == "NoSuchBucket":
            return f"bucket {self.bucket!r} of {self.url} does not exist (NoSuchBucket; " \
                   f"{self.where})"
        hint = _REFUSAL_HINTS.get(code) or str(error.get("Message", "")) or "refused"
        return f"store {self.url} refused access: {code}: {hint} ({self.where})"

    async def cleanup(self, keys_of_ours: set[str]) -> int:
        if not keys_of_ours:
            return 0
        wanted = {self._key(k) for k in keys_of_ours}
        aborted = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        pages = await self._call(lambda: list(paginator.paginate(Bucket=self.bucket,
                                                                 Prefix=self.prefix)))
        for page in pages:
            for upload in page.get("Uploads", []):
                if upload["Key"] in wanted:
                    await self._call(self.client.abort_multipart_upload, Bucket=self.bucket,
                                     Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted += 1
        return aborted

    def _put_args(self, meta: ObjectMeta) -> dict[str, Any]:
        args: dict[str, Any] = {"Metadata": meta.to_headers()}
        if self.storage_class != "STANDARD":
            args["StorageClass"] = self.storage_class
        return args

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None, *, finish: Finish | None = None,
    ) -> str | None:
        if finish is not None:
            meta = await finish()  # its checksums travel in the first request
        full = self._key(key)
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if size <= self.part_size:
                if os.fstat(fd).st_size < size:
                    raise TierError(f"{source} is shorter than {size} bytes")
                # Streamed from the file, with progress as it is sent (a slow store shows a
                # file moving, not standing still until it is all there).
                body = _PartReader(fd, 0, size, progress)
                whole = _whole_crc(meta.checksum)
                sent = {} if whole is None else {"ChecksumCRC32C": _crc_header(whole)}
                async with self._markers.creating(full):
                    reply = await self._call(self.client.put_object, Bucket=self.bucket,
                                             Key=full, Body=body, **sent, **self._put_args(meta))
                if progress and body.reported != size:
                    progress(size - body.reported)  # what the hooks did not see, if anything
            else:
                reply = await self._multipart(full, fd, size, meta, progress)
        finally:
            os.close(fd)
        return _tag(reply.get("ETag"))

    async def _multipart(
        self, full: str, fd: int, size: int, meta: ObjectMeta, progress: Progress | None
    ) -> dict[str, Any]:
        sums = BlockSums.decode(meta.blocks)
        if sums is not None and not sums.matches_size(size):
            sums = None
        part_size = self.part_size if sums is None else _part_size(self.part_size, sums, size)
        crcs = None if sums is None else await trio.to_thread.run_sync(
            _part_crcs, sums, size, part_size)
        args = self._put_args(meta)
        if crcs is not None:
            args["ChecksumAlgorithm"] = "CRC32C"
        created = await self._call(self.client.create_multipart_upload, Bucket=self.bucket,
                                   Key=full, **args)
        upload_id = created["UploadId"]
        count = (size + part_size - 1) // part_size
        etags: list[str | None] = [None] * count
        slots = trio.Semaphore(self.part_concurrency)

        def send(number: int) -> str:
            offset = (number - 1) * part_size
            body = _PartReader(fd, offset, min(part_size, size - offset))
            sent = {} if crcs is None else {"ChecksumCRC32C": _crc_header(crcs[number - 1])}
            reply = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                            PartNumber=number, Body=body, **sent)
            return str(reply["ETag"])

        failed: list[Exception] = []

        async def part(number: int, cancel: trio.CancelScope) -> None:
            try:
                async with slots:
                    if self.pace is not None:
                        await self.pace()  # the job is busy: the next part waits for it
                    etags[number - 1] = await self._call(send, number)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the abort
                # The first failure is the upload's, as itself: in an exception group a
                # StoreUnavailable would not read as transient (retried as a store outage).
                failed.append(exc)
                cancel.cancel()
                return
            if progress:
                progress(min(part_size, size - (number - 1) * part_size))

        try:
            async with trio.open_nursery() as nursery:
                for number in range(1, count + 1):
                    # at most part_concurrency send at once
                    nursery.start_soon(part, number, nursery.cancel_scope)
            if failed:
                raise failed[0]
            done = await self._complete(full, upload_id, etags, crcs)
        except BaseException:
            await self._abort(full, upload_id, "upload of")
            raise
        return done

    async def _complete(self, full: str, upload_id: str, etags: list[str | None],
                        crcs: list[int] | None = None) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{"ETag": e, "PartNumber": i + 1}
                                       for i, e in enumerate(etags)]
        if crcs is not None:  # an upload created with a checksum names each part's
            for part, crc in zip(parts, crcs):
                part["ChecksumCRC32C"] = _crc_header(crc)
        async with self._markers.creating(full):
            done: dict[str, Any] = await self._call(
                self.client.complete_multipart_upload, Bucket=self.bucket, Key=full,
                UploadId=upload_id, MultipartUpload={"Parts": parts},
            )
        return done

    async def _abort(self, full: str, upload_id: str, what: str) -> None:
        """Abort a multipart upload that failed or was cancelled (shielded: a cancelled
        upload is aborted too); a failure here is left to the next start's cleanup."""
        with trio.CancelScope(shield=True):
            try:
                await self._call(self.client.abort_multipart_upload, Bucket=self.bucket,
                                 Key=full, UploadId=upload_id)
            except (StoreUnavailable, TierError, ObjectMissing) as exc:
                log.warning("could not abort multipart %s %s (cleaned up at the next start): "
                            "%s", what, full, exc)

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        if meta.kind is Kind.DIRECTORY:
            full, body = self._key(key.rstrip("/") + "/"), b""
        else:
            full, body = self._key(key), (meta.target or "").encode("utf-8", "surrogateescape")
        async with self._markers.creating(full):
            await self._call(self.client.put_object, Bucket=self.bucket, Key=full, Body=body,
                             Metadata=meta.to_headers())
        if full.endswith("/"):
            log.debug("put directory marker s3://%s/%s", self.bucket, full)

    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        from botocore.exceptions import ClientError

        args: dict[str, Any] = {}
        if if_absent:
            args["IfNoneMatch"] = "*"
        if if_tag is not None:
            args["IfMatch"] = if_tag

        def put() -> str:
            try:
                reply = self.client.put_object(Bucket=self.bucket, Key=self._key(key),
                                               Body=data, **args)
            except ClientError as exc:
                # 412 when the condition fails; AWS answers 409 to a conditional write that
                # races another one on the same key: that one won.
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or (
                        if_tag is not None and code in _MISSING_CODES):
                    raise PreconditionFailed(f"{self.url}: {key}: {code}") from None
                raise
            return _tag(reply["ETag"]) or ""

        async with self._markers.creating(self._key(key)):
            tag: str = await self._call(put)
        return tag

    async def get_small(self, key: str) -> tuple[bytes, str]:
        def get() -> tuple[bytes, str]:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return reply["Body"].read(), _tag(reply["ETag"]) or ""

        result: tuple[bytes, str] = await self._call(get)
        return result

    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        if length <= 0:
            return 0

        def fetch() -> int:
            reply = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                           Range=f"bytes={offset}-{offset + length - 1}")
            done = 0
            for chunk in reply["Body"].iter_chunks(1024 * 1024):
                done += write_local(fd, chunk, fd_offset + done)
            return done

        result: int = await self._call(fetch)
        return result

    async def head(self, key: str) -> ObjectInfo:
        reply = await self._call(self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        return self._info(key, reply)

    def _info(self, key: str, reply: dict[str, Any]) -> ObjectInfo:
        headers = reply.get("Metadata", {})
        meta = ObjectMeta.from_headers(headers)
        if key.endswith("/"):
            # SeaweedFS keeps no metadata on a directory marker: then it is a directory as a
            # listing shows one (0755), not a file's default mode
            mode = meta.mode if "ckptfs-mode" in headers else 0o755
            meta = ObjectMeta(Kind.DIRECTORY, mode, meta.mtime_ns, meta.uid, meta.gid,
                              stamp=meta.stamp)
        restore = reply.get("Restore")
        state = None
        if restore:
            state = "ongoing" if 'ongoing-request="true"' in restore else "done"
        return ObjectInfo(key, int(reply.get("ContentLength", 0)), meta,
                          reply.get("StorageClass", "STANDARD"), state,
                          etag=_tag(reply.get("ETag")))

    async def list_dir(self, prefix: str) -> builtins.list[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = await self._call(lambda: list(paginator.paginate(
            Bucket=self.bucket, Prefix=self._key(prefix), Delimiter="/")))
        found: dict[str, ObjectInfo] = {}
        commons = [c["Prefix"] for page in pages for c in page.get("CommonPrefixes", [])]
        if commons and _lists_emptied_prefixes(pages[0]):
            commons = await self._holding_keys(commons)
        for common in commons:
            rel = self._rel(common)
            found[rel] = ObjectInfo(rel, 0, ObjectMeta(Kind.DIRECTORY, 0o755),
                                    meta_known=False)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = self._rel(obj["Key"])
                if rel == prefix or rel.endswith("/"):
                    continue  # the directory's own marker (or a stray "a//" key)
                found[rel] = ObjectInfo(rel, int(obj["Size"]), ObjectMeta(),
                                        obj.get("StorageClass", "STANDARD"), meta_known=False,
                                        etag=_tag(obj.get("ETag")))
        return [found[k] for k in sorted(found)]

    async def _holding_keys(self, prefixes: builtins.list[str]) -> builtins.list[str]:
        """The ``prefixes`` (full, from a delimited listing) with a key under them. SeaweedFS
        lists an emptied directory of its filer as a common prefix until its empty-folder
        cleanup removes it (minutes later): one ``MaxKeys=1`` listing each, concurrently,
        tells (an emptied prefix has no key; a directory marker is one)."""
        holding: set[str] = set()
        limiter = trio.CapacityLimiter(PREFIX_CHECKS)

        async def look(prefix: str) -> None:
            async with limiter:
                reply = await self._call(self.client.list_objects_v2, Bucket=self.bucket,
                                         Prefix=prefix, MaxKeys=1)
            if reply.get("Contents"):
                holding.add(prefix)

        async with trio.open_nursery() as nursery:
            for prefix in prefixes:
                nursery.start_soon(look, prefix)
        return [p for p in prefixes if p in holding]

    async def restore(self, key: str, days: int) -> None:
        from botocore.exceptions import ClientError

        def request() -> None:
            try:
                self.client.restore_object(
                    Bucket=self.bucket, Key=self._key(key),
                    RestoreRequest={"Days": days,
                                    "GlacierJobParameters": {"Tier": "Standard"}})
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "RestoreAlreadyInProgress":
                    raise

        await self._call(request)

    async def promote(self, key: str) -> None:
        # A copy onto itself that changes the storage class (allowed for a restored object),
        # keeping the metadata (REPLACE with the same metadata: copy_from).
        await self.copy_from(self.bucket, self._key(key), key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = await self._call(lambda: list(paginator.paginate(
            Bucket=self.bucket, Prefix=self._key(prefix))))
        found = []
        for page in pages:
            for obj in page.get("Contents", []):
                rel = self._rel(obj["Key"])
                if not rel:
                    continue
                kind = Kind.DIRECTORY if rel.endswith("/") else Kind.FILE
                found.append(ObjectInfo(rel, int(obj["Size"]), ObjectMeta(kind=kind),
                                        obj.get("StorageClass", "STANDARD"), meta_known=False,
                                        etag=_tag(obj.get("ETag"))))
        return found

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        return await self.copy_from(self.bucket, self._key(src), dst, if_etag=if_etag)

    async def copy_from(self, bucket: str, source: str, key: str, *,
                        if_etag: str | None = None) -> str | None:
        """Server-side copy of ``s3://bucket/source`` (a full key, of this tier or another
        one behind the same endpoint) to ``key`` of this tier, in this tier's storage class,
        with all of the source's metadata, at any size; the new object's ETag. ``if_etag``:
        only that version of the source (``PreconditionFailed`` otherwise)."""
        full = self._key(key)
        try:
            head = await self._call(self.client.head_object, Bucket=bucket, Key=source)
        except ObjectMissing:
            raise ObjectMissing(f"{self.url}: {source}: no such key") from None
        etag = _tag(head["ETag"]) or ""
        if if_etag is not None:
            if_etag = _tag(if_etag)
        if if_etag is not None and etag != if_etag:
            raise PreconditionFailed(f"{self.url}: {source}: changed (ETag {etag}, "
                                     f"expected {if_etag})")
        size = int(head.get("ContentLength", 0))
        onto_itself = bucket == self.bucket and source == full
        # Always named: a self-copy must change something, a copy from a colder tier must not
        # keep the source's class.
        args: dict[str, Any] = {"StorageClass": self.storage_class}
        if onto_itself:
            args.update(MetadataDirective="REPLACE", **_content_args(head))
        try:
            if size >= self.copy_threshold and size > 0:
                return await self._multipart_copy(bucket, source, full, size, head, etag, args)
            # A self-copy rewrites the metadata read above: only onto that version.
            pin = if_etag if if_etag is not None or not onto_itself else etag
            async with self._markers.creating(full):
                reply = await self._call(
                    self.client.copy_object, Bucket=self.bucket, Key=full,
                    CopySource={"Bucket": bucket, "Key": source},
                    **({"CopySourceIfMatch": pin} if pin is not None else {}), **args)
        except PreconditionFailed:
            if if_etag is not None:
                raise
            # Rewritten while we copied (between HEAD and copy, or between parts): the caller
            # asked for whatever is there, so a retry will do.
            raise StoreUnavailable(f"{self.url}: {source} changed during its copy") from None
        return _tag(reply.get("CopyObjectResult", {}).get("ETag"))

    async def _multipart_copy(self, bucket: str, source: str, full: str, size: int,
                              head: dict[str, Any], etag: str, args: dict[str, Any]) -> str | None:
        """UploadPartCopy in ``copy_part_size`` ranges, each pinned to ``etag``, into an upload
        created with the source's metadata and content headers; aborted on any failure."""
        create = {k: v for k, v in args.items() if k != "MetadataDirective"}
        create.update(_content_args(head))
        created = await self._call(self.client.create_multipart_upload, Bucket=self.bucket,
                                   Key=full, **create)
        upload_id = created["UploadId"]
        part = max(self.copy_part_size, MIN_PART_SIZE, -(-size // MAX_PARTS))
        count = -(-size // part)
        etags: list[str | None] = [None] * count
        slots = trio.Semaphore(self.part_concurrency)

        failed: list[Exception] = []

        async def copy_part(number: int, cancel: trio.CancelScope) -> None:
            first = (number - 1) * part
            last = min(size, first + part) - 1
            try:
                async with slots:
                    reply = await self._call(
                        self.client.upload_part_copy, Bucket=self.bucket, Key=full,
                        UploadId=upload_id, PartNumber=number,
                        CopySource={"Bucket": bucket, "Key": source}, CopySourceIfMatch=etag,
                        CopySourceRange=f"bytes={first}-{last}")
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the abort
                # The first failure is the copy's (as itself, not in an exception group).
                failed.append(exc)
                cancel.cancel()
                return
            etags[number - 1] = str(reply["CopyPartResult"]["ETag"])

        try:
            async with trio.open_nursery() as nursery:
                for number in range(1, count + 1):
                    nursery.start_soon(copy_part, number, nursery.cancel_scope)
            if failed:
                raise failed[0]
            done = await self._complete(full, upload_id, etags)
        except BaseException:
            await self._abort(full, upload_id, "copy to")
            raise
        return _tag(done.get("ETag"))

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        if key.endswith("/"):
            log.debug("delete directory marker s3://%s/%s", self.bucket, self._key(key))
        if if_etag is None:
            await self._call(self.client.delete_object, Bucket=self.bucket, Key=self._key(key))
            return
        # A HEAD first: not every S3 server honours If-Match on DeleteObject (AWS, MinIO and
        # SeaweedFS differ), and one that ignores it must not delete a newer version. Where
        # it is honoured it also closes the gap between the HEAD and the delete.
        try:
            found = (await self.head(key)).etag
        except ObjectMissing:
            return
        if found != if_etag:
            raise PreconditionFailed(f"{self.url}: {key}: changed (ETag {found}, expected "
                                     f"{if_etag})")
        await self._call(self.client.delete_object, Bucket=self.bucket, Key=self._key(key),
                         IfMatch=if_etag)

    async def aclose(self) -> None:
        self.client.close()


def _drop_expect(request: Any, **_: Any) -> None:
    """``before-send``: no ``Expect: 100-continue`` (see the module docstring). Returns None:
    anything else would be taken for the reply."""
    request.headers.pop("Expect", None)


def _content_args(head: dict[str, Any]) -> dict[str, Any]:
    """The user metadata and content headers of a HEAD reply, as arguments of a write
    (CreateMultipartUpload, or CopyObject with MetadataDirective=REPLACE)."""
    args: dict[str, Any] = {"Metadata": dict(head.get("Metadata", {}))}
    for name in _CONTENT_HEADERS:
        if head.get(name):
            args[name] = head[name]
    return args


def _tag(etag: object) -> str | None:
    """An ETag as the tier's tag: quoted (``"..."``, as HEAD and listings send it), whether
    the server quoted it or not (SeaweedFS does not in CopyObject/UploadPartCopy results)."""
    if not etag:
        return None
    text = str(etag)
    if text.startswith(('"', 'W/"')):
        return text
    return f'"{text}"'


# Listings in flight at once while checking a directory's common prefixes (_holding_keys).
PREFIX_CHECKS = 16


def _lists_emptied_prefixes(reply: dict[str, Any]) -> bool:
    """Whether the server that sent this listing may list an emptied directory as a common
    prefix: SeaweedFS (its filer keeps the folder until a cleanup minutes later). Only then
    does ``list_dir`` pay one more request per subdirectory; AWS S3, MinIO and Ceph list a
    prefix only while a key is under it."""
    server = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("server", "")
    return isinstance(server, str) and server.startswith("SeaweedFS")


# -- CRC32C of parts, from the integrity blocks (integrity.py) ------------------------------------

_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _whole_crc(checksum: str | None) -> int | None:
    """The whole-file CRC32C of ``ObjectMeta.checksum`` ("crc32c:<8 hex>"), if it is one."""
    if not checksum or not checksum.startswith("crc32c:"):
        return None
    try:
        return int(checksum[7:], 16)
    except ValueError:
        return None


def _crc_header(crc: int) -> str:
    """A CRC32C as S3 wants it in ``x-amz-checksum-crc32c``: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _part_size(wanted: int, sums: BlockSums, size: int) -> int:
    """The part size of a multipart upload whose part CRCs come from ``sums``: ``wanted``
    rounded up to a whole number of integrity blocks (and to at most MAX_PARTS parts)."""
    wanted = max(wanted, -(-size // MAX_PARTS))
    return -(-wanted // sums.block_size) * sums.block_size


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _crc_shift(length: int) -> list[int]:
    """The linear map (32 columns over GF(2)) that carries a CRC32C over ``length`` more
    bytes: crc(a + b) == _gf2_times(_crc_shift(len(b)), crc(a)) ^ crc(b) (zlib's
    crc32_combine, with the Castagnoli polynomial)."""
    odd = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = [_gf2_times(odd, c) for c in odd]  # two zero bits
    odd = [_gf2_times(even, c) for c in even]  # four zero bits
    shift = [1 << n for n in range(32)]
    while length:
        even = [_gf2_times(odd, c) for c in odd]  # one zero byte, then 4, 16, ...
        if length & 1:
            shift = [_gf2_times(even, c) for c in shift]
        length >>= 1
        if not length:
            break
        odd = [_gf2_times(even, c) for c in even]  # two zero bytes, then 8, 32, ...
        if length & 1:
            shift = [_gf2_times(odd, c) for c in shift]
        length >>= 1
    return shift


def _part_crcs(sums: BlockSums, size: int, part_size: int) -> list[int]:
    """The CRC32C of each ``part_size`` part of a ``size``-byte file, combined from its block
    CRCs (``part_size`` is a whole number of blocks)."""
    block = sums.block_size
    per_part = part_size // block
    full, tail = _crc_shift(block), None
    last_len = size - (len(sums.crcs) - 1) * block
    out: list[int] = []
    for first in range(0, len(sums.crcs), per_part):
        crc = sums.crcs[first]
        for j in range(first + 1, min(first + per_part, len(sums.crcs))):
            if j == len(sums.crcs) - 1 and last_len != block:
                tail = tail or _crc_shift(last_len)
                crc = _gf2_times(tail, crc) ^ sums.crcs[j]
            else:
                crc = _gf2_times(full, crc) ^ sums.crcs[j]
        out.append(crc)
    return out
