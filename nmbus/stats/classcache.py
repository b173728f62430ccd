"""A class-data-sharing archive of the Spark driver's classes: a JVM that starts warm.

A Spark driver loads, verifies and links about 18,000 classes before its first
job, and on two cores that is a third of a small report's time. Java's own
class-data sharing (CDS) maps those classes ready-made from one archive file
instead. The archive is made from what a real run loaded:

1. A run that finds no archive records the classes it loads
   (``-XX:DumpLoadedClassList``) and otherwise runs as always.
2. When that run's session stops, a builder process starts in the background at
   the lowest CPU priority. It waits for the run's JVM to exit, then has the
   same Java write the archive (``-Xshare:dump``) under a temporary name, and
   renames it into place only when Java says it succeeded. A reader never sees
   a partial file, and at most one builder runs at a time.
3. Later runs start their driver with ``-XX:SharedArchiveFile``.

The archive belongs to one Java, one Spark install and one class path: its
name carries a digest of those, so another Java or an upgraded pyspark makes a
new one (and the old one is deleted). The size in the name guards against a
damaged file: a Java that maps a truncated archive crashes, so a file whose
size is not the one written is deleted instead of used.

``NMBUS_SPARK_CLASS_CACHE=off`` turns all of this off; any other value is the
folder to keep the archive in (default: ``$XDG_CACHE_HOME/nmbus/spark-classes``,
else ``~/.cache/nmbus/spark-classes``). A failed build leaves its reason in
``build.log`` and a ``.failed`` marker there, and is not tried again until the
folder is emptied. Standard library only: it runs under spark-submit too.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "NMBUS_SPARK_CLASS_CACHE"
OFF = frozenset({"off", "0", "no", "false"})
# Spark splits extraJavaOptions like a shell; a folder with such characters is not used.
_SAFE_PATH = re.compile(r"^[\w./+:@%,=-]+$")
BUILD_TIMEOUT = 900.0  # seconds for -Xshare:dump, on a loaded two-core machine
JVM_EXIT_WAIT = 600.0  # seconds the builder waits for the recording run's JVM to exit


@dataclass(frozen=True)
class ClassCache:
    """Where the archive of one (Java, Spark, class path) lives."""

    folder: Path
    key: str
    java: str  # the java executable that runs the driver, and makes the archive

    @property
    def lock(self) -> Path:
        return self.folder / f".building-{self.key}"

    @property
    def failed(self) -> Path:
        return self.folder / f"spark-{self.key}.failed"

    @property
    def log(self) -> Path:
        return self.folder / "build.log"

    def archive(self) -> Path | None:
        """The complete archive, or None; a damaged one is deleted."""
        for path in self.folder.glob(f"spark-{self.key}-*.jsa"):
            expected = path.stem.rsplit("-", 1)[1]
            try:
                if str(path.stat().st_size) == expected:
                    return path
            except OSError:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
        return None

    def forget(self, archive: Path, reason: str) -> None:
        """Delete an archive Java could not use, and build no other for this key."""
        with contextlib.suppress(OSError):
            self.failed.write_text(reason + "\n", encoding="utf-8")
        with contextlib.suppress(OSError):
            archive.unlink()

    def building(self) -> bool:
        """True while a live builder holds the lock."""
        try:
            pid = int(self.lock.read_text().strip() or "0")
        except (OSError, ValueError):
            return False
        return _alive(pid)


def cache_for(java: str, java_home: str, spark_home: str | None = None) -> ClassCache | None:
    """The class cache of this Java and Spark, or None when it is off or cannot be used."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF:
        return None
    if setting:
        folder = Path(setting).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = Path(base) / "nmbus" / "spark-classes"
    folder = folder.absolute()
    if not _SAFE_PATH.match(str(folder)):
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    return ClassCache(folder, _key(java_home, spark_home), java)


def _key(java_home: str, spark_home: str | None) -> str:
    """A digest of what the archive depends on: the Java, the Spark jars, the class path."""
    digest = hashlib.sha256()
    home = os.path.realpath(java_home)
    digest.update(home.encode())
    for name in ("release", os.path.join("lib", "server", "libjvm.so")):
        try:
            st = os.stat(os.path.join(home, name))
            digest.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
        except OSError:
            digest.update(f"{name}:-".encode())
    if spark_home is None:
        spark_home = _spark_home()
    jars = os.path.join(spark_home, "jars")
    digest.update(os.path.realpath(spark_home).encode())
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(jars)):
            digest.update(f"{name}:{os.path.getsize(os.path.join(jars, name))}".encode())
    for var in ("SPARK_CONF_DIR", "SPARK_DIST_CLASSPATH", "HADOOP_CONF_DIR"):
        digest.update(f"{var}={os.environ.get(var, '')}".encode())
    return digest.hexdigest()[:16]


def _spark_home() -> str:
    if os.environ.get("SPARK_HOME"):
        return os.environ["SPARK_HOME"]
    from pyspark.find_spark_home import _find_spark_home

    return str(_find_spark_home())


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child not yet reaped) has exited.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@dataclass(frozen=True)
class Plan:
    """What one session does with the cache: use an archive, or record for one."""

    options: list[str]
    archive: Path | None = None
    recording: Path | None = None


def plan(cache: ClassCache | None) -> Plan:
    """The driver's JVM options for this run."""
    if cache is None:
        return Plan([])
    archive = cache.archive()
    if archive is not None:
        # Xlog off: a JVM that cannot use the archive says so on stdout, then runs without it.
        return Plan(
            [f"-XX:SharedArchiveFile={archive}", "-Xshare:auto", "-Xlog:cds=off"],
            archive=archive,
        )
    if cache.failed.exists() or cache.building():
        return Plan([])
    _sweep(cache)
    recording = cache.folder / f".{cache.key}-{os.getpid()}-{time.monotonic_ns()}.classlist"
    return Plan([f"-XX:DumpLoadedClassList={recording}"], recording=recording)


def _sweep(cache: ClassCache, age: float = 86400.0) -> None:
    """Delete what runs and builders that died mid-way left behind.

    A half-written archive of this key is garbage as soon as no builder holds
    its lock (the caller checked); the rest (recordings, class paths, other
    keys' half-written archives) once a day old.
    """
    folder, now = cache.folder, time.time()
    for path in folder.glob(f".{cache.key}-*.jsa"):
        with contextlib.suppress(OSError):
            path.unlink()
    for pattern in (".*.classlist", ".*.classpath", ".*.jsa"):
        for path in folder.glob(pattern):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > age:
                    path.unlink()


def start_builder(cache: ClassCache, recording: Path, classpath: str, jvm_pid: int) -> None:
    """Start the background builder of ``cache``'s archive from ``recording``.

    It runs in a session of its own, so it outlives this process, which is the
    point: the recording is complete only once the run's JVM has exited.
    """
    if cache.building():
        _remove(recording)
        return
    # The class path is longer than a command line should be: it goes in a file.
    cp_file = recording.with_suffix(".classpath")
    cp_file.write_text(classpath, encoding="utf-8")
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--folder",
        str(cache.folder),
        "--key",
        cache.key,
        "--java",
        cache.java,
        "--recording",
        str(recording),
        "--classpath-file",
        str(cp_file),
        "--wait-for",
        str(jvm_pid),
    ]
    with open(cache.log, "wb") as log:
        subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def build(cache: ClassCache, recording: Path, cp_file: Path, wait_for: int) -> int:
    """The builder: lock, wait for the run's JVM to exit, dump, install. 0 on success."""
    try:
        fd = os.open(cache.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        if cache.building():
            print("another build of this archive is running", flush=True)
            _remove(recording, cp_file)
            return 0
        cache.lock.unlink(missing_ok=True)  # its builder died: take it over
        try:
            fd = os.open(cache.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _remove(recording, cp_file)
            return 0
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    temporary = cache.folder / f".{cache.key}-{os.getpid()}.jsa"
    try:
        deadline = time.monotonic() + JVM_EXIT_WAIT
        while _alive(wait_for) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(wait_for):
            print(f"the run's JVM (pid {wait_for}) did not exit; no archive", flush=True)
            return 1
        if not recording.exists() or recording.stat().st_size == 0:
            print("the run recorded no classes; no archive", flush=True)
            return 1
        classpath = cp_file.read_text(encoding="utf-8")
        command = [
            cache.java,
            "-Xshare:dump",
            f"-XX:SharedClassListFile={recording}",
            f"-XX:SharedArchiveFile={temporary}",
            "-Xlog:cds=error",
            "-cp",
            classpath,
        ]
        started = time.monotonic()
        proc = subprocess.run(command, stdin=subprocess.DEVNULL, timeout=BUILD_TIMEOUT, check=False)
        size = temporary.stat().st_size if temporary.exists() else 0
        if proc.returncode != 0 or size == 0:
            cache.failed.write_text(
                f"java -Xshare:dump exited with {proc.returncode}; see build.log\n",
                encoding="utf-8",
            )
            print(f"java -Xshare:dump exited with {proc.returncode}; no archive", flush=True)
            return 1
        final = cache.folder / f"spark-{cache.key}-{size}.jsa"
        os.replace(temporary, final)
        for old in cache.folder.glob("spark-*.jsa"):
            if old != final:
                with contextlib.suppress(OSError):
                    old.unlink()
        print(f"wrote {final} ({size} bytes) in {time.monotonic() - started:.1f}s", flush=True)
        return 0
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"no archive: {exc}", flush=True)
        return 1
    finally:
        _remove(recording, cp_file, temporary)
        with contextlib.suppress(OSError):
            if cache.lock.read_text().strip() == str(os.getpid()):
                cache.lock.unlink()


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build the Spark driver's class archive.")
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--java", required=True)
    p.add_argument("--recording", type=Path, required=True)
    p.add_argument("--classpath-file", type=Path, required=True)
    p.add_argument("--wait-for", type=int, default=0)
    args = p.parse_args(argv)
    cache = ClassCache(args.folder, args.key, args.java)
    with contextlib.suppress(OSError):
        os.nice(19)  # the user's next work comes first
    return build(cache, args.recording, args.classpath_file, args.wait_for)


if __name__ == "__main__":
    sys.exit(main())
