"""Zero-code activation of ds_lowcomm: an unmodified DeepSpeed script picks up a "lowcomm" JSON.

``ds_lowcomm_autoload.pth``, installed into site-packages with the package, runs
:func:`install_hook` when the interpreter starts. It puts a finder first on ``sys.meta_path`` that
answers for ``deepspeed`` only: it asks the other finders for DeepSpeed's spec and wraps its loader,
so whenever DeepSpeed's ``__init__`` has run (``import deepspeed``, ``from deepspeed import ...``,
``importlib.import_module``, ``deepspeed.runtime.engine`` reached first, a lazy loader),
:func:`activate`

- wraps ``DeepSpeedEngine.__init__`` in a check that refuses a config with a ``"lowcomm"`` section
  unless the engine is ds_lowcomm's (it marks itself with ``accepts_lowcomm_config``): whatever the
  path to the engine, a ``"lowcomm"`` JSON never trains stock DeepSpeed silently;
- imports :mod:`ds_lowcomm`, whose import patches ``deepspeed.initialize`` (unless
  ``DS_LOWCOMM_AUTOLOAD=0``; ``import ds_lowcomm`` in the script still activates it then).

The finder is never used up: ``importlib.util.find_spec("deepspeed")`` (transformers' and
accelerate's ``is_deepspeed_available``) gets the wrapped spec too, and the real import later goes
through the finder again. Standard library only, and nothing imported at start-up beyond ``os``,
``sys`` and the built-in ``_thread``: this runs in every interpreter of the environment.
"""
import _thread  # built in: threading.local without importing threading at start-up
import os
import sys

ENV = "DS_LOWCOMM_AUTOLOAD"
SECTION = "lowcomm"
#: why the hook did not activate ds_lowcomm in this process (None: it did, or no DeepSpeed yet)
inactive_reason = None


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _engine_config(arguments: dict):
    """The config dict a ``DeepSpeedEngine(args, model, ..., config, config_class)`` call carries."""
    config_class = arguments.get("config_class")
    if config_class is not None:
        return getattr(config_class, "_param_dict", None)
    config = arguments.get("config")
    if config is None:
        config = getattr(arguments.get("args"), "deepspeed_config", None)
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # DeepSpeed's own reader

    return load_ds_config(config)


def refusal(engine_cls) -> str:
    """The one-line error for a ``"lowcomm"`` config reaching an engine that is not ds_lowcomm's."""
    head = (f"this DeepSpeed config has a \"{SECTION}\" section, but it reached {engine_cls.__name__}, "
            f"which would ignore it and train stock DeepSpeed")
    if "ds_lowcomm" not in sys.modules:  # not activated, neither by the hook nor by an import
        return (f"{head}: ds_lowcomm is not active ({inactive_reason or 'not imported'}). Unset {ENV} (or add "
                f"`import ds_lowcomm` to the script) to train with it, or remove the section")
    return (f"{head}. Build the engine with deepspeed.initialize(...) (ds_lowcomm replaces it; "
            f"pipeline and hybrid engines are not supported), or remove the section")


def guard_engine(engine_cls) -> None:
    """Make ``engine_cls.__init__`` (and so every subclass's) refuse a ``"lowcomm"`` config unless
    the class being built sets ``accepts_lowcomm_config`` (idempotent)."""
    init = engine_cls.__init__
    if getattr(init, "ds_lowcomm_guarded", False):
        return
    import functools
    import inspect

    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if not getattr(type(self), "accepts_lowcomm_config", False):
            try:
                config = _engine_config(signature.bind(self, *args, **kwargs).arguments)
            except Exception:  # DeepSpeed reports a malformed call or config in its own words
                config = None
            if isinstance(config, dict) and SECTION in config:
                raise RuntimeError(refusal(type(self)))
        init(self, *args, **kwargs)

    __init__.ds_lowcomm_guarded = True
    engine_cls.__init__ = __init__


def activate(deepspeed) -> None:
    """Called once DeepSpeed's ``__init__`` has run: guard its engine, then load ds_lowcomm."""
    global inactive_reason
    try:
        guard_engine(deepspeed.runtime.engine.DeepSpeedEngine)
    except Exception as err:  # never break `import deepspeed` (a DeepSpeed whose engine moved)
        import warnings

        warnings.warn(f"ds_lowcomm: could not install the DeepSpeedEngine check ({err!r}); a "
                      f"\"lowcomm\" config reaching a stock engine would not be refused")
    if not enabled():
        inactive_reason = f"{ENV}={os.environ.get(ENV)}"
        return
    try:
        import ds_lowcomm  # its first import patches deepspeed.initialize

        ds_lowcomm.install()  # again, for an importlib.reload(deepspeed)
    except Exception as err:  # never break `import deepspeed` for scripts that do not use us
        inactive_reason = f"importing ds_lowcomm failed: {err!r}"
    else:
        inactive_reason = None


class _Loader:
    """DeepSpeed's own loader, with :func:`activate` after its ``exec_module``."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        activate(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, is_package, ...
        if name == "loader":  # not set yet (a copy, an unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class DeepSpeedImportHook:
    """Meta-path finder for ``deepspeed``: the spec the other finders give, with a wrapped loader."""

    def __init__(self) -> None:
        self.local = _thread._local()  # .searching: asking the others (one of them may ask back)

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed" or getattr(self.local, "searching", False):
            return None
        self.local.searching = True
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    if spec.loader is not None and not isinstance(spec.loader, _Loader):
                        spec.loader = _Loader(spec.loader)
                    return spec
            return None
        finally:
            self.local.searching = False


def install_hook() -> None:
    """Run by the .pth at interpreter start (idempotent)."""
    if "deepspeed" in sys.modules:
        activate(sys.modules["deepspeed"])
    elif not any(isinstance(f, DeepSpeedImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportHook())
