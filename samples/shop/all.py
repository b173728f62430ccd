"""Start the whole shop, each service in its own process, and show the messages flow.

    NMBUS_DSN=postgresql://... python -m samples.shop.all --orders 10

billing, shipping and fulfilment start first (their subscriptions must exist
before orders publishes); orders then places the orders and exits once all
have shipped, fulfilment once every order's saga has completed; the others are
stopped with SIGTERM (graceful shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


async def relay(name: str, proc: asyncio.subprocess.Process, ready: asyncio.Event) -> None:
    assert proc.stdout is not None
    async for raw in proc.stdout:
        line = raw.decode().rstrip()
        print(line if line.startswith(f"[{name}]") else f"[{name}] {line}", flush=True)
        if line.endswith("] ready"):
            ready.set()


async def start(name: str, *args: str) -> tuple[asyncio.subprocess.Process, asyncio.Task[None]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-u", "-m", f"samples.shop.{name}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    ready = asyncio.Event()
    task = asyncio.create_task(relay(name, proc, ready))
    await asyncio.wait(
        [asyncio.create_task(ready.wait()), task], timeout=60, return_when="FIRST_COMPLETED"
    )
    if not ready.is_set():
        raise SystemExit(f"{name} did not start")
    return proc, task


async def main(orders: int, interval: float, payment_due: float) -> int:
    started = [await start("billing"), await start("shipping")]
    code = 1
    try:
        fulfilment = await start(
            "fulfilment", "--count", str(orders), "--payment-due", str(payment_due)
        )
        started.append(fulfilment)
        proc, task = await start("orders", "--count", str(orders), "--interval", str(interval))
        code = await proc.wait()
        await task
        # The fulfilment sagas complete once they have heard of every shipment.
        try:
            async with asyncio.timeout(60):
                code = await fulfilment[0].wait() or code
        except TimeoutError:
            code = 1
    finally:
        for proc, _ in started:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc, task in started:
            await proc.wait()
            await task
    return code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="run orders, billing, shipping and fulfilment together"
    )
    parser.add_argument("--orders", type=int, default=10)
    parser.add_argument("--interval", type=float, default=0.3)
    parser.add_argument("--payment-due", type=float, default=5.0)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.orders, args.interval, args.payment_due)))
