"""Model files: ``path/to/file.py`` or ``path/to/file.py:NAME`` (DESIGN section 3).

``NAME`` is a callable returning an ``nn.Module`` or ``(nn.Module, example_inputs)``, or
an ``nn.Module`` subclass constructible without arguments. Without ``NAME`` the first of
:data:`DEFAULT_NAMES` found in the file is used. Example inputs come with the model, or
from ``example_inputs()`` / ``get_inputs()`` in the file; their batch is the global
batch of one iteration.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flexsearch.errors import ModelLoadError

DEFAULT_NAMES = ("build_model", "get_model", "model", "Model")
INPUT_NAMES = ("example_inputs", "get_inputs")


def split_spec(spec: str) -> tuple[Path, str | None]:
    """``"a/b.py:NAME"`` -> (Path("a/b.py"), "NAME"); a bare path gives ``None``."""
    spec = str(spec)
    path, sep, name = spec.rpartition(":")
    if sep and path and name.isidentifier() and not Path(spec).exists():
        return Path(path), name
    if sep and path and not name and not Path(spec).exists() and Path(path).exists():
        raise ModelLoadError(f"{spec}: no NAME after ':'; pass {path}:NAME, or {path} alone")
    return Path(spec), None


def _user_frame(exc: BaseException, path: Path) -> str:
    """The deepest traceback frame inside the model file, as ``file:line: code``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{exc.filename}:{exc.lineno}"
    mine = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
    frame = (mine or frames or [None])[-1]
    if frame is None:
        return str(path)
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def _import(path: Path) -> ModuleType:
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist; pass path/to/file.py[:NAME]")
    if path.is_dir() or path.suffix != ".py":
        raise ModelLoadError(f"model file {path} is not a .py file; pass path/to/file.py[:NAME]")
    mod_name = f"flexsearch_model_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        with _user_code() as pressed:
            spec.loader.exec_module(module)
    except (SystemExit, KeyboardInterrupt) as exc:  # the file ends the process: not at import time
        sys.modules.pop(mod_name, None)
        if isinstance(exc, KeyboardInterrupt) and pressed():  # Ctrl-C, not the file's own
            raise
        what = f"exits (sys.exit({exc.code!r}))" if isinstance(exc, SystemExit) else "raises KeyboardInterrupt"
        raise ModelLoadError(
            f"model file {path} {what} when imported (at {_user_frame(exc, path)}); put script code under "
            "`if __name__ == \"__main__\":`"
        ) from None
    except Exception as exc:  # the user's code: report its own error and line
        sys.modules.pop(mod_name, None)
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelLoadError(
            f"model file {path} failed to import: {type(exc).__name__}: {msg} "
            f"(at {_user_frame(exc, path)}); fix the file and retry"
        ) from exc
    return module


@contextlib.contextmanager
def _user_code() -> Iterator[Callable[[], bool]]:
    """Runs the model file's code, telling a Ctrl-C from the code's own
    ``KeyboardInterrupt``: yields ``pressed()``, true once SIGINT came while it ran (the
    handler in place still runs, and raises the interrupt). A Ctrl-C ends the command as
    an interrupt; a ``KeyboardInterrupt`` the code raises itself is the file's fault.
    Outside the main thread, or where SIGINT is ignored or kills, nothing is installed
    and ``pressed()`` stays false."""
    seen: list[bool] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield lambda: False
        return

    def handler(signum, frame):
        seen.append(True)
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(seen)
    finally:
        signal.signal(signal.SIGINT, previous)


def _call(obj, what: str, path: Path):
    try:
        with _user_code() as pressed:
            return obj()
    except (SystemExit, KeyboardInterrupt) as exc:
        if isinstance(exc, KeyboardInterrupt) and pressed():  # Ctrl-C, not the code's own
            raise
        how = f"exits (sys.exit({exc.code!r}))" if isinstance(exc, SystemExit) else "raises KeyboardInterrupt"
        raise ModelLoadError(f"{what} in {path} {how} (at {_user_frame(exc, path)}); it must return the model") \
            from None
    except Exception as exc:
        msg = str(exc).splitlines()[0] if str(exc) else ""
        hint = "it must be callable without arguments" if isinstance(exc, TypeError) and "argument" in msg \
            else "fix it there and run again"
        raise ModelLoadError(
            f"{what} in {path} raised {type(exc).__name__}: {msg} (at {_user_frame(exc, path)}); {hint}"
        ) from exc


def _as_inputs(value) -> tuple:
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    return (value,)


def load_model(spec: str | Path) -> tuple[nn.Module, tuple]:
    """Load ``path.py[:NAME]`` and return ``(model, example_inputs)``.

    Raises :class:`ModelLoadError` with one line for: a missing file, a file that fails
    to import (the file's own error and line), no model found (the names looked for), a
    ``NAME`` that does not exist (the names the file has), missing example inputs.
    """
    path, name = split_spec(str(spec))
    module = _import(path)
    if name is None:
        name = next((n for n in DEFAULT_NAMES if hasattr(module, n)), None)
        if name is None:
            raise ModelLoadError(
                f"no model found in {path}: looked for {', '.join(DEFAULT_NAMES)}; "
                f"define one of them or pass {path}:NAME"
            )
    elif not hasattr(module, name):
        candidates = sorted(
            k
            for k, v in vars(module).items()
            if not k.startswith("_")
            and callable(v)
            and getattr(v, "__module__", None) == module.__name__
        )
        raise ModelLoadError(
            f"{path} has no {name!r}; callables defined there: {', '.join(candidates) or 'none'}"
        )
    obj = getattr(module, name)
    if isinstance(obj, nn.Module):
        result = obj
    elif inspect.isclass(obj) and issubclass(obj, nn.Module) or callable(obj):
        result = _call(obj, repr(name), path)
    else:
        raise ModelLoadError(
            f"{path}:{name} is a {type(obj).__name__}, not an nn.Module or a callable "
            "returning one; point NAME at a builder function or module class"
        )
    inputs = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, inputs = result[0], _as_inputs(result[1])
    if not isinstance(result, nn.Module):
        raise ModelLoadError(
            f"{path}:{name} returned {type(result).__name__}, not an nn.Module or "
            "(nn.Module, example_inputs); return the model"
        )
    if inputs is None:
        fn = next((getattr(module, n) for n in INPUT_NAMES if callable(getattr(module, n, None))), None)
        if fn is None:
            raise ModelLoadError(
                f"no example inputs for {path}:{name}: return (model, inputs) from {name} "
                f"or define {' or '.join(n + '()' for n in INPUT_NAMES)} in the file"
            )
        inputs = _as_inputs(_call(fn, fn.__name__, path))
    if not inputs or not any(isinstance(x, torch.Tensor) for x in tree_leaves(inputs)):  # a trailing dict too
        raise ModelLoadError(
            f"example inputs of {path}:{name} hold no tensor; give a tuple of input tensors "
            "whose dim 0 is the global batch"
        )
    return result, inputs
