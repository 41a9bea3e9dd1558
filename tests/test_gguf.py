"""GGUF weights at the file's own precision: exact import per type, row-independent products, the loader's
tensor mapping (llama's permuted q/k rows included), and the torch fallback."""
import numpy as np
import pytest
import torch

import gguf
from hydraspec.errors import HydraspecError
from hydraspec.gguf_weights import SUPPORTED, GGUFEmbedding, GGUFLinear, decode

# byte ranges of each type's fp16 fields in a block: random bytes there could be NaN or inf
_F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}


def random_tensor(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes [rows, bytes per row] of ``type_name``: random codes and sub-scales, finite fp16 scales."""
    qt = gguf.GGMLQuantizationType[type_name]
    per, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per, nbytes), dtype=np.uint8)
    for at in _F16_FIELDS[type_name]:
        blocks[:, at:at + 2] = (rng.uniform(-0.02, 0.02, size=len(blocks)).astype(np.float16)
                                .view(np.uint8).reshape(-1, 2))
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", SUPPORTED)
def test_decode_equals_gguf_dequantize(type_name):
    raw = random_tensor(type_name, 40, 512)
    qt = gguf.GGMLQuantizationType[type_name]
    ref = gguf.dequantize(raw, qt)
    qw = decode(type_name, raw, 40, 512)
    assert np.array_equal(qw.dequantize(), ref)  # bit for bit, fp32
    lin = GGUFLinear(qw)
    assert torch.equal(lin.dequantized(), torch.from_numpy(ref))
    rows = torch.tensor([39, 0, 17, 31, 32])
    assert torch.equal(lin.select(rows).dequantized(), torch.from_numpy(ref)[rows])
    emb = GGUFEmbedding(lin, torch.float32)
    assert torch.equal(emb(rows.view(1, -1))[0], torch.from_numpy(ref)[rows])


def test_unsupported_type_is_refused_by_name():
    with pytest.raises(HydraspecError, match="Q3_K"):
        decode("Q3_K", np.zeros((1, 110), np.uint8), 1, 256)


@pytest.mark.parametrize("type_name", SUPPORTED)
@pytest.mark.parametrize("native", [True, False])
def test_rows_are_independent(type_name, native, monkeypatch):
    """A row's output is the same whatever rows are computed beside it (the verify step relies on it), and
    the kernel computes what its torch reference computes."""
    import hydraspec.gguf_weights as gw

    lin = GGUFLinear(decode(type_name, random_tensor(type_name, 70, 512, seed=1), 70, 512),
                     bias=torch.randn(70))
    if native and gw._gguf_lib() is None:
        pytest.skip("no native GGUF kernel on this CPU")
    if not native:
        monkeypatch.setattr(gw, "_gguf_lib", lambda: None)
    x = torch.randn(15, 512).bfloat16()
    x[3] *= 40  # a row with large values beside small ones
    with torch.no_grad():
        full = lin(x)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
        pieces = torch.cat([lin(x[:7]), lin(x[7:])])
        ref = lin.reference(x)
    assert torch.equal(full, alone) and torch.equal(full, pieces)
    dense = x.float() @ lin.dequantized().T + lin.bias32
    scale = dense.abs().amax(-1, keepdim=True)
    assert ((full.float() - ref.float()).abs() <= 0.02 * scale).all()
    assert ((full.float() - dense).abs() <= 0.05 * scale).all()  # int8 activations: close, not equal


@pytest.mark.parametrize("native", [True, False])
def test_joined_siblings_compute_what_each_weight_computes(native, monkeypatch):
    """q/k/v (or gate/up) joined into one weight give each projection exactly its own output, whatever
    the order of the calls, and a format that differs (here v at 6 bits) stays a separate weight."""
    import hydraspec.gguf_weights as gw
    from hydraspec.gguf_weights import can_concat
    from hydraspec.shared_input import Projection, fuse_siblings

    if native and gw._gguf_lib() is None:
        pytest.skip("no native GGUF kernel on this CPU")
    if not native:
        monkeypatch.setattr(gw, "_gguf_lib", lambda: None)
    parts = {"q_proj": ("Q4_K", 64), "k_proj": ("Q4_K", 32), "v_proj": ("Q6_K", 32)}
    attn = torch.nn.Module()
    for i, (name, (kind, rows)) in enumerate(parts.items()):
        setattr(attn, name, GGUFLinear(decode(kind, random_tensor(kind, rows, 512, seed=i), rows, 512),
                                       bias=torch.randn(rows)))
    alone = {n: getattr(attn, n) for n in parts}
    assert not can_concat(list(alone.values()))  # Q6_K beside Q4_K
    assert fuse_siblings(attn, can_concat, GGUFLinear.concat) == 1
    assert isinstance(attn.q_proj, Projection) and isinstance(attn.k_proj, Projection)
    assert attn.v_proj is alone["v_proj"]
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    for order in (["q_proj", "k_proj", "v_proj"], ["k_proj", "q_proj", "k_proj", "v_proj", "q_proj"]):
        for n in order:
            assert torch.equal(getattr(attn, n)(x), alone[n](x)), n
    y = torch.randn(3, 512, dtype=torch.bfloat16)
    assert torch.equal(attn.q_proj(x), alone["q_proj"](x)) and torch.equal(attn.k_proj(y), alone["k_proj"](y))
    attn.q_proj(x), attn.k_proj(x)
    assert attn.q_proj.shared._x is None  # nothing held once every part has taken its columns


def _write_tiny_llama(path, types):
    """A one-layer llama GGUF (hidden 256, 4 heads, 2 kv heads) with random weights of the given types."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(64)
    shapes = {"token_embd.weight": (64, 256), "blk.0.attn_q.weight": (256, 256), "blk.0.attn_k.weight": (128, 256),
              "blk.0.attn_v.weight": (128, 256), "blk.0.attn_output.weight": (256, 256),
              "blk.0.ffn_gate.weight": (512, 256), "blk.0.ffn_up.weight": (512, 256),
              "blk.0.ffn_down.weight": (256, 512)}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        t = types[i % len(types)]
        w.add_tensor(name, random_tensor(t, rows, cols, seed=i),
                     raw_dtype=gguf.GGMLQuantizationType[t])
    rng = np.random.default_rng(9)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(256)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_loader_maps_every_tensor_as_transformers_does(tmp_path):
    """build_model holds each weight at the file's precision, and its dequantization equals the tensor
    transformers' own GGUF loader makes (names, llama's q/k row order, tied embeddings)."""
    from transformers import LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from hydraspec.gguf_weights import build_model

    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1", "Q5_K", "Q4_0", "Q5_1"])
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = build_model(path, config, torch.float32, "eager", progress=False)
    from transformers import AutoModelForCausalLM
    ref_model = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref_model)["tensors"]
    for name, mod in model.named_modules():
        if isinstance(mod, GGUFLinear) and f"{name}.weight" in ref:
            assert torch.equal(mod.dequantized(), ref[f"{name}.weight"].float()), name
    assert torch.equal(model.model.embed_tokens.weight, ref["model.embed_tokens.weight"].float())
    assert model.lm_head is model.model.embed_tokens.table  # tied: one copy
    ids = torch.tensor([[1, 5, 9, 33]])
    with torch.no_grad():
        full = model(ids).logits
        # the last position computed alone, after the others in the cache, gives the same logits
        out = model(ids[:, :3], use_cache=True)
        last = model(ids[:, 3:], past_key_values=out.past_key_values).logits
    assert torch.allclose(full[:, 3], last[:, 0], atol=1e-5)


def test_without_a_compiler_everything_runs_on_torch(tmp_path):
    """No C compiler: the kernel build fails quietly, GGUF weights run on their torch reference, and a
    speculative answer still equals plain decoding."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "warnings.simplefilter('ignore')\n"
        "from hydraspec import kernels\n"
        "assert kernels.native_lib() is None and kernels.int8_dot_lib() is None\n"
        "from hydraspec.gguf_weights import _gguf_lib\n"
        "assert _gguf_lib() is None\n"
        "import sys; sys.path.insert(0, %r)\n"
        "import tiny\n"
        "from hydraspec import SpeculativeGenerator, make_drafter\n"
        "tok = tiny.make_tokenizer(); model = tiny.make_model('llama')\n"
        "ref = SpeculativeGenerator(model, tok).generate('a b a b a b', max_new_tokens=12)\n"
        "res = SpeculativeGenerator(model, tok, make_drafter('pld')).generate('a b a b a b', max_new_tokens=12)\n"
        "assert res.token_ids == ref.token_ids\n"
        "print('ok')\n" % os.path.dirname(__file__))
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"), HYDRASPEC_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
