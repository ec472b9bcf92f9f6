"""One gateway, however many processes: what the workers of a host share through their supervisor,
and what replicas share through the optional store.

Roles: `clock` (the one time base of every gateway process), `channel` (framed two-way RPC over a
private Unix socket), `scrape` (one /metrics merged over workers by each family's declared rule,
monotonic across restarts), `windows` and `host_views` (the hub's merged /metrics and comparison, a
retired worker's windows kept until they age out), `hub` (the supervisor's side: probes once,
limits, fans admin writes out, merges metrics and windows), `committed` (the one config generation
the supervisor owns and hands its workers), `commit` (the two-phase reload it coordinates), `probes`
(its per-backend probes, forwarded as they come), `link` and `following` (a worker's side of the
same channel, and of the committed generation), `supervisor` (starts, restarts and stops the
workers; slots that cannot start stay down), `coordinator` (what a process's admin endpoints call:
its own state, or the hub's), `overrides` and `fleet` (live weights and window data shared through
the store).

May import every room below it (state, access, stats, observability, admin, kvcache) and `tasks`; only `app` and
`process` import it.
"""
