"""Scrape a backend's model card with the health poll: its context length (`max_model_len`), which
the gateway's `/v1/models` reports. Read once a backend answers, then every `CARD_INTERVAL_S` (a
restarted engine may serve another context length); a failure keeps the last value."""

from __future__ import annotations

import aiohttp

from backends.model_card import card_path, max_model_len

from .pool import BackendState

CARD_INTERVAL_S = 60.0


async def scrape_card(session: aiohttp.ClientSession, state: BackendState, now: float) -> None:
    path = card_path(state.config.runtime)
    if path is None or (state.card_scraped_at is not None and now - state.card_scraped_at < CARD_INTERVAL_S):
        return
    try:
        async with session.get(state.config.base_url + path, timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            body = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError):
        return  # not up yet: asked again at the next poll
    state.card_scraped_at = now  # answered (a backend behind an API key answers 401: configure max_model_len)
    if status != 200:
        return
    length = max_model_len(body, state.config.model)
    if length is not None:
        state.max_model_len = length
