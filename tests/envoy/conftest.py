from __future__ import annotations

from tests.integration.fixtures import loop_thread

__all__ = ["loop_thread"]
