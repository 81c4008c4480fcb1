"""Checkpoint storage in an S3 bucket, or any S3-compatible store (torch-free): the second implementation
of :class:`phalanx.checkpoint.storage.Storage` beside the POSIX directory. boto3 loads only when a bucket
is used."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable
from typing import Any


class S3Storage:
    """A prefix of an S3 bucket, or of any S3-compatible store (MinIO, Ceph RGW, GCS's XML API, ...).

    boto3 is configured the standard way, so a Pod needs nothing phalanx-specific: credentials from the
    environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), a web identity (EKS IRSA, Pod Identity) or
    a profile; ``AWS_ENDPOINT_URL`` for a store other than AWS; ``AWS_REGION``. Atomicity is the store's: a
    PUT, or the completion of a multipart upload (files above :data:`PART_BYTES`, sent in parts by several
    threads), makes an object appear whole; a failed upload is aborted and leaves nothing. "Directories"
    are key prefixes.
    """

    PART_BYTES = 64 << 20

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None) -> None:
        if client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as exc:
                raise ValueError("s3:// checkpoint storage needs boto3: pip install 'phalanx[s3]'") from exc
            client = boto3.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))
        self.client: Any = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.reads = 0
        self.read_bytes = 0
        self._lock = threading.Lock()

    def _key(self, path: str) -> str:
        return "/".join(p for p in (self.prefix, path.strip("/")) if p)

    def _error(self, exc: Exception, path: str) -> OSError:
        """An OSError for a boto3 error, FileNotFoundError for a missing key."""
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        message = f"{self.url(path)}: {exc}"
        return FileNotFoundError(message) if code in ("404", "NoSuchKey", "NotFound") else OSError(message)

    def write_atomic(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Uploads the chunks as one object (in parts when large), streaming them: nothing is staged."""
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        reader = _ChunkReader(chunks)
        config = TransferConfig(
            multipart_threshold=self.PART_BYTES, multipart_chunksize=self.PART_BYTES, max_concurrency=4
        )
        try:
            # Buffered: boto3 takes one read() of the threshold's size as "all there is" when it comes short,
            # and would send the whole file in one PUT (which S3 refuses above 5 GiB).
            stream = io.BufferedReader(reader, buffer_size=1 << 20)
            self.client.upload_fileobj(stream, self.bucket, self._key(path), Config=config)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, path) from exc
        return reader.size

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``, which S3 and MinIO honour): the store refuses it with 412
        when the key exists, and with 409 when another conditional write of the key is in flight."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data, IfNoneMatch="*")
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise self._error(exc, path) from exc
        except BotoCoreError as exc:
            raise self._error(exc, path) from exc
        return True

    def read(self, path: str) -> bytes:
        """Downloads a whole object and counts the read."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            data: bytes = self.client.get_object(Bucket=self.bucket, Key=self._key(path))["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, path) from exc
        with self._lock:
            self.reads += 1
            self.read_bytes += len(data)
        return data

    def exists(self, path: str) -> bool:
        """Whether an object exists (a HEAD, not counted as a read)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(path))
        except (BotoCoreError, ClientError) as exc:
            error = self._error(exc, path)
            if isinstance(error, FileNotFoundError):
                return False
            raise error from exc
        return True

    def _objects(self, path: str, *, delimiter: str = "") -> Iterable[dict[str, Any]]:
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self._key(path)
        prefix = f"{prefix}/" if prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, Delimiter=delimiter
        )
        try:
            yield from pages
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, path) from exc

    def list(self, path: str) -> list[str]:
        """Names directly under a prefix: objects and "subdirectories"."""
        names: set[str] = set()
        for page in self._objects(path, delimiter="/"):
            names.update(p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in page.get("CommonPrefixes", []))
            names.update(o["Key"].rsplit("/", 1)[-1] for o in page.get("Contents", []))
        return sorted(names)

    def remove_file(self, path: str) -> None:
        """Deletes one object (S3 answers a missing key with success too)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(path))
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, path) from exc

    def remove_dir(self, path: str) -> None:
        """Deletes every object under a prefix, a thousand per request; an OSError names what stayed."""
        from botocore.exceptions import BotoCoreError, ClientError

        keys = [o["Key"] for page in self._objects(path) for o in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):
            delete = {"Objects": [{"Key": k} for k in keys[start : start + 1000]], "Quiet": True}
            try:
                done = self.client.delete_objects(Bucket=self.bucket, Delete=delete)
            except (BotoCoreError, ClientError) as exc:
                raise self._error(exc, path) from exc
            if errors := done.get("Errors"):  # a quiet delete answers with the keys it could not delete
                first = errors[0]
                detail = f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                raise OSError(f"{self.url(path)}: {len(errors)} objects not deleted, e.g. {detail}")

    def url(self, path: str) -> str:
        """The object's ``s3://`` URL."""
        return f"s3://{self.bucket}/{self._key(path)}"


class _ChunkReader(io.RawIOBase):
    """A readable stream over an iterable of byte chunks (boto3 uploads file objects), counting bytes."""

    def __init__(self, chunks: Iterable[bytes | memoryview]) -> None:
        self._chunks = iter(chunks)
        self._current = memoryview(b"")
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._current.nbytes:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._current = memoryview(chunk).cast("B")
        n = min(len(buffer), self._current.nbytes)
        buffer[:n] = self._current[:n]
        self._current = self._current[n:]
        self.size += n
        return n
