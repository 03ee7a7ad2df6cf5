"""Resolve a model location to a local directory holding the model files.

Three kinds of location are understood:

* a local directory (``/opt/ml/model``, ``./model``, ``~/models/x``),
* an S3 prefix (``s3://bucket/prefix/``) that holds the *extracted* model files;
  it is downloaded once into ``download_dir`` and reused on later calls,
* a Hugging Face hub id (``org/name`` or ``name``), fetched with
  ``huggingface_hub.snapshot_download`` into the usual HF cache.

Every failure is reported as an :class:`ArtifactError` whose message is one
sentence meant to be shown to the user as is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
PATH_PREFIXES = ("/", "./", "../", "~")
HF_ALLOW_PATTERNS = [
    "*.safetensors", "*.json", "tokenizer*", "*.txt", "*.model",
    "*.tiktoken", "*.py", "*.jinja",
]


class ArtifactError(Exception):
    """One clear human sentence, shown to the user as is."""


def resolve_model(model_id: str | None, model_dir: str | None, *, download_dir: str,
                  revision: str | None = None, max_workers: int = 8, progress: bool = True) -> str:
    """Return a local directory holding the model files."""
    if not model_id:
        if model_dir is None:
            raise ArtifactError("no model: set option.model_id or pass --model-dir")
        return _local_dir(model_dir)
    if model_id.startswith("s3://"):
        return _resolve_s3(model_id, download_dir, max_workers, progress)
    if os.path.isdir(os.path.expanduser(model_id)) or model_id.startswith(PATH_PREFIXES):
        return _local_dir(model_id)
    return _resolve_hub(model_id, revision, max_workers, progress)


def _local_dir(path: str) -> str:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise ArtifactError(f"model directory {path} does not exist.")
    if not os.path.isdir(full):
        raise ArtifactError(f"model path {path} is not a directory.")
    return full


# --------------------------------------------------------------------------- S3


def _split_s3_url(url: str) -> tuple[str, str, str]:
    """Return (bucket, prefix ending in '/' or empty, normalised url)."""
    if url.lower().endswith(ARCHIVE_SUFFIXES):
        parent = url.rsplit("/", 1)[0] + "/"
        raise ArtifactError(
            f"{url} is a model.tar.gz archive, which is not supported as option.model_id; "
            "set option.model_id to the S3 prefix that holds the extracted model files, "
            f'e.g. "{parent}".')
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ArtifactError(f"{url} has no bucket name; expected s3://bucket/prefix/.")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix, f"s3://{bucket}/{prefix}"


def _resolve_s3(url: str, download_dir: str, max_workers: int, progress: bool) -> str:
    bucket, prefix, norm = _split_s3_url(url)
    digest = hashlib.sha256(norm.encode()).hexdigest()[:16]
    target = os.path.abspath(os.path.join(download_dir, digest))
    if os.path.isdir(target):
        logger.info("reusing cached download of %s at %s", norm, target)
        return target
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client = boto3.client("s3")
        objects = _list_objects(client, bucket, prefix)
        if not objects:
            raise ArtifactError(f"no objects under {norm}; check the bucket and prefix.")
        return _download_all(client, bucket, objects, norm, target, max_workers, progress)
    except ClientError as exc:
        err = exc.response.get("Error", {})
        reason = f"{err.get('Code', 'error')}: {err.get('Message') or exc}"
        raise ArtifactError(f"could not download the model from {norm} ({reason}).") from exc
    except BotoCoreError as exc:
        raise ArtifactError(f"could not download the model from {norm} ({exc}).") from exc


def _list_objects(client: Any, bucket: str, prefix: str) -> list[tuple[str, str, int]]:
    """Return (key, relative path, size) for every file object under prefix."""
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):
                continue
            rel = os.path.normpath(key[len(prefix):])
            if rel.startswith("..") or os.path.isabs(rel):
                raise ArtifactError(f"s3://{bucket}/{key} has a key that escapes its prefix.")
            found.append((key, rel, int(obj.get("Size", 0))))
    return found


def _download_all(client: Any, bucket: str, objects: list[tuple[str, str, int]], url: str,
                  target: str, max_workers: int, progress: bool) -> str:
    from tqdm import tqdm

    parent = os.path.dirname(target) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".tmp-", dir=parent)
    total = sum(size for _, _, size in objects)
    start = time.monotonic()
    lock = threading.Lock()
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc=url, disable=not progress) as bar:
            def advance(n: int) -> None:
                with lock:
                    bar.update(n)

            def fetch(item: tuple[str, str, int]) -> None:
                dest = os.path.join(tmp, item[1])
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                client.download_file(bucket, item[0], dest, Callback=advance)

            with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
                list(pool.map(fetch, objects))
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("downloaded %d files (%.1f MB) from %s to %s in %.1f s",
                len(objects), total / 1e6, url, target, time.monotonic() - start)
    return target


def _publish(tmp: str, target: str) -> None:
    """Atomically move a finished download into place; a concurrent winner is kept."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------- hub


def _resolve_hub(repo_id: str, revision: str | None, max_workers: int, progress: bool) -> str:
    import huggingface_hub
    from huggingface_hub import errors

    name = repo_id if revision is None else f"{repo_id} (revision {revision})"
    start = time.monotonic()
    try:
        path = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=HF_ALLOW_PATTERNS,
            max_workers=max_workers, etag_timeout=10,
            tqdm_class=None if progress else _quiet_tqdm())
    except errors.HFValidationError as exc:
        raise ArtifactError(
            f"{repo_id} is not a local directory, an s3:// prefix "
            "or a valid Hugging Face model id.") from exc
    except errors.IncompleteSnapshotError as exc:
        raise ArtifactError(
            f"the cached copy of {name} is incomplete and the Hugging Face hub could not be reached "
            "to finish it; rerun with network access or use a local directory.") from exc
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as exc:
        raise _offline_error(name) from exc
    except errors.GatedRepoError as exc:
        raise ArtifactError(
            f"{repo_id} is a gated model on the Hugging Face hub; accept its terms on the hub "
            "and set HF_TOKEN to a token that has access.") from exc
    except errors.RepositoryNotFoundError as exc:
        raise ArtifactError(
            f"{repo_id} was not found on the Hugging Face hub; check the id, "
            "or set HF_TOKEN if it is a private repository.") from exc
    except errors.RevisionNotFoundError as exc:
        raise ArtifactError(
            f"revision {revision} of {repo_id} was not found on the Hugging Face hub.") from exc
    except errors.HfHubHTTPError as exc:
        raise ArtifactError(f"the Hugging Face hub refused to serve {name} ({exc}).") from exc
    except Exception as exc:
        if _is_network_error(exc):
            raise _offline_error(name) from exc
        raise
    logger.info("resolved %s from the Hugging Face hub to %s in %.1f s",
                name, path, time.monotonic() - start)
    return str(path)


def _offline_error(name: str) -> ArtifactError:
    return ArtifactError(
        f"{name} could not be fetched from the Hugging Face hub and is not in the local HF cache; "
        "this machine appears to be offline, so use a local directory or an s3:// prefix "
        "as option.model_id, or pre-populate the HF cache.")


def _is_network_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return type(exc).__module__.split(".")[0] in {"httpx", "httpx2", "requests", "urllib3"}


def _quiet_tqdm() -> type:
    from tqdm import tqdm

    class QuietTqdm(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietTqdm
