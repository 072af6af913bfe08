"""A checkout that stops in the middle: ``checkout_child.py STORE REF TARGET READY``.

Checks out REF into TARGET; at its first progress report (files are being written into its
temporary directory) it creates READY and sleeps until killed, as a job killed mid-checkout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import casckpt


def main() -> None:
    store_root, ref, target, ready = sys.argv[1:5]

    def stop(_phase: str, _done: int, _total: int) -> None:
        Path(ready).touch()
        time.sleep(3600)

    with casckpt.open(store_root, create=False) as store:
        store.checkout(ref, target, progress=stop)


if __name__ == "__main__":
    main()
