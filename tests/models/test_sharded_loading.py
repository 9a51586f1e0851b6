"""Sharded weight loading: each device's shard is read from its own slice of
the safetensors file, K/V heads repeated for TP > KV heads are read from the original
head's rows, a fused qkv / gate_up shard packs just the device's own heads and rows of
each part, and host memory while loading stays near one param, not the model.

The tests that need a mesh run in a child process with 8 forced host CPU devices
(test_sharded_loading_over_eight_devices) when this process has fewer.
"""
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxllm.config import EngineArgs
from jaxllm.models import params as memory_params
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.loader import abstract_params, create_model, iter_hf_weights, param_shardings
from jaxllm.sharding import make_mesh, named_sharding
from jaxllm.worker.kv_heads import RepeatedHeads, kv_head_repeat, replicate_kv_weights, replicated_arch
from tests.conftest import run_with_host_devices, tiny_model
from tests.models.test_llama import random_hf_tensors, unpacked_hf_tensors

pytestmark = pytest.mark.timeout(300)
NUM_DEVICES = 8
# 8 q heads and 2 KV heads: TP = 8 repeats each KV head 4 times; biases cover the bias repeat.
ARCH = ModelArchConfig(architecture="qwen2", vocab_size=64, hidden_size=64, intermediate_size=64,
                       num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, attention_bias=True)


@pytest.fixture
def eight_devices():
    if jax.device_count() < NUM_DEVICES:  # asked at run time: collection must not start the backend
        pytest.skip("test_sharded_loading_over_eight_devices runs it with 8 devices")


class CountingSource:
    """A tensor source that records each read as (index as (start, stop) per axis, bytes)."""

    def __init__(self, source, reads: list):
        self.source, self.reads, self.shape = source, reads, source.shape

    def __getitem__(self, index):
        piece = np.asarray(self.source[index])
        self.reads.append((tuple(s.indices(n)[:2] for s, n in zip(index, self.shape)), piece.nbytes))
        return piece


def counted(weights, reads: dict):
    for name, source in weights:
        yield name, CountingSource(source, reads.setdefault(name, []))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("sharded")
    save_file(dict(random_hf_tensors(ARCH)), str(folder / "model.safetensors"))
    return str(folder)


def flat_params(model) -> dict:
    return {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}


def load(checkpoint, tp, dtype=jnp.float32, reads=None):
    """The model of ARCH at TP = tp, its K/V heads repeated to one per device where
    needed, and its arch; reads: if given, the tensors' reads are counted into it."""
    repeat = max(tp // ARCH.num_kv_heads, 1)
    weights = iter_hf_weights(checkpoint) if reads is None else counted(iter_hf_weights(checkpoint), reads)
    arch = replicated_arch(ARCH, repeat)
    weights = replicate_kv_weights(weights, ARCH.num_kv_heads, repeat)
    return create_model(arch, dtype=dtype, mesh=make_mesh(tp), weights=weights), arch


def repeated_heads(array: np.ndarray, repeat: int) -> np.ndarray:
    """A K/V projection [kv_heads * head_dim, ...] with each head repeated, as np.repeat."""
    heads = array.reshape(ARCH.num_kv_heads, ARCH.head_dim, *array.shape[1:])
    return np.repeat(heads, repeat, axis=0).reshape(-1, *array.shape[1:])


@pytest.mark.usefixtures("eight_devices")
@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sharded_load_equals_the_whole_tensors(checkpoint, tp, dtype):
    """At TP = 8 the K/V heads are repeated 4 times: the params equal np.repeat of the whole tensors."""
    repeat = max(tp // ARCH.num_kv_heads, 1)
    model, arch = load(checkpoint, tp, dtype)
    mesh = make_mesh(tp)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        assert var.get_value().sharding == named_sharding(mesh, var.get_metadata()["out_sharding"]), path
    whole = load_file(os.path.join(checkpoint, "model.safetensors"))
    loaded = unpacked_hf_tensors(arch, model)
    assert set(loaded) == set(whole)
    for name, array in whole.items():
        if ".k_proj." in name or ".v_proj." in name:
            array = repeated_heads(array, repeat)
        np.testing.assert_array_equal(loaded[name], array.astype(dtype), err_msg=name)


def shards_by_device(param, tp: int) -> list[np.ndarray]:
    """A param's shards in the order of their devices along the model axis."""
    devices = list(make_mesh(tp).devices.flat)
    shards = sorted(param.get_value().addressable_shards, key=lambda shard: devices.index(shard.device))
    assert len(shards) == tp
    return [np.asarray(shard.data) for shard in shards]


@pytest.mark.usefixtures("eight_devices")
@pytest.mark.parametrize("tp", [2, 8])
def test_each_devices_fused_shard_is_its_own_heads_and_rows_of_each_part(checkpoint, tp):
    """Device i's qkv shard (and bias) is its q heads' columns, then its KV head's k, then
    v: at TP = 2 q heads 4i .. 4i + 3 and KV head i, at TP = 8 q head i and (a copy of) KV
    head i // 4, the one it reads. Its o_proj rows are the same q heads'; its gate_up shard
    is its rows of gate and of up."""
    model, _ = load(checkpoint, tp)
    whole = load_file(os.path.join(checkpoint, "model.safetensors"))
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp

    def hf(name):
        return whole["model.layers.1." + name]

    d, q_heads, m = ARCH.head_dim, ARCH.num_heads // tp, ARCH.intermediate_size // tp
    params = (attn.qkv_proj.kernel, attn.qkv_proj.bias, attn.o_proj.kernel, mlp.gate_up_proj.kernel)
    for i, (qkv, qkv_bias, o, gate_up) in enumerate(zip(*(shards_by_device(p, tp) for p in params))):
        q_rows = slice(i * q_heads * d, (i + 1) * q_heads * d)
        kv_head = i * ARCH.num_kv_heads // tp
        kv_rows = slice(kv_head * d, (kv_head + 1) * d)
        for got, leaf in ((qkv, "weight"), (qkv_bias, "bias")):
            want = np.concatenate([hf(f"self_attn.q_proj.{leaf}")[q_rows], hf(f"self_attn.k_proj.{leaf}")[kv_rows],
                                   hf(f"self_attn.v_proj.{leaf}")[kv_rows]]).T
            np.testing.assert_array_equal(got, want, err_msg=f"qkv {leaf} of device {i}")
        np.testing.assert_array_equal(o, hf("self_attn.o_proj.weight")[:, q_rows].T, err_msg=f"o of device {i}")
        rows = slice(i * m, (i + 1) * m)
        want = np.stack([hf("mlp.gate_proj.weight")[rows].T, hf("mlp.up_proj.weight")[rows].T], axis=1)
        np.testing.assert_array_equal(gate_up, want, err_msg=f"gate_up of device {i}")


@pytest.mark.usefixtures("eight_devices")
def test_each_part_of_a_column_parallel_param_is_read_by_halves(checkpoint):
    """At TP = 2 each device reads only its half of each of qkv's and gate_up's parts."""
    reads = {}
    load(checkpoint, 2, reads=reads)
    q_rows, kv_rows, hidden = ARCH.num_heads * ARCH.head_dim, ARCH.num_kv_heads * ARCH.head_dim, ARCH.hidden_size
    for name, rows in (("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows), ("self_attn.v_proj", kv_rows),
                       ("mlp.gate_proj", ARCH.intermediate_size), ("mlp.up_proj", ARCH.intermediate_size)):
        half_bytes = rows * hidden * 4 // 2
        assert sorted(reads[f"model.layers.0.{name}.weight"]) == [
            (((0, rows // 2), (0, hidden)), half_bytes), (((rows // 2, rows), (0, hidden)), half_bytes)], name
    assert sorted(reads["model.layers.0.self_attn.k_proj.bias"]) == [
        (((0, kv_rows // 2),), kv_rows * 2), (((kv_rows // 2, kv_rows),), kv_rows * 2)]
    half_bytes = q_rows * hidden * 4 // 2
    # o_proj is row-parallel: its HF [hidden, q] weight is read by column halves.
    assert sorted(reads["model.layers.0.self_attn.o_proj.weight"]) == [
        (((0, hidden), (0, q_rows // 2)), half_bytes), (((0, hidden), (q_rows // 2, q_rows)), half_bytes)]
    assert reads["model.norm.weight"] == [(((0, hidden),), hidden * 4)]  # replicated: read once


@pytest.mark.usefixtures("eight_devices")
def test_devices_that_share_a_shard_share_one_read(checkpoint):
    """Over a [data 2, model 2] mesh each shard sits on 2 devices; every byte is read once."""
    reads = {}
    create_model(ARCH, dtype=jnp.float32, mesh=make_mesh(2, 2), weights=counted(iter_hf_weights(checkpoint), reads))
    whole = load_file(os.path.join(checkpoint, "model.safetensors"))
    for name, array in whole.items():
        assert sum(nbytes for _, nbytes in reads[name]) == array.nbytes, name


@pytest.mark.usefixtures("eight_devices")
def test_repeated_kv_heads_read_each_original_head_once(checkpoint):
    reads = {}
    load(checkpoint, NUM_DEVICES, reads=reads)
    hidden, head_dim = ARCH.hidden_size, ARCH.head_dim
    # Device d holds repeated head d, a copy of original head d // repeat: the 4 devices
    # with copies of one head share one read of its rows.
    heads = [(h * head_dim, (h + 1) * head_dim) for h in range(ARCH.num_kv_heads)]
    assert reads["model.layers.1.self_attn.k_proj.weight"] == [((rows, (0, hidden)), head_dim * hidden * 4)
                                                                for rows in heads]
    assert reads["model.layers.1.self_attn.v_proj.bias"] == [((rows,), head_dim * 4) for rows in heads]


@pytest.mark.parametrize("rows", [slice(None), slice(0, 8), slice(4, 12), slice(8, 24), slice(3, 15), slice(12, 16)])
def test_repeated_heads_read_as_np_repeat_of_the_whole_tensor(rows):
    head_dim, repeat = 4, 2
    weight = np.random.default_rng(0).normal(size=(2 * head_dim, 5)).astype(np.float32)  # 2 KV heads
    repeated = np.repeat(weight.reshape(2, head_dim, 5), repeat, axis=0).reshape(-1, 5)
    source = RepeatedHeads(weight, head_dim, repeat)
    assert source.shape == repeated.shape
    np.testing.assert_array_equal(source[(rows, slice(1, 4))], repeated[rows, 1:4])


@pytest.mark.usefixtures("eight_devices")
@pytest.mark.parametrize("model, tp", [("qwen2 with biases", 2), ("qwen2 with biases", 8), ("qwen2_moe", 2),
                                       ("mamba2", 2), ("granite_hybrid", 2)])
def test_hf_named_params_in_memory_are_placed_as_the_loader_places_them_each_part_split(checkpoint, model, tp,
                                                                                       monkeypatch):
    """models/params.py's placement of HF-named arrays (LLM(params=...), update_weights) gives the loader's
    params in the loader's shardings; each HF part reaches the mesh split as its param is, never whole
    on every device (fused, stacked, transposed or cut into rows as the param is made of it)."""
    folder, arch = (checkpoint, ARCH) if model == "qwen2 with biases" else (
        tiny_model(model), EngineArgs(model=tiny_model(model)).create_config().model.arch)
    repeat = kv_head_repeat(arch, tp)
    mesh, run_arch = make_mesh(tp), replicated_arch(arch, repeat)
    loaded = flat_params(create_model(run_arch, dtype=jnp.float32, mesh=mesh, weights=replicate_kv_weights(
        iter_hf_weights(folder), arch.num_kv_heads, repeat)))
    _, abstract = abstract_params(run_arch, jnp.float32)
    hf = load_file(os.path.join(folder, "model.safetensors"))
    parts, part_sharding = [], memory_params._part_sharding
    monkeypatch.setattr(memory_params, "_part_sharding", lambda packing, axes, sharding, shape: parts.append(
        (sharding, part_sharding(packing, axes, sharding, shape))) or parts[-1][1])
    placed = dict(memory_params.place(hf, memory_params.check(hf, abstract, arch, mesh), abstract,
                                      param_shardings(abstract, mesh), arch, repeat))
    assert placed.keys() == loaded.keys()
    for path, value in loaded.items():
        assert placed[path].sharding == value.sharding and np.array_equal(placed[path], value), path
    assert parts and all(part.is_fully_replicated == param.is_fully_replicated for param, part in parts)


def traced_host_bytes_per_tensor(weights, transient_bytes: list):
    """The weights, appending to transient_bytes, as the loader asks for each next tensor,
    the traced host memory the previous one took at its peak above what was there before
    it. (On CPU a device array may keep its host piece as its buffer, so the memory still
    held after the load is the devices', not the loader's.)"""
    before = None
    for item in weights:
        current, peak = tracemalloc.get_traced_memory()
        if before is not None:
            transient_bytes.append(peak - before)
        before = current
        tracemalloc.reset_peak()
        yield item
    transient_bytes.append(tracemalloc.get_traced_memory()[1] - before)


def test_peak_host_memory_stays_near_the_largest_param(tmp_path):
    arch = ModelArchConfig(architecture="llama", vocab_size=256, hidden_size=256, intermediate_size=256,
                           num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64)
    tensors = dict(random_hf_tensors(arch))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    # The largest param is a fused one, qkv_proj or gate_up_proj: its parts wait for one
    # another (unread), then each device's piece packs its rows of each.
    largest_bytes = 2 * arch.hidden_size * arch.intermediate_size * 4  # gate_up_proj's
    model_bytes = sum(a.nbytes for a in tensors.values())
    del tensors
    assert model_bytes > 20 * largest_bytes
    transient_bytes = []
    tracemalloc.start()
    try:
        weights = traced_host_bytes_per_tensor(iter_hf_weights(str(tmp_path)), transient_bytes)
        create_model(arch, dtype=jnp.float32, mesh=make_mesh(), weights=weights)
    finally:
        tracemalloc.stop()
    assert len(transient_bytes) == arch.num_layers * 9 + 3  # every tensor measured
    assert max(transient_bytes) < 3 * largest_bytes, (max(transient_bytes), largest_bytes, model_bytes)


def test_loading_shows_a_bar_over_tensors_with_the_rate(checkpoint, capsys):
    model = create_model(ARCH, dtype=jnp.float32, mesh=make_mesh(), weights=iter_hf_weights(checkpoint),
                         show_progress=True)
    err = capsys.readouterr().err
    num_params = len(flat_params(model))
    assert "Loading weights" in err and f"{num_params}/{num_params}" in err and "GB/s" in err


def test_sharded_loading_over_eight_devices():
    """The tests above that need a mesh, in a child process with 8 forced host devices."""
    if jax.device_count() >= NUM_DEVICES:
        pytest.skip("this process has the devices: the tests above run here")
    run_with_host_devices(__file__, "not over_eight_devices", NUM_DEVICES, "passed", timeout_s=240)
