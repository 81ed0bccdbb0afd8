"""The tokenizer pool's fairness: a tenant with a queue of long calls does not hold back
another tenant's call."""

from __future__ import annotations

import asyncio
import threading

from loraplex.server.fair_pool import FairPool


def _blocking(log: list[str], name: str, release: threading.Event):
    def call(resource: str) -> str:
        log.append(f"{name} on {resource}")
        assert release.wait(10)
        return name
    return call


def test_another_tenant_gets_a_worker_while_one_tenant_queues_many_calls() -> None:
    async def scenario() -> list[str]:
        pool = FairPool(["worker-0", "worker-1"], max_per_tenant=1, name="test")
        log: list[str] = []
        release = threading.Event()
        flood = [asyncio.ensure_future(pool.run("a", _blocking(log, f"a{i}", release))) for i in range(5)]
        await asyncio.sleep(0)  # the calls are queued (scheduling happens in run(), on the loop)
        other = asyncio.ensure_future(pool.run("b", lambda resource: f"b on {resource}"))
        assert await asyncio.wait_for(other, 5) == "b on worker-0"  # not behind a1..a4
        assert log == ["a0 on worker-1"]  # tenant a never held two workers
        release.set()
        assert await asyncio.gather(*flood) == [f"a{i}" for i in range(5)]  # in the order given
        pool.close()
        return log

    assert len(asyncio.run(scenario())) == 5


def test_the_tenant_served_longest_ago_goes_first() -> None:
    async def scenario() -> list[str]:
        pool = FairPool(["only"], max_per_tenant=1, name="test")
        order: list[str] = []
        gate = threading.Event()
        first = asyncio.ensure_future(pool.run("a", lambda r: (gate.wait(10), order.append("a0"))))
        await asyncio.sleep(0)  # a0 holds the worker
        calls = [pool.run("a", lambda r, i=i: order.append(f"a{i}")) for i in (1, 2, 3)]
        calls.append(pool.run("b", lambda r: order.append("b0")))
        tasks = [asyncio.ensure_future(call) for call in calls]
        await asyncio.sleep(0)  # all queued behind it
        gate.set()
        await asyncio.gather(first, *tasks)
        pool.close()
        return order

    assert asyncio.run(scenario()) == ["a0", "b0", "a1", "a2", "a3"]  # b had no turn yet


def test_a_caller_that_leaves_before_its_turn_drops_its_call() -> None:
    async def scenario() -> list[str]:
        pool = FairPool(["only"], max_per_tenant=1, name="test")
        ran: list[str] = []
        gate = threading.Event()
        running = asyncio.ensure_future(pool.run("a", lambda r: gate.wait(10)))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(pool.run("b", lambda r: ran.append("b")))
        await asyncio.sleep(0)
        waiting.cancel()
        gate.set()
        await running
        assert await pool.run("c", lambda r: "c") == "c"
        pool.close()
        return ran

    assert asyncio.run(scenario()) == []
