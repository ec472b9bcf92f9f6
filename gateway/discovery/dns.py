"""DNS discovery: A/AAAA records of a name, or SRV records and then A/AAAA of each target.

Yields (see source.py) the endpoints each resolution names, one resolution every `interval_s`
(measured start to start), and `Failed` when a resolution fails, retrying then with backoff capped
at `interval_s` (`gateway.retrying.forever`: a failure streak ends at the next answer). An answer
may name only some of the records (Route 53 multivalue answers, capped or rotating answers):
`changes()` holds an address it leaves out for the entry's `leave_after_answers` and `leave_after_s`
(hysteresis.py) before it leaves.

What counts as an answer and what as a failure:
- NXDOMAIN, or no records of the asked type (NODATA), is an answer: that name has no endpoints now.
  A headless Service scaled to zero answers NXDOMAIN, and its backends leave (once the hold is over).
- A timeout, SERVFAIL, REFUSED, an unreachable nameserver or a malformed reply is a failure: the
  last known set stays. Any failed query fails the whole resolution (a half answer is not complete).
- SRV: every record's target is resolved (A and AAAA) and used with the record's port; priority
  and weight are ignored (the routing policy weighs backends), and a target of `.` means none.

TTLs: we re-resolve every `interval_s` whatever the records' TTLs say, and keep no cache of our own
(dnspython's resolver cache stays off), so a record lives at most `interval_s` plus whatever the
nameserver itself caches. A TTL shorter than the interval does not make us resolve sooner.

Library: dnspython's `dns.asyncresolver` rather than aiodns. Both are maintained; dnspython is
pure Python (nothing to compile in the container image or under mypyc), ships type hints, takes a
nameserver address and port per resolver instance, reports TTLs, and its exceptions tell NXDOMAIN
and NODATA (answers) apart from timeouts and SERVFAIL (failures), which is the distinction above.
aiodns wraps c-ares (a C extension) and reports most of these as one error class with a code.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator

import dns.asyncresolver
import dns.exception
import dns.rdata
import dns.rdatatype
import dns.resolver
from dns.rdtypes.IN.SRV import SRV

from ..retrying import Backoff, forever
from .endpoints import Endpoint
from .source import Clock, Failed, Observation, Resolved, Sleep, failure


class DnsError(Exception):
    """A resolution that failed (not NXDOMAIN or NODATA, which are answers)."""


def make_resolver(nameserver: tuple[str, int] | None, *, timeout_s: float) -> dns.asyncresolver.Resolver:
    """A resolver for one nameserver (tests point it at a local server), or the system's
    (/etc/resolv.conf; raises `dns.resolver.NoResolverConfiguration` when there is none).
    `timeout_s` bounds a whole query, shared among the nameservers; nothing is cached."""
    if nameserver is None:
        resolver = dns.asyncresolver.Resolver(configure=True)
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [nameserver[0]]
        resolver.port = nameserver[1]
    resolver.lifetime = timeout_s
    resolver.timeout = timeout_s / max(1, len(resolver.nameservers))
    resolver.cache = None
    return resolver


class DnsSource:
    """A/AAAA of `host` on `port`, or SRV of `srv`; one resolution per `interval_s`."""

    def __init__(
        self,
        name: str,
        *,
        nameserver: tuple[str, int] | None = None,
        timeout_s: float = 2.0,
        host: str | None = None,
        port: int | None = None,
        srv: str | None = None,
        interval_s: float = 5.0,
        search: bool = False,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if (host is None) == (srv is None) or (host is not None and port is None):
            raise ValueError("DnsSource needs `host` and `port`, or `srv`")
        self._name = name
        self._nameserver = nameserver
        self._timeout_s = timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None  # made at the first resolution
        self._host = host
        self._port = port
        self._srv = srv
        self._interval_s = interval_s
        self._search = search  # apply resolv.conf search domains (only with the system's resolver)
        self._rng = rng or random.Random()
        self._backoff = backoff or Backoff(max_s=interval_s, rng=self._rng)
        self._sleep = sleep
        self._clock = clock

    @property
    def name(self) -> str:
        return self._name

    async def observe(self) -> AsyncGenerator[Observation, None]:
        while True:
            started, endpoints = self._clock(), frozenset[Endpoint]()
            async for attempt in forever(wait=self._backoff, sleep=self._sleep, retry_on=DnsError):
                with attempt:
                    started = self._clock()  # the interval runs from the start of the attempt that answered
                    endpoints = await self.resolve()
                error = failure(attempt, DnsError)
                if error is not None:
                    yield Failed(str(error))  # then the loop sleeps its backoff and resolves again
            yield Resolved(endpoints)
            await self._sleep(max(0.0, started + self._interval_s - self._clock()))

    async def resolve(self) -> frozenset[Endpoint]:
        """One resolution: every endpoint the records name now. Raises `DnsError`."""
        if self._host is not None:
            assert self._port is not None
            return frozenset(Endpoint.of(a, self._port) for a in await self._addresses(self._host))
        assert self._srv is not None
        records = [r for r in await self._query(self._srv, dns.rdatatype.SRV) if isinstance(r, SRV)]
        targets = sorted({r.target.to_text() for r in records if r.target.to_text() != "."})
        found = await asyncio.gather(*(self._addresses(t) for t in targets))
        by_target = dict(zip(targets, found, strict=True))
        return frozenset(
            Endpoint.of(address, r.port) for r in records for address in by_target.get(r.target.to_text(), ())
        )

    async def _addresses(self, host: str) -> list[str]:
        v4, v6 = await asyncio.gather(self._query(host, dns.rdatatype.A), self._query(host, dns.rdatatype.AAAA))
        return [r.to_text() for r in (*v4, *v6)]

    async def _query(self, name: str, rdtype: dns.rdatatype.RdataType) -> list[dns.rdata.Rdata]:
        kind = rdtype.name
        try:
            if self._resolver is None:  # here, so that a missing resolv.conf is a failure to retry
                self._resolver = make_resolver(self._nameserver, timeout_s=self._timeout_s)
            answer = await self._resolver.resolve(name, rdtype, raise_on_no_answer=False, search=self._search)
        except dns.resolver.NXDOMAIN:
            return []
        except (dns.exception.DNSException, OSError) as exc:  # timeouts, SERVFAIL, REFUSED, no resolv.conf
            raise DnsError(f"{kind} {name}: {type(exc).__name__}: {exc}") from None
        return [] if answer.rrset is None else list(answer.rrset)
