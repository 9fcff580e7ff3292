"""Old import path of :mod:`echotrain.optim.sharpness` (Hessian eigenvalue / trace / SAM sharpness),
kept because README.md and docs/experiments/late_sam.md name ``echotrain.sharpness``: this name
is the same module object."""

import sys

from echotrain.optim import sharpness as _sharpness

sys.modules[__name__] = _sharpness
