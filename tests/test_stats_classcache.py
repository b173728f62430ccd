"""The Spark driver's class archive: recorded by a first report, used by the next ones.

The end-to-end test runs ``nmbus report`` as a user does, twice, in processes
of its own: the first records its classes and leaves a builder behind, the
second must load Spark's classes from the archive that builder wrote (the
JVM's own class-load log says where each class came from) and write the same
figures. The rest checks the rules that keep a damaged or half-written archive
from ever being mapped, without a JVM.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
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
    # Spark splits extraJavaOptions like a shell, and Java's launcher mangles
    # non-ASCII under a C locale: such a folder is not used.
    for name in ("with space", "it's", "caf\u00e9"):
        monkeypatch.setenv(classcache.ENV, str(tmp_path / name))
        assert classcache.cache_for("/bin/true", str(tmp_path), str(tmp_path)) is None


def test_the_folder_is_private_or_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JVM maps the archive as code: a folder others can write to is never used."""
    folder = tmp_path / "classes"
    monkeypatch.setenv(classcache.ENV, str(folder))
    assert classcache.cache_for("/bin/true", str(tmp_path), str(tmp_path)) is not None
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    folder.chmod(0o777)
    assert classcache.cache_for("/bin/true", str(tmp_path), str(tmp_path)) is None
    folder.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    monkeypatch.setenv(classcache.ENV, str(link))
    assert classcache.cache_for("/bin/true", str(tmp_path), str(tmp_path)) is None


def test_the_key_changes_with_the_java_the_spark_jars_and_the_class_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    java, spark = tmp_path / "java", tmp_path / "spark"
    (java / "lib" / "server").mkdir(parents=True)
    (spark / "jars").mkdir(parents=True)
    (java / "release").write_text('JAVA_VERSION="17.0.15"\n')
    jar = spark / "jars" / "spark-core.jar"
    jar.write_bytes(b"x" * 10)

    def key(extra: str = "") -> str:
        cache = classcache.cache_for("/bin/true", str(java), str(spark), extra)
        assert cache is not None
        return cache.key

    seen = [key()]
    assert key() == seen[0]
    (java / "release").write_text('JAVA_VERSION="17.0.16"\n')
    seen.append(key())
    jar.write_bytes(b"x" * 11)
    seen.append(key())
    os.utime(jar, ns=(1, 1))  # the same size, reinstalled: Java checks jar times
    seen.append(key())
    (spark / "conf").mkdir()
    (spark / "conf" / "log4j2.properties.template").write_text("")
    seen.append(key())
    seen.append(key("/opt/extra.jar"))
    assert len(set(seen)) == len(seen)


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


@contextmanager
def _held(lock: Path) -> Iterator[None]:
    """The lock a live builder holds."""
    fd = os.open(lock, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_one_builder_at_a_time_and_none_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, monkeypatch)
    with _held(cache.lock):
        assert cache.building()
        assert classcache.plan(cache) == classcache.Plan([])
    # A builder killed with SIGKILL leaves its lock file, but not its lock.
    assert cache.lock.exists() and not cache.building()
    assert classcache.plan(cache).recording is not None

    cache.failed.write_text("java -Xshare:dump exited with 1\n")
    assert classcache.plan(cache) == classcache.Plan([])


def test_a_builder_that_loses_the_race_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, monkeypatch)
    recording = cache.folder / "run.classlist"
    recording.write_text("java/lang/Object\n")
    cp_file = cache.folder / "run.classpath"
    cp_file.write_text("/nowhere.jar")
    with _held(cache.lock):
        assert classcache.build(cache, recording, cp_file, wait_for=0) == 0
        assert cache.building()  # the winner's lock is not touched
    assert not recording.exists() and not cp_file.exists()
    assert list(cache.folder.glob("spark-*.jsa")) == []


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
    with _held(cache.lock):
        classcache.plan(cache)
        assert half.exists()  # its builder is alive: left alone
    classcache.plan(cache)
    assert not half.exists() and not old.exists()
    assert other.exists()


def test_lock_files_of_builders_that_died_are_swept_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, monkeypatch)
    dead = [cache.lock, cache.folder / ".building-0123456789abcdef"]  # empty, held by nobody
    for path in dead:
        path.write_bytes(b"")
    alive = cache.folder / ".building-fedcba9876543210"
    with _held(alive):
        assert classcache.plan(cache).recording is not None
        assert [p.exists() for p in dead] == [False, False]
        assert alive.exists()
    classcache.plan(cache)
    assert list(cache.folder.glob(".building-*")) == []


def _recorded(cache: classcache.ClassCache, classpath: str) -> tuple[Path, Path]:
    recording = cache.folder / "run.classlist"
    recording.write_text("java/lang/Object\n")
    cp_file = cache.folder / "run.classpath"
    cp_file.write_text(classpath)
    return recording, cp_file


def test_a_failed_dump_installs_nothing_and_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    cache = classcache.cache_for("/bin/false", str(tmp_path), str(tmp_path))
    assert cache is not None
    recording, cp_file = _recorded(cache, "/nowhere.jar")
    assert classcache.build(cache, recording, cp_file, wait_for=0) == 1
    assert "exited with 1" in cache.failed.read_text()
    assert list(cache.folder.glob("*.jsa")) == []
    assert not cache.building() and not recording.exists()
    assert not cache.lock.exists()
    assert classcache.plan(cache) == classcache.Plan([])


def test_a_class_path_with_a_full_folder_fails_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spark's launcher puts its conf folder first; Java archives nothing then."""
    cache = _cache(tmp_path, monkeypatch)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf.template").write_text("")
    recording, cp_file = _recorded(cache, f"{conf}:/nowhere.jar")
    assert classcache.build(cache, recording, cp_file, wait_for=0) == 1
    assert f"not empty: {conf}" in cache.failed.read_text()


def test_an_archive_is_installed_only_once_java_maps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake java: the dump writes a file, the check refuses it, nothing is installed."""
    java = tmp_path / "java"
    java.write_text(
        "#!/bin/sh\n"
        "for a; do case $a in -XX:SharedArchiveFile=*) f=${a#*=};; -Xshare:on) on=1;; esac; done\n"
        'if [ -n "$on" ]; then exit 7; fi\n'
        'printf x > "$f"\n'
    )
    java.chmod(0o755)
    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    cache = classcache.cache_for(str(java), str(tmp_path), str(tmp_path))
    assert cache is not None
    recording, cp_file = _recorded(cache, "/nowhere.jar")
    assert classcache.build(cache, recording, cp_file, wait_for=0) == 1
    assert "refused the new archive (7)" in cache.failed.read_text()
    assert list(cache.folder.glob("*.jsa")) == [] and list(cache.folder.glob(".*.jsa")) == []

    cache.failed.unlink()
    java.write_text(java.read_text().replace("exit 7", "exit 0"))
    recording, cp_file = _recorded(cache, "/nowhere.jar")
    assert classcache.build(cache, recording, cp_file, wait_for=0) == 0
    assert [p.name for p in cache.folder.glob("*.jsa")] == [f"spark-{cache.key}-1.jsa"]
    assert cache.archive() == cache.folder / f"spark-{cache.key}-1.jsa"
    # A builder, failed or done, takes its lock file with it: no empty file stays.
    assert list(cache.folder.glob(".building-*")) == []
    assert classcache.usage(cache.folder) == (
        sum(p.stat().st_size for p in cache.folder.iterdir()),
        1,
    )


# --------------------------------------------------------------------------- with Spark

pyspark = pytest.importorskip("pyspark")

from tests.procs import JVM_NOISE  # noqa: E402
from tests.stats_data import seed  # noqa: E402
from tests.waits import wait_until  # noqa: E402


def _report(dsn: str, out: Path, env: dict[str, str], *extra: str) -> dict:
    cmd = [sys.executable, "-m", "nmbus", "report", "--dsn", dsn, "--out", str(out),
           "--master", "local[2]", "--json", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    noise = [line for line in proc.stdout.splitlines() if JVM_NOISE.search(line)]
    assert not noise, noise[:10]
    return json.loads(proc.stdout)


def _archive(folder: Path) -> Path | None:
    """The class archive once it is built and no builder holds its lock; a failed build fails."""
    built = list(folder.glob("spark-*.jsa"))
    locks = [
        classcache.ClassCache(folder, p.name.removeprefix(".building-"), "").building()
        for p in folder.glob(".building-*")
    ]
    if built and not any(locks):
        return built[0]
    failed = list(folder.glob("*.failed"))
    assert not failed, [p.read_text() for p in folder.glob("build-*.log")]
    return None


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
    asyncio.run(seed(dsn, {"orders": 400, "billing": 100}))
    folder = tmp_path / "classes"
    env = {**os.environ, classcache.ENV: str(folder)}

    first = _report(dsn, tmp_path / "first", env)
    archive = asyncio.run(
        wait_until(
            lambda: _archive(folder),
            timeout=600,
            interval=0.5,
            what=f"the class archive in {folder}",
        )
    )
    key = archive.name.split("-")[1]
    left = sorted(p.name for p in folder.iterdir())
    # No recording, no class path, no half-written archive, no lock file.
    assert left == [f"build-{key}.log", archive.name], left
    assert "wrote" in (folder / f"build-{key}.log").read_text()
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


class FakeSpark:
    """What build_session asks of a started session, with a JVM that says ``vm_info``."""

    def __init__(self, vm_info: str = "mixed mode, sharing") -> None:
        props = {"java.vm.info": vm_info, "java.class.path": "/nowhere.jar"}
        system = SimpleNamespace(getProperty=props.__getitem__)
        handle = SimpleNamespace(current=lambda: SimpleNamespace(pid=lambda: 0))
        lang = SimpleNamespace(System=system, ProcessHandle=handle)
        self._jvm = SimpleNamespace(java=SimpleNamespace(lang=lang))
        self.sparkContext = SimpleNamespace(setLogLevel=lambda level: None)
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


class Starts(list[dict[str, str]]):
    """The settings of each start, and what the next starts answer."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[Any] = []


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Starts:
    """Every start build_session makes: the settings its builder holds; each start answers
    with the next of ``starts.answers`` (an exception is raised), by default _Stop."""
    from pyspark.sql import SparkSession

    seen = Starts()
    monkeypatch.setattr("pyspark.SparkContext._gateway", None)  # no JVM in this process yet

    def get_or_create(builder: Any) -> Any:
        seen.append(dict(builder._options))
        answer = seen.answers.pop(0) if seen.answers else _Stop()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(SparkSession.Builder, "getOrCreate", get_or_create)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    return seen


@pytest.mark.parametrize(
    ("expected_rows", "c1"), [(10_000, True), (1_000_000, True), (5_000_000, False), (None, False)]
)
def test_only_a_run_known_to_be_short_gives_up_c2(
    starts: Starts, expected_rows: int | None, c1: bool
) -> None:
    from nmbus.stats import session

    with pytest.raises(_Stop):
        session.build_session(
            "local[2]",
            expected_rows=expected_rows,
            extra_conf={"spark.driver.extraJavaOptions": "-Dmine=1"},
        )
    options = starts[0]["spark.driver.extraJavaOptions"].split()
    assert ("-XX:TieredStopAtLevel=1" in options) is c1
    assert options[-1] == "-Dmine=1"  # the caller's own come last, and win


@pytest.mark.parametrize(("expected_rows", "c1"), [(10_000, True), (5_000_000, False)])
def test_a_short_run_on_a_cluster_gives_up_c2_in_its_executors_too(
    starts: Starts, expected_rows: int, c1: bool
) -> None:
    from nmbus.stats import session

    with pytest.raises(_Stop):
        session.build_session(
            "spark://127.0.0.1:7077",
            need_jdbc=False,
            expected_rows=expected_rows,
            extra_conf={"spark.executor.extraJavaOptions": "-Dmine=1"},
        )
    options = starts[0]["spark.executor.extraJavaOptions"].split()
    assert ("-XX:TieredStopAtLevel=1" in options) is c1
    assert options[-1] == "-Dmine=1"


def test_spark_defaults_java_options_are_kept(
    starts: Starts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --conf value replaces spark-defaults.conf's: nmbus sets one only with something
    to add, and then puts the file's options after its own."""
    from nmbus.stats import session

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(
        "# site settings\n"
        "spark.driver.extraJavaOptions   -Djava.security.krb5.conf=/etc/krb5.conf\n"
        "spark.executor.extraJavaOptions=-Dsite=1\n"
    )
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf))
    with pytest.raises(_Stop):
        session.build_session("local[2]")  # nothing to add (the cache is off here)
    assert "spark.driver.extraJavaOptions" not in starts[-1]
    with pytest.raises(_Stop):
        session.build_session("spark://127.0.0.1:7077", need_jdbc=False, expected_rows=10)
    assert starts[-1]["spark.driver.extraJavaOptions"] == (
        "-XX:TieredStopAtLevel=1 -Djava.security.krb5.conf=/etc/krb5.conf"
    )
    assert starts[-1]["spark.executor.extraJavaOptions"] == "-XX:TieredStopAtLevel=1 -Dsite=1"


def _installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """The cache build_session will use, holding an archive of the right size."""
    from nmbus.stats import session

    monkeypatch.setenv(classcache.ENV, str(tmp_path / "classes"))
    java = session.ensure_java()
    cache = classcache.cache_for(java.executable, java.home)
    assert cache is not None
    archive = cache.folder / f"spark-{cache.key}-10.jsa"
    archive.write_bytes(b"\0" * 10)
    return cache, archive


def test_an_archive_the_jvm_did_not_take_is_deleted_and_recorded_anew(
    starts: Starts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nmbus.stats import session

    cache, archive = _installed(tmp_path, monkeypatch)
    starts.answers.append(FakeSpark("mixed mode, sharing"))
    session.build_session("local[2]")
    assert f"-XX:SharedArchiveFile={archive}" in starts[-1]["spark.driver.extraJavaOptions"]
    assert archive.exists()
    starts.answers.append(FakeSpark("mixed mode"))
    session.build_session("local[2]")
    assert not archive.exists() and not cache.failed.exists()
    starts.answers.append(FakeSpark())
    session.build_session("local[2]")
    assert "-XX:DumpLoadedClassList=" in starts[-1]["spark.driver.extraJavaOptions"]
    session._recording = None


def test_a_jvm_that_dies_with_the_archive_and_starts_without_it_gives_it_up(
    starts: Starts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from nmbus.stats import session

    cache, archive = _installed(tmp_path, monkeypatch)
    starts.answers.extend([RuntimeError("JAVA_GATEWAY_EXITED"), FakeSpark()])
    session.build_session("local[2]")
    assert "SharedArchiveFile" not in starts[-1].get("spark.driver.extraJavaOptions", "")
    assert not archive.exists() and "did not start" in cache.failed.read_text()


def test_a_failure_inside_a_live_jvm_does_not_blame_the_archive(
    starts: Starts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark import SparkContext

    from nmbus.stats import session

    cache, archive = _installed(tmp_path, monkeypatch)

    def failing(builder: Any) -> Any:
        starts.append(dict(builder._options))
        SparkContext._gateway = object()  # the JVM came up; Spark failed inside it
        raise RuntimeError("bad master URL")

    from pyspark.sql import SparkSession

    monkeypatch.setattr(SparkSession.Builder, "getOrCreate", failing)
    with pytest.raises(RuntimeError, match="bad master URL"):
        session.build_session("local[2]")
    assert len(starts) == 1  # not started again
    assert archive.exists() and not cache.failed.exists()


def test_the_end_of_a_run_never_fails_on_the_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from nmbus.stats import session

    cache = _cache(tmp_path, monkeypatch)
    recording = cache.folder / ".run.classlist"
    recording.write_text("java/lang/Object\n")
    session._recording = session._Recording(cache, str(recording), "/nowhere.jar", 0)
    shutil.rmtree(cache.folder)  # deleted while the run ran
    spark = FakeSpark()
    session.stop_session(spark)
    assert spark.stopped and session._recording is None


def test_the_report_estimates_an_archive_from_its_footers(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nmbus.cli.report import _rows_in_archive

    for day in ("2026-11-01", "2026-11-02"):
        folder = tmp_path / "queue=orders" / f"day={day}"
        folder.mkdir(parents=True)
        pq.write_table(pa.table({"id": list(range(7))}), folder / "part-0.parquet")
    assert _rows_in_archive(str(tmp_path)) == 14
    assert _rows_in_archive(f"file://{tmp_path}") == 14
    assert _rows_in_archive("hdfs://namenode/archive") is None  # unknown: a big run
    (tmp_path / "queue=orders" / "day=2026-11-01" / "bad.parquet").write_text("not parquet")
    assert _rows_in_archive(str(tmp_path)) is None
