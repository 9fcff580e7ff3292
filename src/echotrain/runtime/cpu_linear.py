"""oneDNN's inner product for the float32 linear layers of generation on a CPU: ``decode_linear``.

PyTorch's CPU ``F.linear`` in float32 is MKL's ``sgemm``. At the row counts of decoding (one to a
few dozen rows a step) oneDNN's inner product on the same weights was measured faster on an AMD
EPYC CPU, most for wide layers: SmolLM2's 49,152 x 576 LM head took 0.32-0.58x of ``F.linear``'s
time at 4-64 rows with the weights in oneDNN's blocked layout, and the default job's float32
rollouts 0.84x (packed) / 0.87x (plain) of their time, 0.88x / 0.94x with every kernel capped at
AVX2 (docs/benchmarks.md, "oneDNN for generation's linear layers"). Not measured on an Intel CPU
(MKL is Intel's, and may be the faster one there): ``decode_linear=torch`` keeps PyTorch's path,
and ``benchmarks/bench_decode_linear.py`` measures both.

The setting's values (:data:`DECODE_LINEARS`):

- ``"torch"``: ``F.linear`` everywhere.
- ``"onednn"`` (the default): during generation, each plain ``torch.nn.Linear`` of the model
  computes ``torch.ops.mkldnn._linear_pointwise(x, weight, bias)`` (oneDNN's inner product, the op
  inductor emits for CPU linears) on its own float32 weight: no copy of the weights (the default
  job's rollouts still peaked 0.2 GB higher than with ``torch``: 1.59 against 1.38 GB; not traced).
- ``"onednn_packed"``: the same on a copy of each weight in oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``), made at the first forward of a generation call
  and dropped at its end: faster again at a few rows, but +1x the linear weights' memory while
  generating (0.5 GB for SmolLM2-135M in float32; its rollouts peaked at 2.07 GB), ~0.1 s a call to
  make them.

Only where it applies: a forward in a thread inside :func:`linear_backend`, without grad, not
under CPU autocast (bfloat16 products already go to oneDNN), with float32 input and weight on the
CPU, of a module whose type is exactly ``torch.nn.Linear`` (subclasses, e.g. quantized linears,
keep theirs), with at least :data:`MIN_ONEDNN_WEIGHTS` weights (2^17: small layers lose to
oneDNN's cost per call; the testbed's are all smaller, so testbed runs are unchanged) and no
instance ``forward`` of its own (e.g. accelerate's hooks). Every other
call runs ``F.linear`` as ``nn.Linear.forward`` does; so the update's own forwards (with grad, and
the old / reference log-probs it recomputes) keep PyTorch's path. The sampler's log-probs, which
the update reads where it reuses them (``reuse_sampler_log_probs`` for the later mini-batches,
``recompute_old_log_prob=false``), come from generation, here oneDNN's: they already differed from
the update's by rounding (other shapes, a KV cache), now by another rounding.
The results equal ``F.linear``'s up to float32 rounding (another summation order: ~1e-6
relative); sampled tokens may therefore differ from ``torch``'s where two tokens' cumulative
probabilities meet within that rounding.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F

#: the values of the ``decode_linear`` setting (module docstring)
DECODE_LINEARS = ("torch", "onednn", "onednn_packed")
#: its default (our choice, a documented flag; the trainer's key and ``generate_rollouts``): most of
#: the gain of ``onednn_packed`` without its copy of the weights (echotrain keeps memory low);
#: ``torch`` keeps the generation's peak memory lowest
DEFAULT_DECODE_LINEAR = "onednn"
#: layers with fewer weights keep ``F.linear`` in every mode (our choice, a documented flag): oneDNN's
#: fixed cost per call made SmolLM2's 192 x 576 key/value projections slower at 1 to 16 rows (plain
#: 1.74x, 1.16x, 1.31x at 1, 4, 16 rows), where its 576 x 576 layers were slower at 1 row only (plain
#: 1.20x) and faster from 4 rows on (0.72-0.97x);
#: the testbed's layers (d_model 128) are all below, so its runs and studies are unchanged
MIN_ONEDNN_WEIGHTS = 2**17

_local = threading.local()  # .state: the _State of this thread's innermost linear_backend; None or absent: none
_lock = threading.Lock()
_installed: dict[int, list] = {}  # id(module) -> [module, number of linear_backend contexts holding it]


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's CPU inner product (``torch.ops.mkldnn._linear_pointwise``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _State:
    """One context's mode and its packed weights, keyed by the weight's id and packed again when the
    weight was written since (its version or its storage changed; a write through ``.data`` in
    place changes neither and is not seen)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.packed: dict[int, tuple[torch.Tensor, tuple[int, int], torch.Tensor]] = {}

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.mode != "onednn_packed":
            return w
        stamp = (w._version, w.data_ptr())
        hit = self.packed.get(id(w))
        if hit is None or hit[0] is not w or hit[1] != stamp:
            hit = (w, stamp, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
            self.packed[id(w)] = hit
        return hit[2]


class _Forward:
    """The instance ``forward`` :func:`linear_backend` sets on a ``nn.Linear``: ``nn.Linear.forward``
    with oneDNN's inner product where a context of this thread applies. An object, not a bound
    function, so that a model pickled or deep-copied meanwhile loads (its copy keeps it: outside a
    context it is ``F.linear``)."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        state = getattr(_local, "state", None)
        m = self.module
        w = m.weight
        if (state is None or torch.is_grad_enabled() or input.dtype != torch.float32 or w.dtype != torch.float32
                or input.device.type != "cpu" or w.device.type != "cpu" or torch.is_autocast_enabled("cpu")):
            return F.linear(input, w, m.bias)
        return torch.ops.mkldnn._linear_pointwise(input, state.weight(w), m.bias, "none", [], "")


def _linears(model: Any) -> list[torch.nn.Linear]:
    """The modules of ``model`` that :func:`linear_backend` takes over: exactly ``nn.Linear``, float32
    weights on the CPU, at least :data:`MIN_ONEDNN_WEIGHTS` of them, no instance ``forward`` other
    than ours."""
    out = []
    for m in model.modules():
        if (type(m) is not torch.nn.Linear or m.weight.dtype != torch.float32 or m.weight.device.type != "cpu"
                or m.weight.numel() < MIN_ONEDNN_WEIGHTS):
            continue
        own = m.__dict__.get("forward")
        if own is None or (isinstance(own, _Forward) and own.module is m):
            out.append(m)
    return out


def check_decode_linear(mode: str) -> None:
    """Raises ValueError naming the setting unless ``mode`` is one of :data:`DECODE_LINEARS`."""
    if mode not in DECODE_LINEARS:
        raise ValueError(f"decode_linear must be one of {DECODE_LINEARS}, got {mode!r}")


@contextlib.contextmanager
def linear_backend(model: Any, mode: str) -> Iterator[None]:
    """Run the float32 CPU linear layers of ``model``'s no-grad forwards in this thread, inside the
    block, by ``mode`` (one of :data:`DECODE_LINEARS`; module docstring). Other threads, with-grad
    forwards and autocast keep ``F.linear``. On leaving, the modules are as they were (an instance
    ``forward`` is set on each while any context holds it) and packed copies are dropped. Nested
    contexts: the innermost mode applies; a nested context of the same mode reuses the packed
    copies of the outer one.

    Raises:
        ValueError: ``mode`` is not one of :data:`DECODE_LINEARS`.
    """
    check_decode_linear(mode)
    modules = _linears(model) if mode != "torch" and onednn_linear_available() else []
    outer = getattr(_local, "state", None)
    if mode == "torch":
        state = None
    else:
        state = outer if outer is not None and outer.mode == mode else _State(mode)
    with _lock:
        for m in modules:
            held = _installed.get(id(m))
            if held is None:
                m.forward = _Forward(m)
                _installed[id(m)] = [m, 1]
            else:
                held[1] += 1
    _local.state = state
    try:
        yield
    finally:
        _local.state = outer  # None: no context (a torch one included)
        with _lock:
            for m in modules:
                held = _installed.get(id(m))
                if held is None:
                    continue
                held[1] -= 1
                if held[1] == 0:
                    del _installed[id(m)]
                    own = m.__dict__.get("forward")
                    if isinstance(own, _Forward) and own.module is m:  # not a forward set by others meanwhile
                        del m.forward
