"""Where the Kubernetes API server is and how we prove who we are: a kubeconfig, or the pod's
service account (in-cluster). kubernetes_asyncio's own loaders do the reading.

In-cluster: `KUBERNETES_SERVICE_HOST` / `KUBERNETES_SERVICE_PORT`, and in the service-account
directory `token` (re-read every minute by the library, as projected tokens rotate), `ca.crt` and
`namespace` (the default namespace). The library builds an `https://` URL there: the in-cluster
path cannot speak plain HTTP. A kubeconfig may point anywhere, plain HTTP included, and its
context's `namespace` is the default one; it is never written back (`persist_config=False`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import ConfigException
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.config.kube_config import load_kube_config

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class CredentialsError(Exception):
    """No usable kubeconfig or in-cluster service account."""


@dataclass(frozen=True, slots=True)
class Credentials:
    kubeconfig: Path | None = None
    context: str | None = None
    service_account: Path = SERVICE_ACCOUNT
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    async def client(self) -> tuple[ApiClient, str]:
        """A new API client (the caller closes it) and the default namespace. Raises `CredentialsError`."""
        configuration = Configuration()
        namespace: str | None
        try:
            if self.kubeconfig is not None:
                loader = await load_kube_config(
                    config_file=str(self.kubeconfig),
                    context=self.context,
                    client_configuration=configuration,
                    persist_config=False,
                )
                context = (loader.current_context or {}).get("context") or {}
                namespace = context.get("namespace")
            else:
                InClusterConfigLoader(
                    token_filename=str(self.service_account / "token"),
                    cert_filename=str(self.service_account / "ca.crt"),
                    environ=dict(self.environ),
                ).load_and_set(configuration)
                namespace = _read(self.service_account / "namespace")
        except (ConfigException, OSError, yaml.YAMLError, ValueError, KeyError, TypeError) as exc:
            where = f"kubeconfig {self.kubeconfig}" if self.kubeconfig else f"in-cluster ({self.service_account})"
            raise CredentialsError(f"{where}: {type(exc).__name__}: {exc}") from exc
        return ApiClient(configuration=configuration), namespace or "default"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None
