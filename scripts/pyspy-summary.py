"""Where a server's threads spent a py-spy recording (`py-spy record --format raw --threads`, as
`PYSPY=1 scripts/gpu-serving.sh` takes them): samples by thread, then each thread's functions
that appear in the most samples (anywhere in the stack: inclusive) and that were sampled on top
(exclusive).

    python3 scripts/pyspy-summary.py pyspy-poisson-1000-gil.txt [--top 12]

With a `--gil` recording the samples are those of the thread that held the GIL, so the share by
thread is who held it, and for how much of the recording. A recording with `--subprocesses` (the
server and its engine-core process) names each thread's process too."""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

THREAD = re.compile(r"^thread \(\w+\): ([^;]*)")
"""A stack's first frame names its thread (`thread (0x7f..): loraplex-engine`)."""
PROCESS = re.compile(r"^process (\d+)")
"""With `--subprocesses` a frame before it names the process (`process 1234:"python3 -m ..."`)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recording", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    by_thread: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    exclusive: dict[str, Counter[str]] = defaultdict(Counter)
    for line in args.recording.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = PROCESS.match(frames[0])
        if process:
            frames = frames[1:]
        match = THREAD.match(frames[0])
        thread = match.group(1) if match else frames[0]
        if process:
            thread = f"{thread} (pid {process.group(1)})"
        samples = int(count)
        by_thread[thread] += samples
        for frame in set(frames[1:]):
            inclusive[thread][frame] += samples
        exclusive[thread][frames[-1]] += samples
    total = sum(by_thread.values())
    print(f"{total} samples in {args.recording.name}")
    for thread, samples in by_thread.most_common():
        print(f"\n{thread}: {samples} samples ({samples / total:.1%})")
        print("  inclusive:")
        for frame, n in inclusive[thread].most_common(args.top):
            print(f"    {n / samples:6.1%}  {frame}")
        print("  on top:")
        for frame, n in exclusive[thread].most_common(args.top // 2):
            print(f"    {n / samples:6.1%}  {frame}")


if __name__ == "__main__":
    main()
