"""The AsyncAPI project's own parser (npm ``@asyncapi/parser``), run under node.

``.ci/run`` installs it as it installs graphile-worker: into
``~/.cache/asyncapi-parser`` with npm (``$NMBUS_ASYNCAPI_PARSER_MODULES``
names another ``node_modules`` folder). Nothing is downloaded here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("asyncapi_parse.js")
VERSION = "3.6.6"
INSTALL_HINT = (
    "mkdir -p ~/.cache/asyncapi-parser && cd ~/.cache/asyncapi-parser && "
    f"npm install @asyncapi/parser@{VERSION} (or set NMBUS_ASYNCAPI_PARSER_MODULES)"
)


def modules() -> Path | None:
    given = os.environ.get("NMBUS_ASYNCAPI_PARSER_MODULES")
    folder = Path(given) if given else Path.home() / ".cache" / "asyncapi-parser" / "node_modules"
    return folder if (folder / "@asyncapi" / "parser" / "package.json").is_file() else None


def missing() -> str | None:
    """Why the parser cannot run here (None: it can)."""
    if shutil.which("node") is None:
        return "node is not installed: the AsyncAPI parser needs Node.js"
    if modules() is None:
        return f"@asyncapi/parser is not installed: {INSTALL_HINT}"
    return None


def parse(files: list[Path]) -> dict[Path, dict[str, Any]]:
    """What the parser says of each file: ``parsed`` and its ``diagnostics``."""
    found = modules()
    node = shutil.which("node")
    assert found is not None and node is not None, missing()
    result = subprocess.run(
        [node, str(SCRIPT), *map(str, files)],
        env={**os.environ, "NODE_PATH": str(found)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return {Path(line["file"]): line for line in lines}
