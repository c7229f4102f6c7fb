"""Where Ray Train persists checkpoints, and proof that a worker can write there before it trains.

Checkpoints reach S3 through pyarrow, whose bundled AWS SDK for C++ resolves credentials on its own:
it reads EKS Pod Identity credentials (`AWS_CONTAINER_CREDENTIALS_FULL_URI` plus the token in
`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`) only from AWS SDK 1.11.263 on, and a pyarrow built with an
older SDK finds no credentials in a pod where boto3 works. Without a check the run trains until its
first checkpoint and then fails. `check_writable` writes and deletes a marker object first; when that
fails, `diagnose` tells the causes apart by doing the same with boto3.

    python -m workloads.launch.storage s3://bucket/prefix   # the same check from a shell in a pod
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING, Callable, Optional

from workloads.context import PreflightError

if TYPE_CHECKING:
    import pyarrow.fs

MARKER_DIR = ".write-check"


class StorageNotWritableError(PreflightError):
    """A worker could not write to the run's storage; the message names the bucket, the identity
    and the likely cause."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def resolve_storage(storage_path: str) -> tuple[Optional["pyarrow.fs.FileSystem"], str]:
    """Ray Train's storage as (filesystem, path on it), resolved once, in the job's entrypoint.

    A URI goes through pyarrow, whose S3 filesystem honours the standard AWS environment
    (credentials, AWS_REGION, and AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL), so `s3://bucket/prefix`
    reaches the real bucket or any S3-compatible endpoint the same way. The resolved filesystem
    carries its endpoint to the TrainController and every worker, whatever their own node's
    environment says. A local folder is left to Ray as it is: (None, the folder).
    """
    if "://" not in storage_path:
        return None, storage_path
    import pyarrow.fs

    try:
        return pyarrow.fs.FileSystem.from_uri(storage_path)
    except OSError as exc:  # pyarrow.ArrowInvalid (a bad URI) is already a ValueError
        raise ValueError(f"cannot open storage {storage_path}: {_last_line(str(exc))}") from None


def marker_name(*, host: str, pid: int) -> str:
    return f"{host}-{pid}"


def check_writable(
    filesystem: "pyarrow.fs.FileSystem",
    folder: str,
    *,
    uri: str,
    marker: str,
    diagnose_failure: Optional[Callable[[str, str], str]] = None,
) -> None:
    """Write and delete `folder/.write-check/<marker>` on `filesystem`; StorageNotWritableError if
    either fails. `uri` is how the user named the storage (for the message)."""
    path = f"{folder.rstrip('/')}/{MARKER_DIR}/{marker}"
    try:
        filesystem.create_dir(f"{folder.rstrip('/')}/{MARKER_DIR}", recursive=True)
        with filesystem.open_output_stream(path) as out:
            out.write(b"this worker can write checkpoints here\n")
        filesystem.delete_file(path)
    except OSError as exc:
        error = _last_line(str(exc))
        cause = (diagnose_failure or diagnose)(uri, error)
        raise StorageNotWritableError(
            f"cannot write checkpoints to {uri} from {socket.gethostname()}: {error}\n  {cause}"
        ) from None


def _bucket_and_key(uri: str) -> tuple[str, str]:
    rest = uri.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix


def role_of(arn: str) -> str:
    """The IAM role (or user) an STS caller ARN names: `arn:aws:sts::1:assumed-role/R/session` -> R."""
    resource = arn.split(":", 5)[-1]
    kind, _, rest = resource.partition("/")
    if kind == "assumed-role":
        return rest.split("/", 1)[0]
    return rest or arn


def diagnose(uri: str, error: str) -> str:
    """Why pyarrow could not write to `uri`: the same marker written with boto3 (which reads every
    credential source the AWS CLI does) separates a pyarrow that cannot read Pod Identity
    credentials from a role that lacks permission and from a pod that has no credentials at all."""
    if not uri.startswith("s3://"):
        return "check that the folder exists on every node and that the Ray worker's user can write to it"
    bucket, prefix = _bucket_and_key(uri)
    pod_identity = bool(os.environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"))
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
        import pyarrow
    except ImportError as exc:
        return f"boto3 is not installed here ({exc.name}), so the cause cannot be narrowed down"
    config = botocore.config.Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2})
    # EKS pods get AWS_REGION; boto3 reads AWS_DEFAULT_REGION.
    session = boto3.session.Session(region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
    try:
        arn = session.client("sts", config=config).get_caller_identity()["Arn"]
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.CredentialRetrievalError) as exc:
        where = (f"the EKS Pod Identity agent gave none ({_last_line(str(exc))}): check the Pod Identity "
                 "association of the Ray service account and the eks-pod-identity-agent add-on" if pod_identity
                 else "no credential source is set in this pod: the Ray service account needs its Pod Identity "
                 "association (infra/storage.py)")
        return f"no AWS credentials reach this process: {where}"
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        return f"boto3 could not read the caller identity either ({_last_line(str(exc))})"
    role = role_of(arn)
    key = f"{prefix.rstrip('/')}/{MARKER_DIR}/boto3-{socket.gethostname()}".lstrip("/")
    try:
        s3 = session.client("s3", config=config)
        s3.put_object(Bucket=bucket, Key=key, Body=b"")
        s3.delete_object(Bucket=bucket, Key=key)
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        return (f"role {role} may not write to bucket {bucket} ({code}): it needs s3:PutObject, s3:GetObject, "
                f"s3:DeleteObject and s3:ListBucket on {bucket}/{prefix or '*'}")
    except botocore.exceptions.BotoCoreError as exc:
        return f"bucket {bucket} is not reachable from this pod ({_last_line(str(exc))})"
    if pod_identity:
        return (f"boto3 writes to bucket {bucket} as role {role}, pyarrow {pyarrow.__version__} does not: its "
                "bundled AWS SDK for C++ predates EKS Pod Identity support (1.11.263), so it finds no "
                "credentials. Use an image whose pyarrow is built with a newer SDK, or IAM roles for "
                "service accounts (AWS_WEB_IDENTITY_TOKEN_FILE), which older SDKs read")
    return (f"boto3 writes to bucket {bucket} as role {role}, pyarrow {pyarrow.__version__} does not: compare "
            "the credential sources each sees (AWS_* variables, ~/.aws) and the endpoint (AWS_ENDPOINT_URL_S3)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m workloads.launch.storage s3://bucket/prefix|/absolute/folder", file=sys.stderr)
        return 2
    uri = argv[0]
    try:
        filesystem, path = resolve_storage(uri)
        if filesystem is None:
            import pyarrow.fs

            filesystem = pyarrow.fs.LocalFileSystem()
        check_writable(filesystem, path, uri=uri, marker=marker_name(host=socket.gethostname(), pid=os.getpid()))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StorageNotWritableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{uri}: writable from {socket.gethostname()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
