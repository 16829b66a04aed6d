"""Settings handed to libraries are checked before any data or compilation (training/validate.py): W&B tags and
names, XLA flags, TFDS names, glob characters in paths, and checkpoint folders that cannot be written; each refusal
is one line with the fix."""

from __future__ import annotations

import pytest

from utils import run_train


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


# ---- a checkpoint folder that cannot be created or written stops at start, not after training -------------------
def test_unwritable_checkpoint_dir_is_one_line_before_training(tmp_path):
    from core.errors import ConfigError
    from training.validate import check_writable_folder

    with pytest.raises(ConfigError) as e:
        check_writable_folder("checkpoint.dir", "/proc/x/ckpt")  # /proc refuses new folders, also to root
    assert str(e.value) == (
        "checkpoint.dir=/proc/x/ckpt cannot be written (No such file or directory in /proc); choose a folder "
        "you can write to"
    )
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError) as e:
        check_writable_folder("checkpoint.dir", tmp_path / "afile" / "sub")
    assert str(e.value) == (
        f"checkpoint.dir={tmp_path}/afile/sub is inside {tmp_path}/afile, which is a file; give a folder"
    )
    check_writable_folder("checkpoint.dir", tmp_path / "new" / "deeper")  # fine, and nothing is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_read_only_folder_is_refused(tmp_path, monkeypatch):
    import tempfile

    from core.errors import ConfigError
    from training.validate import check_run_folder
    from utils import make_cfg

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)  # what a read-only folder gives a user who is not root
    with pytest.raises(ConfigError) as e:
        check_run_folder(tmp_path / "run", make_cfg().checkpoint)  # checkpoint.dir null: the run folder
    assert str(e.value) == (
        f"the run folder (hydra.run.dir / hydra.sweep.dir)={tmp_path}/run/checkpoints cannot be written "
        f"(Permission denied in {tmp_path}); choose a folder you can write to"
    )
    check_run_folder(tmp_path / "run", make_cfg(checkpoint__enabled=False).checkpoint)  # no checkpoints: no probe


def test_unwritable_checkpoint_dir_in_train_py_writes_only_the_failed_summary(tmp_path):
    from utils import run_train

    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=10", "checkpoint.dir=/proc/x", "wandb.mode=disabled")
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "error: checkpoint.dir=/proc/x cannot be written (No such file or directory in /proc); choose a folder "
        "you can write to"
    ]
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".lock", "summary.json", "train.log"]


# ---- W&B, XLA, TFDS and path settings are checked in plan(), before data and compilation -------------------------
def test_empty_wandb_tag_says_remove_it():
    from core.errors import ConfigError
    from training.validate import check_wandb
    from utils import make_cfg

    with pytest.raises(ConfigError) as e:
        check_wandb(make_cfg(wandb__tags="[fast,'']").wandb)
    assert (
        str(e.value)
        == "wandb.tags[1]='' is 0 characters; W&B tags must have 1 to 64 characters: remove it or write one"
    )


def test_long_wandb_tag_fails_at_start(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=10", f"wandb.tags=[{'t' * 70}]")
    assert proc.returncode == 1
    assert error_lines(proc) == [
        "error: wandb.tags[0]='tttttttttttttttttttt...' is 70 characters; W&B tags must "
        "have 1 to 64 characters: shorten it"
    ]
    assert "Traceback" not in proc.stderr and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "dotted,needle",
    [
        ({"wandb__tags": "[" + "x" * 65 + "]"}, "65 characters"),
        ({"wandb__tags": "['']"}, "0 characters"),
        ({"wandb__project": "a/b"}, "wandb.project='a/b'"),
        ({"wandb__project": "p" * 129}, "1 to 128"),
        ({"wandb__group": "g" * 129}, "wandb.group="),
        ({"wandb__entity": "a b"}, "wandb.entity='a b'"),
        ({"wandb__init_timeout_s": "inf"}, "wandb.init_timeout_s=inf is out of range; it must be finite and > 0"),
        ({"xla__flags": "[xla_gpu_foo=1]"}, "--name or --name=value"),
        ({"xla__flags": "['--xla_not_a_flag=1']"}, "XLA does not know --xla_not_a_flag=1"),
        ({"checkpoint__dir": "'/tmp/a[1]'"}, "checkpoint.dir='/tmp/a[1]' contains [ ]"),
        ({"checkpoint__resume": "/tmp/ck*"}, "checkpoint.resume='/tmp/ck*' contains *"),
        ({"data__data_dir": "/d?"}, "data.data_dir='/d?' contains ?"),
        ({"data__name": "mnist", "data__tfds_name": "mnsit"}, "TFDS has no dataset 'mnsit'; did you mean mnist"),
        ({"data__name": "mnist", "data__tfds_name": "MNIST!"}, "is not a TFDS name"),
    ],
)
def test_library_settings_are_refused_in_plan(dotted, needle):
    from parallel import ConfigError
    from training.build import plan
    from utils import make_cfg

    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        plan(make_cfg(**dotted))


def test_valid_library_settings_pass():
    from training.validate import check_library_settings, check_path
    from utils import make_cfg

    check_library_settings(
        make_cfg(
            wandb__tags="[" + "x" * 64 + "]",
            xla__flags="['--xla_cpu_use_thunk_runtime=true']",
            checkpoint__dir="'/tmp/sp ace,=%#é'",
        )
    )
    check_path("checkpoint.dir", "/tmp/a b/c=d,e%f#g/é")


@pytest.mark.unit
@pytest.mark.parametrize("data", ["synthetic", "tiny_shakespeare", "text"])
def test_data_read_without_tfds_needs_no_tfds(data, monkeypatch, tmp_path):
    """Synthetic and text data never read ``data.tfds_name`` (here left at the schema's default, ``mnist``, as a
    config built from a dict has it), so checking the settings imports no ``tensorflow_datasets`` even where no TFDS
    data set is prepared (the device machine has no TFDS)."""
    import sys

    from training.validate import check_library_settings
    from utils import make_cfg

    class NoTFDS:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "tensorflow_datasets":
                raise ImportError(f"{name} refused by the test")
            return None

    for name in [m for m in sys.modules if m.partition(".")[0] == "tensorflow_datasets"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoTFDS(), *sys.meta_path])
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    cfg = make_cfg(data__name=data)
    assert cfg.data.tfds_name == "mnist"
    check_library_settings(cfg)
    with pytest.raises(ImportError, match="refused by the test"):  # where the TFDS name is read, TFDS is asked
        check_library_settings(make_cfg(data__name="mnist"))
