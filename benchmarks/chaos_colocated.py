"""Chaos, co-located: :mod:`benchmarks.chaos` with the pool held by the servers themselves.

No store process: each vLLM server's connector holds a segment of the pool in its own memory
(``global_segment_size``), so a server loads its own objects directly and its peer's over
TCP, and a frozen or killed server takes its segment with it. Faults: every kind of the
store fleet's run but the store faults, plus ``server_frozen``. ``--smoke`` is the short
variant; ``--out DIR`` keeps the history.
"""

from __future__ import annotations

import sys

from benchmarks import chaos


def main(argv: list[str] | None = None) -> int:
    return chaos.main(argv, colocated=True)


if __name__ == "__main__":
    sys.exit(main())
