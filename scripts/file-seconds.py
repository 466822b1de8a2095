"""Write tests/file_seconds.json from the output of a pytest run with --durations=0.

    pytest ... --durations=0 | tee run.log; python scripts/file-seconds.py run.log

The seconds each test file took (setup, call and teardown of its tests, rounded):
tests/conftest.py hands the files to the processes side by side longest first,
so that no long file starts last. Refresh it when files grow or new ones come;
a file it does not name counts as long as the median one.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"\s*(?P<seconds>[\d.]+)s (?:setup|call|teardown)\s+(?P<file>[^:\s]+)::")


def main(log: str) -> None:
    seconds: Counter[str] = Counter()
    for line in Path(log).read_text().splitlines():
        if match := LINE.match(line):
            seconds[match["file"]] += float(match["seconds"])
    if not seconds:
        sys.exit(f"{log}: no durations (run pytest with --durations=0)")
    out = Path(__file__).resolve().parent.parent / "tests" / "file_seconds.json"
    ranked = {name: round(total) for name, total in seconds.most_common()}
    out.write_text(json.dumps(ranked, indent=1) + "\n")
    print(f"{out.name}: {len(ranked)} files, {sum(ranked.values())} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
