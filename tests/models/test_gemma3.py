"""Gemma 3 and Gemma 2 on CPU: logit parity of tiny random models with HF transformers,
and the embedded Gemma-3-270M GGUF (config, weights, tokenizer, greedy generation)
against transformers' goldens (scripts/make_fixtures.py, scripts/make_gguf_fixtures.py)."""
import json
import os
import shutil

import gguf
import numpy as np
import pytest

from jaxllm import LLM, EngineArgs, SamplingParams
from jaxllm.models import gguf as gguf_loader
from jaxllm.models.config import ModelArchConfig
from jaxllm.models.gguf import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer
from jaxllm.models.loader import create_model, iter_hf_weights
from jaxllm.sharding import make_mesh
from jaxllm.tokenizer import generation_eos_ids
from tests.models.test_llama import assert_logits_match_hf, load_fixture

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
with open(os.path.join(FIXTURES, "gemma3_golden.json")) as f:
    GOLDEN = json.load(f)
END_OF_TURN = 106
MAX_MODEL_LEN = 512


# -- tiny random models -------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_logits_match_hf_transformers(name):
    config, model, golden = load_fixture(name)
    assert config.sliding_window == 8  # below the 33- and 100-token prompts
    assert_logits_match_hf(name, config, model, golden)


def test_legacy_gemma3_config_keys_give_the_same_architecture():
    # transformers 4's config.json: rope_theta / rope_scaling / rope_local_base_freq and a
    # sliding_window_pattern, where transformers 5 writes rope_parameters and layer_types.
    with open(os.path.join(FIXTURES, "tiny", "gemma3", "config.json")) as f:
        d = json.load(f)
    legacy = {k: v for k, v in d.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=10000.0,
                  sliding_window_pattern=2, num_hidden_layers=3)
    assert ModelArchConfig.from_hf_config(legacy) == ModelArchConfig.from_hf_config(d)


def test_gemma3_layers_take_their_own_window_and_rope():
    config = load_fixture("gemma3")[0]
    assert [config.layer_sliding_window(i) for i in range(3)] == [8, None, 8]
    assert config.layer_rope(0) == (10000.0, None)
    assert config.layer_rope(1) == (1e6, {"rope_type": "linear", "factor": 4.0})
    assert config.attn_scale == pytest.approx(24 ** -0.5) and config.qk_norm and config.tie_word_embeddings


def test_gemma2_defaults_soft_cap_like_hf():
    with open(os.path.join(FIXTURES, "tiny", "gemma2", "config.json")) as f:
        d = json.load(f)
    del d["attn_logit_softcapping"], d["final_logit_softcapping"], d["layer_types"]
    config = ModelArchConfig.from_hf_config(d)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.sliding_layers == (0, 2) and not config.qk_norm and config.rope_local_theta is None


def test_gemma_rejects_another_activation():
    with open(os.path.join(FIXTURES, "tiny", "gemma3", "config.json")) as f:
        d = json.load(f)
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        ModelArchConfig.from_hf_config({**d, "hidden_activation": "silu"})


def test_multimodal_gemma3_reads_its_text_model():
    with open(os.path.join(FIXTURES, "tiny", "gemma3", "config.json")) as f:
        d = json.load(f)
    multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": d}
    config = ModelArchConfig.from_hf_config(multimodal)
    assert config == ModelArchConfig.from_hf_config(d)
    # transformers 4 names the text model language_model.model.*, 5 model.language_model.*.
    folder = os.path.join(FIXTURES, "tiny", "gemma3")
    for prefix in ("language_model.model.", "model.language_model."):
        weights = [(prefix + name.removeprefix("model."), w) for name, w in iter_hf_weights(folder)]
        weights.append(("vision_tower.vision_model.post_layernorm.weight", np.ones(4, np.float32)))
        model = create_model(config, dtype=np.float32, mesh=make_mesh(), weights=weights)
        expected = dict(weights)[prefix + "layers.1.mlp.up_proj.weight"][...].T  # a source: [...] reads it whole
        np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.gate_up_proj.kernel[...][:, 1]), expected)


def test_gemma2_gguf_config_alternates_windows_and_soft_caps(tmp_path):
    file = tmp_path / "gemma2.gguf"
    writer = gguf.GGUFWriter(str(file), "gemma2")
    for key, value in {"embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
                       "attention.key_length": 16, "feed_forward_length": 128, "block_count": 4,
                       "context_length": 256, "vocab_size": 300, "attention.sliding_window": 8}.items():
        writer.add_uint32(f"gemma2.{key}", value)
    for key, value in {"attention.layer_norm_rms_epsilon": 1e-6, "attn_logit_softcapping": 50.0,
                       "final_logit_softcapping": 30.0}.items():
        writer.add_float32(f"gemma2.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelArchConfig.from_hf_config(load_gguf_config(str(file)))
    assert config.architecture == "gemma2" and config.sliding_layers == (0, 2) and config.sliding_window == 8
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.query_pre_attn_scalar) == (50.0, 30.0, 16)
    assert config.rope_local_theta is None and not config.qk_norm


def test_hf_generation_config_lists_every_eos_id(tmp_path):
    folder = tmp_path / "gemma3"
    shutil.copytree(os.path.join(FIXTURES, "tiny", "gemma3"), folder)
    with open(folder / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 2, "eos_token_id": [1, END_OF_TURN]}, f)  # as Gemma 3's HF folders
    mc = EngineArgs(model=str(folder)).create_config().model
    assert generation_eos_ids(mc, None) == (1, END_OF_TURN)


# -- the embedded Gemma-3-270M GGUF ------------------------------------------

def test_gguf_config_describes_gemma3_270m(gemma3_270m_path):
    d = load_gguf_config(gemma3_270m_path)
    assert d["architectures"] == ["Gemma3ForCausalLM"]
    config = ModelArchConfig.from_hf_config(d)
    expected = dict(architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                    num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6, rope_scaling=None,
                    max_position_embeddings=32768, tie_word_embeddings=True, qk_norm=True, sliding_window=512,
                    query_pre_attn_scalar=256, attn_logit_softcap=None, final_logit_softcap=None,
                    rope_local_theta=10000.0)
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert [i for i in range(18) if config.layer_sliding_window(i) is None] == [5, 11, 17]


def test_gguf_weights_equal_transformers_dequantization(gemma3_270m_path):
    # The GGUF stores norms as 1 + w (llama.cpp's converter); transformers and we give w.
    sample = np.load(os.path.join(FIXTURES, "gemma3_weights_sample.npz"))
    ours = {name: w for name, w in iter_gguf_weights(gemma3_270m_path)
            if name in sample.files or name == "model.embed_tokens.weight"}
    raw = {t.name: t for t in gguf_loader._reader(gemma3_270m_path).tensors}
    assert gguf_loader.dequantize_tensor(raw["blk.0.attn_norm.weight"]) == pytest.approx(
        ours["model.layers.0.input_layernorm.weight"] + 1)
    for name in sample.files:
        if name == "embed_tokens_rows":
            np.testing.assert_array_equal(ours["model.embed_tokens.weight"][sample[name]],
                                          sample["model.embed_tokens.weight"])
        elif name.endswith("q_proj.weight"):
            np.testing.assert_array_equal(ours[name][:, :8], sample[name])
        elif name != "model.embed_tokens.weight":
            np.testing.assert_allclose(ours[name], sample[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def tokenizer(gemma3_270m_path):
    return load_gguf_tokenizer(gemma3_270m_path)


@pytest.mark.parametrize("case", GOLDEN["tokenization"], ids=lambda c: repr(c["text"])[:30])
def test_tokenizer_ids_equal_transformers(tokenizer, case):
    assert tokenizer(case["text"], add_special_tokens=False)["input_ids"] == case["ids"]
    assert tokenizer(case["text"])["input_ids"] == case["ids_with_special"]
    assert tokenizer.decode(case["ids"]) == case["decoded"]


def test_chat_template_writes_gemma_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    for g in GOLDEN["generations"]:
        if g["kind"] == "chat":
            assert tokenizer.apply_chat_template(g["messages"], add_generation_prompt=True, tokenize=False) == g["prompt"]
            assert tokenizer(g["prompt"], add_special_tokens=False)["input_ids"] == g["prompt_token_ids"]


def test_generation_ends_at_eos_and_end_of_turn(gemma3_270m_path):
    mc = EngineArgs(model=gemma3_270m_path).create_config().model
    assert generation_eos_ids(mc, None) == (1, END_OF_TURN)  # the file names no eot id: found by its text


@pytest.fixture(scope="module")
def llm(gemma3_270m_path):
    with LLM(model=gemma3_270m_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=128,
             num_gpu_blocks_override=256, show_progress=False) as llm:
        yield llm


def greedy(n=GOLDEN.get("num_new_tokens", 32), **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


def test_greedy_tokens_equal_transformers(llm):
    gens = GOLDEN["generations"]
    assert sum(g["kind"] == "plain" for g in gens) >= 4 and sum(g["kind"] == "chat" for g in gens) >= 4
    outputs = llm.generate([{"prompt_token_ids": g["prompt_token_ids"]} for g in gens], greedy(), use_tqdm=False)
    for g, out in zip(gens, outputs):
        assert out.outputs[0].token_ids == g["output_token_ids"], g["prompt"]


def test_text_prompts_and_chat_give_transformers_tokens(llm):
    plain = [g for g in GOLDEN["generations"] if g["kind"] == "plain"]
    for g, out in zip(plain, llm.generate([g["prompt"] for g in plain], greedy(8), use_tqdm=False)):
        assert out.prompt_token_ids == g["prompt_token_ids"]
        assert out.outputs[0].token_ids == g["output_token_ids"][:8]
    chats = [g for g in GOLDEN["generations"] if g["kind"] == "chat"]
    for g, out in zip(chats, llm.chat([g["messages"] for g in chats], greedy(8), use_tqdm=False)):
        assert out.prompt_token_ids == g["prompt_token_ids"]
        assert out.outputs[0].token_ids == g["output_token_ids"][:8]


def test_chat_stops_at_end_of_turn(llm):
    # The 270M base model never ends a turn by itself (see the goldens), so a logit bias
    # makes <end_of_turn> its first token: the engine's EOS ids, not a stop_token_ids, end it.
    chat = next(g for g in GOLDEN["generations"] if g["kind"] == "chat")
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={END_OF_TURN: 100.0})
    out = llm.chat(chat["messages"], params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [END_OF_TURN], "")
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={END_OF_TURN: 100.0}, ignore_eos=True)
    out = llm.chat(chat["messages"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == [END_OF_TURN] * 8
