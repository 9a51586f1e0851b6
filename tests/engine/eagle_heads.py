"""Tiny random EAGLE heads for the tiny Llama (tests/fixtures/tiny/llama), written in the HF layout
of EAGLE checkpoints (no "model." prefix, EAGLE-3's layer "midlayer", its d2t and t2d), and a
float64 numpy reference of the target's forward and of the heads' formulas (models/eagle.py)."""
import json
import os
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from jaxllm.models.config import ModelArchConfig
from jaxllm.models.llama import rope_inv_freq
from tests.conftest import tiny_model

# The tiny Llama's attention and MLP shapes, one layer.
HEAD_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
               "hidden_act": "silu"}
HEAD_STD = 0.3  # EAGLE-3's LM head, wider than the target's 0.1: logits far apart, their argmax clear
# The layer's: sharp attention (its KV matters), which moves the state without drowning fc's part.
LAYER_STD = {"self_attn.q_proj": 0.3, "self_attn.k_proj": 0.3, "self_attn.v_proj": 0.1, "self_attn.o_proj": 0.05,
             "mlp.gate_proj": 0.1, "mlp.up_proj": 0.1, "mlp.down_proj": 0.05}


def _decoder_layer(rng, prefix: str, config: dict, in_dim: int, norms: tuple[str, ...]) -> dict[str, np.ndarray]:
    h, heads, kv, hd, m = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "intermediate_size"))
    shapes = {"self_attn.q_proj": (heads * hd, in_dim), "self_attn.k_proj": (kv * hd, in_dim),
              "self_attn.v_proj": (kv * hd, in_dim), "self_attn.o_proj": (h, heads * hd),
              "mlp.gate_proj": (m, h), "mlp.up_proj": (m, h), "mlp.down_proj": (h, m)}
    tensors = {f"{prefix}.{name}.weight": LAYER_STD[name] * rng.standard_normal(shape)
               for name, shape in shapes.items()}
    tensors.update({f"{prefix}.{norm}.weight": 1 + 0.2 * rng.standard_normal(h) for norm in norms})
    return tensors


def _save(folder, config: dict, tensors: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: np.ascontiguousarray(v, dtype=v.dtype if v.dtype.kind in "ib" else np.float32)
               for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    return str(folder)


def write_eagle_head(folder) -> str:
    """An EAGLE-1 head as the original checkpoints have it: fc with a bias, its first layer without
    input_layernorm, and a copy of the target's embedding (which the engine does not read). fc maps
    a token's embedding to 20 times its row of the target's LM head (least squares), so the head
    guesses the token comes again, as the tiny Llama's tokens often do: some drafts are taken."""
    rng, copy = np.random.default_rng(0), 20.0
    h = HEAD_CONFIG["hidden_size"]
    target = load_file(f"{tiny_model('llama')}/model.safetensors")
    embedding = target["model.embed_tokens.weight"].astype(np.float64)
    to_head_row = np.linalg.lstsq(embedding, target["lm_head.weight"].astype(np.float64), rcond=None)[0].T
    fc = 0.1 * rng.standard_normal((h, 2 * h))
    fc[:, :h] += copy * to_head_row
    tensors = {"fc.weight": fc, "fc.bias": 0.1 * rng.standard_normal(h), "embed_tokens.weight": embedding,
               **_decoder_layer(rng, "layers.0", HEAD_CONFIG, h, ("post_attention_layernorm",))}
    return _save(folder, HEAD_CONFIG, tensors)


def write_eagle3_head(folder, target: str, aux_layers: list[int], hidden_size: int = 64,
                      norm_before_residual: bool = False) -> str:
    """An EAGLE-3 head of `target`: fc over three target states, "midlayer" with its hidden_norm and
    2H-wide q, k, v, its own norm and LM head over half the target's ids (d2t, t2d). fc passes on 10
    times the state entering the target's first layer (the token's embedding) and the LM head's rows
    are the draft tokens' embeddings, 10 times, so the head guesses the token comes again (with
    aux_layers[0] == 0). A hidden_size other than the target's 64 gives it an embedding of its own."""
    rng, copy = np.random.default_rng(0), 10.0
    vocab, target_hidden = HEAD_CONFIG["vocab_size"], HEAD_CONFIG["hidden_size"]
    h, draft_vocab_size = hidden_size, HEAD_CONFIG["vocab_size"] // 2
    config = {**HEAD_CONFIG, "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h,
              "num_attention_heads": h // 16, "num_key_value_heads": max(h // 32, 1), "intermediate_size": 2 * h,
              "draft_vocab_size": draft_vocab_size, "target_hidden_size": target_hidden,
              "eagle_aux_hidden_state_layer_ids": aux_layers, "norm_before_residual": norm_before_residual}
    ids = np.sort(rng.choice(vocab, draft_vocab_size, replace=False))  # the target ids the draft vocabulary holds
    own = {} if h == target_hidden else {"embed_tokens.weight": 0.1 * rng.standard_normal((vocab, h))}
    embedding = own.get("embed_tokens.weight", load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"])
    rows = embedding[ids].astype(np.float64)
    fc = 0.1 * rng.standard_normal((h, 3 * target_hidden))
    fc[:, :target_hidden] += copy * np.eye(h, target_hidden)
    tensors = {**own, "fc.weight": fc, "norm.weight": 1 + 0.2 * rng.standard_normal(h),
               "lm_head.weight": HEAD_STD * rng.standard_normal((draft_vocab_size, h))
               + copy * rows / np.linalg.norm(rows, axis=1, keepdims=True),
               "d2t": (ids - np.arange(draft_vocab_size)).astype(np.int64), "t2d": np.isin(np.arange(vocab), ids),
               **_decoder_layer(rng, "midlayer", config, 2 * h, ("input_layernorm", "hidden_norm",
                                                                 "post_attention_layernorm"))}
    return _save(folder, config, tensors)


def write_deeper_llama(folder, num_layers: int = 4) -> str:
    """The tiny Llama with `num_layers` layers: EAGLE-3 reads three distinct layers, more than the
    fixture's two. The layers past two are theirs again, perturbed, their o_proj and down_proj a
    tenth: the model stays near the fixture's, whose tokens often come again."""
    rng = np.random.default_rng(0)
    src = tiny_model("llama")
    weights = load_file(f"{src}/model.safetensors")
    for layer in range(2, num_layers):
        for name, value in list(weights.items()):
            if name.startswith(f"model.layers.{layer % 2}."):
                scale = 0.1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                new = name.replace(f"model.layers.{layer % 2}.", f"model.layers.{layer}.")
                weights[new] = (scale * value * (1 + 0.1 * rng.standard_normal(value.shape))).astype(np.float32)
    with open(f"{src}/config.json") as f:
        config = {**json.load(f), "num_hidden_layers": num_layers}
    os.makedirs(folder, exist_ok=True)
    shutil.copy(f"{src}/generation_config.json", folder)
    return _save(folder, config, weights)


# ---- the numpy reference (float64) ----

def load(folder: str) -> tuple[dict[str, np.ndarray], dict]:
    """A folder's tensors (float64, names without "model.") and config."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    return {k.removeprefix("model."): v.astype(np.float64) if v.dtype.kind == "f" else v
            for k, v in tensors.items()}, config


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, inv_freq):
    """x [T, heads, head_dim], rotate-half."""
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(x, w, prefix, config, positions, rows: slice):
    """Causal attention over the sequence x [T, in], for the queries of `rows`."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    inv_freq = rope_inv_freq(ModelArchConfig.from_hf_config({**config, "architectures": ["LlamaForCausalLM"]}))
    n = x.shape[0]
    q = _rope((x[rows] @ w[f"{prefix}.q_proj.weight"].T).reshape(-1, heads, hd), positions[rows], inv_freq)
    k = _rope((x @ w[f"{prefix}.k_proj.weight"].T).reshape(n, kv, hd), positions, inv_freq)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).reshape(n, kv, hd)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.arange(n)[None, None, :] <= np.arange(n)[rows][None, :, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(q.shape[0], heads * hd) @ w[f"{prefix}.o_proj.weight"].T


def _mlp(x, w, prefix):
    gate, up = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ w[f"{prefix}.down_proj.weight"].T


def target_states(w, config, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(the final hidden states after the norm [T, H], the residual stream entering each layer [L, T, H])."""
    eps, positions = config["rms_norm_eps"], np.arange(len(tokens), dtype=np.float64)
    x = w["embed_tokens.weight"][tokens]
    entering = []
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}"
        entering.append(x)
        x = x + _attention(_rms_norm(x, w[f"{p}.input_layernorm.weight"], eps), w, f"{p}.self_attn", config, positions,
                           slice(None))
        x = x + _mlp(_rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps), w, f"{p}.mlp")
    return _rms_norm(x, w["norm.weight"], eps), np.stack(entering)


def eagle_head(method, w, config, embeds, hidden, positions, rows: slice = slice(None)
               ) -> tuple[np.ndarray, np.ndarray]:
    """The head over a sequence: embeds, hidden [T, H] (hidden already through EAGLE-3's fc) ->
    (the state its logits read, the state the next draft reads), each [len(rows), H]."""
    eps = config["rms_norm_eps"]
    if method == "eagle":
        x = np.concatenate([embeds, hidden], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        x = x[rows] + _attention(x, w, "layers.0.self_attn", config, positions, rows)  # no input norm
        x = x + _mlp(_rms_norm(x, w["layers.0.post_attention_layernorm.weight"], eps), w, "layers.0.mlp")
        return x, x
    p = "midlayer"
    normed = _rms_norm(hidden, w[f"{p}.hidden_norm.weight"], eps)
    attn_in = np.concatenate([_rms_norm(embeds, w[f"{p}.input_layernorm.weight"], eps), normed], -1)
    residual = normed if config["norm_before_residual"] else hidden
    x = residual[rows] + _attention(attn_in, w, f"{p}.self_attn", config, positions, rows)
    x = x + _mlp(_rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps), w, f"{p}.mlp")
    return _rms_norm(x, w["norm.weight"], eps), x


def head_embedding(method, w, target_w) -> np.ndarray:
    """The embedding a head reads: an EAGLE-3 head's own when its checkpoint has one, else the target's."""
    own = method == "eagle3" and "embed_tokens.weight" in w
    return w["embed_tokens.weight"] if own else target_w["embed_tokens.weight"]


def head_logits(method, w, target_w, x) -> tuple[np.ndarray, np.ndarray]:
    """(logits [n, V'] over the head's vocabulary, the target id of each of its ids [V'])."""
    if method == "eagle":
        return x @ target_w["lm_head.weight"].T, np.arange(target_w["lm_head.weight"].shape[0])
    d2t = w["d2t"]
    return x @ w["lm_head.weight"].T, np.arange(len(d2t)) + d2t


def head_inputs(method, head, target, tokens, aux_layers=()) -> np.ndarray:
    """The state the head reads at each position of `tokens` [T, H]: the target's final one (EAGLE-1), or
    fc over the ones entering `aux_layers` (EAGLE-3). Causal: a prefix's are the first of the whole's."""
    (w, _), (tw, tconfig) = head, target
    final, entering = target_states(tw, tconfig, np.asarray(tokens))
    if method == "eagle":
        return final
    return np.concatenate([entering[i] for i in sorted(aux_layers)], -1) @ w["fc.weight"].T


def reference_drafts(method, head, target, tokens, hidden, k: int, margin: float = 1e-4) -> list[int | None]:
    """The head's k greedy drafts after `tokens`, from the whole sequence: position p reads `hidden`
    [>= len(tokens) - 1, H] (head_inputs') at p and token p + 1 up to the last token, then the head's
    own state and its drafts. None from the first whose top two logits are within `margin` (float32
    may pick either)."""
    (w, config), (tw, _) = head, target
    hidden = hidden[:len(tokens) - 1]
    ids = list(tokens[1:])
    embedding = head_embedding(method, w, tw)
    drafts = []
    while len(drafts) < k:
        logit_states, states = eagle_head(method, w, config, embedding[np.asarray(ids)], hidden,
                                          np.arange(len(ids), dtype=np.float64), rows=slice(-1, None))
        logits, to_target = head_logits(method, w, tw, logit_states)
        top2 = np.sort(logits[0])[-2:]
        if top2[1] - top2[0] < margin:
            return drafts + [None] * (k - len(drafts))
        drafts.append(int(to_target[np.argmax(logits[0])]))
        ids.append(drafts[-1])
        hidden = np.concatenate([hidden, states[-1:]])
    return drafts
