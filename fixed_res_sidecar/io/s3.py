"""S3 clients: one boto3 client and one pyarrow filesystem per process and endpoint settings.

Both take their settings from the standard AWS chain, `AWS_ENDPOINT_URL` included, and retry
transient errors with backoff (`S3_MAX_ATTEMPTS`).
"""

import functools
import os
from urllib.parse import urlparse

import pyarrow.fs as pafs

S3_MAX_ATTEMPTS = 10


def _aws_settings() -> tuple[str | None, str | None, str | None]:
    """The settings that change which client is right (the cache key of the clients)."""
    return (
        os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
        os.environ.get("AWS_PROFILE"),
        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
    )


def s3_client():
    return _s3_client(*_aws_settings())


def s3_filesystem() -> pafs.S3FileSystem:
    return _s3_filesystem(*_aws_settings())


# Credentials of these kinds never change, so pyarrow may hold a copy; others (assumed roles,
# instance profiles, SSO) expire and are left to pyarrow's own AWS chain, which refreshes them.
STATIC_CREDENTIAL_METHODS = {"explicit", "env", "shared-credentials-file", "config-file"}


@functools.lru_cache(maxsize=8)
def _s3_client(endpoint: str | None, profile: str | None, region: str | None):
    import boto3.session
    from botocore.config import Config

    # boto3 reads AWS_ENDPOINT_URL, the region and the profile's endpoint_url itself.
    session = boto3.session.Session(profile_name=profile)
    config = Config(retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"})
    return session.client("s3", config=config)


@functools.lru_cache(maxsize=8)
def _s3_filesystem(endpoint: str | None, profile: str | None, region: str | None) -> pafs.S3FileSystem:
    import boto3.session

    client = _s3_client(endpoint, profile, region)
    endpoint_url = client.meta.endpoint_url
    kwargs = {
        "region": client.meta.region_name or "us-east-1",
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS),
    }
    credentials = boto3.session.Session(profile_name=profile).get_credentials()
    if credentials is not None and credentials.method in STATIC_CREDENTIAL_METHODS:
        frozen = credentials.get_frozen_credentials()
        kwargs.update(access_key=frozen.access_key, secret_key=frozen.secret_key, session_token=frozen.token)
    if not (urlparse(endpoint_url).hostname or "").endswith("amazonaws.com"):
        # A custom endpoint (MinIO, moto, ...) that boto3 resolved from the AWS chain.
        scheme, _, host = endpoint_url.partition("://")
        kwargs.update(endpoint_override=host, scheme=scheme)
    return pafs.S3FileSystem(**kwargs)
