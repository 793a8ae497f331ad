"""Zero-code activation of ds_lowcomm: an unmodified DeepSpeed script picks up a "lowcomm" JSON.

``ds_lowcomm_autoload.pth``, installed into site-packages with the package, imports this module
when the interpreter starts. It costs nothing until something imports ``deepspeed``: a meta-path
finder waits for that import and, once DeepSpeed's ``__init__`` has run,

- imports :mod:`ds_lowcomm`, whose import patches ``deepspeed.initialize`` (the default);
- or, with ``DS_LOWCOMM_AUTOLOAD=0`` (or if importing ds_lowcomm fails), wraps
  ``deepspeed.initialize`` in a guard that refuses a config with a ``"lowcomm"`` section, so a user
  never silently trains stock ZeRO-1 from a ds_lowcomm JSON. ``import ds_lowcomm`` in the script
  still activates the package explicitly.

Standard library only: this runs in every interpreter of the environment.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys

ENV = "DS_LOWCOMM_AUTOLOAD"
SECTION = "lowcomm"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _config_of(args: tuple, kwargs: dict):
    """The config ``deepspeed.initialize(args, model, ..., config, config_params)`` was given."""
    config = kwargs.get("config") if kwargs.get("config") is not None else kwargs.get("config_params")
    ds_args = kwargs.get("args", args[0] if args else None)
    if config is None:
        config = getattr(ds_args, "deepspeed_config", None)
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            text = f.read()
        try:
            return json.loads(text)
        except ValueError:
            import hjson  # DeepSpeed's own JSON reader accepts hjson

            return hjson.loads(text)
    return config if isinstance(config, dict) else None


def guard(initialize, reason: str):
    """``deepspeed.initialize`` that raises for a config with a ``"lowcomm"`` section."""

    @functools.wraps(initialize)
    def guarded(*args, **kwargs):
        config = _config_of(args, kwargs)
        if isinstance(config, dict) and SECTION in config:
            raise RuntimeError(
                f"this DeepSpeed config has a \"{SECTION}\" section but ds_lowcomm is not active "
                f"({reason}); stock DeepSpeed would ignore it and train plain ZeRO-1. Add "
                f"`import ds_lowcomm` to the script, unset {ENV}, or remove the section")
        return initialize(*args, **kwargs)

    guarded.ds_lowcomm_guarded = initialize  # ds_lowcomm.initialize calls through to this
    return guarded


def activate(deepspeed) -> None:
    """Called once ``deepspeed`` is imported: patch it, or guard it."""
    if not enabled():
        deepspeed.initialize = guard(deepspeed.initialize, f"{ENV}={os.environ.get(ENV)}")
        return
    try:
        import ds_lowcomm  # noqa: F401  (its import patches deepspeed.initialize)
    except Exception as err:  # never break `import deepspeed` for scripts that do not use us
        deepspeed.initialize = guard(deepspeed.initialize, f"importing ds_lowcomm failed: {err!r}")


class _Loader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        activate(module)


class DeepSpeedImportHook(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` with the other finders, and runs :func:`activate` after it loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_hook() -> None:
    """Run by the .pth at interpreter start (idempotent)."""
    if "deepspeed" in sys.modules:
        activate(sys.modules["deepspeed"])
    elif not any(isinstance(f, DeepSpeedImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())
