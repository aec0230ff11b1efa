"""What the history store's numba functions share (rlspec/speculation/history/host/store.py and
counts.py): numba itself, a cache folder it can write, and the 64-bit mix of their hashes."""
from __future__ import annotations

import atexit
import shutil
import tempfile

import numpy as np

try:
    import numba as nb
except ImportError as e:
    raise ImportError("speculation=history needs numba (the history store's walks are compiled with it): "
                      "pip install numba") from e


def _cache_probe():
    pass


try:  # numba looks for a writable cache folder when a function is declared cache=True
    nb.njit(cache=True)(_cache_probe)
except RuntimeError:  # none: a folder of this process's own, removed at exit
    nb.config.CACHE_DIR = tempfile.mkdtemp(prefix="rlspec-numba-")
    atexit.register(shutil.rmtree, nb.config.CACHE_DIR, True)

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_P = np.uint64(0x100000001B3)


@nb.njit(inline="always", cache=True)
def _mix(h):
    h ^= h >> np.uint64(33)
    h *= _M1
    h ^= h >> np.uint64(33)
    h *= _M2
    h ^= h >> np.uint64(33)
    return h
