"""Print the table of committed benchmark JSON, as the bench printed it: ``python benchmarks/show.py FILE...``.

Each block starts with the file name and the command that made it (``command`` in the JSON); the tables in
benchmarks/README.md are this output, pasted (tests/test_bench_schema.py checks that they still match).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any


def table(result: dict[str, Any]) -> str:
    """The bench's own ``format_table`` of one result (the schema envelope)."""
    from kvshuttle.cli import BENCHES  # the module of each bench name (``e2e`` lives in kvshuttle.bench.e2e.bench)

    module = importlib.import_module(BENCHES.get(result["bench"], f"kvshuttle.bench.{result['bench']}"))
    text: str = module.format_table(result)
    return text


def show(path: Path) -> str:
    result = json.loads(path.read_text())
    text = f"{path.name}: {result['command']}\n{table(result)}"
    return "\n".join(line.rstrip() for line in text.splitlines())


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv]
    blocks = [show(p) for p in paths if "bench" in json.loads(p.read_text())]
    print("\n\n".join(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
