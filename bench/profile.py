"""Sum py-spy's collapsed stacks (``--format raw``) per function.

python -m bench.profile FILE [--top 25] [--only deferred/]

Inclusive: the share of samples where the function is on the stack (once per
sample, however deep); self: where it is the innermost frame. Idle threads
(waiting in ``select``, a lock or ``sleep``) are in the samples too, so read
the shares of the busy frames against each other.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def summarize(path: Path, only: str = "") -> tuple[int, Counter[str], Counter[str]]:
    total = 0
    inclusive: Counter[str] = Counter()
    innermost: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = [f for f in stack.split(";") if f and (not only or only in f)]
        for frame in set(frames):
            inclusive[frame] += count
        if frames and stack.split(";")[-1] == frames[-1]:
            innermost[frames[-1]] += count
    return total, inclusive, innermost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--only", default="", help="keep frames whose text contains this")
    args = parser.parse_args()
    total, inclusive, innermost = summarize(args.file, args.only)
    print(f"{total} samples")
    print("inclusive:")
    for frame, count in inclusive.most_common(args.top):
        print(f"  {100 * count / total:5.1f}%  {frame}")
    print("self:")
    for frame, count in innermost.most_common(args.top):
        print(f"  {100 * count / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
