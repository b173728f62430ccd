"""The file ``spark-submit`` runs: the statistics job from the zip ``ship.py`` writes.

::

    python nmbus/stats/ship.py nmbus-stats.zip
    spark-submit --jars /usr/share/java/postgresql.jar --py-files nmbus-stats.zip \\
        nmbus/stats/submit.py --dsn postgresql://user@db:5432/app --out hdfs:///reports/nmbus

The zip holds this package as ``nmbus_stats``; this file runs its ``job``. It
imports only the standard library, so it runs alone wherever spark-submit
copies it, on a machine where nmbus is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

PACKAGE = "nmbus_stats"  # the package's name in the zip (ship.py)


def main() -> int:
    if importlib.util.find_spec(PACKAGE) is None:
        print(
            f"nmbus-stats: error: No module named {PACKAGE!r}: pass the zip that "
            "'python nmbus/stats/ship.py nmbus-stats.zip' writes with --py-files nmbus-stats.zip",
            file=sys.stderr,
        )
        return 1
    job = importlib.import_module(f"{PACKAGE}.job")
    code: int = job.main()
    return code


if __name__ == "__main__":
    sys.exit(main())
