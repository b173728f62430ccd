"""A class-data-sharing archive of the Spark driver's classes: a JVM that starts warm.

A Spark driver loads, verifies and links about 18,000 classes before its first
job, and on two cores that is a third of a small report's time. Java's own
class-data sharing (CDS) maps those classes ready-made from one archive file
instead. The archive is made from what a real run loaded:

1. A run that finds no archive records the classes it loads
   (``-XX:DumpLoadedClassList``) and otherwise runs as always.
2. When that run's session stops, a builder process starts in the background at
   the lowest CPU priority. It waits for the run's JVM to exit, then has the
   same Java write the archive (``-Xshare:dump``) under a temporary name,
   checks that Java maps it, and only then renames it into place. A reader
   never sees a partial file. The builder holds an exclusive lock
   (``flock``) on its key for its whole life, so at most one builds a given
   archive, and the kernel lets go of it if the builder is killed. It
   deletes its lock file before it lets go; one a killed builder left is
   deleted by the next run that records, or the next builder that finishes.
3. Later runs start their driver with ``-XX:SharedArchiveFile``; a run whose
   JVM did not take the archive (``java.vm.info`` without "sharing") deletes
   it, and the next run records again.

The archive belongs to one Java, one Spark install and one class path: its
name carries a digest of those (jar sizes and times, the conf folder, the
extra class path), so another Java or an upgraded pyspark makes a new one.
Archives of other keys are deleted once unused for ``KEEP_DAYS``. The size
in the name guards against a damaged file: a Java that maps a truncated
archive crashes, so a file whose size is not the one written is deleted
instead of used.

The folder must be this user's alone (the JVM maps the archive as code):
``NMBUS_SPARK_CLASS_CACHE=off`` turns all of this off; any other value is the
folder to keep the archive in (default: ``$XDG_CACHE_HOME/nmbus/spark-classes``,
else ``~/.cache/nmbus/spark-classes``), which is made with mode 0700 and not
used when another user owns it or others may write to it. A failed build
leaves its reason in ``build-<key>.log`` and a ``.failed`` marker there, and
is not tried again until the marker is deleted. Standard library only: it runs
under spark-submit too.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "NMBUS_SPARK_CLASS_CACHE"
OFF = frozenset({"off", "0", "no", "false"})
# Spark splits extraJavaOptions like a shell, and Java's launcher mangles
# non-ASCII under a C locale: a folder with other characters is not used.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+:@%,=-]+$")
BUILD_TIMEOUT = 900.0  # seconds for -Xshare:dump, on a loaded two-core machine
JVM_EXIT_WAIT = 600.0  # seconds the builder waits for the recording run's JVM to exit
KEEP_DAYS = 30  # archives of other keys (other Javas, venvs) unused this long go


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
        return self.folder / f"build-{self.key}.log"

    def archive(self) -> Path | None:
        """The complete archive, or None; a damaged one is deleted."""
        for path in self.folder.glob(f"spark-{self.key}-*.jsa"):
            expected = path.stem.rsplit("-", 1)[1]
            try:
                if str(path.stat().st_size) == expected:
                    with contextlib.suppress(OSError):
                        os.utime(path)  # in use: kept while other keys come and go
                    return path
            except OSError:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
        return None

    def forget(self, archive: Path) -> None:
        """Delete an archive Java did not take; the next run records a new one."""
        with contextlib.suppress(OSError):
            archive.unlink()

    def give_up(self, archive: Path, reason: str) -> None:
        """Delete an archive the driver could not start with, and build no other."""
        with contextlib.suppress(OSError):
            self.failed.write_text(reason + "\n", encoding="utf-8")
        self.forget(archive)

    def building(self) -> bool:
        """True while a builder holds this key's lock."""
        try:
            fd = os.open(self.lock, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)  # closing drops the shared lock, if it was taken
        return False


def cache_folder() -> Path | None:
    """The folder the archives are kept in (made or not), or None when the cache is off."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF:
        return None
    if setting:
        folder = Path(setting).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = Path(base) / "nmbus" / "spark-classes"
    return folder.absolute()


def cache_for(
    java: str, java_home: str, spark_home: str | None = None, extra_classpath: str = ""
) -> ClassCache | None:
    """The class cache of this Java and Spark, or None when it is off or cannot be used."""
    folder = cache_folder()
    if folder is None or not _SAFE_PATH.match(str(folder)) or not _private_folder(folder):
        return None
    return ClassCache(folder, _key(java_home, spark_home, extra_classpath), java)


def usage(folder: Path) -> tuple[int, int]:
    """(bytes, archives) the folder holds: every file in it, and the complete archives."""
    size = archives = 0
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            with contextlib.suppress(OSError):
                st = path.lstat()
                if stat.S_ISREG(st.st_mode):
                    size += st.st_size
                    archives += path.name.startswith("spark-") and path.suffix == ".jsa"
    return size, archives


def _private_folder(folder: Path) -> bool:
    """Make ``folder`` (0700) if needed; True when it is a directory only this user can write."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        st = os.lstat(folder)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _key(java_home: str, spark_home: str | None, extra_classpath: str = "") -> str:
    """A digest of what the archive depends on: the Java, the Spark jars, the class path."""
    digest = hashlib.sha256()
    home = os.path.realpath(java_home)
    digest.update(home.encode())
    for name in ("release", os.path.join("lib", "server", "libjvm.so")):
        digest.update(f"{name}:{_stamp(os.path.join(home, name))}".encode())
    if spark_home is None:
        spark_home = find_spark_home()
    digest.update(os.path.realpath(spark_home).encode())
    jars = os.path.join(spark_home, "jars")
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(jars)):
            digest.update(f"{name}:{_stamp(os.path.join(jars, name))}".encode())
    # The launcher puts the conf folder first on the class path.
    conf = os.environ.get("SPARK_CONF_DIR") or os.path.join(spark_home, "conf")
    try:
        digest.update(f"conf:{sorted(os.listdir(conf))}".encode())
    except OSError:
        digest.update(b"conf:-")
    for var in ("SPARK_CONF_DIR", "SPARK_DIST_CLASSPATH", "HADOOP_CONF_DIR"):
        digest.update(f"{var}={os.environ.get(var, '')}".encode())
    digest.update(f"extra={extra_classpath}".encode())
    return digest.hexdigest()[:16]


def _stamp(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def find_spark_home() -> str:
    """Spark's installation: ``$SPARK_HOME``, else pyspark's own."""
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


def took_archive(vm_info: str) -> bool:
    """Whether a JVM started with an archive uses it (``java.vm.info`` says "sharing")."""
    return "sharing" in vm_info


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
    _sweep_locks(folder)
    for pattern in (".*.classlist", ".*.classpath", ".*.jsa"):
        for path in folder.glob(pattern):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > age:
                    path.unlink()


def _sweep_locks(folder: Path) -> None:
    """Delete the lock files of builders that died (a live builder's is locked)."""
    for path in folder.glob(".building-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Held by nobody: delete it while holding it, if it is still this file.
            if _same_file(fd, path):
                path.unlink()
        except OSError:  # BlockingIOError: a builder holds it
            pass
        finally:
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _take_lock(cache: ClassCache) -> int | None:
    """The builder's exclusive lock on its key: an open descriptor, or None if another
    builder holds it. Raises OSError when the lock file cannot be made.

    Lock files are deleted by the builder that holds them (and by a sweep, when
    their builder died), so a lock taken on a file that was deleted meanwhile is
    no lock: it is taken again on the file now at that path.
    """
    for _ in range(10):
        fd = os.open(cache.lock, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _same_file(fd, cache.lock):
            return fd
        os.close(fd)
    raise OSError(f"the lock file {cache.lock} keeps being replaced")


def start_builder(cache: ClassCache, recording: Path, classpath: str, jvm_pid: int) -> None:
    """Start the background builder of ``cache``'s archive from ``recording``.

    It runs in a session of its own, so it outlives this process, which is the
    point: the recording is complete only once the run's JVM has exited. The
    shell in between exits at once, so this process has no child left to wait for.
    """
    if cache.building():
        _remove(recording)
        return
    # The class path is longer than a command line should be: it goes in a file.
    cp_file = recording.with_suffix(".classpath")
    cp_file.write_text(classpath, encoding="utf-8")
    command = [
        sys.executable,
        "-I",  # isolated: not this folder, nor PYTHON* variables, on its path
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
    subprocess.run(
        ["/bin/sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1 &', "sh", *command],
        cwd=cache.folder,
        start_new_session=True,
        check=True,
        timeout=30,
    )


def build(cache: ClassCache, recording: Path, cp_file: Path, wait_for: int) -> int:
    """The builder: lock, wait for the run's JVM to exit, dump, check, install. 0 on success."""
    try:
        lock = _take_lock(cache)
    except OSError as exc:
        _remove(recording, cp_file)
        print(f"no lock: {exc}", flush=True)
        return 1
    if lock is None:
        _remove(recording, cp_file)
        print("another build of this archive is running", flush=True)
        return 0
    temporary = cache.folder / f".{cache.key}-{os.getpid()}.jsa"
    try:
        return _build_locked(cache, recording, cp_file, wait_for, temporary)
    finally:
        # The lock file goes while still locked: no empty file stays behind.
        _remove(recording, cp_file, temporary, cache.lock)
        os.close(lock)  # lets go of the flock


def _build_locked(
    cache: ClassCache, recording: Path, cp_file: Path, wait_for: int, temporary: Path
) -> int:
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
    crowded = [p for p in classpath.split(os.pathsep) if os.path.isdir(p) and os.listdir(p)]
    if crowded:
        # Java archives classes from jars only, and refuses a class path with a
        # folder that holds anything (Spark's conf folder, in a full distribution).
        return _fail(cache, f"the class path has a folder that is not empty: {crowded[0]}")
    base = [f"-XX:SharedArchiveFile={temporary}", "-Xlog:cds=error", "-cp", classpath]
    try:
        started = time.monotonic()
        dump = [cache.java, "-Xshare:dump", f"-XX:SharedClassListFile={recording}", *base]
        proc = subprocess.run(dump, stdin=subprocess.DEVNULL, timeout=BUILD_TIMEOUT, check=False)
        size = temporary.stat().st_size if temporary.exists() else 0
        if proc.returncode != 0 or size == 0:
            return _fail(cache, f"java -Xshare:dump exited with {proc.returncode}")
        # Java must map what it wrote, with this very class path, before anyone may.
        check = [cache.java, "-Xshare:on", *base, "-version"]
        proc = subprocess.run(check, stdin=subprocess.DEVNULL, timeout=120, check=False)
        if proc.returncode != 0:
            return _fail(cache, f"java -Xshare:on refused the new archive ({proc.returncode})")
        with open(temporary, "rb") as fh:
            os.fsync(fh.fileno())
        final = cache.folder / f"spark-{cache.key}-{size}.jsa"
        os.replace(temporary, final)
        fd = os.open(cache.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"no archive: {exc}", flush=True)
        return 1
    _retire_others(cache, final)
    print(f"wrote {final} ({size} bytes) in {time.monotonic() - started:.1f}s", flush=True)
    return 0


def _fail(cache: ClassCache, reason: str) -> int:
    print(f"{reason}; no archive", flush=True)
    with contextlib.suppress(OSError):
        cache.failed.write_text(reason + f"; see {cache.log.name}\n", encoding="utf-8")
    return 1


def _retire_others(cache: ClassCache, keep: Path) -> None:
    """Archives of other keys that no run has used for KEEP_DAYS."""
    old = time.time() - KEEP_DAYS * 86400
    for path in cache.folder.glob("spark-*.jsa"):
        with contextlib.suppress(OSError):
            if path != keep and path.stat().st_mtime < old:
                path.unlink()
    _sweep_locks(cache.folder)


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
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
        fh.write("1000")  # and under memory pressure, this goes first
    # Its own log, appended to: not the user's terminal, not another key's log.
    fd = os.open(cache.log, os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(time.strftime("%Y-%m-%dT%H:%M:%S"), "building", cache.key, flush=True)
    return build(cache, args.recording, args.classpath_file, args.wait_for)


if __name__ == "__main__":
    sys.exit(main())
