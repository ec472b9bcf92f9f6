"""Why a backend's KV-event source hears nothing, and what fixes it (pure): the log line and the
`/admin/backends` hint of a source that went silent (`BackendCache.tick`).

Which side binds decides most of it. vLLM (`vllm/distributed/kv_events.py`) and SGLang
(`srt/disaggregation/kv_events.py`) share one rule for their ZMQ PUB socket: they *bind* when the
`--kv-events-config` endpoint has a wildcard (`*`, `::`) or is `ipc://` / `inproc://`, and
*connect* otherwise; their replay ROUTER always binds. So an engine given a concrete address
(`tcp://10.0.0.5:5557`) connects, and a gateway that connects there too (`bind` left false)
reaches nobody, while an engine given `tcp://*:5557` binds, and a gateway that binds as well
(`bind: true`) is never connected to. `connected` is what the intake's socket monitor saw: whether
any peer completed a connection (None when it cannot know: the supervisor's relay listens).
"""

from __future__ import annotations

from ..settings import Backend


def explain(b: Backend, *, heard: bool, connected: bool | None, failed: str | None = None) -> str:
    """One sentence for the log and the admin view: what was (not) heard, the likely cause, the fix.
    `failed` is why the intake's socket cannot be set up, when it cannot."""
    kv = b.kv_events
    assert kv is not None
    wait = f"{kv.silent_after_s:g} s"
    if heard:
        where = kv.endpoint or f"{b.base_url.rstrip('/')}/kv_cache_events"
        return (f"KV events from {where} stopped: no batch within {wait} of a response that showed the engine "
                f"stored new blocks; routing uses the approximate index for {b.name} until batches arrive again "
                "and answers verify the index")
    endpoint = kv.endpoint
    if endpoint is None:
        return (f"no KV event ever arrived from {b.base_url.rstrip('/')}/kv_cache_events, although the engine "
                f"stored new blocks more than {wait} before: trtllm-serve queues KV-cache events only with "
                "`event_buffer_max_size` above 0 in its `kv_cache_config` (and block reuse on), and each poll "
                "drains the queue, so nothing else may poll it (another gateway on the same engine)")
    head = (f"no KV event ever arrived {'at' if kv.bind else 'from'} {endpoint}, although the engine stored new "
            f"blocks more than {wait} before")
    if connected:
        topic = (f"a topic that starts with `kv_events.topic` ({kv.topic!r})" if kv.topic
                 else "any topic (the gateway subscribes to all)")
        return (f"{head}, and a publisher is connected: it sends nothing the gateway subscribes to. Check the "
                "engine's `--kv-events-config`: `enable_kv_cache_events: true`, `publisher: \"zmq\"`, "
                f"{topic}; and that prefix caching is on")
    port = endpoint.rpartition(":")[2] if endpoint.startswith("tcp://") else ""
    if failed is not None:
        if kv.bind:
            return (f"{head}: the gateway cannot bind it ({failed}). Another process binds it: an engine whose "
                    "`--kv-events-config` endpoint has a wildcard (tcp://*:PORT) or is ipc:// binds it itself. "
                    f"Remove `bind` from backend {b.name} and set `kv_events.endpoint` to the engine's address "
                    f"(tcp://<engine host>:{port}), or stop whatever else holds the address")
        return f"{head}: the gateway cannot connect to it ({failed})"
    maybe = "" if connected is False else "if "
    if endpoint.startswith(("ipc://", "inproc://")):
        if kv.bind:
            return (f"{head}: vLLM and SGLang bind {endpoint.split(':', 1)[0]}:// endpoints themselves, so the "
                    f"gateway must connect to them: remove `kv_events.bind` from backend {b.name}")
        return (f"{head}: {maybe}nothing is bound at that path. vLLM and SGLang bind ipc:// endpoints "
                "themselves: check that the engine's `--kv-events-config` endpoint is this path on this host")
    if kv.bind:
        return (f"{head}: {maybe}no publisher connected to it (the gateway binds it: `kv_events.bind: true`). "
                "vLLM and SGLang connect only when their `--kv-events-config` endpoint is a concrete address; "
                f"with a wildcard (tcp://*:{port}) or ipc:// they bind it themselves. Start the engine with endpoint "
                f"tcp://<an address of this gateway host>:{port}, or remove `bind` from backend {b.name} and set "
                f"`kv_events.endpoint` to the engine's address (tcp://<engine host>:{port})")
    return (f"{head}: {maybe}nothing accepted the gateway's connection there. vLLM and SGLang bind their "
            "publisher only when its `--kv-events-config` endpoint has a wildcard (tcp://*:PORT) or is ipc://; "
            f"an engine started with endpoint {endpoint} connects to that address, as the gateway does, and "
            f"nobody binds. Set `kv_events.bind: true` on backend {b.name} (the gateway then binds {endpoint}, "
            f"which must be an address of this host, and the engine connects to it), or start the engine with "
            f"endpoint tcp://*:{port} and leave `bind` false")
