"""Build the source a config entry describes. The composition root calls this, passing its clock,
sleep and random generator (tests pass theirs)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Mapping
from pathlib import Path

from .config import DiscoveryEntry
from .source import Clock, Sleep, Source


def make_source(
    entry: DiscoveryEntry,
    *,
    sleep: Sleep = asyncio.sleep,
    clock: Clock = time.monotonic,
    rng: random.Random | None = None,
    service_account: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> Source:
    """A `DnsSource` or `KubernetesSource` for `entry`. kubernetes_asyncio is imported only here,
    and only for a Kubernetes entry (it takes seconds to import). `service_account` and `environ`
    replace the in-cluster credential locations (tests)."""
    rng = rng or random.Random()
    if entry.dns is not None:
        from .dns import DnsSource

        cfg = entry.dns
        return DnsSource(
            entry.name,
            nameserver=cfg.nameserver,
            timeout_s=cfg.timeout_s,
            host=cfg.host,
            port=cfg.port,
            srv=cfg.srv,
            interval_s=cfg.interval_s,
            search=cfg.resolver is None,
            sleep=sleep,
            clock=clock,
            rng=rng,
        )
    assert entry.kubernetes is not None
    from .kubernetes import KubernetesSource
    from .kubernetes_auth import Credentials

    kube = entry.kubernetes
    credentials = Credentials(kubeconfig=kube.kubeconfig, context=kube.context)
    if service_account is not None:
        credentials = dataclasses.replace(credentials, service_account=service_account)
    if environ is not None:
        credentials = dataclasses.replace(credentials, environ=environ)
    return KubernetesSource(
        entry.name,
        credentials=credentials,
        namespace=kube.namespace,
        service=kube.service,
        label_selector=kube.label_selector,
        port=kube.port,
        sleep=sleep,
        clock=clock,
        rng=rng,
    )
