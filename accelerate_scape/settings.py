"""Where SCAPE settings come from: arguments > ``SCAPE_*`` environment > ``scape_config.yaml`` > defaults.

The file lives next to Accelerate's ``default_config.yaml`` (``$HF_HOME/accelerate``, else
``$XDG_CACHE_HOME/huggingface/accelerate``, else ``~/.cache/huggingface/accelerate``), unless
``SCAPE_CONFIG_FILE`` (or an explicit path) names another one. Every ``ScapeConfig`` field has
an environment variable ``SCAPE_<FIELD>`` (``SCAPE_SPARSITY``, ``SCAPE_WARMUP_STEPS``, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from scape_core import ScapeConfig

FILE_NAME = "scape_config.yaml"
ENV_PREFIX = "SCAPE_"
CONFIG_FILE_ENV = "SCAPE_CONFIG_FILE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def fields() -> dict[str, Any]:
    """``ScapeConfig`` field names and their defaults, in declaration order."""
    return {f.name: f.default for f in dataclasses.fields(ScapeConfig)}


def env_name(field: str) -> str:
    """The environment variable of a field: ``env_name("warmup_steps") == "SCAPE_WARMUP_STEPS"``."""
    return ENV_PREFIX + field.upper()


def accelerate_config_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The directory of Accelerate's ``default_config.yaml``, by the rule Accelerate uses.

    Mirrors ``accelerate.commands.config.config_args.cache_dir``, but reads the environment at
    call time (Accelerate reads it once, at import).
    """
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME", "~/.cache")
    hf_home = env.get("HF_HOME", os.path.join(cache, "huggingface"))
    return Path(os.path.expanduser(hf_home)) / "accelerate"


def default_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """The SCAPE config file used when none is named: ``$SCAPE_CONFIG_FILE`` or the Accelerate dir's.

    Example:
        >>> default_config_file({"HF_HOME": "/data/hf"})
        PosixPath('/data/hf/accelerate/scape_config.yaml')
    """
    env = os.environ if environ is None else environ
    if env.get(CONFIG_FILE_ENV):
        return Path(os.path.expanduser(env[CONFIG_FILE_ENV]))
    return accelerate_config_dir(env) / FILE_NAME


@dataclass(frozen=True)
class Settings:
    """A resolved :class:`ScapeConfig` and, per field, where its value came from.

    ``sources[field]`` is ``"argument"`` (or the name :func:`resolve_settings` was given for the
    overrides, e.g. ``"flag"``), ``"env SCAPE_<FIELD>"``, ``"file <path>"`` or ``"default"``.
    """

    config: ScapeConfig
    sources: dict[str, str]
    file: Path
    file_found: bool

    @property
    def chosen(self) -> list[str]:
        """The fields set somewhere (an override, the environment or the file), not left at the default."""
        return [n for n, s in self.sources.items() if s != "default"]

    def describe(self) -> str:
        """One line per field: ``name = value  (source)``."""
        width = max(len(n) for n in self.sources)
        return "\n".join(f"  {n:<{width}} = {getattr(self.config, n)!r:<20} ({s})" for n, s in self.sources.items())


def resolve_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    config_file: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
    overrides_source: str = "argument",
) -> Settings:
    """Resolve every ``ScapeConfig`` field: ``overrides`` > ``SCAPE_*`` env > config file > default.

    ``None`` in ``overrides`` means "not given"; ``overrides_source`` names where they came from in
    :attr:`Settings.sources`. The config file is read whenever it exists, so a bad file is an error
    even where the environment overrides its keys.

    Example:
        >>> s = resolve_settings({"sparsity": 0.9}, environ={"SCAPE_WARMUP_STEPS": "20", "HF_HOME": "/none"})
        >>> s.config.sparsity, s.config.warmup_steps, s.sources["warmup_steps"]
        (0.9, 20, 'env SCAPE_WARMUP_STEPS')
    """
    env = os.environ if environ is None else environ
    defaults = fields()
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"unknown SCAPE setting(s) {unknown}; valid: {sorted(defaults)}")
    for name, value in given.items():
        validate_field(name, value, where=f"argument {name}={value!r}")
    _warn_unknown_env(env, defaults)

    path = Path(config_file).expanduser() if config_file is not None else default_config_file(env)
    if config_file is not None and not path.is_file():
        raise FileNotFoundError(f"SCAPE config file {path} does not exist (write it with `accelerate-scape config`)")
    if config_file is None and env.get(CONFIG_FILE_ENV) and not path.is_file():  # named, so meant: not skipped
        what = "is a folder" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"{CONFIG_FILE_ENV}={env[CONFIG_FILE_ENV]} names no SCAPE config file: {path} {what}. "
                                f"Point it at the file (write one with `accelerate-scape config`), or unset it")
    found = path.is_file()
    from_file = load_config_file(path) if found else {}

    values, sources = {}, {}
    for name, default in defaults.items():
        if name in given:
            values[name], sources[name] = given[name], overrides_source
        elif env.get(env_name(name), "") != "":
            values[name], sources[name] = parse_env_value(name, env[env_name(name)]), f"env {env_name(name)}"
        elif name in from_file:
            values[name], sources[name] = from_file[name], f"file {path}"
        else:
            values[name], sources[name] = default, "default"
    return Settings(ScapeConfig(**values), sources, path, found)


class _Loader(yaml.SafeLoader):
    """YAML as people write it: ``1e-1`` is a float (YAML 1.2), not the string PyYAML's YAML 1.1 makes it."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a ``scape_config.yaml``; errors name the file and the key.

    Example:
        >>> load_config_file("~/.cache/huggingface/accelerate/scape_config.yaml")  # doctest: +SKIP
        {'sparsity': 0.9, 'warmup_steps': 50, ...}
    """
    path = Path(path).expanduser()
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of SCAPE settings, got {type(data).__name__}")
    known = fields()
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}; valid keys: {', '.join(known)}")
        validate_field(key, value, where=f"{path}: key {key!r}")
    return data


def parse_env_value(name: str, raw: str) -> Any:
    """Convert the string of ``SCAPE_<NAME>`` to the field's type; errors name the variable."""
    return parse_value(name, raw, where=f"environment variable {env_name(name)}={raw!r}")


def parse_value(name: str, raw: str, where: str | None = None) -> Any:
    """Convert a command-line / environment string to field ``name``'s type and validate it.

    Example:
        >>> parse_value("error_feedback", "no", where="--error_feedback")
        False
    """
    default = fields()[name]
    kind = {bool: "yes/no", int: "an int", float: "a number", str: "a string"}[type(default)]
    try:
        if isinstance(default, bool):
            if raw.strip().lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            value: Any = raw.strip().lower() in _TRUE
        elif isinstance(default, int):
            value = int(raw)
        elif isinstance(default, float):
            value = float(raw)
        else:
            value = raw.strip()
    except ValueError:
        raise ValueError(f"{where + ': ' if where else ''}{name} expects {kind}, got {raw!r}") from None
    validate_field(name, value, where=where)
    return value


def write_config_file(config: ScapeConfig, path: str | os.PathLike | None = None,
                      names: Iterable[str] | None = None) -> Path:
    """Write the fields ``names`` of ``config`` (default: every field) to ``path`` (default:
    :func:`default_config_file`); returns it. A field left out takes, in each run, the script's own
    default or ``ScapeConfig``'s.

    Example:
        >>> write_config_file(ScapeConfig(sparsity=0.99), "/tmp/scape.yaml", names=["sparsity"])  # doctest: +SKIP
        PosixPath('/tmp/scape.yaml')
    """
    path = Path(path).expanduser() if path is not None else default_config_file()
    values = config.to_dict()
    chosen = {n: values[n] for n in (values if names is None else names)}
    header = ("# SCAPE settings for accelerate_scape (written by `accelerate-scape config`); a setting not here takes "
              "the script's own default, else ScapeConfig's\n")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header + (yaml.safe_dump(chosen, sort_keys=False) if chosen else ""), encoding="utf-8")
    except OSError as e:  # the same error type, saying which file could not be written
        raise type(e)(e.errno, f"cannot write the SCAPE config file {path}: {e.strerror}", e.filename) from None
    return path


def to_environ(config: ScapeConfig, names: Iterable[str] | None = None) -> dict[str, str]:
    """``SCAPE_*`` variables that reproduce ``config`` (or its fields ``names``) in a child process.

    Example:
        >>> to_environ(ScapeConfig(sparsity=0.99), names=["sparsity"])
        {'SCAPE_SPARSITY': '0.99'}
    """
    values = config.to_dict()
    out = {}
    for name in values if names is None else names:
        value = values[name]
        out[env_name(name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def validate_field(name: str, value: Any, where: str | None = None) -> None:
    """Check one field on its own, so the error names exactly this key (``where`` prefixes it)."""
    try:
        ScapeConfig(**{name: value})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where + ': ' if where else ''}{e}") from None


def _warn_unknown_env(env: Mapping[str, str], known: dict[str, Any]) -> None:
    names = {env_name(n) for n in known} | {CONFIG_FILE_ENV}
    for key in env:
        if key.startswith(ENV_PREFIX) and key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.warn(f"environment variable {key} is not a SCAPE setting and is ignored{hint}", stacklevel=3)
