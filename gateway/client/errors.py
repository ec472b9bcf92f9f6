"""The upstream client's one exception tree; the proxy maps it once, at its edge.

    UpstreamClientError
    ├── UpstreamLocalExhaustion  this process is out of descriptors or memory (not the upstream's fault)
    ├── UpstreamConnectError     the connection could not be opened (refused, unreachable, DNS, TLS,
    │                            connect timeout, pool closed): nothing was sent, so nothing was done
    ├── UpstreamResetError       the request was written and the connection closed before the response
    │                            head: the upstream may have done the work (a non-streaming generation
    │                            sends its head last), so this is never safe to resend
    └── UpstreamProtocolError    the response was malformed, or the connection closed mid-head or mid-body

The split between "connect" and "reset" is Envoy's `connect-failure` vs `reset` retry condition: only
the first proves the upstream did nothing.
"""

from __future__ import annotations

import errno

LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class UpstreamClientError(Exception):
    """Base of every failure of this client."""


class UpstreamConnectError(UpstreamClientError):
    """No connection: the request was never sent."""


class UpstreamResetError(UpstreamClientError):
    """The request was sent; the connection closed before any response byte arrived."""


class UpstreamProtocolError(UpstreamClientError):
    """The response was malformed or cut short."""


class UpstreamLocalExhaustion(UpstreamClientError):
    """This process could not open a socket (out of file descriptors or memory): the upstream is not
    at fault, and another upstream would fail the same way."""
