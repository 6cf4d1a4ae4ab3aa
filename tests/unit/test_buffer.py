"""The lag bound of the asynchronous loop: ticket gates, the policy clock and the staleness buffer (asyncio only)."""

import asyncio

import pytest

from app.training.buffer import StalenessBuffer, Versioned, Watermark, publish_gate, ticket_gate


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def test_ticket_gate_makes_max_lag_zero_the_synchronous_loop():
    # Ticket t (for step t) needs the weights of step t - 1 when max_lag = 0 ...
    assert [ticket_gate(t, 0) for t in (1, 2, 3)] == [0, 1, 2]
    # ... and may start max_lag versions earlier otherwise (the first tickets need only version 0).
    assert [ticket_gate(t, 2) for t in (1, 2, 3, 4)] == [-2, -1, 0, 1]
    # exact_lag: version v is published once ticket v + k has generated with version v - 1.
    assert publish_gate(5, 2) == 7 and ticket_gate(7, 2) == 4


def test_watermark_wakes_waiters_and_never_goes_back():
    async def main():
        clock = Watermark(0)
        woke = []

        async def waiter(v):
            await clock.wait_for(v)
            woke.append(v)

        tasks = [asyncio.create_task(waiter(v)) for v in (2, 1, 0)]
        await asyncio.sleep(0.01)
        assert woke == [0]
        await clock.advance(1)
        await asyncio.sleep(0.01)
        assert sorted(woke) == [0, 1]
        await clock.advance(2)
        await asyncio.gather(*tasks)
        with pytest.raises(ValueError, match="only moves forward"):
            await clock.advance(1)

    run(main())


def test_take_returns_the_oldest_admissible_groups_and_drops_stale_ones():
    async def main():
        buffer = StalenessBuffer(max_lag=1, capacity=10)
        await buffer.put([Versioned(f"g{v}", v) for v in (0, 1, 2, 2)])
        # Trainer at version 2: lag of version 0 is 2 > 1 -> dropped; versions 1 and 2 admitted in order.
        out = await buffer.take(2, trainer_version=2)
        assert [v.item for v in out] == ["g1", "g2"]
        assert buffer.stats.dropped == 1 and buffer.stats.admitted == 2
        assert dict(buffer.stats.lags) == {1: 1, 0: 1}
        assert len(buffer) == 1

    run(main())


def test_take_waits_for_enough_groups():
    async def main():
        buffer = StalenessBuffer(max_lag=0, capacity=4)
        taker = asyncio.create_task(buffer.take(2, trainer_version=0))
        await buffer.put([Versioned("a", 0)])
        await asyncio.sleep(0.01)
        assert not taker.done()
        await buffer.put([Versioned("b", 0)])
        assert [v.item for v in await taker] == ["a", "b"]

    run(main())


def test_put_blocks_when_full_until_the_trainer_takes():
    async def main():
        buffer = StalenessBuffer(max_lag=3, capacity=2)
        await buffer.put([Versioned(i, 0) for i in range(2)])
        putter = asyncio.create_task(buffer.put([Versioned(2, 0)]))
        await asyncio.sleep(0.01)
        assert not putter.done() and len(buffer) == 2  # back-pressure, not growth
        await buffer.take(1, trainer_version=0)
        await putter
        assert len(buffer) == 2 and buffer.stats.peak == 2

    run(main())


def test_close_wakes_waiters_with_the_error():
    async def main():
        buffer = StalenessBuffer(max_lag=0, capacity=1)
        taker = asyncio.create_task(buffer.take(1, trainer_version=0))
        await asyncio.sleep(0.01)
        await buffer.close(RuntimeError("rollout server gone"))
        with pytest.raises(RuntimeError, match="rollout server gone"):
            await taker

    run(main())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_lag"):
        StalenessBuffer(max_lag=-1, capacity=1)
    with pytest.raises(ValueError, match="capacity"):
        StalenessBuffer(max_lag=0, capacity=0)

    async def main():
        with pytest.raises(ValueError, match="never be served"):
            await StalenessBuffer(max_lag=0, capacity=2).take(3, trainer_version=0)

    run(main())


def test_a_simulated_async_schedule_never_exceeds_the_lag_bound():
    """Producer and trainer at different speeds, wired as app/training/loop.py wires them: every admitted lag <= k."""

    async def schedule(k: int, gen_s: float, train_s: float, steps: int = 8) -> list[int]:
        clock, buffer, lags = Watermark(0), StalenessBuffer(max_lag=k, capacity=k + 1), []

        async def produce():
            ticket = 1
            while True:
                await clock.wait_for(ticket_gate(ticket, k))
                version = clock.value  # the weights the engine holds when it starts this ticket
                await asyncio.sleep(gen_s)
                await buffer.put([Versioned(ticket, version)])
                ticket += 1

        producer = asyncio.create_task(produce())
        for step in range(1, steps + 1):
            (item,) = await buffer.take(1, trainer_version=step - 1)
            lags.append(step - 1 - item.version)
            await asyncio.sleep(train_s)
            await clock.advance(step)
        producer.cancel()
        return lags

    for k in (0, 1, 2):
        for gen_s, train_s in ((0.001, 0.004), (0.004, 0.001)):
            lags = run(schedule(k, gen_s, train_s))
            assert max(lags) <= k, (k, gen_s, train_s, lags)
            if k == 0:
                assert lags == [0] * 8
    # Training slower than generation with k = 2: the pipeline fills and runs at the bound.
    assert run(schedule(2, 0.001, 0.004))[-3:] == [2, 2, 2]
