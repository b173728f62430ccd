"""What the embedded PostgreSQL changes on the machine when nmbus runs as root.

PostgreSQL refuses to run as root. So when the effective uid is 0, and only
then, :meth:`nmbus.demo.embedded.EmbeddedPostgres.start` calls
:func:`hand_over` before it initialises the data folder, and the server runs
as the system user ``pgserver`` (pgserver's own package does the same). That
call, never an import, makes these changes, each logged when it is made:

1. ``useradd --system -s /bin/sh pgserver``, when no such user exists
   (``embedded_postgres_user_created``);
2. ``g+rx,o+rx`` on every folder above the data folder and above pgserver's
   ``pginstall`` folder, up to ``/``, so that user can reach both: a data
   folder under ``/root`` makes ``/root`` traversable by every user
   (``embedded_postgres_folders_opened``);
3. the ``pginstall`` tree made readable by all, its executables runnable
   (``embedded_postgres_binaries_opened``);
4. the data folder (``pgdata``) given to ``pgserver``; the caller then sets
   its mode to 0700 (``embedded_postgres_data_handed_over``).

Nothing is undone by ``stop()`` or ``destroy()``: the user and the modes stay.
Not as root, none of this happens and the server runs as the current user.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from pathlib import Path

import structlog

log = structlog.get_logger("nmbus.demo.embedded")

SYSTEM_USER = "pgserver"


def system_user() -> str | None:
    """The user the server must run as: ``pgserver`` as root, None (the current user) else."""
    return SYSTEM_USER if os.geteuid() == 0 else None


def hand_over(user: str, pgdata: Path, install: Path) -> list[str]:
    """Let ``user`` run the binaries under ``install`` on ``pgdata``; see the module docstring.

    Returns what it changed on the machine, one sentence each (none when all was
    done before), for the command line to say on the terminal as well as in the log.
    """
    said = []
    uid, gid, created = _ensure_system_user(user)
    if created:
        said.append(f"created the system user {user} (useradd --system)")
    opened = [*_open_up(pgdata), *_open_up(install)]
    if opened:
        log.warning(
            "embedded_postgres_folders_opened", user=user, folders=opened, added="g+rx,o+rx"
        )
        said.append(f"opened to every user (g+rx,o+rx): {', '.join(opened)}")
    changed = _open_tree(install)
    if changed:
        log.info("embedded_postgres_binaries_opened", user=user, tree=str(install), files=changed)
        said.append(f"made pgserver's binaries in {install} readable by every user")
    if pgdata.stat().st_uid != uid:
        os.chown(pgdata, uid, gid)
        log.info("embedded_postgres_data_handed_over", user=user, pgdata=str(pgdata))
        said.append(f"gave {pgdata} to {user}")
    return said


def _ensure_system_user(name: str) -> tuple[int, int, bool]:
    """The user's uid and gid, and whether it was created now."""
    try:
        entry = pwd.getpwnam(name)
        created = False
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "-s", "/bin/sh", name], check=True, capture_output=True
        )
        log.warning("embedded_postgres_user_created", user=name)
        entry = pwd.getpwnam(name)
        created = True
    return entry.pw_uid, entry.pw_gid, created


def _open_up(path: Path) -> list[str]:
    """Let other users traverse every folder above ``path`` (g+rx, o+rx); those changed."""
    changed = []
    for parent in path.parents:
        mode = parent.stat().st_mode
        if mode & 0o055 != 0o055:
            parent.chmod(mode | 0o055)
            changed.append(str(parent))
    return changed


def _open_tree(root: Path) -> int:
    """Make the tree readable (its executables runnable) by every user; how many changed."""
    changed = 0
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, d) for d in dirs)]:
            mode = os.stat(name).st_mode
            if mode & 0o055 != 0o055:
                os.chmod(name, mode | 0o055)
                changed += 1
        for name in files:
            full = os.path.join(folder, name)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                continue
            wanted = mode | 0o044 | (0o011 if mode & 0o100 else 0)
            if wanted != mode:
                os.chmod(full, wanted)
                changed += 1
    return changed
