"""echotrain.compare: multi-seed comparisons of objective arms (``echotrain compare``).

- :mod:`~echotrain.compare.config`   the comparison file: arms x sweep values x seeds -> validated cells
- :mod:`~echotrain.compare.runner`   cells as ordinary run directories: skip done, resume killed, N at a time
- :mod:`~echotrain.compare.stats`    pure statistics: mean/std/bootstrap CI, AUC, steps to threshold,
                                     paired t / BCa intervals, Holm, minimal detectable effect,
                                     the verdict rule
- :mod:`~echotrain.compare.restate`  a written report's claims re-judged under the current rule
- :mod:`~echotrain.compare.report`   aggregation of run directories into Markdown + JSON + PNG
- :mod:`~echotrain.compare.commands` the ``echotrain compare`` command line

Stability flags are :mod:`echotrain.train.stability` (shared with ``echotrain train``).
"""
