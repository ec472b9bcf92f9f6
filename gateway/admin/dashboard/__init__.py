"""The live comparison over HTTP: `/admin/compare` (JSON) and `/dashboard` (a self-contained page)."""

from .handlers import DashboardHandlers

__all__ = ["DashboardHandlers"]
