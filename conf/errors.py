"""Hydra's and OmegaConf's refusals of a config as ONE line each, and the command line prepared for Hydra.

Hydra prints its composition errors over many lines (search path, every option, object types); ``one_line``
words each as the key, the value, the choices or a "did you mean" hint. The functions know a structured-config
schema only through what they are given: ``root`` (the root dataclass) and ``options``, the groups whose keys
depend on the chosen option (``group -> ({option name: dataclass}, default option)``); ``conf.schema`` passes
its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import typing
from pathlib import Path
from typing import Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from core.errors import NEEDS_QUOTES, ConfigError

Options = Mapping[str, tuple[Mapping[str, type], str]]


class ConfigInputError(ConfigError):
    """A command-line override or config value the schema refuses; the message is one line naming the key."""


class UnknownKeyError(ConfigInputError):
    """A key the schema does not know (e.g. ``+optim.learning_rate=0.5``, ``model=cnn model.hidden=512``)."""


def keys_of(schema: type) -> list[str]:
    """The field names of the dataclass ``schema``."""
    return [f.name for f in dataclasses.fields(schema)]


def option_of(schema: Optional[type], options: Options) -> Optional[tuple[str, str]]:
    """(group, option) when ``schema`` is one option's schema (e.g. CNNConfig -> ("model", "cnn"))."""
    for group, (schemas, _) in options.items():
        for name, s in schemas.items():
            if s is schema:
                return group, name
    return None


def unknown_key_message(key: str, schema: Optional[type], options: Options, more: str = "") -> str:
    """One line for ``key`` (dotted) missing from the dataclass ``schema`` of its parent node.

    Under an option group (model, parallel, optim) it names the chosen option and the keys it has, and the
    options the key belongs to; elsewhere a "did you mean" hint, else the parent's keys. ``more`` is appended
    after the key."""
    parent, _, leaf = key.rpartition(".")
    known = keys_of(schema) if dataclasses.is_dataclass(schema) else []
    option = option_of(schema, options)
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.5)
    if option is not None:
        group, name = option
        if "." not in key:  # (a node merged on its own, e.g. by from_dict)
            key = f"{group}.{key}"
        own = ", ".join(k for k in known if k != "name")
        elsewhere = [n for n, s in options[group][0].items() if leaf in keys_of(s)]
        if elsewhere:
            return (
                f"{key}{more} does not apply to {group}={name} (only to {group}={', '.join(elsewhere)}); "
                f"{group}={name} has: {own}"
            )
        hint = f"did you mean {group}.{close[0]}?" if close else f"{group}={name} has: {own}"
        return f"unknown config key {key}{more} for {group}={name}; {hint}"
    where = f"{parent}." if parent else ""
    hint = (
        f"did you mean {where}{close[0]}?"
        if close
        else f"known keys{' of ' + parent if parent else ''}: " + ", ".join(known)
    )
    return f"unknown config key {key}{more}; {hint}"


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, dataclass of its parent) for every key of ``cfg`` that its dataclass schema lacks.

    Hydra's ``+key=value`` adds keys even to a typed (struct) node and ``OmegaConf.to_object`` then drops
    them silently, so they are looked for here, recursively, in every node that has a dataclass type.
    """
    found: list[tuple[str, type]] = []
    schema = OmegaConf.get_type(cfg)
    known = keys_of(schema) if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if known is not None and key not in known:
            found.append((dotted, schema))
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found.extend(unknown_keys(child, dotted + "."))
    return found


def check_known_keys(cfg: DictConfig, options: Options) -> None:
    """Raises ``UnknownKeyError`` (one line, with a "did you mean" hint) for the first key the schema lacks."""
    bad = unknown_keys(cfg)
    if bad:
        key, schema = bad[0]
        more = f" (and {len(bad) - 1} more: {', '.join(k for k, _ in bad[1:])})" if len(bad) > 1 else ""
        raise UnknownKeyError(unknown_key_message(key, schema, options, more))


def check_keys(cfg: DictConfig, options: Options) -> None:
    """``check_known_keys`` then ``check_option_names``: the keys ``cfg`` holds and the options it names."""
    check_known_keys(cfg, options)
    check_option_names(cfg, options)


def check_option_names(cfg: DictConfig, options: Options) -> None:
    """``model.name`` / ``parallel.name`` / ``optim.name`` must be the chosen option's: the option picks the schema, so
    ``model.name=cnn`` on ``model=mlp`` would build a CNN from MLP settings. Raises ConfigInputError."""
    for group, (schemas, _) in options.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "name" not in node:
            continue
        option = option_of(OmegaConf.get_type(node), options)
        name = node.get("name")
        if option is not None and name != option[1]:
            how = f"{group}={name}" if name in schemas else f"{group}=<one of {', '.join(schemas)}>"
            raise ConfigInputError(
                f"{group}.name={name} does not match the chosen option {group}={option[1]}; "
                f"choose the {group} with {how}"
            )


def schema_at(path: str, root: type, options: Options) -> Optional[type]:
    """The dataclass of the node at dotted ``path`` of ``root`` ("" is the root; an option group gives its
    default option's schema), or None when there is no such node."""
    schema: Optional[type] = root
    for part in [p for p in path.split(".") if p]:
        if schema is root and part in options:
            schemas, default = options[part]
            schema = schemas.get(default)
            continue
        fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        if part not in fields or not callable(fields[part].default_factory):
            return None
        schema = type(fields[part].default_factory())
    return schema if dataclasses.is_dataclass(schema) else None


def _choices(e: OmegaConfBaseException) -> Optional[list[str]]:
    """The members of the Enum field an OmegaConf validation error is about, else None."""
    schema, key = getattr(e, "object_type", None), getattr(e, "key", None)
    if not dataclasses.is_dataclass(schema) or key is None:
        return None
    hint = typing.get_type_hints(schema).get(str(key))
    for t in (hint, *typing.get_args(hint)):  # Optional[E] -> (E, NoneType)
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return [m.value for m in t]
    return None


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def _quote_hint(override: str) -> str:
    """``; quote the value: 'key="value"'`` for an unquoted override value Hydra cannot parse because of a
    space, a bracket or another character of its grammar (also any non-ASCII letter); else ``""`` (also for
    a value that starts as a list or dict: a typo there is not a quoting matter)."""
    key, sep, value = str(override).partition("=")
    if not sep or not value or value[0] in "'\"[{" or '"' in value or not NEEDS_QUOTES.search(value):
        return ""
    return f"; quote the value for Hydra inside the shell's quotes: '{key}=\"{value}\"'"


# Groups whose options only set existing keys: an unlisted value can be given through the key itself.
GROUP_KEYS = {"accum": "train.accum_steps", "mesh": "mesh.devices / mesh.shape"}


def default_groups(config: Path = Path(__file__).resolve().parent / "config.yaml") -> set[str]:
    """The config groups of the main config's defaults list (``parallel``, ``model``, ...); any other group
    (``experiment``, ``sweep``) is added on the command line with a ``+``."""
    import yaml

    defaults = (yaml.safe_load(config.read_text()) or {}).get("defaults") or []
    return {next(iter(d)).lstrip("+").split("@")[0] for d in defaults if isinstance(d, dict)}


def one_line(e: BaseException, root: Optional[type] = None, options: Optional[Options] = None) -> str:
    """One line for an error of Hydra's composition or OmegaConf's validation: the key, the value, the choices
    or a "did you mean" hint (``root``/``options``: the schema, for unknown keys).

    Handles Hydra's ``MissingConfigException`` (unknown group option), ``OverrideParseException``,
    ``ConfigCompositionException`` (unknown key without ``+``, wrong type or choice, ambiguous value) and
    OmegaConf's own errors; anything else: its first line.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    options = options or {}
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, _, value = e.missing_cfg_file.rpartition("/")
        choices = sorted(o for o in (e.options or []) if not o.startswith("_"))
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        # a group outside the defaults list (experiment, sweep) is added with a +; Hydra's own (hydra/launcher) is not
        plus = "" if group in default_groups() or group.startswith("hydra/") else "+"
        hint = f"; did you mean {plus}{group}={close[0]}?" if close else ""
        key = GROUP_KEYS.get(group)
        other = f" (or set {key} directly)" if key else ""
        return (
            f"{plus}{group}={value} is not an option of group {group}; choose one of {', '.join(choices)}{other}{hint}"
        )
    if isinstance(e, OverrideParseException):
        return f"cannot parse the override {e.override!r}: {_first_line(str(e))}{_quote_hint(e.override)}"
    cause = e.__cause__ if isinstance(e, ConfigCompositionException) else e
    text = str(e)
    if isinstance(e, ConfigCompositionException) and "Ambiguous value for argument" in text:
        arg = text.split("'")[1] if "'" in text else text
        return (
            f"{arg}: a comma-separated value is a sweep (add -m); for a list write key=[a,b], for a string "
            f"quote it: key='a,b'"
        )
    if isinstance(e, ConfigCompositionException) and "Could not delete from config" in text and "'" in text:
        key = text.split("'")[1]
        schema = schema_at(key.rpartition(".")[0], root, options) if root is not None else None
        if schema is not None:
            return f"cannot delete ~{key}: " + unknown_key_message(key, schema, options)
    if isinstance(e, ConfigCompositionException) and "No match in the defaults list" in text:
        group = text.split("'")[1] if "'" in text else "?"
        return f"{group} is not in the defaults list: add it with a + (+{group}=<option>)"
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or getattr(cause, "key", None)
        override = text.split("override ", 1)[1].strip() if "Error merging override " in text else None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key and "not in" in str(cause):
            return unknown_key_message(str(key), getattr(cause, "object_type", None), options)
        choices = _choices(cause)
        option = option_of(getattr(cause, "object_type", None), options)
        if option is not None and "." not in str(key):  # (a node merged on its own, e.g. by from_dict)
            key = f"{option[0]}.{key}"
        value = getattr(cause, "value", None)
        shown = override or (f"{key}={value}" if value is not None else str(key))
        if choices is not None:
            return f"{shown} is not a valid choice; choose one of {', '.join(choices)}"
        return f"{shown}: {_first_line(str(cause))}"
    if isinstance(e, ValueError) and text.startswith("Config group override"):
        return f"{_first_line(text)}: a group option is a name, e.g. accum=4 or parallel=fsdp"
    return _first_line(text)


def is_composition_error(e: BaseException) -> bool:
    """Whether ``e`` is Hydra's or OmegaConf's refusal of a config or override (``one_line`` words it)."""
    from hydra.errors import HydraException

    return isinstance(e, (HydraException, OmegaConfBaseException)) or (
        isinstance(e, ValueError) and str(e).startswith("Config group override")
    )


def command_line_error(e: BaseException, argv: Sequence[str], root: type, options: Options) -> Optional[str]:
    """The one line for an error Hydra raised before a job started (``argv``: the command's arguments), or None
    when ``e`` is not one: a refused composition (``one_line``), two run flags together (e.g. -m with --cfg), or
    a run (sweep) folder that cannot be created."""
    if is_composition_error(e):
        return one_line(e, root, options)
    if isinstance(e, ValueError) and str(e).startswith("Only one of --run, --multirun"):
        sweep = any(a in ("-m", "--multirun") for a in argv)
        hint = "; drop -m (--multirun) and give one job's values, e.g. python train.py --cfg job mesh.devices=2"
        return f"{e}{hint if sweep else ''}"
    if isinstance(e, OSError):  # Hydra could not create the run (or sweep) folder
        return (
            f"cannot create the run folder: {e.strerror or e}: {e.filename}; set hydra.run.dir "
            "(hydra.sweep.dir with -m) to a folder you can write"
        )
    return None


# ---- the command line prepared for Hydra's parser --------------------------------------------------------------
_NUMBERS = re.compile(r"\d+(,\d+)*")


def quote_numeric_options(args: Sequence[str], conf_dir: Path) -> list[str]:
    """``args`` with numeric values of config groups quoted: ``accum=4`` -> ``accum='4'``, ``accum=1,2,4,8`` ->
    ``accum='1','2','4','8'``. Hydra parses an unquoted number as an integer and refuses it as a group option
    ("Config group override must be a string or a list"); every other argument is returned unchanged."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~").split("@")[0]
        if (
            sep
            and not arg.startswith("-")
            and group
            and (Path(conf_dir) / group).is_dir()
            and _NUMBERS.fullmatch(value)
        ):
            arg = f"{key}=" + ",".join(f"'{v}'" for v in value.split(","))
        out.append(arg)
    return out


def multirun_flag_first(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``-m``/``--multirun`` moved before the overrides: Hydra's argument parser refuses the flag
    after an override (``python train.py data=synthetic -m accum=1,2`` would print its usage and exit 2)."""
    flags = [a for a in argv if a in ("-m", "--multirun")]
    return flags + [a for a in argv if a not in ("-m", "--multirun")]
