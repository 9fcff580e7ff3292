"""Moved to :mod:`echotrain.devicecheck.overlap` (part of ``echotrain device-check``); this path
still runs it:

    python benchmarks/bench_overlap_gpu.py --devices cuda:0
"""

from echotrain.devicecheck.overlap import main

if __name__ == "__main__":
    main()
