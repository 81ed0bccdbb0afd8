"""The registry cache on the request path: a change made through this server holds at once,
even against a read of the registry that was already in flight when the change was made; the
requests that miss the cache together share one read."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from loraplex.registry import Registry, RegistryConfig
from loraplex.registry.registry_errors import AuthenticationError
from loraplex.server.cache import SingleFlight, TTLCache, read_cached
from loraplex.server.principals import Principals


class _SlowKeys:
    """The registry's key service, with `authenticate` held after its database read until the
    test lets it return: a read in flight."""

    def __init__(self, keys) -> None:
        self._keys = keys
        self.has_read = threading.Event()
        self.may_return = threading.Event()
        self.num_reads = 0

    def authenticate(self, presented: str):
        self.num_reads += 1
        principal = self._keys.authenticate(presented)
        self.has_read.set()
        assert self.may_return.wait(10)
        return principal


class _SlowRegistry:
    def __init__(self, registry: Registry) -> None:
        self.keys = _SlowKeys(registry.keys)
        self.tenants = registry.tenants


@pytest.fixture
def registry(tmp_path: Path):
    with Registry.open(RegistryConfig(data_dir=tmp_path / "data")) as opened:
        opened.tenants.create("acme")
        yield opened


def test_a_key_read_before_its_revocation_is_not_cached_after_it(registry: Registry) -> None:
    created = registry.keys.create(tenant="acme")
    slow = _SlowRegistry(registry)
    principals = Principals(slow, ttl_s=60)  # type: ignore[arg-type]
    reader = threading.Thread(target=principals.authenticate, args=(created.secret,))
    reader.start()
    assert slow.keys.has_read.wait(10)  # it read the key while it was valid ...
    registry.keys.revoke(created.key.id)  # ... and the admin API revokes it now
    principals.forget()
    slow.keys.may_return.set()
    reader.join()
    assert principals.cached(created.secret) is None
    with pytest.raises(AuthenticationError, match="revoked"):
        principals.authenticate(created.secret)


def test_the_cache_keeps_only_values_read_since_the_last_forget() -> None:
    cache: TTLCache[str, int] = TTLCache(ttl_s=60)
    read_at = cache.generation
    cache.forget(lambda key: key == "other")  # any change made meanwhile: the value may be stale
    assert cache.put("k", 1, read_at) == 1 and cache.get("k") is None
    cache.put("k", 2, cache.generation)
    assert cache.get("k") == 2
    cache.forget(lambda key: key == "k")
    assert cache.get("k") is None


def test_requests_that_miss_the_cache_together_share_one_read(registry: Registry) -> None:
    created = registry.keys.create(tenant="acme")
    slow = _SlowRegistry(registry)
    principals = Principals(slow, ttl_s=60)  # type: ignore[arg-type]

    async def burst() -> list:
        callers = [asyncio.ensure_future(principals.principal_of(created.secret)) for _ in range(20)]
        await asyncio.to_thread(slow.keys.has_read.wait, 10)
        slow.keys.may_return.set()
        return await asyncio.gather(*callers)

    assert {p.tenant for p in asyncio.run(burst())} == {"acme"}
    assert slow.keys.num_reads == 1


def test_a_request_after_a_revocation_does_not_share_a_read_begun_before_it(registry: Registry) -> None:
    created = registry.keys.create(tenant="acme")
    slow = _SlowRegistry(registry)
    principals = Principals(slow, ttl_s=60)  # type: ignore[arg-type]

    async def scenario() -> tuple:
        before = asyncio.ensure_future(principals.principal_of(created.secret))
        await asyncio.to_thread(slow.keys.has_read.wait, 10)  # read while the key was valid
        registry.keys.revoke(created.key.id)
        principals.forget()
        after = asyncio.ensure_future(principals.principal_of(created.secret))
        await asyncio.sleep(0.05)
        slow.keys.may_return.set()
        return await asyncio.gather(before, after, return_exceptions=True)

    before, after = asyncio.run(scenario())
    assert before.tenant == "acme"  # it began before the change
    assert isinstance(after, AuthenticationError)
    assert slow.keys.num_reads == 2


def test_a_failed_read_fails_every_request_that_shared_it_and_is_not_kept(registry: Registry) -> None:
    slow = _SlowRegistry(registry)
    slow.keys.may_return.set()
    principals = Principals(slow, ttl_s=60)  # type: ignore[arg-type]

    async def burst() -> list:
        return await asyncio.gather(*[principals.principal_of("lp-unknown") for _ in range(5)],
                                    return_exceptions=True)

    assert all(isinstance(result, AuthenticationError) for result in asyncio.run(burst()))
    assert slow.keys.num_reads == 1
    asyncio.run(burst())
    assert slow.keys.num_reads == 2  # unknown keys are never cached


def test_requests_for_one_adapter_that_miss_the_cache_share_one_read() -> None:
    from types import SimpleNamespace

    from loraplex.server.adapter_names import AdapterNames

    reads: list[tuple[str, str]] = []
    may_return = threading.Event()

    def get(tenant: str, name: str) -> SimpleNamespace:
        reads.append((tenant, name))
        assert may_return.wait(10)
        return SimpleNamespace(digest=f"digest-of-{name}", tenant=tenant, name=name)

    names = AdapterNames(SimpleNamespace(adapters=SimpleNamespace(get=get)), None, 16, ttl_s=60)  # type: ignore[arg-type]

    async def burst() -> list:
        callers = [asyncio.ensure_future(names.lookup("acme", name)) for name in ("style", "style", "other")]
        await asyncio.sleep(0.1)
        may_return.set()
        return await asyncio.gather(*callers)

    records = asyncio.run(burst())
    assert [r.digest for r in records] == ["digest-of-style", "digest-of-style", "digest-of-other"]
    assert sorted(reads) == [("acme", "other"), ("acme", "style")]
    assert names.names_of("digest-of-style") == ("style",)


def test_a_read_that_answers_no_drops_the_value_kept_for_outages() -> None:
    """A key cached before, past its time, re-read slowly (the stale value is served meanwhile,
    as during an outage): once the read answers that the key is revoked, the stale value is
    gone, and no later request is served with it."""
    cache: TTLCache[str, str] = TTLCache(ttl_s=0.01, max_stale_s=600)
    reads: SingleFlight[tuple[int, str], str] = SingleFlight()
    cache.put("key", "acme", cache.generation)
    gate, finished = threading.Event(), threading.Event()

    def revoked() -> str:
        try:
            assert gate.wait(10)
            raise AuthenticationError("this API key has been revoked")
        finally:
            finished.set()

    async def scenario() -> None:
        await asyncio.sleep(0.05)  # past its time
        assert await read_cached(cache, reads, "key", revoked) == "acme"  # the read has not answered
        gate.set()
        assert await asyncio.to_thread(finished.wait, 10)
        for _ in range(100):  # the read's end reaches the event loop
            await asyncio.sleep(0.01)
            if cache.get_stale("key") is None:
                break
        assert cache.get_stale("key") is None
        with pytest.raises(AuthenticationError, match="revoked"):
            await read_cached(cache, reads, "key", revoked)

    asyncio.run(scenario())
