"""Tests for measure.collectives, measure.hlo_text and measure.stablehlo (static communication accounting).

Fixtures in tests/fixtures/hlo/:
  real_*   captured from jax 0.10.2 on 8 simulated CPU devices
           (``.hlo``: ``jit(f).lower(x).compile().as_text()``,
           ``.mlir``: ``jit(f).lower(x).as_text()``);
  hand_*   hand-written for forms XLA:CPU never prints (``.hlo``: async start/done pairs, iota groups, nested
           loops, no-ops; ``.mlir``: valid MLIR in generic op syntax with an mhlo op, a generic-form while,
           calls, a splat self-permute).
"""

from __future__ import annotations

import pathlib

import pytest
from jax.extend.mlir import ir

from measure.collectives import KINDS, Collective, comm_metrics
from measure.hlo_text import parse_hlo_collectives
from measure.stablehlo import lowered_payload_bytes, parse_stablehlo_collectives
from utils import full_hlo_parse

pytestmark = pytest.mark.unit  # all in-process and quick: make test-unit runs them

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hlo"

F32_784x256 = 784 * 256 * 4  # 802816 bytes


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def _hlo(name: str, **kw) -> list[Collective]:
    return parse_hlo_collectives(_read(name), **kw)


def _by_name(collectives: list[Collective]) -> dict[str, Collective]:
    return {c.name: c for c in collectives}


def _ring(kind: str, n: int, s: int) -> float:
    return Collective(kind, s, n, False, "f32", "x").ring_bytes


# --------------------------------------------------------------------------
# Ring model and metrics
# --------------------------------------------------------------------------


def test_ring_bytes_per_kind():
    s, n = 800, 8
    assert _ring("all-reduce", n, s) == pytest.approx(2 * 7 / 8 * 800)
    assert _ring("all-gather", n, s) == pytest.approx(7 / 8 * 800)
    assert _ring("reduce-scatter", n, s) == pytest.approx(7 / 8 * 800)
    assert _ring("all-to-all", n, s) == pytest.approx(7 / 8 * 800)
    assert _ring("collective-permute", n, s) == 800.0


def test_comm_metrics_keys_and_sums():
    cs = [
        Collective("all-reduce", 1000, 4, False, "f32", "a"),
        Collective("all-gather", 400, 2, True, "bf16", "b"),
    ]
    m = comm_metrics(cs)
    assert m["comm/payload_bytes_per_step"] == 1400
    assert isinstance(m["comm/payload_bytes_per_step"], int)
    assert m["comm/bytes_per_step"] == pytest.approx(1500.0 + 200.0)
    assert isinstance(m["comm/bytes_per_step"], float)
    assert m["comm/count/all-reduce"] == 1
    assert m["comm/count/all-gather"] == 1
    for kind in ("reduce-scatter", "all-to-all", "collective-permute"):
        assert m[f"comm/count/{kind}"] == 0
    assert m["comm/in_loop_count"] == 1
    assert set(m) == {
        "comm/payload_bytes_per_step",
        "comm/bytes_per_step",
        "comm/in_loop_count",
        *(f"comm/count/{k}" for k in KINDS),
    }


def test_comm_metrics_empty_and_prefix():
    m = comm_metrics([], prefix="train/comm_")
    assert m["train/comm_payload_bytes_per_step"] == 0
    assert m["train/comm_bytes_per_step"] == 0.0
    assert m["train/comm_count/all-to-all"] == 0
    assert m["train/comm_in_loop_count"] == 0


# --------------------------------------------------------------------------
# Real captures (jax 0.10.2, XLA:CPU, 8 devices)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture, kind, payload, n",
    [
        ("real_psum_f32.hlo", "all-reduce", F32_784x256, 8),
        ("real_psum_scatter.hlo", "reduce-scatter", F32_784x256, 8),  # input f32[784,256]
        ("real_all_gather.hlo", "all-gather", 8 * F32_784x256, 8),  # output f32[6272,256]
        ("real_all_to_all.hlo", "all-to-all", F32_784x256, 8),  # 8-tuple of f32[98,256]
        ("real_ppermute.hlo", "collective-permute", F32_784x256, 8),
        ("real_psum_groups_2x4.hlo", "all-reduce", F32_784x256, 4),  # {{0,1,2,3},{4,5,6,7}}
        ("real_psum_groups_4x2.hlo", "all-reduce", F32_784x256, 2),  # {{0,4},{1,5},...}
        ("real_gspmd_mesh_device_ids.hlo", "all-reduce", F32_784x256, 4),  # mesh[...], device_ids=(...)
    ],
)
def test_real_single_collective(fixture, kind, payload, n):
    (c,) = _hlo(fixture)
    assert (c.kind, c.payload_bytes, c.group_size, c.in_loop, c.dtype) == (kind, payload, n, False, "f32")
    assert c.ring_bytes == pytest.approx(_ring(kind, n, payload))


def test_real_dp_grad_is_one_combined_tuple_all_reduce():
    # jit with batch sharded over 8 devices: GSPMD inserts the gradient
    # all-reduce, XLA's combiner merges the three grads into one tuple op,
    # printed with mesh-notation replica groups.
    assert "replica_groups=mesh[" in _read("real_dp_grad_combined.hlo")
    (c,) = _hlo("real_dp_grad_combined.hlo")
    assert c.kind == "all-reduce" and c.group_size == 8 and c.dtype == "f32"
    assert c.payload_bytes == (256 + 256 * 784 + 10 * 256) * 4 == 814080
    # ... while the lowered module has no collectives at all (GSPMD runs later).


def test_real_two_psums_combined_into_tuple():
    (c,) = _hlo("real_two_psums_combined.hlo")
    assert c.payload_bytes == F32_784x256 + 8 * 256 * 4
    assert c.kind == "all-reduce" and c.group_size == 8


def test_real_bf16_psum_promoted_to_f32_when_compiled():
    (hlo,) = _hlo("real_psum_bf16.hlo")
    (mlir,) = parse_stablehlo_collectives(_read("real_psum_bf16.mlir"))
    assert (hlo.dtype, hlo.payload_bytes) == ("f32", F32_784x256)
    assert (mlir.dtype, mlir.payload_bytes) == ("bf16", F32_784x256 // 2)


@pytest.mark.parametrize("fixture", ["real_scan_psum.hlo", "real_scan_cond_psum.hlo"])
def test_real_psum_inside_scan_is_in_loop(fixture):
    # scan_cond: the psum sits in a conditional branch called from the body.
    (c,) = _hlo(fixture)
    assert (c.kind, c.payload_bytes, c.group_size, c.in_loop) == ("all-reduce", F32_784x256, 8, True)
    assert comm_metrics([c])["comm/in_loop_count"] == 1


def test_real_fori_ppermute_then_all_gather():
    cs = _hlo("real_fori_ppermute.hlo")
    assert [(c.kind, c.in_loop) for c in cs] == [("collective-permute", True), ("all-gather", False)]
    m = comm_metrics(cs)
    assert m["comm/payload_bytes_per_step"] == F32_784x256 + 8 * F32_784x256
    assert m["comm/bytes_per_step"] == pytest.approx(F32_784x256 + 7 / 8 * 8 * F32_784x256)


def test_real_group_size_one_is_dropped():
    # psum over a mesh axis of size 1: replica_groups={{0},{1},...,{7}}.
    assert "all-reduce(" in _read("real_psum_size1.hlo")
    assert _hlo("real_psum_size1.hlo") == []
    assert parse_stablehlo_collectives(_read("real_psum_size1.mlir")) == []


@pytest.mark.parametrize(
    "fixture, expected",
    [
        ("real_psum_f32.mlir", [("all-reduce", F32_784x256, 8, False)]),
        ("real_scan_psum.mlir", [("all-reduce", F32_784x256, 8, True)]),  # func.call from while body
        ("real_scan_cond_psum.mlir", [("all-reduce", F32_784x256, 8, True)]),  # call -> case
        (
            "real_fori_ppermute.mlir",
            [("all-gather", 8 * F32_784x256, 8, False), ("collective-permute", F32_784x256, 8, True)],
        ),
    ],
)
def test_real_stablehlo(fixture, expected):
    cs = parse_stablehlo_collectives(_read(fixture))
    assert [(c.kind, c.payload_bytes, c.group_size, c.in_loop) for c in cs] == expected


# --------------------------------------------------------------------------
# Hand-written HLO
# --------------------------------------------------------------------------


def test_async_start_done_pairs_counted_once():
    cs = _by_name(_hlo("hand_async_collectives.hlo"))
    got = {name: (c.kind, c.payload_bytes, c.group_size, c.dtype) for name, c in cs.items()}
    assert got == {
        # variadic all-reduce-start, replica_groups={} -> num_partitions=8
        "all-reduce-start": ("all-reduce", (784 * 256 + 256) * 4, 8, "f32"),
        # (input, output) tuple: the output f32[256,32]; [2,4]<=[8] -> 4
        "all-gather-start": ("all-gather", 256 * 32 * 4, 4, "f32"),
        # (input, output, u32[], u32[]): the input s32[16,8]
        "collective-permute-start": ("collective-permute", 16 * 8 * 4, 4, "s32"),
        # async-start wrapping reduce-scatter: full input bf16[1024,512]
        "reduce-scatter-start": ("reduce-scatter", 1024 * 512 * 2, 8, "bf16"),
        # async syntax sugar ((operand), output): [4,2]<=[2,4]T(1,0) -> 2
        "all-to-all-start": ("all-to-all", 64 * 32 * 4, 2, "f32"),
        "rs-sugar-start": ("reduce-scatter", 256 * 4, 4, "f32"),
    }
    m = comm_metrics(cs.values())
    assert [m[f"comm/count/{k}"] for k in KINDS] == [1, 1, 2, 1, 1]
    assert m["comm/in_loop_count"] == 0


def test_replica_group_notations():
    n = {c.name: c.group_size for c in _hlo("hand_group_notations.hlo")}
    assert n == {
        "ar.explicit": 4,  # {{0,1,2,3},{4,5,6,7}}
        "ar.iota": 4,  # [2,4]<=[8]
        "ar.iota_t": 2,  # [4,2]<=[2,4]T(1,0)
        "ar.empty": 8,  # {} with replica_count=1, num_partitions=8
        "ar.mesh": 4,  # mesh['x'=2,'y'=4] {'y'}
        "ar.mesh2": 8,  # mesh['x'=2,'y'=4] {'x','y'}
        "ar.mesh_ids": 2,  # mesh[...,'axis_2'=2], device_ids=(...) {'axis_2'}
        "ar.subaxis": 4,  # mesh['x'=8] {'x':(2)4}
        "ar.spaced": 2,  # { {0, 2}, {1, 3}, ... }
    }


def test_num_devices_overrides_header_for_empty_groups():
    cs = _by_name(_hlo("hand_group_notations.hlo", num_devices=16))
    assert cs["ar.empty"].group_size == 16
    assert cs["ar.explicit"].group_size == 4


def test_group_size_one_and_self_permutes_are_noops():
    (c,) = _hlo("hand_noops.hlo")
    assert (c.name, c.group_size, c.payload_bytes) == ("ar.real", 2, 1024)


def test_in_loop_through_calls_fusions_conditionals_and_nested_whiles():
    cs = _by_name(_hlo("hand_while_nested.hlo"))
    assert {name: c.in_loop for name, c in cs.items()} == {
        "ar.top": False,
        "ar.branch": True,  # body -> call -> conditional branch
        "cp.inner": True,  # nested while body
        "ag-start": True,  # async-start in body -> wrapped all-gather
        "ar.cond": True,  # while condition runs every iteration too
    }
    assert cs["ag-start"].payload_bytes == 16 * 16 * 4
    assert cs["ar.cond"].dtype == "s32"
    assert comm_metrics(cs.values())["comm/in_loop_count"] == 4


def test_empty_groups_without_device_count_raise():
    text = _read("hand_empty_groups_no_header.hlo")
    with pytest.raises(ValueError, match="ar_0"):
        parse_hlo_collectives(text)
    cs = _by_name(parse_hlo_collectives(text, num_devices=4))
    # XLA-test style: no '%', multi-line instruction, reduce-scatter-start sugar.
    assert (cs["ar_0"].payload_bytes, cs["ar_0"].group_size) == (512 * 4, 4)
    assert (cs["rs_0"].kind, cs["rs_0"].payload_bytes) == ("reduce-scatter", 8 * 4)


def test_tuple_of_mixed_dtypes():
    text = """HloModule m, num_partitions=2
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
ENTRY %e (a: f32[3,5], b: s32[7], c: pred[4], d: f8e4m3fn[10]) -> (f32[3,5], s32[7], pred[4], f8e4m3fn[10]) {
  %a = f32[3,5]{1,0} parameter(0)
  %b = s32[7]{0} parameter(1)
  %c = pred[4]{0} parameter(2)
  %d = f8e4m3fn[10]{0} parameter(3)
  ROOT %all-reduce = (f32[3,5]{1,0}, s32[7]{0}, /*index=2*/pred[4]{0}, f8e4m3fn[10]{0}) all-reduce(%a, %b, %c, %d), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}
"""
    (c,) = parse_hlo_collectives(text)
    assert c.payload_bytes == 15 * 4 + 7 * 4 + 4 * 1 + 10 * 1
    assert c.dtype == "f32,s32,pred,f8e4m3fn"
    assert c.ring_bytes == pytest.approx(2 * 1 / 2 * c.payload_bytes)


# --------------------------------------------------------------------------
# Hand-written StableHLO
# --------------------------------------------------------------------------


def test_stablehlo_generic_while_calls_and_mhlo():
    cs = parse_stablehlo_collectives(_read("hand_stablehlo.mlir"))
    got = [(c.name, c.kind, c.payload_bytes, c.group_size, c.in_loop, c.dtype) for c in cs]
    assert got == [
        ("main/%0", "all-gather", 64 * 8 * 4, 4, False, "f32"),  # output size
        ("main/%3", "all-reduce", 64 * 2, 4, True, "bf16"),  # empty groups -> 4
        ("helper/%0", "collective-permute", 64 * 2, 4, True, "bf16"),  # called from body
        ("helper/%1", "reduce-scatter", 64 * 2, 2, True, "bf16"),  # mhlo, input size
        ("helper/%2", "all-gather", 64 * 2, 2, True, "bf16"),
        ("unused_a2a/%0", "all-to-all", 8 * 4 * 4, 4, False, "s32"),  # never called
    ]  # the splat self-pair permute in main is a no-op
    assert lowered_payload_bytes(_read("hand_stablehlo.mlir")) == sum(c[2] for c in got)


def test_stablehlo_empty_groups_need_device_count():
    text = _read("hand_stablehlo.mlir").replace(
        "attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} ", ""
    )
    with pytest.raises(ValueError, match="main/%3"):
        parse_stablehlo_collectives(text)
    cs = _by_name(parse_stablehlo_collectives(text, num_devices=2))
    assert cs["main/%3"].group_size == 2


def test_stablehlo_text_must_be_valid_mlir():
    # collectives have no custom assembly form: the generic form is the only one MLIR prints or parses
    text = _read("hand_stablehlo.mlir").replace('"stablehlo.all_gather"(%arg0)', "stablehlo.all_gather(%arg0)")
    with pytest.raises(ir.MLIRError, match="has no custom assembly form"):
        parse_stablehlo_collectives(text)


def test_stablehlo_variadic_all_reduce():
    text = """module @m attributes {mhlo.num_partitions = 2 : i32} {
  func.func public @main(%arg0: tensor<3x5xf32>, %arg1: tensor<7xf32>) -> (tensor<3x5xf32>, tensor<7xf32>) {
    %0:2 = "stablehlo.all_reduce"(%arg0, %arg1) <{replica_groups = dense<> : tensor<0x0xi64>}> ({
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %s = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<3x5xf32>, tensor<7xf32>) -> (tensor<3x5xf32>, tensor<7xf32>)
    return %0#0, %0#1 : tensor<3x5xf32>, tensor<7xf32>
  }
}"""
    (c,) = parse_stablehlo_collectives(text)
    # results %0#0, %0#1: named %0; the payload is both operands
    assert (c.name, c.kind, c.payload_bytes, c.group_size, c.dtype) == ("main/%0", "all-reduce", 88, 2, "f32")
    assert c.payload_bytes == (15 + 7) * 4


def test_stablehlo_dynamic_dimension_cannot_be_sized():
    text = """module @m attributes {mhlo.num_partitions = 2 : i32} {
  func.func public @main(%arg0: tensor<?x4xf32>) -> tensor<?x4xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %s = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<?x4xf32>) -> tensor<?x4xf32>
    return %0 : tensor<?x4xf32>
  }
}"""
    with pytest.raises(ValueError, match=r"cannot size dynamic tensor tensor<\?x4xf32>"):
        parse_stablehlo_collectives(text)


# --------------------------------------------------------------------------
# Live: compile tiny programs on 8 simulated CPU devices
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh8():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets jax_num_cpu_devices=8)")
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))


def _shard_map_psum(mesh, dtype):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    f = jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False)
    return jax.jit(f).lower(jnp.ones((8 * 784, 256), dtype))


def test_live_psum_f32(mesh8):
    import jax.numpy as jnp

    lowered = _shard_map_psum(mesh8, jnp.float32)
    (c,) = parse_hlo_collectives(lowered.compile().as_text())
    assert (c.kind, c.payload_bytes, c.group_size, c.dtype) == ("all-reduce", 802816, 8, "f32")
    assert c.ring_bytes == pytest.approx(2 * 7 / 8 * 802816)
    assert lowered_payload_bytes(lowered.compiler_ir("stablehlo")) == 802816


def test_live_psum_bf16_lowered_vs_compiled(mesh8):
    import jax.numpy as jnp

    lowered = _shard_map_psum(mesh8, jnp.bfloat16)
    (low,) = parse_stablehlo_collectives(lowered.compiler_ir("stablehlo"))
    (comp,) = parse_hlo_collectives(lowered.compile().as_text())
    assert (low.dtype, low.payload_bytes) == ("bf16", 401408)
    assert (comp.dtype, comp.payload_bytes) == ("f32", 802816)  # XLA:CPU promotes bf16


def test_live_dp_gradient_all_reduce(mesh8):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

    def step(p, x):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x))

    rep, batch = NamedSharding(mesh8, P()), NamedSharding(mesh8, P("d"))
    p = {"w": jax.device_put(jnp.ones((784, 256)), rep), "b": jax.device_put(jnp.ones((256,)), rep)}
    x = jax.device_put(jnp.ones((64, 784)), batch)
    lowered = jax.jit(step).lower(p, x)
    cs = parse_hlo_collectives(lowered.compile().as_text())
    m = comm_metrics(cs)
    assert {c.kind for c in cs} == {"all-reduce"} and all(c.group_size == 8 for c in cs)
    assert m["comm/payload_bytes_per_step"] == (784 * 256 + 256) * 4
    assert m["comm/bytes_per_step"] == pytest.approx(2 * 7 / 8 * (784 * 256 + 256) * 4)
    assert parse_stablehlo_collectives(lowered.compiler_ir("stablehlo")) == []  # GSPMD adds them later


def test_live_scan_psum_in_loop(mesh8):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def f(a):
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "d"), None), a, None, length=3)[0]

    g = jax.shard_map(f, mesh=mesh8, in_specs=P("d"), out_specs=P("d"), check_vma=False)
    lowered = jax.jit(g).lower(jnp.ones((8 * 16, 4), jnp.float32))
    (compiled,) = parse_hlo_collectives(lowered.compile().as_text())
    (low,) = parse_stablehlo_collectives(lowered.compiler_ir("stablehlo"))
    for c in (compiled, low):
        assert (c.kind, c.payload_bytes, c.group_size, c.in_loop) == ("all-reduce", 16 * 4 * 4, 8, True)


def test_live_module_and_its_text_agree(mesh8):
    """The walk over ``compiler_ir("stablehlo")`` and over its printed text (parsed again) list the same
    collectives, SSA names included: pmap, a loop, a tuple psum over two dtypes, all-to-all, psum_scatter."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def sm(f, out=P("d")):
        return jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("d"), out_specs=out, check_vma=False))

    x = jnp.ones((8 * 16, 4), jnp.float32)
    ring = [(i, (i + 1) % 8) for i in range(8)]
    lowered = {
        "pmap": jax.pmap(lambda a: jax.lax.psum(a, "i"), axis_name="i").lower(jnp.ones((8, 16, 4))),
        "fori": sm(lambda a: jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.ppermute(c, "d", ring), a)).lower(x),
        "tuple": sm(lambda a: jax.lax.psum((a, a.astype(jnp.int32)), "d"), P()).lower(x),
        "a2a": sm(lambda a: jax.lax.all_to_all(a, "d", 0, 0, tiled=True)).lower(x),
        "scatter": sm(lambda a: jax.lax.psum_scatter(a, "d", tiled=True)).lower(x),
    }
    got = {}
    for key, low in lowered.items():
        from_module = parse_stablehlo_collectives(low.compiler_ir("stablehlo"))
        assert parse_stablehlo_collectives(low.as_text()) == from_module, key
        got[key] = [(c.kind, c.payload_bytes, c.group_size, c.in_loop, c.dtype) for c in from_module]
    assert got == {
        "pmap": [("all-reduce", 256, 8, False, "f32")],
        "fori": [("collective-permute", 256, 8, True, "f32")],
        "tuple": [("all-reduce", 256, 8, False, "f32"), ("all-reduce", 256, 8, False, "s32")],  # one per leaf
        "a2a": [("all-to-all", 256, 8, False, "f32")],
        "scatter": [("reduce-scatter", 256, 8, False, "f32")],
    }


def test_a_module_without_collective_opcodes_is_not_parsed(monkeypatch):
    """No ``<collective opcode>(`` anywhere in the text (a one-device step): [] without splitting the module. Every
    fixture gives what the full parse gives (forced by a comment naming an opcode, which the parse drops)."""
    import measure.hlo_text as hlo_text

    for path in sorted(FIXTURES.glob("*.hlo")):
        text = path.read_text()
        assert parse_hlo_collectives(text, num_devices=4) == parse_hlo_collectives(
            text + "\n/* all-reduce( */\n", num_devices=4
        ), path.name
    plain = "HloModule m\nENTRY %main (p: f32[4]) -> f32[4] {\n  ROOT %p = f32[4] parameter(0)\n}\n"
    monkeypatch.setattr(hlo_text, "_split_hlo", lambda text: pytest.fail("parsed a module without collectives"))
    assert parse_hlo_collectives(plain, num_devices=8) == []


CALL_IN_LOOP_HLO = """HloModule m, replica_count=4

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}

%inner (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={{0,1,2,3}}, to_apply=%sum
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8]{0}) %t), index=0
  %x = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %t), index=1
  %y = f32[8]{0} call(f32[8]{0} %x), to_apply=%inner
  ROOT %r = (s32[], f32[8]{0}) tuple(s32[] %i, f32[8]{0} %y)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(s32[] %z, f32[8]{0} %x)
  %w = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t), condition=%cond, body=%body
  ROOT %o = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %w), index=1
}
"""


def test_the_prefilter_keeps_what_the_collectives_need(monkeypatch):
    """Only instructions that may be a collective, a loop, an async wrapper or a call are parsed
    (``hlo_text._may_matter``); every fixture gives what parsing every instruction gives, and most
    instructions of a real module are skipped."""
    import measure.hlo_text as hlo_text

    for path in sorted(FIXTURES.glob("*.hlo")):
        text = path.read_text()
        assert parse_hlo_collectives(text, num_devices=4) == full_hlo_parse(text, num_devices=4), path.name
    for opcode in [*hlo_text._HLO_OPCODES, "while", "async-start"]:
        assert hlo_text._may_matter(f"%x.1 = f32[4]{{0}} {opcode}(f32[4]{{0}} %p)"), opcode
    for attr in hlo_text._CALLEE_ATTRS:
        assert hlo_text._may_matter(f"%x.1 = f32[4]{{0}} fusion(f32[4]{{0}} %p), {attr}=%comp"), attr
    assert not hlo_text._may_matter("%x.1 = f32[4]{0} add(f32[4]{0} %p, f32[4]{0} %q)")
    # a collective reached from a loop body only through a call: the call's statement must be parsed
    (c,) = parse_hlo_collectives(CALL_IN_LOOP_HLO)
    assert (c.kind, c.payload_bytes, c.group_size, c.in_loop) == ("all-reduce", 32, 4, True)
    assert [c] == full_hlo_parse(CALL_IN_LOOP_HLO)
    with monkeypatch.context() as m:  # a filter that skips the call loses the loop: the check above can fail
        m.setattr(hlo_text, "_MAY_MATTER", tuple(k for k in hlo_text._MAY_MATTER if k != "to_apply="))
        assert [x.in_loop for x in parse_hlo_collectives(CALL_IN_LOOP_HLO)] == [False]
    text = _read("real_dp_grad_combined.hlo")
    parsed = sum(len(v) for v in hlo_text._split_hlo(text)[1].values())
    every = sum(len(v) for v in hlo_text._split_hlo(text, keep=lambda stmt: True)[1].values())
    assert 0 < parsed < every / 2, (parsed, every)
