"""Entry point of the reward worker process (``python -m echotrain.rewards._worker``).

Kept apart from ``isolated.py`` so that running it does not re-execute an imported module.
"""

from echotrain.rewards.isolated import _serve

if __name__ == "__main__":
    _serve()
