"""The Spark driver's class archive: recorded by a first report, used by the next ones.

The end-to-end test runs ``nmbus report`` as a user does, twice, in processes
of its own: the first records its classes and leaves a builder behind, the
second must load Spark's classes from the archive that builder wrote (the
JVM's own class-load log says where each class came from) and write the same
figures. The rest checks the rules that keep a damaged or half-written archive
from ever being mapped, without a JVM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nmbus.stats import classcache

ROOT = Path(__file__).resolve().parent.parent


def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> classcache.ClassCache:
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    cache = classcache.cache_for("/bin/true", str(tmp_path / "java"), str(tmp_path / "spark"))
    assert cache is not None
    return cache


def test_it_is_off_when_asked_or_when_its_folder_cannot_be_named_safely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for off in ("off", "OFF", "0", "false", "no"):
        monkeypatch.setenv(classcache.ENV, off)
        assert classcache.cache_for("/bin/true", str(tmp_path)) is None
        assert classcache.plan(None).options == []
    # Spark splits extraJavaOptions like a shell: a folder it would split is not used.
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "with space"))
    assert classcache.cache_for("/bin/true", str(tmp_path), str(tmp_path)) is None
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "it's"))
    assert classcache.cache_for("/bin/true", str(tmp_path), str(tmp_path)) is None


def test_the_key_changes_with_the_java_and_the_spark_jars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    java, spark = tmp_path / "java", tmp_path / "spark"
    (java / "lib" / "server").mkdir(parents=True)
    (spark / "jars").mkdir(parents=True)
    (java / "release").write_text('JAVA_VERSION="17.0.15"\n')
    (spark / "jars" / "spark-core.jar").write_bytes(b"x" * 10)

    def key() -> str:
        cache = classcache.cache_for("/bin/true", str(java), str(spark))
        assert cache is not None
        return cache.key

    first = key()
    assert key() == first
    (java / "release").write_text('JAVA_VERSION="17.0.16"\n')
    second = key()
    assert second != first
    (spark / "jars" / "spark-core.jar").write_bytes(b"x" * 11)
    assert key() not in (first, second)


def test_a_damaged_archive_is_deleted_not_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Java that maps a truncated archive dies of SIGBUS: the size in the name is checked."""
    cache = _cache(tmp_path, monkeypatch)
    whole = cache.folder / f"spark-{cache.key}-4096.jsa"
    whole.write_bytes(b"\0" * 4096)
    assert cache.archive() == whole
    assert classcache.plan(cache).options[0] == f"-XX:SharedArchiveFile={whole}"

    whole.write_bytes(b"\0" * 1000)  # cut short after it was installed
    assert cache.archive() is None
    assert not whole.exists()
    plan = classcache.plan(cache)
    assert plan.archive is None and plan.recording is not None  # records for a new one


def test_one_builder_at_a_time_and_none_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, monkeypatch)
    cache.lock.write_text(str(os.getpid()))  # a live builder
    assert classcache.plan(cache) == classcache.Plan([])
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    cache.lock.write_text(dead.stdout.strip())  # its builder died
    assert classcache.plan(cache).recording is not None

    cache.lock.unlink()
    cache.failed.write_text("java -Xshare:dump exited with 1\n")
    assert classcache.plan(cache) == classcache.Plan([])


def test_what_a_killed_builder_left_is_swept_when_nobody_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, monkeypatch)
    half = cache.folder / f".{cache.key}-999999.jsa"  # a builder SIGKILLed mid-dump
    half.write_bytes(b"\0" * 100)
    other = cache.folder / ".0123456789abcdef-1.jsa"  # another Java's, maybe still building
    other.write_bytes(b"\0" * 100)
    old = cache.folder / ".0123456789abcdef-2-3.classlist"
    old.write_text("java/lang/Object\n")
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    cache.lock.write_text(str(os.getpid()))
    classcache.plan(cache)
    assert half.exists()  # its builder may be alive: left alone
    cache.lock.unlink()
    classcache.plan(cache)
    assert not half.exists() and not old.exists()
    assert other.exists()


def test_a_builder_that_loses_the_race_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, monkeypatch)
    cache.lock.write_text(str(os.getpid()))
    recording = cache.folder / "run.classlist"
    recording.write_text("java/lang/Object\n")
    cp_file = cache.folder / "run.classpath"
    cp_file.write_text("/nowhere.jar")
    assert classcache.build(cache, recording, cp_file, wait_for=0) == 0
    assert not recording.exists() and not cp_file.exists()
    assert cache.lock.read_text() == str(os.getpid())  # the winner's lock is not touched
    assert list(cache.folder.glob("spark-*.jsa")) == []


def test_a_failed_dump_installs_nothing_and_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    cache = classcache.cache_for("/bin/false", str(tmp_path), str(tmp_path))
    assert cache is not None
    recording = cache.folder / "run.classlist"
    recording.write_text("java/lang/Object\n")
    cp_file = cache.folder / "run.classpath"
    cp_file.write_text("/nowhere.jar")
    assert classcache.build(cache, recording, cp_file, wait_for=0) == 1
    assert cache.failed.exists()
    assert list(cache.folder.glob("*.jsa")) == []
    assert not cache.lock.exists() and not recording.exists()
    assert classcache.plan(cache) == classcache.Plan([])


# --------------------------------------------------------------------------- with Spark

pyspark = pytest.importorskip("pyspark")

from tests.procs import JVM_NOISE  # noqa: E402
from tests.test_stats import _run, _seed  # noqa: E402


def _report(dsn: str, out: Path, env: dict[str, str], *extra: str) -> dict:
    cmd = [sys.executable, "-m", "nmbus", "report", "--dsn", dsn, "--out", str(out),
           "--master", "local[2]", "--json", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    noise = [line for line in proc.stdout.splitlines() if JVM_NOISE.search(line)]
    assert not noise, noise[:10]
    return json.loads(proc.stdout)


def _wait_for_archive(folder: Path, timeout: float = 600) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        built = list(folder.glob("spark-*.jsa"))
        if built and not list(folder.glob(".building-*")):
            return built[0]
        failed = list(folder.glob("*.failed"))
        assert not failed, (folder / "build.log").read_text()
        time.sleep(0.5)
    raise AssertionError(f"no archive after {timeout}s: {(folder / 'build.log').read_text()}")


def _figures(summary: dict) -> dict:
    """The summary less what differs between two runs of the same data: time and place."""
    figures = {k: v for k, v in summary.items() if k not in ("run", "generated_at")}
    figures["options"] = {k: v for k, v in summary["options"].items() if k != "out"}
    return figures


@pytest.mark.spark
@pytest.mark.timeout(1500)
def test_the_next_report_starts_from_the_archive_the_first_one_left(
    dsn: str, tmp_path: Path
) -> None:
    _run(_seed(dsn, {"orders": 400, "billing": 100}))
    folder = tmp_path / "classes"
    env = {**os.environ, classcache.ENV: str(folder)}

    first = _report(dsn, tmp_path / "first", env)
    archive = _wait_for_archive(folder)
    left = sorted(p.name for p in folder.iterdir())
    assert left == ["build.log", archive.name], left  # no recording, class path or lock
    assert archive.stat().st_size == int(archive.stem.rsplit("-", 1)[1])

    # The JVM logs where each class came from; the caller's own options still apply.
    loads = tmp_path / "class-load.log"
    second = _report(
        dsn, tmp_path / "second", env,
        "--conf", f"spark.driver.extraJavaOptions=-Xlog:class+load=info:file={loads}",
    )  # fmt: skip
    # Lambdas and the classes Spark generates at run time are made in the run itself.
    made = ("$$Lambda", ".GeneratedClass")
    lines = loads.read_text().splitlines()
    spark_classes = [
        line for line in lines if " org.apache.spark." in line and not any(m in line for m in made)
    ]
    shared = [line for line in spark_classes if "shared objects file" in line]
    assert len(spark_classes) > 1000, len(spark_classes)
    assert len(shared) > 0.9 * len(spark_classes), (len(shared), len(spark_classes))
    assert _figures(second) == _figures(first)
    assert sorted(p.name for p in folder.iterdir()) == left  # used, not rebuilt


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("expected_rows", "c1"), [(10_000, True), (1_000_000, True), (5_000_000, False), (None, False)]
)
def test_only_a_run_known_to_be_short_gives_up_c2(
    monkeypatch: pytest.MonkeyPatch, expected_rows: int | None, c1: bool
) -> None:
    from pyspark.sql import SparkSession

    from nmbus.stats import session

    seen: list[str] = []

    def start(builder: object, ours: list[str], theirs: str) -> None:
        seen.append(" ".join([*ours, theirs]))
        raise _Stop

    monkeypatch.setattr(session, "_start", start)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    with pytest.raises(_Stop):
        session.build_session(
            "local[2]",
            expected_rows=expected_rows,
            extra_conf={"spark.driver.extraJavaOptions": "-Dmine=1"},
        )
    options = seen[0].split()
    assert ("-XX:TieredStopAtLevel=1" in options) is c1
    assert options[-1] == "-Dmine=1"  # the caller's own come last, and win


@pytest.mark.parametrize(("expected_rows", "c1"), [(10_000, True), (5_000_000, False)])
def test_a_short_run_on_a_cluster_gives_up_c2_in_its_executors_too(
    monkeypatch: pytest.MonkeyPatch, expected_rows: int, c1: bool
) -> None:
    from pyspark.sql import SparkSession

    from nmbus.stats import session

    seen: list[str] = []

    def start(builder: Any, ours: list[str], theirs: str) -> None:
        seen.append(builder._options.get("spark.executor.extraJavaOptions", ""))
        raise _Stop

    monkeypatch.setattr(session, "_start", start)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    with pytest.raises(_Stop):
        session.build_session(
            "spark://127.0.0.1:7077",
            need_jdbc=False,
            expected_rows=expected_rows,
            extra_conf={"spark.executor.extraJavaOptions": "-Dmine=1"},
        )
    options = seen[0].split()
    assert ("-XX:TieredStopAtLevel=1" in options) is c1
    assert options[-1] == "-Dmine=1"
