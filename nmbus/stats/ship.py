"""Write the one archive a cluster needs: this package, as ``nmbus_stats``, for ``--py-files``.

::

    python nmbus/stats/ship.py nmbus-stats.zip      # from a checkout; or, nmbus installed:
    python -m nmbus.stats.ship nmbus-stats.zip

Every ``.py`` file of this folder goes into the zip under ``nmbus_stats/``; the
modules import each other relatively, so they work under that name as under
``nmbus.stats``, and import nothing else of nmbus. ``submit.py`` is the file
spark-submit runs. This file imports only the standard library, so it runs as a
plain file from a checkout without nmbus's dependencies.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

PACKAGE = "nmbus_stats"  # the name submit.py imports
HERE = Path(__file__).resolve().parent


def ship(zip_path: str | Path) -> list[str]:
    """Write ``zip_path``; returns the names it holds."""
    names = []
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as zf:
        for source in sorted(HERE.glob("*.py")):
            name = f"{PACKAGE}/{source.name}"
            zf.write(source, name)
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ship.py", description="Write the statistics job's zip for spark-submit --py-files."
    )
    p.add_argument("zip", help="the zip to write, e.g. nmbus-stats.zip")
    args = p.parse_args(argv)
    names = ship(args.zip)
    print(f"{args.zip}: {len(names)} files of the package {PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
