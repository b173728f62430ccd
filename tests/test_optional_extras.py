"""Without the ``metrics`` and ``otel`` extras the bus works, and asking for them says what to do.

The extras are installed where the tests run, so a child process hides them:
a meta-path finder refuses ``prometheus_client`` and ``opentelemetry``, as an
environment without them would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import asyncio, json, sys

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("prometheus_client", "opentelemetry"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hide())

    from nmbus import Bus, Context, Message
    from nmbus.errors import ConfigurationError

    class Hello(Message, type_name="absent.Hello"):
        n: int

    DSN = sys.argv[1]
    report = {}

    for name, kwargs in (("metrics", {"metrics_port": 0}), ("otel", {"tracer_provider": object()})):
        try:
            Bus("absent", dsn=DSN, **kwargs)
        except ConfigurationError as exc:
            report[name + "_error"] = str(exc)

    async def main():
        bus = Bus("absent", dsn=DSN, concurrency=0, subscription_ttl=None)
        seen = []

        @bus.handler
        async def hello(msg: Hello, ctx: Context) -> None:
            seen.append(msg.n)
            await ctx.send(Hello(n=msg.n + 100), to="absent_out")

        async with bus:
            await bus.store.ensure_queue("absent_out")
            await bus.send(Hello(n=1), to="absent", headers={"traceparent": "carried"})
            report["burst"] = await bus.worker.run_burst()
            conn = await __import__("asyncpg").connect(DSN)
            report["carried"] = json.loads(
                await conn.fetchval("SELECT msg_headers FROM nmbus.absent_out")
            )
            await conn.close()
        report["seen"] = seen
        report["tracing"] = repr(bus.tracing)
        report["metrics"] = repr(bus.metrics)

    asyncio.run(main())
    report["loaded"] = sorted(
        m for m in sys.modules if m.split(".")[0] in ("prometheus_client", "opentelemetry")
    )
    print(json.dumps(report))
    """
)


def test_the_bus_works_without_the_extras_and_asking_for_them_is_a_clear_error(
    dsn: str,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMBUS_")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, dsn],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["metrics"] == "None" and report["tracing"] == "None"
    assert report["loaded"] == []
    assert report["burst"] == {"X": 1, "R": 0, "F": 0}
    assert report["seen"] == [1]
    # Headers still travel from a handled message to what its handler sends.
    assert report["carried"] == {"traceparent": "carried"}
    assert report["metrics_error"] == (
        "metrics_port is set but prometheus_client is not installed: "
        "pip install 'nmbus[metrics]', or leave NMBUS_METRICS_PORT unset"
    )
    assert report["otel_error"] == (
        "tracer_provider is given but opentelemetry-api is not installed: pip install 'nmbus[otel]'"
    )
