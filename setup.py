"""Optional native build of the request path with mypyc (metadata lives in pyproject.toml).

With `GATEWAY_NATIVE=1` the modules in `NATIVE` are compiled to C extensions by mypyc: the same
typed Python source, about a quarter less CPU per proxied request (`bench/results/overhead.md`
measures both builds side by side). `make native` builds them in place; `make pure` removes them.
Without the variable this is a plain pure-Python build. Everything runs either way; `gateway serve`
says which build it runs and refuses compiled modules older than their sources.
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

# The modules every proxied request runs through. Nothing outside this list may subclass a class
# defined in it (compiled classes cannot have interpreted subclasses). The exception trees
# (`errors.py`, `client/errors.py`) stay interpreted: compiled, class-level defaults (`code = None`)
# were missing on instances of the base class. Packages' `__init__.py` stay interpreted: a compiled
# one gets a wrong `__path__` (`gateway/gateway/routing`), so its submodules that nothing compiled
# had imported yet could not be found.
NATIVE = [
    "backends/base.py",
    "backends/chat_templates.py",
    "backends/openai_compat.py",
    "backends/ranks.py",
    "backends/sglang.py",
    "backends/trtllm.py",
    "backends/vllm.py",
    "gateway/access/auth.py",
    "gateway/client/connection.py",
    "gateway/client/pool.py",
    "gateway/client/response.py",
    "gateway/cluster/clock.py",
    "gateway/http/native_front.py",
    "gateway/http/reader.py",
    "gateway/http/wire.py",
    "gateway/json_codec.py",
    "gateway/kvcache/cache.py",
    "gateway/kvcache/index.py",
    "gateway/kvcache/registry.py",
    "gateway/observability/arms.py",
    "gateway/observability/lockfree.py",
    "gateway/observability/metrics.py",
    "gateway/observability/outcome.py",
    "gateway/observability/reservoir.py",
    "gateway/proxy/accounting.py",
    "gateway/proxy/attempts.py",
    "gateway/proxy/deadlines.py",
    "gateway/proxy/dispatch.py",
    "gateway/proxy/exchange.py",
    "gateway/proxy/relay.py",
    "gateway/proxy/request.py",
    "gateway/proxy/responses_sse.py",
    "gateway/proxy/routes.py",
    "gateway/proxy/service.py",
    "gateway/proxy/shadow.py",
    "gateway/proxy/sse.py",
    "gateway/routing/affinity.py",
    "gateway/routing/base.py",
    "gateway/routing/capabilities.py",
    "gateway/routing/cost.py",
    "gateway/routing/features.py",
    "gateway/routing/hashing.py",
    "gateway/routing/latency.py",
    "gateway/routing/prefix_index.py",
    "gateway/routing/registry.py",
    "gateway/routing/response_owners.py",
    "gateway/routing/scoring.py",
    "gateway/routing/simple.py",
    "gateway/routing/sla.py",
    "gateway/routing/split.py",
    "gateway/routing/state.py",
    "gateway/routing/tokens.py",
    "gateway/state/generations.py",
    "gateway/state/outliers.py",
    "gateway/state/pool.py",
    "gateway/state/splits.py",
    "gateway/stats/book.py",
    "gateway/stats/quantiles.py",
    "gateway/stats/window.py",
]

# Written in C, built with the compiled modules: the SSE relay's walk over a read's events and the JSON
# facts it reads of a chunk (why: gateway/proxy/sse_scan.py, their Python reference and the pure
# build's fallback).
C_EXTENSIONS = [Extension("gateway.proxy._sse_scan", ["gateway/proxy/_sse_scan.c", "gateway/proxy/_json_facts.c"],
                          depends=["gateway/proxy/_json_facts.h"], extra_compile_args=["-O2"])]

ext_modules = []
if os.environ.get("GATEWAY_NATIVE") == "1":
    from mypyc.build import mypycify

    ext_modules = [*mypycify(NATIVE, opt_level="3", group_name="gateway._native"), *C_EXTENSIONS]

setup(ext_modules=ext_modules)
