#!/usr/bin/env python3
"""Write the JSON Schemas of `fleetserve ... -o json|yaml` to docs/schema/v1/ (docs/output.md).

    .venv/bin/python scripts/gen_schema.py           # (re)write them
    .venv/bin/python scripts/gen_schema.py --check   # exit 1 if a committed file differs

A change of what the CLI prints shows up as a changed file here: within v1, fields may be
added, never renamed or removed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fleetserve.cli.schema import VERSION, generate

OUT = Path(__file__).resolve().parent.parent / "docs" / "schema" / VERSION


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        path = OUT / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not check:
            path.write_text(text)
    for path in stale:
        print(f"{'differs' if check else 'wrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
