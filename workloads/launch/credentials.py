"""The secrets a job needs from outside (MLflow's credentials, the Hugging Face hub's token), read
where the cluster keeps them: never from the job's entrypoint or runtime_env, which Ray keeps in its
job table and shows to whoever lists the jobs (`python -m workloads list`, the dashboard).

On EKS every Ray pod mounts the Kubernetes Secret CREDENTIALS_SECRET of the Ray namespace (optional:
pods start without it) at CREDENTIALS_DIR, one file per key (infra/raycluster.py). The job's driver
and each training worker call `load_credentials` first: each name of CREDENTIAL_NAMES the process
lacks is set from its file, so MLflow's client and huggingface_hub find it where they look, in the
environment. On a local cluster (`run --local`) the processes inherit them from the environment of
the command instead. Nothing here imports Ray, so infra/ reads the names too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping, Optional

CREDENTIALS_SECRET = "ray-job-credentials"
"""The Secret of the Ray namespace the Ray pods mount (created by the user: docs/SECURITY.md)."""
CREDENTIALS_DIR = "/var/run/secrets/ray-eks/job-credentials"
CREDENTIAL_NAMES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN")
"""MLflow's basic-auth user and password and its bearer token, and the Hugging Face hub's token, as
those libraries read them from the environment."""


def load_credentials(*, folder: Path = Path(CREDENTIALS_DIR),
                     environ: Optional[MutableMapping[str, str]] = None) -> list[str]:
    """Set each of CREDENTIAL_NAMES that `environ` (this process's by default) lacks from its file in
    `folder`; the names set, never their values."""
    env = os.environ if environ is None else environ
    loaded = []
    for name in CREDENTIAL_NAMES:
        path = folder / name
        if env.get(name) or not path.is_file():
            continue
        value = path.read_text().strip()
        if value:
            env[name] = value
            loaded.append(name)
    return loaded
