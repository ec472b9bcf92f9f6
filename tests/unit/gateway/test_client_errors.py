"""How upstream client failures map onto the gateway's error classes (and so onto retries,
ejections and the client's status)."""

from __future__ import annotations

import pytest

from gateway.client import UpstreamConnectError, UpstreamLocalExhaustion, UpstreamProtocolError, UpstreamResetError
from gateway.errors import (
    BackendConnectError,
    BackendError,
    BackendProtocolError,
    BackendResetError,
    BackendTimeout,
    GatewayOverloaded,
)
from gateway.proxy.attempts import map_client_errors


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (TimeoutError(), BackendTimeout),
        (UpstreamConnectError("refused"), BackendConnectError),
        (UpstreamProtocolError("cut"), BackendProtocolError),
        (UpstreamResetError("closed after the request was sent"), BackendResetError),
    ],
)
def test_backend_failures_name_the_backend(raised: Exception, expected: type[BackendError]) -> None:
    with pytest.raises(expected) as info, map_client_errors("b1"):
        raise raised
    assert info.value.backend == "b1"


def test_running_out_of_descriptors_is_a_503_of_ours_not_a_backend_failure() -> None:
    with pytest.raises(GatewayOverloaded) as info, map_client_errors("b1"):
        raise UpstreamLocalExhaustion("EMFILE")
    assert not isinstance(info.value, BackendError)  # so it neither ejects the backend nor retries
    assert info.value.status == 503
    assert info.value.headers["Retry-After"] == "1"


def test_only_what_never_reached_an_engine_is_retryable() -> None:
    from backends.base import ErrorBody
    from gateway.errors import BackendOverloaded

    assert BackendConnectError("b").retryable
    assert BackendOverloaded("b", 503, ErrorBody(message="busy", type="server_error")).retryable
    assert not BackendResetError("b").retryable  # the request was written: the engine may have generated
    assert not BackendTimeout("b").retryable
    assert not BackendProtocolError("b").retryable
