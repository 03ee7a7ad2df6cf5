"""Tests for engines.weights.artifacts against a real moto S3 server and a real HF cache layout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import boto3
import huggingface_hub.constants as hf_constants
import pytest

from engines.weights.artifacts import ArtifactError, resolve_model
from tests.support import free_port

BUCKET = "models"
PREFIX = "llama/v1"
FAKE_MODEL = {
    "config.json": b'{"model_type": "llama", "pad": "' + b"x" * 4096 + b'"}',
    "model-00001-of-00002.safetensors": os.urandom(9 * 1024 * 1024),  # above the multipart threshold
    "model-00002-of-00002.safetensors": os.urandom(200 * 1024),
    "tokenizer/tokenizer.json": os.urandom(8 * 1024),
    "nested/deeper/weights.bin": os.urandom(16 * 1024),
}


@pytest.fixture(scope="module")
def bucket(moto_endpoint):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=BUCKET)
    for rel, data in FAKE_MODEL.items():
        s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{rel}", Body=data)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/emptyfolder/", Body=b"")  # folder marker
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}-other/stray.json", Body=b"{}")  # sibling prefix
    s3.put_object(Bucket=BUCKET, Key="other/thing.txt", Body=b"x")
    return BUCKET


@pytest.fixture
def aws_env(moto_endpoint, monkeypatch, tmp_path):
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # fresh session sees this test's env
    return moto_endpoint


def _tree(root: str) -> dict[str, bytes]:
    base = Path(root)
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def test_s3_download_matches_and_is_cached(bucket, aws_env, tmp_path, monkeypatch):
    dl = str(tmp_path / "dl")
    first = resolve_model(f"s3://{bucket}/{PREFIX}/", None, download_dir=dl, progress=False)
    assert os.path.dirname(first) == dl
    assert _tree(first) == FAKE_MODEL
    assert os.listdir(dl) == [os.path.basename(first)]  # no temp dir left behind

    # Second call must not touch S3: point it at a closed port and forbid client creation.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(boto3, "client", lambda *a, **k: pytest.fail("S3 was contacted"))
    again = resolve_model(f"s3://{bucket}/{PREFIX}/", None, download_dir=dl, progress=False)
    assert again == first
    assert _tree(again) == FAKE_MODEL


def test_closed_endpoint_is_reported(bucket, aws_env, tmp_path, monkeypatch):
    """Sanity check for the test above: an uncached URL with a dead endpoint fails."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    url = f"s3://{bucket}/{PREFIX}/"
    with pytest.raises(ArtifactError, match=url):
        resolve_model(url, None, download_dir=str(tmp_path), progress=False)
    assert os.listdir(tmp_path) == []


def test_prefix_without_slash_maps_to_same_dir(bucket, aws_env, tmp_path):
    with_slash = resolve_model(f"s3://{bucket}/{PREFIX}/", None,
                               download_dir=str(tmp_path / "a"), progress=False)
    without = resolve_model(f"s3://{bucket}/{PREFIX}", None,
                            download_dir=str(tmp_path / "b"), progress=False, max_workers=2)
    assert os.path.basename(with_slash) == os.path.basename(without)
    assert _tree(without) == FAKE_MODEL  # the sibling "llama/v1-other/" prefix is not mixed in


def test_tar_gz_is_rejected(bucket, aws_env, tmp_path):
    with pytest.raises(ArtifactError, match="prefix") as info:
        resolve_model(f"s3://{bucket}/{PREFIX}/model.tar.gz", None, download_dir=str(tmp_path))
    assert f'"s3://{bucket}/{PREFIX}/"' in str(info.value)


def test_empty_prefix(bucket, aws_env, tmp_path):
    with pytest.raises(ArtifactError, match="no objects"):
        resolve_model(f"s3://{bucket}/does-not-exist/", None, download_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_missing_bucket(bucket, aws_env, tmp_path):
    url = "s3://no-such-bucket/model/"
    with pytest.raises(ArtifactError, match=url) as info:
        resolve_model(url, None, download_dir=str(tmp_path))
    assert "NoSuchBucket" in str(info.value)


def test_local_dir_returns_abspath(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("./m", None, download_dir=str(tmp_path)) == str(tmp_path / "m")
    assert resolve_model("m", None, download_dir=str(tmp_path)) == str(tmp_path / "m")


@pytest.mark.parametrize("path", ["/definitely/not/here", "./missing-model", "../missing-model",
                                  "~/missing-model-xyz"])
def test_missing_local_path(path, tmp_path):
    with pytest.raises(ArtifactError, match="missing-model|not/here"):
        resolve_model(path, None, download_dir=str(tmp_path))


def test_model_dir_fallback(tmp_path):
    assert resolve_model(None, str(tmp_path), download_dir="/unused") == str(tmp_path)
    assert resolve_model("", str(tmp_path), download_dir="/unused") == str(tmp_path)
    with pytest.raises(ArtifactError, match="nope"):
        resolve_model(None, str(tmp_path / "nope"), download_dir="/unused")
    with pytest.raises(ArtifactError, match="no model"):
        resolve_model(None, None, download_dir="/unused")


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    """Offline HF with an empty cache. huggingface_hub reads these env vars at import
    time into huggingface_hub.constants, so the constants are patched as well."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_offline_without_cache_fails_fast(hf_offline, tmp_path):
    start = time.monotonic()
    with pytest.raises(ArtifactError, match="offline") as info:
        resolve_model("some-org/some-model", None, download_dir=str(tmp_path), progress=False)
    assert time.monotonic() - start < 5
    assert "some-org/some-model" in str(info.value)


def test_hub_offline_uses_prepopulated_cache(hf_offline, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_offline / "models--org--name"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    got = resolve_model("org/name", None, download_dir=str(tmp_path), progress=False)
    assert os.path.realpath(got) == os.path.realpath(snapshot)
    assert (Path(got) / "config.json").read_text() == '{"model_type": "llama"}'
