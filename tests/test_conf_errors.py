"""The command line prepared for Hydra and its parse errors worded as one line (conf/errors.py): a path Hydra cannot
parse unquoted gets the quoted form, and ``-m`` may come after the overrides."""

from __future__ import annotations

import pytest


# ---- a path with spaces, brackets or non-ASCII letters: Hydra's parse error says how to quote it -------------
def _parse_error(override: str) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from conf.errors import is_composition_error, one_line
    from conf.schema import OPTION_SCHEMAS, Config

    try:
        OverridesParser.create().parse_overrides([override])
    except Exception as e:
        assert is_composition_error(e), repr(e)
        return one_line(e, Config, OPTION_SCHEMAS)
    raise AssertionError(f"{override!r} parsed")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "checkpoint.dir=ckpt/my run (1)",
            "cannot parse the override 'checkpoint.dir=ckpt/my run (1)': mismatched input ' (' expecting <EOF>; "
            "quote the value for Hydra inside the shell's quotes: 'checkpoint.dir=\"ckpt/my run (1)\"'",
        ),
        (
            "hydra.run.dir=runs/a [b]",
            "cannot parse the override 'hydra.run.dir=runs/a [b]': mismatched input '[' expecting <EOF>; "
            "quote the value for Hydra inside the shell's quotes: 'hydra.run.dir=\"runs/a [b]\"'",
        ),
        (
            "data.cache_dir=/tmp/c é",
            "cannot parse the override 'data.cache_dir=/tmp/c é': LexerNoViableAltException: data.cache_dir=/tmp/c é; "
            "quote the value for Hydra inside the shell's quotes: 'data.cache_dir=\"/tmp/c é\"'",
        ),
        # a broken list is a typo, not a quoting matter: no hint
        ("train.steps=[1,2", "cannot parse the override 'train.steps=[1,2': no viable alternative at input '[1,2'"),
    ],
)
def test_unparsable_path_override_names_the_quoting(override, message):
    assert _parse_error(override) == message


def test_the_quoted_form_the_hint_gives_parses_to_the_path():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides(['checkpoint.dir="ckpt/my run (1) ü=a,b%#"'])
    assert parsed.value() == "ckpt/my run (1) ü=a,b%#"


@pytest.mark.unit
def test_multirun_flag_moves_before_the_overrides():
    from conf.errors import multirun_flag_first

    assert multirun_flag_first(["data=synthetic", "-m", "accum=1,2"]) == ["-m", "data=synthetic", "accum=1,2"]
    assert multirun_flag_first(["a=1", "--multirun"]) == ["--multirun", "a=1"]
    assert multirun_flag_first(["a=1", "b=2"]) == ["a=1", "b=2"]


@pytest.mark.unit
@pytest.mark.parametrize("path", ["/tmp/f/a b/rün 2/checkpoints", "/tmp/plain/ckpt", "runs/a [b]", "~/ck,1"])
def test_advised_overrides_parse_back_to_the_path(path):
    """An error or stop line's advice (``core.errors.override``) pasted into a shell reaches Hydra as the path: a
    path with spaces or non-ASCII letters was printed bare and failed to parse when followed."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from core.errors import override
    from training import process

    text = override("checkpoint.dir", path)
    (parsed,) = OverridesParser.create().parse_overrides(shlex.split(text))
    assert (parsed.key_or_group, parsed.value()) == ("checkpoint.dir", path)
    line = process.saved_stop_text(f"{path}/12", path)
    assert f"continue with the same command and {text} (or {override('checkpoint.resume', path + '/12')})" in line
