"""The config says more: one schema per model, mode and optimizer, Enum choices, conf/experiment/ recipes, the accum= and
mesh= groups, and one-line errors for everything Hydra composes (in-process compose + two train.py runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conf import errors, schema
from conf.schema import (
    AdamConfig,
    CNNConfig,
    ConfigInputError,
    FsdpConfig,
    JitShardingConfig,
    MLPConfig,
    ResNetConfig,
    SGDConfig,
    ViTConfig,
    register,
    to_typed,
)
from conf.errors import is_composition_error, quote_numeric_options
from utils import REPO, run_train

CONF = REPO / "conf"


def _compose(*overrides: str, return_hydra_config: bool = False):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=quote_numeric_options(list(overrides), CONF),
            return_hydra_config=return_hydra_config,
        )


def _typed(*overrides: str):
    return to_typed(_compose(*overrides))


def _error(*overrides: str) -> str:
    """The one-line message train.py prints for ``overrides`` (composition or schema error)."""
    try:
        _typed(*overrides)
    except ConfigInputError as e:
        return str(e)
    except Exception as e:  # Hydra's / OmegaConf's own errors, as train.py words them (training.entry.cli)
        assert is_composition_error(e), repr(e)
        return errors.one_line(e, schema.Config, schema.OPTION_SCHEMAS)
    raise AssertionError(f"{overrides} composed without an error")


# ---- one schema per model and per parallel mode ---------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize(
    "option, expected",
    [
        ("mlp", MLPConfig(hidden=256, activation="tanh", dropout=0.0, init_std=0.01)),
        ("cnn", CNNConfig(width=16, dropout=0.0)),
        ("resnet", ResNetConfig(width=64)),
        ("vit", ViTConfig(width=64, depth=4, patch=4, heads=4, mlp_ratio=4, dropout=0.0)),
    ],
)
def test_each_model_has_its_own_keys_with_schema_defaults(option, expected):
    assert _typed(f"model={option}").model == expected


@pytest.mark.unit
@pytest.mark.parametrize(
    "option, expected",
    [
        ("jit_sharding", JitShardingConfig()),
        ("fsdp", FsdpConfig(min_shard_bytes=0)),
    ],
)
def test_each_mode_has_its_own_keys(option, expected):
    assert _typed(f"parallel={option}").parallel == expected


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=cnn", "model.hidden=512"],
            "model.hidden does not apply to model=cnn (only to model=mlp); model=cnn has: width, dropout",
        ),
        (
            ["model=cnn", "+model.hidden=512"],
            "model.hidden does not apply to model=cnn (only to model=mlp); model=cnn has: width, dropout",
        ),
        (
            ["model=resnet", "model.dropout=0.1"],
            "model.dropout does not apply to model=resnet (only to model=mlp, cnn, vit, gpt); model=resnet has: width",
        ),
        (
            ["model=vit", "model.activation=relu"],
            "model.activation does not apply to model=vit (only to model=mlp); model=vit has: width, depth, patch, heads, "
            "mlp_ratio, dropout",
        ),
        (
            ["model.widht=3"],
            "unknown config key model.widht for model=mlp; model=mlp has: hidden, activation, dropout, init_std",
        ),
        (["model.hiden=3"], "unknown config key model.hiden for model=mlp; did you mean model.hidden?"),
        (
            ["parallel.min_shard_bytes=1024"],
            "parallel.min_shard_bytes does not apply to parallel=jit_sharding (only to parallel=fsdp); "
            "parallel=jit_sharding has: grad_reduce_dtype, grad_compression",
        ),
        (
            ["model.name=cnn"],
            "model.name=cnn does not match the chosen option model=mlp; choose the model with model=cnn",
        ),
        (
            ["parallel=fsdp", "parallel.name=pmap"],
            "parallel.name=pmap does not match the chosen option parallel=fsdp; choose the parallel with parallel=pmap",
        ),
    ],
)
def test_a_key_the_model_or_mode_lacks_is_one_line(overrides, message):
    assert _error(*overrides) == message


def test_model_keys_reach_the_model_builder():
    from models import build_model
    from training.build import model_kwargs

    assert model_kwargs(_typed("model=cnn", "model.width=4").model) == {"width": 4, "dropout": 0.0}
    assert model_kwargs(_typed("model=resnet").model) == {"width": 64}
    assert ResNetConfig().dropout == 0.0 and JitShardingConfig().min_shard_bytes == 0  # read by the loop/builder
    cnn = _typed("model=cnn", "model.width=4").model
    model = build_model(cnn.name, (28, 28, 1), 10, seed=0, **model_kwargs(cnn))
    assert model.__class__.__name__ == "CNN"


@pytest.mark.unit
def test_from_dict_is_strict_unless_lenient():
    old_cnn = {
        "name": "cnn",
        "hidden": 256,
        "width": 16,
        "depth": 4,
        "patch": 4,
        "heads": 4,
        "mlp_ratio": 4,
        "activation": "tanh",
        "dropout": 0.0,
        "init_std": 0.01,
    }  # a checkpoint saved with the union schema
    with pytest.raises(ConfigInputError, match=r"^model.hidden does not apply to model=cnn"):
        schema.from_dict({"model": old_cnn})
    assert schema.from_dict(
        {"model": old_cnn, "parallel": {"name": "pmap", "min_shard_bytes": 0}}, lenient=True
    ).model == CNNConfig(width=16)
    with pytest.raises(
        ConfigInputError, match=r"^model.name='cnx' is unknown; choose one of mlp, cnn, resnet, vit, gpt$"
    ):
        schema.from_dict({"model": {"name": "cnx"}})


@pytest.mark.unit
def test_resume_policy_ignores_keys_only_the_old_union_schema_had():
    from training.checkpoint import resume_conflicts

    new = schema.as_dict(schema.from_dict({"model": {"name": "cnn"}}))
    old = {
        **new,
        "model": {**new["model"], "hidden": 256, "init_std": 0.01},
        "parallel": {**new["parallel"], "min_shard_bytes": 0},
    }
    assert resume_conflicts(old, new, 256, 256) == []
    assert resume_conflicts({**old, "model": {**old["model"], "width": 32}}, new, 256, 256) == ["model.width: 32 -> 16"]


# ---- one schema per optimizer -------------------------------------------------------------------------------
ADAM_KEYS = (
    "lr, schedule, warmup_steps, decay_steps, lr_scaling, base_batch, clip_grad_norm, min_lr, b1, b2, eps, "
    "weight_decay, weight_decay_mask"
)
SGD_KEYS = "lr, schedule, warmup_steps, decay_steps, lr_scaling, base_batch, clip_grad_norm, min_lr, momentum"
SHARED = {"schedule": "constant", "warmup_steps": 0, "decay_steps": 0, "lr_scaling": "none", "base_batch": 256}


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], AdamConfig(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)),
        (["optim=sgd"], SGDConfig(lr=0.1, momentum=0.0)),
        (["optim=sgd_momentum"], SGDConfig(lr=0.1, momentum=0.9)),
        (["optim=sgd", "optim.momentum=0.8", "optim.lr=0.05"], SGDConfig(lr=0.05, momentum=0.8)),
        (
            ["optim=adam", "optim.b1=0.8", "optim.weight_decay=1e-4", "optim.schedule=cosine", "optim.decay_steps=9"],
            AdamConfig(lr=1e-3, b1=0.8, b2=0.999, eps=1e-8, weight_decay=1e-4, schedule="cosine", decay_steps=9),
        ),
    ],
)
def test_each_optimizer_has_its_own_keys_with_schema_defaults(overrides, expected):
    optim = _typed(*overrides).optim
    assert type(optim) is type(expected) and optim == expected
    assert (optim.name, optim.clip_grad_norm, optim.base_batch) == (expected.name, None, 256)


@pytest.mark.unit
def test_optimizer_values_in_the_saved_config_are_the_options_values():
    """.hydra/config.yaml holds the same values as when optim was one union, less the other optimizer's keys."""
    saved = {o: OmegaConf.to_container(_compose(f"optim={o}").optim, enum_to_str=True) for o in ("adam", "sgd")}
    assert saved == {
        "adam": {
            "name": "adam",
            "lr": 1e-3,
            **SHARED,
            "clip_grad_norm": None,
            "b1": 0.9,
            "b2": 0.999,
            "eps": 1e-8,
            "weight_decay": 0.0,
            "weight_decay_mask": None,
            "min_lr": 0.0,
        },
        "sgd": {"name": "sgd", "lr": 0.1, **SHARED, "clip_grad_norm": None, "min_lr": 0.0, "momentum": 0.0},
    }


@pytest.mark.unit
def test_optim_options_only_pick_their_schema():
    """conf/optim/<optimizer>.yaml holds no value (defaults: conf/schema.py); sgd_momentum is SGD + momentum 0.9."""
    found = {}
    for path in sorted((CONF / "optim").glob("*.yaml")):
        found[path.stem] = yaml.safe_load(path.read_text())
    assert found == {
        "adam": {"defaults": ["/schema/optim/adam@_here_", "_self_"]},
        "sgd": {"defaults": ["/schema/optim/sgd@_here_", "_self_"]},
        "sgd_momentum": {"defaults": ["/schema/optim/sgd@_here_", "_self_"], "momentum": 0.9},
    }
    assert set(schema.OPTIM_SCHEMAS) == {"adam", "sgd"} == {m.value for m in schema.OptimizerName}


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optim=sgd", "optim.b1=0.8"],
            f"optim.b1 does not apply to optim=sgd (only to optim=adam); optim=sgd has: {SGD_KEYS}",
        ),
        (
            ["optim=sgd", "+optim.weight_decay=1e-4"],
            f"optim.weight_decay does not apply to optim=sgd (only to optim=adam); optim=sgd has: {SGD_KEYS}",
        ),
        (
            ["optim=sgd_momentum", "optim.eps=1e-6"],
            f"optim.eps does not apply to optim=sgd (only to optim=adam); optim=sgd has: {SGD_KEYS}",
        ),
        (
            ["optim=adam", "optim.momentum=0.9"],
            f"optim.momentum does not apply to optim=adam (only to optim=sgd); optim=adam has: {ADAM_KEYS}",
        ),
        (
            ["optim=sgd", "optim.momentun=0.9"],
            "unknown config key optim.momentun for optim=sgd; did you mean optim.momentum?",
        ),
        (
            ["optim=sgd", "optim.name=adam"],
            "optim.name=adam does not match the chosen option optim=sgd; choose the optim with optim=adam",
        ),
        (
            ["optim=sgdm"],
            "optim=sgdm is not an option of group optim; choose one of adam, sgd, sgd_momentum; did you mean optim=sgd?",
        ),
    ],
)
def test_a_key_the_optimizer_lacks_is_one_line(overrides, message):
    assert _error(*overrides) == message


@pytest.mark.unit
def test_optimizer_keys_reach_optax():
    """The chosen optimizer's own keys are the keyword arguments of make_optimizer (exact updates)."""
    import jax.numpy as jnp

    from training.build import _optimizer, optimizer_kwargs

    sgd = _typed("optim=sgd", "optim.momentum=0.9", "optim.lr=0.5")
    adam = _typed("optim.weight_decay=0.1")
    assert optimizer_kwargs(sgd.optim) == {"momentum": 0.9}
    assert optimizer_kwargs(adam.optim) == {
        "b1": 0.9,
        "b2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "weight_decay_mask": None,
    }
    tx, _ = _optimizer(sgd, 0.5)
    params, grad = jnp.ones(2), jnp.full(2, 2.0)
    state = tx.init(params)
    first, state = tx.update(grad, state, params)
    second, _ = tx.update(grad, state, params)  # heavy ball: -lr (g + 0.9 g)
    assert first.tolist() == [-1.0, -1.0] and second.tolist() == pytest.approx([-1.9, -1.9], rel=1e-6)
    tx, _ = _optimizer(adam, 1e-3)
    matrix = jnp.ones((1, 2))  # (the default optim.weight_decay_mask decays tensors of 2 or more dimensions)
    update, _ = tx.update(jnp.zeros((1, 2)), tx.init(matrix), matrix)  # AdamW, zero gradient: -lr * wd * param
    assert update[0].tolist() == pytest.approx([-1e-4, -1e-4], rel=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim=sgd", "optim.momentum=1.0"], "optim.momentum=1.0 is out of range; it must be in [0, 1)"),
        (["optim.b2=1.0"], "optim.b2=1.0 is out of range; it must be in [0, 1)"),
        (["optim.eps=0"], "optim.eps=0.0 is out of range; it must be a finite value > 0"),
    ],
)
def test_optimizer_ranges_are_checked_for_the_chosen_optimizer(overrides, message):
    with pytest.raises(ConfigInputError) as e:  # the schema's validation (conf.schema.validate), at start
        _typed("data=synthetic", "train.steps=10", *overrides)
    assert str(e.value) == message


OLD_UNION_SGD = {  # optim as checkpoints saved it when it was one union of every optimizer's keys
    "name": "sgd",
    "lr": 0.1,
    "momentum": 0.9,
    "b1": 0.9,
    "b2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    **SHARED,
    "clip_grad_norm": None,
}


@pytest.mark.unit
def test_old_union_optimizer_config_is_refused_strictly_and_read_leniently():
    with pytest.raises(ConfigInputError) as e:
        schema.from_dict({"optim": OLD_UNION_SGD})
    assert str(e.value) == f"optim.b1 does not apply to optim=sgd (only to optim=adam); optim=sgd has: {SGD_KEYS}"
    assert schema.from_dict({"optim": OLD_UNION_SGD}, lenient=True).optim == SGDConfig(lr=0.1, momentum=0.9)


@pytest.mark.unit
def test_resume_policy_ignores_optimizer_keys_only_the_old_union_had():
    from training.checkpoint import resume_conflicts

    new = schema.as_dict(schema.from_dict({"optim": {"name": "sgd", "momentum": 0.9}}))
    old = {**new, "optim": OLD_UNION_SGD}
    assert resume_conflicts(old, new, 256, 256) == []
    assert resume_conflicts({**old, "optim": {**OLD_UNION_SGD, "momentum": 0.5}}, new, 256, 256) == [
        "optim.momentum: 0.5 -> 0.9"
    ]
    adam = schema.as_dict(schema.from_dict({}))  # another optimizer is another experiment
    assert resume_conflicts(old, adam, 256, 256) == ["optim.lr: 0.1 -> 0.001", "optim.name: 'sgd' -> 'adam'"]


@pytest.mark.unit
def test_resume_policy_allows_where_the_batches_are_made_and_refuses_their_contents():
    from training.checkpoint import resume_conflicts

    base = schema.as_dict(schema.from_dict({}))
    for on_device in (True, False):  # the same batches on the host or the devices (data/pipeline.py: DeviceSource)
        moved = schema.as_dict(schema.from_dict({"data": {"on_device": on_device, "prefetch": 0}}))
        assert resume_conflicts(base, moved, 256, 256) == []
        assert resume_conflicts(moved, base, 256, 256) == []
    augmented = schema.as_dict(schema.from_dict({"data": {"on_device": True, "augment": True}}))
    assert resume_conflicts(base, augmented, 256, 256) == ["data.augment: False -> True"]


def test_train_py_resumes_and_evaluates_a_checkpoint_saved_with_the_union_optimizer(tmp_path):
    """A checkpoint whose metadata holds the old union's optim keys resumes (train.py) and evaluates."""
    ckpt = tmp_path / "ck"
    common = [
        "data=synthetic",
        "optim=sgd_momentum",
        "wandb.mode=disabled",
        "mesh.devices=1",
        "runtime.cpu_devices=1",
        "checkpoint.every=2",
        f"checkpoint.dir={ckpt}",
    ]
    proc = run_train(tmp_path / "run1", *common, "train.steps=2", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta_path = ckpt / "2" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    assert meta["config"]["optim"] == {
        **{k: v for k, v in OLD_UNION_SGD.items() if k not in ("b1", "b2", "eps", "weight_decay")},
        "min_lr": 0.0,
    }
    meta["config"]["optim"] = OLD_UNION_SGD
    meta_path.write_text(json.dumps(meta))
    out = subprocess.run(
        [sys.executable, "-m", "evaluate", "--json", str(ckpt / "2"), "runtime.cpu_devices=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["step"] == 2
    proc = run_train(tmp_path / "run2", *common, "train.steps=4", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert (summary["status"], summary["checkpoint/resumed_step"], summary["checkpoint/last_step"]) == ("ok", 2, 4)


# ---- Enum fields -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "precision.loss_scale=dynamik",
            "precision.loss_scale=dynamik is not a valid choice; choose one of dynamic, static, none",
        ),
        (
            "precision.compute_dtype=fp16",
            "precision.compute_dtype=fp16 is not a valid choice; choose one of float32, bfloat16, float16",
        ),
        (
            "parallel.grad_compression=int4",
            "parallel.grad_compression=int4 is not a valid choice; choose one of none, int8",
        ),
        (
            "parallel.grad_reduce_dtype=float16",
            "parallel.grad_reduce_dtype=float16 is not a valid choice; choose one of float32, bfloat16",
        ),
        ("optim.name=adamw", "optim.name=adamw is not a valid choice; choose one of adam, sgd"),
        ("optim.schedule=cosin", "optim.schedule=cosin is not a valid choice; choose one of constant, cosine"),
        ("optim.lr_scaling=sqrt", "optim.lr_scaling=sqrt is not a valid choice; choose one of none, linear"),
        (
            "model.activation=swish",
            "model.activation=swish is not a valid choice; choose one of tanh, relu, gelu, sigmoid",
        ),
        (
            "train.transfer_guard=never",
            "train.transfer_guard=never is not a valid choice; choose one of allow, log, "
            "disallow, log_explicit, disallow_explicit",
        ),
        ("wandb.mode=dryrun", "wandb.mode=dryrun is not a valid choice; choose one of online, offline, disabled"),
    ],
)
def test_a_wrong_choice_lists_the_choices(override, message):
    assert _error(override) == message


@pytest.mark.unit
def test_enum_values_are_plain_strings_in_code_yaml_and_saved_config():
    cfg = _compose("precision=fp16", "optim=sgd", "optim.schedule=cosine", "optim.decay_steps=10")
    assert "compute_dtype: float16\n" in OmegaConf.to_yaml(cfg) and "loss_scale: dynamic\n" in OmegaConf.to_yaml(cfg)
    typed = to_typed(cfg)
    values = (
        typed.precision.compute_dtype,
        typed.precision.loss_scale,
        typed.optim.name,
        typed.optim.schedule,
        typed.parallel.grad_compression,
        typed.train.transfer_guard,
    )
    assert values == ("float16", "dynamic", "sgd", "cosine", "none", "allow")
    assert {type(v) for v in values} == {str}
    assert json.loads(json.dumps(schema.as_dict(typed)))["precision"]["loss_scale"] == "dynamic"


@pytest.mark.unit
def test_enums_match_the_libraries_choices():
    from models.mlp import ACTIVATIONS
    from parallel.compress import COMPRESSIONS
    from training.build import COMPUTE_DTYPES
    from core.optim import SCHEDULES
    from core.precision import LOSS_SCALING_MODES
    from training.report import WANDB_MODES
    from training.build import TRANSFER_GUARDS

    for enum_type, library in (
        (schema.Activation, ACTIVATIONS),
        (schema.Compression, COMPRESSIONS),
        (schema.ComputeDtype, COMPUTE_DTYPES),
        (schema.Schedule, SCHEDULES),
        (schema.LossScale, LOSS_SCALING_MODES),
        (schema.WandbMode, WANDB_MODES),
        (schema.TransferGuard, TRANSFER_GUARDS),
    ):
        assert sorted(m.value for m in enum_type) == sorted(library), enum_type
        assert all(m.name == m.value for m in enum_type)  # OmegaConf reads members by name
    assert [m.value for m in schema.ReduceDtype] == ["float32", "bfloat16"]
    assert [m.value for m in schema.OptimizerName] == ["adam", "sgd"]
    assert [m.value for m in schema.LrScaling] == ["none", "linear"]


# ---- recipes under conf/experiment ----------------------------------------------------------------------------
@pytest.mark.unit
def test_cnn_recipe_is_an_experiment_and_model_cnn_is_only_the_model():
    recipe = _typed("+experiment=cnn_mnist")
    assert recipe.model == CNNConfig(width=16, dropout=0.0)
    assert (recipe.data.name, recipe.data.augment, recipe.data.crop_padding, recipe.data.flip) == (
        "mnist",
        True,
        2,
        False,
    )
    assert (
        recipe.train.epochs,
        recipe.optim.name,
        recipe.optim.lr,
        recipe.optim.lr_scaling,
        recipe.optim.base_batch,
        recipe.optim.schedule,
        recipe.optim.decay_steps,
    ) == (4, "adam", 1e-3, "linear", 128, "cosine", 936)
    plain = _typed("model=cnn")
    assert plain.model == recipe.model
    assert (plain.train.epochs, plain.optim.schedule, plain.optim.lr_scaling, plain.data.augment) == (
        10,
        "constant",
        "none",
        False,
    )
    # command-line overrides win over the recipe
    assert _typed("+experiment=cnn_mnist", "data.augment=false", "model.width=8").data.augment is False
    assert _typed("+experiment=cnn_mnist", "model.width=8").model.width == 8
    assert _error("experiment=cnn_mnist") == (
        "experiment is not in the defaults list: add it with a + (+experiment=<option>)"
    )
    assert _error("+experiment=cnn") == (  # the group is added with a +: the line and its hint keep it
        "+experiment=cnn is not an option of group experiment; choose one of "
        "cnn_mnist, gpt_shakespeare, nanogpt_char; did you mean +experiment=cnn_mnist?"
    )
    assert _error("+experiment=gpt_shakspeare").endswith("; did you mean +experiment=gpt_shakespeare?")


@pytest.mark.unit
def test_nanogpt_char_recipe_is_nanogpts_shakespeare_char():
    """karpathy/nanoGPT config/train_shakespeare_char.py, on one device and nanoGPT's 90/10 split (data=text)."""
    r = _typed("+experiment=nanogpt_char")
    m, o, t = r.model, r.optim, r.train
    assert (m.name, m.depth, m.width, m.heads, m.context, m.dropout, m.attention_dropout) == (
        "gpt", 6, 384, 6, 256, 0.2, None  # null: the same 0.2 on the attention probabilities
    )  # fmt: skip
    assert (r.data.name, r.data.path, r.data.tokenizer, r.mesh.devices, r.precision.compute_dtype) == (
        "text", "../shared/data/tiny_shakespeare/input.txt", "bytes", 1, "bfloat16"
    )  # fmt: skip
    assert (t.steps, t.global_batch, t.eval_every) == (5000, 64, 250)
    assert (o.name, o.lr, o.b1, o.b2, o.weight_decay, o.weight_decay_mask, o.clip_grad_norm) == (
        "adam", 1e-3, 0.9, 0.99, 0.1, "matrices", 1.0
    )  # fmt: skip
    assert (o.schedule, o.warmup_steps, o.warmup_steps + o.decay_steps, o.min_lr) == ("cosine", 100, 5000, 1e-4)
    assert (r.checkpoint.keep_best, r.checkpoint.best_mode) == ("eval/loss", "auto")


@pytest.mark.unit
def test_model_options_hold_no_values_the_schema_does_not():
    """conf/model/*.yaml and conf/parallel/*.yaml only pick their schema: the defaults live in conf/schema.py."""
    for group in ("model", "parallel"):
        for path in sorted((CONF / group).glob("*.yaml")):
            assert yaml.safe_load(path.read_text()) == {"defaults": [f"/schema/{group}/{path.stem}@_here_", "_self_"]}


# ---- accum= and mesh= groups --------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_accum_group_sets_accum_steps(k):
    assert _typed(f"accum={k}").train.accum_steps == k


@pytest.mark.unit
def test_accum_key_wins_and_other_counts_go_through_the_key():
    assert _typed().train.accum_steps == 1
    assert _typed("accum=4", "train.accum_steps=3").train.accum_steps == 3
    assert _typed("train.accum_steps=3").train.accum_steps == 3
    assert _error("accum=3") == (
        "accum=3 is not an option of group accum; choose one of 1, 2, 4, 8 (or set train.accum_steps directly)"
    )


@pytest.mark.unit
def test_quote_numeric_options():
    assert quote_numeric_options(
        ["accum=4", "-m", "accum=1,2,4,8", "+accum=2", "train.steps=5", "mesh=data", "accum=x"], CONF
    ) == ["accum='4'", "-m", "accum='1','2','4','8'", "+accum='2'", "train.steps=5", "mesh=data", "accum=x"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "option, devices, shape",
    [
        ("default", None, None),
        ("data", None, [-1, 1]),
        ("fsdp", None, [1, -1]),
        ("hsdp_2x4", 8, [2, 4]),
    ],
)
def test_mesh_presets(option, devices, shape):
    mesh = _typed(f"mesh={option}").mesh
    assert (mesh.devices, mesh.shape) == (devices, shape)


@pytest.mark.unit
def test_mesh_keys_override_the_preset():
    mesh = _typed("mesh=fsdp", "mesh.devices=4").mesh
    assert (mesh.devices, mesh.shape) == (4, [1, -1])


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, result",
    [
        (["parallel=fsdp", "mesh=hsdp_2x4", "accum=4", "precision=bf16"], ((2, 4), 256, 8, 4)),
        (["parallel=fsdp", "mesh=fsdp"], ((1, 8), 256, 8, 1)),
        (["parallel=fsdp", "mesh=data"], ((8, 1), 256, 8, 1)),
        (["parallel=jit_sharding", "mesh=data", "accum=8"], ((8, 1), 256, 8, 8)),
        (["parallel=pmap", "mesh=fsdp", "mesh.devices=1"], ((1, 1), 256, 1, 1)),
        (
            ["parallel=jit_sharding", "mesh=hsdp_2x4"],
            "parallel=jit_sharding needs an fsdp axis of 1 but mesh.shape=[2, 4]; use mesh.shape=[-1,1] or parallel=fsdp",
        ),
        (
            ["parallel=pmap", "mesh=fsdp"],
            "parallel=pmap needs an fsdp axis of 1 but mesh.shape=[1, 8]; use mesh.shape=[-1,1] or parallel=fsdp",
        ),
        (
            ["parallel=fsdp", "mesh=hsdp_2x4", "mesh.devices=4"],
            "mesh.shape=[2, 4] has 8 devices but mesh.devices=4; make the product equal 4 (use -1 to fill)",
        ),
        (
            ["parallel=fsdp", "mesh=hsdp_2x4", "mesh.devices=16"],
            "mesh.devices=16 but only 8 cpu devices are visible; raise runtime.cpu_devices (now 8) to at least 16",
        ),
        (
            ["parallel=fsdp", "mesh=hsdp_2x4", "accum=8", "train.global_batch=96"],
            "train.global_batch=96 is not divisible by mesh.devices=8 x train.accum_steps=8 = 64; choose a global batch "
            "that is a multiple of 64 (e.g. 128)",
        ),
    ],
)
def test_mesh_and_mode_combinations_plan_or_fail_in_one_line(overrides, result):
    """plan() on 8 simulated devices: (mesh shape, global batch, devices, accumulation) or the one-line error."""
    from parallel import ConfigError
    from training.build import plan

    cfg = _typed("data=synthetic", "train.steps=10", *overrides)
    if isinstance(result, str):
        with pytest.raises(ConfigError) as e:
            plan(cfg)
        assert str(e.value) == result
    else:
        p = plan(cfg)
        assert (p.mesh_shape, p.global_batch, len(p.devices), cfg.train.accum_steps) == result


def test_sweep_presets_compose_every_value():
    """Every value of every swept key of conf/sweep/*.yaml composes (with the other keys at their first value)."""
    for path in sorted((CONF / "sweep").glob("*.yaml")):
        params = yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"]
        first = {k: str(v).split(",")[0] for k, v in params.items()}
        for key, values in params.items():
            for value in str(values).split(","):
                overrides = [f"+sweep={path.stem}", *(f"{k}={v}" for k, v in {**first, key: value}.items())]
                composed = _compose(*overrides)
                to_typed(composed)
                if key.startswith("+"):  # an added group (+warmup): it sets other keys
                    continue
                if "." in key:
                    got = OmegaConf.select(composed, key)
                else:  # a group: the option chosen (optim=sgd_momentum is SGD, optim.name=sgd)
                    got = _compose(*overrides, return_hydra_config=True).hydra.runtime.choices[key]
                assert str(got).replace("None", "null") == value, (path.stem, key, value)


# ---- Hydra's multi-line errors become one line --------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optim.learning_rate=0.5"],
            "unknown config key optim.learning_rate for optim=adam; optim=adam has: lr, schedule, warmup_steps, "
            "decay_steps, lr_scaling, base_batch, clip_grad_norm, min_lr, b1, b2, eps, weight_decay, weight_decay_mask",
        ),
        (["train.stepz=3"], "unknown config key train.stepz; did you mean train.steps?"),
        (["paralel=pmap"], "unknown config key paralel; did you mean parallel?"),
        (
            ["hardware=h100"],
            "hardware=h100 is not an option of group hardware; choose one of a100_sxm, auto, cpu, custom, "
            "h100_sxm, h200_sxm, none, tpu_v4, tpu_v5e, tpu_v5p; did you mean hardware=h100_sxm?",
        ),
        (
            ["parallel=fsdb"],
            "parallel=fsdb is not an option of group parallel; choose one of fsdp, jit_sharding, pmap, "
            "shard_map; did you mean parallel=fsdp?",
        ),
        (
            ["precision=bf61"],
            "precision=bf61 is not an option of group precision; choose one of bf16, fp16, fp32; did "
            "you mean precision=bf16?",
        ),
        (
            ["mesh=hsdp_4x2"],
            "mesh=hsdp_4x2 is not an option of group mesh; choose one of data, default, fsdp, hsdp_2x4 "
            "(or set mesh.devices / mesh.shape directly); did you mean mesh=hsdp_2x4?",
        ),
        (["train.steps=abc"], "train.steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
        (
            ["model=cnn,mlp"],
            "model=cnn,mlp: a comma-separated value is a sweep (add -m); for a list write key=[a,b], for "
            "a string quote it: key='a,b'",
        ),
        (
            ["accum=2.5"],
            "Config group override must be a string or a list. Got float: a group option is a name, e.g. "
            "accum=4 or parallel=fsdp",
        ),
    ],
)
def test_composition_errors_are_one_line(overrides, message):
    assert _error(*overrides) == message


@pytest.mark.unit
def test_every_message_is_one_line():
    cases = [
        ["model=cnn", "model.hidden=1"],
        ["optim.lr=x"],
        ["mesh.shape=3"],
        ["hardware=x"],
        ["+foo.bar=1"],
        ["train=1"],
        ["optim.clip_grad_norm=[1]"],
        ["precision.loss_scale=1"],
    ]
    for overrides in cases:
        message = _error(*overrides)
        assert message and "\n" not in message and len(message) < 300, (overrides, message)


# ---- train.py on the command line -----------------------------------------------------------------------------
def test_train_py_unknown_group_option_is_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "data=synthetic", "train.steps=10", "parallel=fsdb", timeout=120)
    assert proc.returncode == 1
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "error: parallel=fsdb is not an option of group parallel; choose one of fsdp, jit_sharding, pmap, "
        "shard_map; did you mean parallel=fsdp?"
    ]
    assert proc.stdout == "" and not run_dir.exists()


def test_train_py_sweeps_the_accum_group(tmp_path):
    """``python train.py -m accum=1,4 ...``: one job per option, each with its train.accum_steps."""
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        f"hydra.sweep.dir={sweep}",
        "accum=1,4",
        "data=synthetic",
        "train.steps=2",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
        "mesh.devices=1",
        "runtime.cpu_devices=1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for job in ("0", "1"):
        saved = yaml.safe_load((sweep / job / ".hydra" / "config.yaml").read_text())
        summary = json.loads((sweep / job / "summary.json").read_text())
        jobs[job] = (saved["train"]["accum_steps"], summary["status"], summary["train/steps"])
    assert jobs == {"0": (1, "ok", 2), "1": (4, "ok", 2)}


@pytest.mark.unit
def test_wandb_mode_from_the_environment_is_checked_before_anything_runs(monkeypatch):
    """W&B refuses an unknown WANDB_MODE with a traceback (wandb.Settings); the config check names it first."""
    from training.report import resolve_wandb_mode

    monkeypatch.setenv("WANDB_MODE", "bogus")
    for mode in (None, "offline", "online"):
        with pytest.raises(ValueError, match="WANDB_MODE='bogus' is not a W&B mode; unset it or set it to online"):
            resolve_wandb_mode(mode)
    assert resolve_wandb_mode("disabled") == "disabled"  # W&B is never imported
    for env, want in (("dryrun", "offline"), ("run", "online"), ("disabled", "disabled"), ("offline", "offline")):
        monkeypatch.setenv("WANDB_MODE", env)
        assert resolve_wandb_mode(None) == want
    monkeypatch.setenv("WANDB_MODE", "")
    with pytest.raises(ValueError, match="WANDB_MODE=''"):
        resolve_wandb_mode(None)
