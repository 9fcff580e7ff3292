"""Checks of every user-given path, device and resume state, run before any heavy work.

``echotrain train`` and ``echotrain eval`` call these after the configuration is parsed and
before a model is loaded or a run directory is written. Each raises :class:`ConfigError` with
one message naming the key or path, the problem and what to do; the CLI prints it and exits 2.

- :func:`check_model` a local model name (embedded, ``testbed``, ``testbed-length``) is known
  offline (a testbed's shipped weights' SHA-256 is checked); a local folder / ``.gguf`` file must
  exist (a folder must hold a ``config.json``); a hub id must look like one and be reachable or
  cached.
- :func:`check_task` builds the task (cheap) and turns its errors (missing JSONL file, a row
  without an answer, no network for a hub data set) into one message.
- :func:`model_task_mismatch` a byte-level testbed policy (``testbed``, ``testbed-length``) takes
  only its own task or one registered ``for_testbed=True`` (no chat template): the message naming
  both, for ``train`` (``model=`` / ``task=``) and ``eval`` (``--model`` / ``--task``, ``--suite``).
- :func:`check_chat_prompts` (after the model loads, the one check that needs its tokenizer): a
  task of chat prompts needs a tokenizer with a chat template.
- :func:`check_device` ``cuda``/``cuda:N``/``mps`` must exist in this torch build and machine.
- :func:`check_threads` at most the number of CPU cores (more only oversubscribes; an absurd
  count makes ``pthread_create`` fail inside torch).
- :func:`check_resume` the run directory has a readable checkpoint, and ``steps`` is not below
  the step it reached; names damaged checkpoint files and falls back to the newest good one.

Hub reachability (:func:`hub_reachable`) is a single TCP connection with a 3 s bound, only made
when a hub model or data set is actually needed; ``HF_HUB_OFFLINE=1`` skips it. When the hub is
not reachable but the model/data set is in the local Hugging Face cache, the offline variables
are set so the libraries read the cache at once instead of retrying the network.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

from echotrain.errors import ConfigError

__all__ = ["affinity_cores", "check_chat_prompts", "check_device", "check_eval_model", "check_model",
           "check_output_dir", "check_resume", "check_task", "check_threads", "check_writable", "cpu_cores",
           "hub_reachable", "model_task_mismatch", "testbed_task_of"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_TRUTHY = ("1", "true", "yes", "on")


def cpu_cores() -> int:
    """CPU cores of this machine (``os.cpu_count``), at least 1."""
    return os.cpu_count() or 1


def affinity_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` elsewhere),
    at least 1: the default thread count of ``echotrain train`` / ``eval``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def default_threads() -> tuple[int, str]:
    """The thread count of ``num_threads=0`` / ``--threads 0`` and why: ``OMP_NUM_THREADS`` when the
    user set it to a positive integer (as torch's own default does), else every core this process
    may run on (:func:`affinity_cores`).

    Returns:
        (threads >= 1, the reason: ``"OMP_NUM_THREADS=N"`` or ``"all cores"``).
    """
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw), f"OMP_NUM_THREADS={raw}"
    return affinity_cores(), "all cores"


def _offline_env() -> bool:
    return any(os.environ.get(k, "").lower() in _TRUTHY for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                                   "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout_s`` (DNS included).

    False at once when ``HF_HUB_OFFLINE`` (or ``HF_DATASETS_OFFLINE``/``TRANSFORMERS_OFFLINE``) is set.
    """
    if _offline_env():
        return False
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout_s).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(ok)


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    return home / "hub"


def _in_hub_cache(repo_id: str, repo_type: str) -> bool:
    folder = _hub_cache() / f"{repo_type}s--{repo_id.replace('/', '--')}"
    if folder.is_dir() and any((folder / "snapshots").glob("*")):
        return True
    if repo_type == "dataset":  # datasets' own processed cache
        home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
        dcache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
        return (dcache / repo_id.replace("/", "___")).is_dir()
    return False


def _go_offline() -> None:
    """Make transformers / datasets / huggingface_hub read only the local cache from now on."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[k] = "1"
    try:  # already imported: their constants were read at import time
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True
    except Exception:  # pragma: no cover - optional
        pass
    try:
        import sys

        if "datasets" in sys.modules:
            import datasets.config as dc

            dc.HF_HUB_OFFLINE = True
            if hasattr(dc, "HF_DATASETS_OFFLINE"):
                dc.HF_DATASETS_OFFLINE = True
    except Exception:  # pragma: no cover
        pass


def require_hub(repo_id: str, repo_type: str, key: str, alternative: str) -> None:
    """Raise unless the hub is reachable or ``repo_id`` is in the local cache (then go offline).

    Raises:
        ConfigError: neither; the message names ``key`` and suggests ``alternative``.
    """
    if hub_reachable():
        return
    if _in_hub_cache(repo_id, repo_type):
        _go_offline()
        return
    why = "HF_HUB_OFFLINE is set" if _offline_env() else "huggingface.co is not reachable (no network)"
    raise ConfigError(f"{key} needs the Hugging Face hub {repo_type} {repo_id!r}, but {why} and it is not in the "
                      f"local cache ({_hub_cache()}); {alternative}")


def check_model(name: str | None, key: str = "model") -> None:
    """Check a ``model`` value before loading it (see :func:`echotrain.models.load_policy`).

    A local model name (:data:`echotrain.models.hf.LOCAL_MODELS`: the embedded models and
    ``testbed``) never needs the hub; it is checked by :func:`echotrain.models.hf.check_local_model`.

    Raises:
        ConfigError: an embedded model whose package is missing, a missing local path or ``.gguf`` file, a folder without ``config.json``, a
            string that is neither a path nor a hub id, or a hub id with no network and no cache.
    """
    from echotrain.models.hf import DEFAULT_MODEL, LOCAL_MODELS, check_local_model, local_model_names

    if name is None or name in LOCAL_MODELS:
        try:
            check_local_model(name or DEFAULT_MODEL)
        except (FileNotFoundError, KeyError) as exc:
            raise ConfigError(f"{key}: {exc}") from None
        except ValueError as exc:  # a testbed's shipped weights do not match their hash
            raise ConfigError(f"{key}={name}: {exc}") from None
        return
    s = str(name)
    p = Path(s).expanduser()
    if s.lower().endswith(".gguf"):
        if not p.is_file():
            raise ConfigError(f"{key}={s!r}: GGUF file not found (resolved to {p.resolve()})")
        return
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            raise ConfigError(f"{key}={s!r}: the folder has no config.json, so it is not a Hugging Face model "
                              "folder (save one with model.save_pretrained, or give a run's final_model/)")
        if p.is_file():
            raise ConfigError(f"{key}={s!r} is a file; give a model folder, a .gguf file or a hub id")
        return
    looks_like_path = s.startswith(("/", "./", "../", "~")) or s.count("/") > 1 or os.sep + os.sep in s
    if looks_like_path or not _REPO_ID.match(s):
        raise ConfigError(f"{key}={s!r}: no such file or folder, and not a Hugging Face hub id (org/name); "
                          f"local models: {', '.join(local_model_names())}")
    if "/" in s and p.parent.is_dir() and not _in_hub_cache(s, "model"):
        # "runs/x" where runs/ is a local folder: a path that does not exist, not a hub id to fetch
        raise ConfigError(f"{key}={s!r}: no such folder ({p.parent}/ exists here but holds no {p.name!r}); give an "
                          "existing model folder, run directory or .gguf file")
    require_hub(s, "model", f"{key}={s!r}: no such local file or folder, and it", "give a local model folder or a "
                ".gguf file, or run where the hub is reachable once to fill the cache")


def check_task(name: str, options: dict[str, Any], key: str = "task") -> Any:
    """Build task ``name`` with ``options`` and return it; a hub data set needs network or cache.

    Raises:
        ConfigError: unknown task, bad option, missing file, malformed data, or no network.
    """
    from echotrain.tasks import get_task, task_hub_dataset

    opts = dict(options or {})
    repo = task_hub_dataset(name)
    if repo and not opts.get("path"):
        require_hub(repo, "dataset", f"{key}={name!r} without task_options.path",
                    "give a local JSONL file with task_options.path=FILE.jsonl")
    try:
        return get_task(name, **opts)
    except KeyError as exc:
        msg = exc.args[0] if exc.args else exc
        raise ConfigError(f"{key}={name!r}: {msg}") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}={name!r} task_options.path={opts.get('path')!r}: {exc}") from None
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"{key}={name!r} task_options={opts}: {exc}") from None


def testbed_task_of(model: str | None) -> str | None:
    """The task a byte-level testbed policy was built for (``testbed`` -> ``testbed``,
    ``testbed-length`` -> ``testbed-length``; :data:`echotrain.models.testbed.TESTBED_CONFIGS`),
    or None for any other model."""
    from echotrain.models.testbed import TESTBED_CONFIGS

    return TESTBED_CONFIGS[model].task if model in TESTBED_CONFIGS else None


def model_task_mismatch(model: str | None, task: str | None, *, model_label: str, task_label: str,
                        task_key: str = "task=") -> str | None:
    """Why ``task`` cannot be run on ``model``, or None when it can.

    A testbed policy reads bare text through a byte tokenizer with no chat template, so it takes
    its own task or one registered ``for_testbed=True`` (:func:`echotrain.tasks.task_for_testbed`);
    ``task`` None stands for chat prompts (a benchmark suite). Every other model takes any task.

    Args:
        model: the model name (for a run directory: its ``config.yaml``'s ``model``).
        task: the task name, or None for a suite's chat-prompt benchmarks.
        model_label, task_label: how the message names the two (``"model='testbed'"``,
            ``"--model 'runs/x' (a run of model=testbed)"``, ``"--task 'default'"``).
        task_key: how the fix is spelled (``"task="``, ``"--task "``).
    """
    from echotrain.tasks import task_for_testbed

    own = testbed_task_of(model)
    if own is None or (task is not None and (task == own or task_for_testbed(task))):
        return None
    return (f"{model_label} speaks bare arithmetic with a byte tokenizer (no chat template) and {task_label} "
            f"is not a task for it: use {task_key}{own} (or a task registered with register_task(name, "
            "for_testbed=True))")


def check_chat_prompts(tokenizer: Any, prompt: Any, *, model_label: str, task_label: str) -> None:
    """After the model loads: a task whose prompts are chat messages (``prompt``, one of them)
    needs a tokenizer with a chat template (``tokenizer.chat_template``); plain-text prompts need
    none.

    Raises:
        ConfigError: chat prompts and no chat template, naming the model and the task.
    """
    if isinstance(prompt, str) or getattr(tokenizer, "chat_template", None):
        return
    raise ConfigError(f"{model_label} has no chat template (its tokenizer, {type(tokenizer).__name__}, sets none) and "
                      f"{task_label} has chat prompts: give a task of plain-text prompts, or a model with a chat "
                      "template (train's chat_template key sets one for a training run)")


def check_device(name: str, key: str = "device") -> None:
    """``cuda``/``cuda:N``/``mps`` must be usable here (checked without loading a model).

    Raises:
        ConfigError: this torch has no CUDA / no such GPU index / no MPS.
    """
    import torch

    if name in ("auto", "cpu"):
        return
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA (CPU-only wheel)" if torch.version.cuda is None
                   else "no CUDA GPU is visible (driver / CUDA_VISIBLE_DEVICES)")
            raise ConfigError(f"{key}={name!r}: {why}; use {key}=cpu or {key}=auto")
        _, _, idx = name.partition(":")
        if idx:
            if not idx.isdigit():
                raise ConfigError(f"{key}={name!r}: expected cuda or cuda:N with N an integer")
            if int(idx) >= torch.cuda.device_count():
                raise ConfigError(f"{key}={name!r}: only {torch.cuda.device_count()} CUDA device(s) "
                                  f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return
    if name == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError(f"{key}={name!r}: MPS is not available here; use {key}=cpu")
        return
    raise ConfigError(f"{key}={name!r} is not a device; valid: auto, cpu, cuda, cuda:N, mps")


def check_threads(n: int, key: str = "num_threads") -> None:
    """``0 <= n <= cpu_cores()`` (0 = all cores).

    Raises:
        ConfigError: negative, or more threads than this machine has cores.
    """
    if n < 0 or n > cpu_cores():
        raise ConfigError(f"{key}={n}: must be in [0, {cpu_cores()}] (0 = all cores; this machine has "
                          f"{cpu_cores()} CPU cores, more threads only oversubscribe them)")


def check_resume(run_dir: str | os.PathLike, steps: int) -> Path:
    """The checkpoint a resume of ``run_dir`` will load; ``steps`` must reach at least its step.

    Damaged checkpoint files (truncated or not a torch zip archive) are skipped with a warning
    naming them; the newest readable one is returned.

    Raises:
        ConfigError: no checkpoint, every checkpoint damaged, or ``steps`` below the step reached.
    """
    import sys

    from echotrain.runtime.checkpoints import latest_valid_checkpoint

    path, damaged = latest_valid_checkpoint(run_dir)
    ckdir = Path(run_dir) / "checkpoints"
    if path is None:
        if damaged:
            raise ConfigError(f"--resume {str(run_dir)!r}: checkpoint file(s) damaged (truncated or not a torch "
                              f"archive): {', '.join(str(d) for d in damaged)}; no earlier checkpoint to fall back "
                              "to (keep_last=2 or more keeps one); start a new run")
        raise ConfigError(f"--resume {str(run_dir)!r}: no checkpoint in {ckdir} (the run stopped before its first "
                          "checkpoint; see save_every); start a new run")
    for d in damaged:
        print(f"echotrain: warning: checkpoint {d} is damaged (truncated or not a torch archive); "
              f"resuming from the previous one, {path.name}", file=sys.stderr)
    from echotrain.runtime.checkpoints import checkpoint_step

    reached = checkpoint_step(path)
    if steps < reached:
        raise ConfigError(f"--resume {str(run_dir)!r}: steps={steps} is below the step the run already reached "
                          f"({reached}, {path.name}); give steps={reached} or more")
    return path


def check_output_dir(output_dir: str | None, resume: bool) -> None:
    """A new run must not write into a file or into another run's directory, and must be able to
    create its directory (``output_dir``, or ``runs/`` when unset).

    Raises:
        ConfigError: ``output_dir`` is a file, holds a run already (``metrics.jsonl`` or
            ``checkpoints/``) and this is not ``--resume``, or nothing can be created in it / its
            nearest existing parent (:func:`check_writable`).
    """
    p = Path(output_dir or "runs").expanduser()  # unset: runs/<preset>-<time> is created in the working folder
    key = f"output_dir={output_dir!r}" if output_dir else "output_dir (unset: runs/<preset>-<time>)"
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key} is a file, not a folder" if output_dir else f"{key}: {p} is a file, not a folder")
    if output_dir and not resume and p.is_dir() and ((p / "metrics.jsonl").exists() or (p / "checkpoints").exists()):
        raise ConfigError(f"output_dir={output_dir!r} holds a run already; continue it with --resume {output_dir} or "
                          "choose another output_dir")
    parent = p
    while not parent.exists():
        parent = parent.parent
    check_writable(parent, key)


def check_writable(folder: str | os.PathLike, key: str) -> None:
    """``folder`` (an existing directory) accepts a new entry: a temporary subfolder is created
    and removed at once. A real write, not ``os.access``: root passes every permission check,
    yet cannot create anything in ``/proc`` or on a read-only mount.

    Raises:
        ConfigError: the folder cannot be written; the message starts with ``key`` and gives the
            reason (``strerror``).
    """
    import tempfile

    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".echotrain-write-check-", dir=folder))
    except OSError as exc:
        raise ConfigError(f"{key}: cannot write in {folder} ({exc.strerror or exc}); give a writable folder") from None


def check_chat_template(value: str | None) -> None:
    """``chat_template``: a valid Jinja template or an existing file holding one.

    Raises:
        ConfigError: neither, or invalid Jinja.
    """
    if not value:
        return
    from echotrain.runtime.chat_template import read_chat_template

    try:
        read_chat_template(value)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None


def check_eval_model(model: str | None) -> None:
    """``--model`` of ``echotrain eval``: a run directory / checkpoint file must be complete;
    anything else is checked as ``model=`` (:func:`check_model`).

    Raises:
        ConfigError: a damaged checkpoint file, a run directory with neither ``final_model/`` nor
            a readable checkpoint, or what :func:`check_model` raises.
    """
    from echotrain.runtime.checkpoints import is_readable_checkpoint, latest_valid_checkpoint

    if model is not None and os.path.exists(model):
        p = Path(model)
        if p.is_file() and p.suffix == ".pt":
            if not is_readable_checkpoint(p):
                raise ConfigError(f"--model {model!r}: checkpoint file is damaged (truncated or not a torch archive)")
            return
        if p.is_dir() and (p / "config.yaml").is_file():
            if (p / "final_model").is_dir():
                return
            ckpt, damaged = latest_valid_checkpoint(p)
            if ckpt is None:
                extra = f" (damaged: {', '.join(map(str, damaged))})" if damaged else ""
                raise ConfigError(f"--model {model!r}: run directory has neither final_model/ nor a readable "
                                  f"checkpoint{extra}")
            return
    check_model(model, key="--model")
