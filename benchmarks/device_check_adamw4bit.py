"""Moved to :mod:`echotrain.devicecheck.adamw4bit_compiled` (part of ``echotrain device-check``);
this path still runs it:

    python benchmarks/device_check_adamw4bit.py [--device cpu]
"""

import sys

from echotrain.devicecheck.adamw4bit_compiled import main

if __name__ == "__main__":
    sys.exit(main())
