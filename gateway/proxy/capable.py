"""Which of a route's backends can serve a request, from what it needs (`routing.capabilities`) and
what each backend serves (`backends.capabilities`, with the config's overrides).

Built per config generation. A backend's capabilities are resolved once, from its config and the
kind of route it serves. When no backend of the route can serve a request, the client gets a 400
`invalid_request_error` whose `param` names the feature and whose message names the backends that
lack it: no backend was asked, so none is blamed (no outlier verdict, no retry, one 400 recorded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.base import Endpoint
from backends.capabilities import Feature, resolve
from backends.values import value

from ..errors import InvalidRequest
from ..routing.capabilities import Needs, blocking, bridged, lacking, param_for
from ..settings import Backend, Route, Settings

_PATHS = {
    Endpoint.CHAT: "/v1/chat/completions", Endpoint.COMPLETIONS: "/v1/completions", Endpoint.RESPONSES: "/v1/responses",
    Endpoint.EMBEDDINGS: "/v1/embeddings", Endpoint.TOKENIZE: "/tokenize", Endpoint.DETOKENIZE: "/detokenize",
}


@value
class Capable:
    """The route's backends that can serve the request, in config order, and those of them that
    serve it through the gateway's Responses-to-chat translation."""

    backends: tuple[str, ...]
    bridged: frozenset[str] = frozenset()


class CapabilityError(InvalidRequest):
    code = "unsupported_parameter"


class Capabilities:
    """Per generation: every backend's capabilities, and the capable subset of a route for a request.

    `config_of(name)` finds a backend's config (backends may be added at run time); a backend's
    capabilities depend on the kind of the route it is asked for."""

    def __init__(self, settings: Settings, config_of: Callable[[str], Backend]) -> None:
        self._config_of = config_of
        self._cache: dict[tuple[str, bool], frozenset[Feature]] = {}
        # per route: what all of its backends serve (the common case needs nothing more); a discovery
        # pool's backends serve their runtime's defaults (an entry has no capability overrides)
        statics = {b.name for b in settings.backends}
        pools = {e.name: e.runtime for e in settings.discovery}
        self._common: dict[str, frozenset[Feature]] = {}
        self._all: dict[str, tuple[Sequence[str], Capable]] = {}
        for route in settings.routes:
            embeddings = route.kind == "embeddings"
            caps = [self.of(n, route) if n in statics else resolve(pools[n], embeddings=embeddings, overrides={})
                    for n in route.candidates if n in statics or n in pools]
            self._common[route.model] = frozenset.intersection(*caps) if caps else frozenset()

    def of(self, name: str, route: Route) -> frozenset[Feature]:
        embeddings = route.kind == "embeddings"
        key = (name, embeddings)
        caps = self._cache.get(key)
        if caps is None:
            config = self._config_of(name)
            caps = self._cache[key] = resolve(config.runtime, embeddings=embeddings,
                                              overrides=config.capabilities.overrides())
        return caps

    def capable(self, route: Route, candidates: Sequence[str], need: Needs) -> Capable:
        """The subset of `candidates` (the route's backends) that can serve `need`; raises
        CapabilityError when there is none."""
        common = self._common.get(route.model)
        if common is not None and need.features <= common and need.serves[0] in common:
            every = self._all.get(route.model)
            if every is not None and every[0] is candidates:  # the same (expanded) list: the same answer
                return every[1]
            found = Capable(tuple(candidates))
            self._all[route.model] = (candidates, found)
            return found
        names: list[str] = []
        via_chat: list[str] = []
        gaps: list[tuple[Feature, ...]] = []
        for name in candidates:
            caps = self.of(name, route)
            gap = lacking(caps, need)
            if gap:
                gaps.append(gap)
                continue
            names.append(name)
            if bridged(caps, need):
                via_chat.append(name)
        if gaps and not names:
            raise self._refusal(route, candidates, need, gaps)  # (no candidates at all: no healthy backend)
        return Capable(tuple(names), frozenset(via_chat))

    def _refusal(self, route: Route, candidates: Sequence[str], need: Needs,
                 gaps: Sequence[tuple[Feature, ...]]) -> CapabilityError:
        feature = blocking(gaps)
        who = "; ".join(
            f"{name} ({self._config_of(name).runtime}) lacks {', '.join(gap)}"
            for name, gap in zip(candidates, gaps, strict=True)
        )
        param = param_for(feature, need.endpoint)
        if feature is Feature.RESPONSES and need.untranslatable is not None:
            param = need.untranslatable
            message = (f"'{param}' needs a backend that serves /v1/responses itself, and no backend of model "
                       f"`{route.model}` does: {who}.")
        elif param == "model":
            message = f"The model `{route.model}` does not serve {_PATHS[need.endpoint]}: {who}."
        else:
            message = (f"Unsupported parameter: '{param}' ({feature}) is not supported by any backend of model "
                       f"`{route.model}`: {who}.")
        return CapabilityError(message, param=param)
