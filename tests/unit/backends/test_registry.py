from __future__ import annotations

import pytest

from backends.base import Runtime
from backends.registry import adapter_for
from backends.triton import TritonAdapter


@pytest.mark.parametrize("runtime", list(Runtime))
def test_every_runtime_has_an_adapter_that_knows_its_runtime(runtime: Runtime) -> None:
    assert adapter_for(runtime).runtime is runtime


def test_chat_template_reaches_triton() -> None:
    adapter = adapter_for(Runtime.TRITON, chat_template="llama3")
    assert isinstance(adapter, TritonAdapter)
    assert adapter.chat_template == "llama3"
