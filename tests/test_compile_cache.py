"""JAX's persistent compilation cache: the runtime keys set jax.config, null turns it off, a second process
loads the step from the cache (training/compile_cache.py)."""

import logging
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conf.schema import Config, register, to_typed
from tests.conftest import COMPILATION_CACHE, REPO
from tests.utils import run_train
from training.runtime import cache_settings, configure_compilation_cache

OPTIONS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture
def restore_cache_config():
    """The session's cache settings come back after the test (other tests compile under them)."""
    saved = {name: getattr(jax.config, name) for name in OPTIONS}
    yield
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    for name, value in saved.items():
        jax.config.update(name, value)


def entries(folder: Path) -> set[str]:
    """Executable entries of a JAX cache folder (``<key>-cache``; ``-atime`` files are access times)."""
    return {p.name for p in folder.iterdir() if p.name.endswith("-cache")} if folder.exists() else set()


@pytest.mark.unit
def test_default_folder_follows_the_environment_and_null_turns_it_off():
    register()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        default = to_typed(compose(config_name="config"))
        off = to_typed(compose(config_name="config", overrides=["runtime.compilation_cache_dir=null"]))
    assert default.runtime.compilation_cache_dir == COMPILATION_CACHE == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert off.runtime.compilation_cache_dir is None
    # without the variable: under the user's cache folder
    plain = OmegaConf.structured(Config)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR")
    try:
        home_default = plain.runtime.compilation_cache_dir
    finally:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
    assert home_default == os.path.join(cache_home, "dp_scaling", "jax_compilation_cache")


@pytest.mark.unit
def test_keys_set_jax_config_and_null_disables(tmp_path, restore_cache_config):
    folder = configure_compilation_cache(str(tmp_path / "c"), 0.25, 128)
    assert folder == str(tmp_path / "c")
    assert jax.config.jax_enable_compilation_cache is True
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 128
    assert configure_compilation_cache(None) is None
    assert jax.config.jax_enable_compilation_cache is False
    assert cache_settings("", 0.0, 0) == {"jax_enable_compilation_cache": False}
    with pytest.raises(ValueError, match="runtime.compilation_cache_min_compile_time_s=-1"):
        cache_settings("x", -1, 0)


@pytest.mark.unit
def test_second_compile_is_read_from_the_cache(tmp_path, restore_cache_config):
    hits = []
    jax.monitoring.register_event_listener(lambda event, **_: hits.append(event))
    folder = tmp_path / "c"

    def scaled_sum(x):
        return (x * 3.0).sum()

    def compile_once():
        jax.clear_caches()  # in-memory caches: the next compile goes to the persistent cache
        return jax.jit(scaled_sum).lower(np.ones(7, np.float32)).compile()

    configure_compilation_cache(None)
    compile_once()
    assert not folder.exists()  # off: nothing written
    configure_compilation_cache(str(folder), 0.0, 0)
    compile_once()
    written = entries(folder)
    assert len(written) == 1 and next(iter(written)).startswith("jit_scaled_sum-")
    before = hits.count("/jax/compilation_cache/cache_hits")
    compile_once()
    assert hits.count("/jax/compilation_cache/cache_hits") == before + 1
    assert entries(folder) == written  # read, not written again


def test_a_second_process_loads_the_train_step(tmp_path):
    """Two ``train.py`` processes with one cache folder: the first writes the train and eval steps, the second
    logs cache hits for them (``JAX_LOG_COMPILES`` makes JAX log hits) and writes nothing new."""
    folder = tmp_path / "cache"
    common = (
        "data=synthetic",
        "train.steps=2",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
        "runtime.cpu_devices=2",
        f"runtime.compilation_cache_dir={folder}",
    )
    first = run_train(tmp_path / "a", *common)
    assert first.returncode == 0, first.stderr[-2000:]
    written = entries(folder)
    assert len(written) >= 2  # at least the train and eval steps
    second = run_train(tmp_path / "b", *common, env={"JAX_LOG_COMPILES": "1"})
    assert second.returncode == 0, second.stderr[-2000:]
    log = second.stdout + second.stderr + (tmp_path / "b" / "train.log").read_text()
    assert "Persistent compilation cache hit for 'jit_train_step'" in log
    assert "Persistent compilation cache hit for 'jit_eval_sums'" in log
    assert entries(folder) == written


# ---- a compilation cache folder that cannot be written ---------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("where", ["file", "inside_file", "proc"])
def test_unwritable_compilation_cache_is_turned_off_with_one_warning(tmp_path, caplog, capsys, where):
    import jax

    from training.runtime import configure_compilation_cache

    (tmp_path / "f").write_text("x")
    folder = {"file": tmp_path / "f", "inside_file": tmp_path / "f" / "sub", "proc": Path("/proc/nope")}[where]
    saved = {n: getattr(jax.config, n) for n in ("jax_enable_compilation_cache", "jax_compilation_cache_dir")}
    try:
        with caplog.at_level(logging.WARNING, logger="training.runtime"):
            assert configure_compilation_cache(str(folder)) is None
        assert jax.config.jax_enable_compilation_cache is False
        [record] = [r for r in caplog.records if r.name == "training.runtime"]
        message = record.getMessage()
        assert message.startswith(f"runtime.compilation_cache_dir={folder} ")
        assert message.endswith("the compilation cache is off for this run (or set runtime.compilation_cache_dir=null)")
        assert "\n" not in message
        assert capsys.readouterr().err.splitlines() == [f"warning: {message}"]  # on stderr too (it was the log only)
    finally:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
        for name, value in saved.items():
            jax.config.update(name, value)
