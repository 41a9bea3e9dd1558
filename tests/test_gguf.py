"""GGUF weights at the file's own precision: exact import per type, row-independent products, the loader's
tensor mapping (llama's permuted q/k rows included), and the torch fallback."""
import os

import numpy as np
import pytest
import torch

import gguf
from hydraspec.cache import cache_kwargs
from hydraspec.errors import HydraspecError
from hydraspec.cpu.gguf import SUPPORTED, GGUFEmbedding, GGUFLinear, decode

# byte ranges of each type's fp16 fields in a block: random bytes there could be NaN or inf
_F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0], "IQ4_XS": [0]}


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
    emb16 = GGUFEmbedding(lin, torch.bfloat16)  # bf16: the native row lookup where the kernel is built
    assert torch.equal(emb16(rows.view(1, -1))[0], torch.from_numpy(ref)[rows].bfloat16())


def test_unsupported_type_is_refused_by_name():
    with pytest.raises(HydraspecError, match="IQ2_XXS.*--quant none"):
        decode("IQ2_XXS", np.zeros((1, 66), np.uint8), 1, 256)


@pytest.mark.parametrize("type_name", SUPPORTED)
@pytest.mark.parametrize("native", [True, False])
def test_rows_are_independent(type_name, native, monkeypatch):
    """A row's output is the same whatever rows are computed beside it (the verify step relies on it), and
    the kernel computes what its torch reference computes."""
    import hydraspec.cpu.gguf as gw

    lin = GGUFLinear(decode(type_name, random_tensor(type_name, 70, 512, seed=1), 70, 512),
                     bias=torch.randn(70))
    if native and gw._gguf_lib() is None:
        pytest.skip("no native GGUF kernel on this CPU")
    if not native:
        monkeypatch.setattr(gw, "_gguf_lib", lambda: None)
    x = torch.randn(16, 512).bfloat16()
    x[3] *= 40  # a row with large values beside small ones
    with torch.no_grad():
        full = lin(x)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
        pieces = torch.cat([lin(x[:7]), lin(x[7:])])
        ref = lin.reference(x)
        for n in range(2, len(x)):  # every number of rows a verify forward takes, in one pass or several
            assert torch.equal(lin(x[:n]), alone[:n]), n
    assert torch.equal(full, alone) and torch.equal(full, pieces)
    dense = x.float() @ lin.dequantized().T + lin.bias32
    scale = dense.abs().amax(-1, keepdim=True)
    assert ((full.float() - ref.float()).abs() <= 0.02 * scale).all()
    assert ((full.float() - dense).abs() <= 0.05 * scale).all()  # int8 activations: close, not equal


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_wide_inputs_take_narrower_passes_and_rows_stay_independent(type_name):
    """Weights with many inputs (an MLP's down projection) take fewer rows a pass (hs_gguf.h's pass_rows: 9
    rows of 8,960 inputs go as 5 + 4, of 512 inputs as one pass): each row still equals itself computed
    alone, for 1-16 rows."""
    x = torch.randn(16, 8960).bfloat16()
    x[5] *= 30
    assert_rows_alone(type_name, 40, x, range(2, len(x) + 1), seed=2)


@pytest.mark.parametrize("type_name", SUPPORTED)
def test_a_prompts_rows_equal_each_row_alone(type_name):
    """A prompt's many rows (several passes over each weight block; 6-bit codes then unpacked once a block)
    give each row what it gives alone, bit for bit."""
    x = torch.randn(41, 512).bfloat16()
    x[9] *= 40
    assert_rows_alone(type_name, 70, x, (25, 37, 41), seed=3)


def assert_rows_alone(type_name: str, out: int, x: torch.Tensor, counts, seed: int) -> None:
    """The first n rows of ``x`` through a random ``type_name`` weight (``out`` outputs) equal each row computed
    alone, for every n of ``counts`` (native kernel only)."""
    import hydraspec.cpu.gguf as gw

    if gw._gguf_lib() is None:
        pytest.skip("no native GGUF kernel on this CPU")
    inp = x.shape[1]
    lin = GGUFLinear(decode(type_name, random_tensor(type_name, out, inp, seed=seed), out, inp), bias=torch.randn(out))
    with torch.no_grad():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
        for n in counts:
            assert torch.equal(lin(x[:n]), alone[:n]), n


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_outputs_do_not_depend_on_how_blocks_are_handed_to_threads(type_name):
    """Weight blocks handed to threads in fixed halves (static) or as each thread finishes (dynamic, the
    default) give the same bits, at 1 and 2 threads and one to several rows."""
    import hydraspec.cpu.gguf as gw

    lib = gw._gguf_lib()
    if lib is None or not hasattr(lib, "hs_set_dynamic"):
        pytest.skip("no native GGUF kernel on this CPU")
    lin = GGUFLinear(decode(type_name, random_tensor(type_name, 1000, 512, seed=2), 1000, 512))
    x = torch.randn(5, 512).bfloat16()
    threads = torch.get_num_threads()
    out = []
    try:
        for dynamic, n in ((0, 2), (1, 2), (1, 1), (0, 1)):
            lib.hs_set_dynamic(dynamic)
            torch.set_num_threads(n)
            with torch.no_grad():
                out.append((lin(x), lin(x[:1])))
    finally:
        lib.hs_set_dynamic(1)
        torch.set_num_threads(threads)
    for many, one in out[1:]:
        assert torch.equal(many, out[0][0]) and torch.equal(one, out[0][1])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_outputs_do_not_depend_on_the_prefetch_distance(type_name, monkeypatch):
    """How far ahead the kernels prefetch their weights (set per CPU, HYDRASPEC_PREFETCH_BYTES overrides) changes
    no output bit, at one row and several; a distance that is not a number of bytes is refused by name."""
    import hydraspec.cpu.gguf as gw
    from hydraspec.cpu import kernels

    lib = gw._gguf_lib()
    if lib is None or not hasattr(lib, "hs_prefetch_ahead"):
        pytest.skip("no native kernel with a prefetch distance on this CPU")
    lin = GGUFLinear(decode(type_name, random_tensor(type_name, 300, 512, seed=4), 300, 512))
    x = torch.randn(7, 512).bfloat16()
    out = []
    try:
        for nbytes in (0, 1024, 4096, 1 << 16):
            kernels.set_prefetch(lib, nbytes)
            with torch.no_grad():
                out.append((lin(x), lin(x[:1])))
    finally:
        kernels.set_prefetch(lib)
    for many, one in out[1:]:
        assert torch.equal(many, out[0][0]) and torch.equal(one, out[0][1])
    monkeypatch.setenv("HYDRASPEC_PREFETCH_BYTES", "2048")
    assert kernels.prefetch_bytes() == 2048
    monkeypatch.setenv("HYDRASPEC_PREFETCH_BYTES", "4k")
    with pytest.raises(HydraspecError, match="HYDRASPEC_PREFETCH_BYTES"):
        kernels.prefetch_bytes()


@pytest.mark.parametrize("native", [True, False])
def test_joined_siblings_compute_what_each_weight_computes(native, monkeypatch):
    """q/k/v (or gate/up) joined into one weight give each projection exactly its own output, whatever
    the order of the calls, and a format that differs (here v at 6 bits) stays a separate weight."""
    import hydraspec.cpu.gguf as gw
    from hydraspec.cpu.gguf import can_concat
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


def _write_tiny_llama(path, types, output: str | None = None):
    """A one-layer llama GGUF (hidden 256, 4 heads, 2 kv heads) with random weights of the given types;
    ``output``: the type of an output tensor of its own (default: tied to the embeddings)."""
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
    if output:
        shapes["output.weight"] = (64, 256)
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        t = output if name == "output.weight" else types[i % len(types)]
        w.add_tensor(name, random_tensor(t, rows, cols, seed=i),
                     raw_dtype=gguf.GGMLQuantizationType[t])
    rng = np.random.default_rng(9)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(256)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_files_layout_is_read_once_and_follows_the_file(tmp_path, monkeypatch):
    """The header is parsed once per file: a second load takes the kept layout and builds the same model; a
    rewritten file (other types, other offsets) is parsed again, never built from the stale layout."""
    from transformers import LlamaConfig

    from hydraspec.cpu import gguf_layout
    from hydraspec.cpu.gguf_load import build_model

    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path / "home"))
    parsed = []
    real_reader = gguf_layout.GGUFReader
    monkeypatch.setattr(gguf_layout, "GGUFReader", lambda f: parsed.append(f) or real_reader(f))
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    path = tmp_path / "tiny.gguf"
    ids = torch.tensor([[1, 5, 9, 33]])

    def logits():
        with torch.no_grad():
            return build_model(path, config, torch.float32, "eager", progress=False)(ids).logits

    _write_tiny_llama(path, ["Q4_K", "Q6_K", "Q8_0"])
    first = logits()
    assert len(parsed) == 1 and gguf_layout.index_path(path).exists()
    assert torch.equal(logits(), first) and len(parsed) == 1  # from the index
    _write_tiny_llama(path, ["Q8_0", "Q5_0", "Q4_0", "Q6_K"])
    os.utime(path, ns=(1, 1))  # even with an old time stamp: the size tells the files apart
    changed = logits()
    assert len(parsed) == 2 and not torch.equal(changed, first)
    for f in gguf_layout.index_path(path).parent.iterdir():
        f.unlink()
    assert torch.equal(logits(), changed) and len(parsed) == 3  # what a fresh parse builds


@pytest.mark.parametrize("types", [["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1", "Q5_K", "Q4_0", "Q5_1"],
                                   ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"]])
def test_loader_maps_every_tensor_as_transformers_does(tmp_path, types):
    """build_model holds each weight at the file's precision, and its dequantization equals the tensor
    transformers' own GGUF loader makes (names, llama's q/k row order, tied embeddings)."""
    from transformers import LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from hydraspec.cpu.gguf_load import build_model

    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, types)
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
        last = model(ids[:, 3:], **cache_kwargs(model, out.past_key_values)).logits
    assert torch.allclose(full[:, 3], last[:, 0], atol=1e-5)


@pytest.mark.parametrize("output", [None, "Q8_0", "Q6_K"])
def test_draft_vocabulary_cut_at_load_equals_the_cut_after_it(tmp_path, output):
    """Reading only the kept rows of the output tensor (or cutting a tied one) gives the layer that cutting
    the whole loaded model gives: same codes, same logits, -inf outside the cut."""
    from transformers import LlamaConfig

    from hydraspec.draft_vocab import DraftVocabHead, kept_ids, trim_draft_vocab
    from hydraspec.cpu.gguf_load import build_model

    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, ["Q4_K", "Q6_K", "Q8_0"], output=output)
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=output is None)
    whole = build_model(path, config, torch.bfloat16, "eager", progress=False)
    assert trim_draft_vocab(whole, 20, [40, 63]) == 22
    keep = kept_ids(20, 64, [40, 63])
    cut = build_model(path, config, torch.bfloat16, "eager", progress=False, output_rows=keep)
    head = cut.get_output_embeddings()
    assert isinstance(head, DraftVocabHead) and head.sub.out_features == 22 and torch.equal(head.keep, keep)
    assert torch.equal(head.sub.dequantized(), whole.get_output_embeddings().sub.dequantized())
    assert cut.model.embed_tokens.num_embeddings == 64  # every id can still be read
    ids = torch.tensor([[1, 5, 40, 33]])
    with torch.no_grad():
        a, b = cut(ids).logits, whole(ids).logits
    assert torch.equal(a, b) and torch.isinf(a[..., 20:40]).all() and torch.isfinite(a[..., 40]).all()


def test_draft_shares_the_target_tokenizer_only_when_its_files_are_the_same(tmp_path):
    from hydraspec.models import same_tokenizer

    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
        (d / "tokenizer.json").write_text('{"model": {"vocab": {"x": 0}}}')
        (d / "tokenizer_config.json").write_text("{}")
    (b / "chat_template.jinja").write_text("{{ messages }}")  # a template of its own: tokens unchanged
    (c / "tokenizer_config.json").write_text('{"eos_token": "x"}')
    assert same_tokenizer(a, b) and same_tokenizer(a, a)
    assert not same_tokenizer(a, c) and not same_tokenizer(a, tmp_path / "missing")


def test_without_a_compiler_everything_runs_on_torch(tmp_path):
    """No C compiler: the kernel build fails quietly, GGUF weights run on their torch reference, and a
    speculative answer still equals plain decoding."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "warnings.simplefilter('ignore')\n"
        "from hydraspec.cpu import kernels\n"
        "assert kernels.native_lib() is None and kernels.int8_dot_lib() is None\n"
        "from hydraspec.cpu.gguf import _gguf_lib\n"
        "assert _gguf_lib() is None\n"
        "import sys; sys.path.insert(0, %r)\n"
        "import tiny\n"
        "from hydraspec import SpeculativeGenerator, make_drafter\n"
        "tok = tiny.make_tokenizer(); model = tiny.make_model('llama')\n"
        "ref = SpeculativeGenerator(model, tok).generate('a b a b a b', max_new_tokens=12)\n"
        "res = SpeculativeGenerator(model, tok, make_drafter('pld')).generate('a b a b a b', max_new_tokens=12)\n"
        "assert res.token_ids == ref.token_ids\n"
        "print('ok')\n" % os.path.dirname(__file__))
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"), HYDRASPEC_HOME=str(tmp_path / "home"),
               HYDRASPEC_PREBUILT=str(tmp_path / "none"))  # installed without a compiler: no install-time build
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_install_time_build_is_used_and_needs_no_compiler_later(tmp_path):
    """What `pip install` builds (setup.py runs native_build.build_all, one compile_library per build) is
    loaded as it is, with no compiler at run time; a library built from other sources (another name) is
    never loaded. The prebuilt folder holds this CPU's build only (the one this machine already has, copied,
    or compiled here)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from hydraspec.cpu import build as native_build, kernels

    isa = kernels.native_isa()
    if isa is None:
        pytest.skip("no AVX2 / AVX-512 CPU")
    pre = tmp_path / "prebuilt"
    name = native_build.library_name(isa)
    lib = kernels.build_native(isa)  # this machine's build of the same sources and flags, where it has one
    if lib is not None and Path(lib._name).name == name:
        pre.mkdir()
        shutil.copy(lib._name, pre / name)
    else:
        so, why = native_build.compile_library(isa, pre)
        if so is None:
            pytest.skip(f"no {isa} build: {why}")
    assert (pre / name).exists()
    (pre / "bf16_linear-stale.so").write_bytes(b"not a library")
    code = ("from hydraspec.cpu import kernels\n"
            "lib = kernels.native_lib()\n"
            "print(lib._name)\n")
    env = dict(os.environ, CC=str(tmp_path / "no-such-compiler"), HYDRASPEC_HOME=str(tmp_path / "home"),
               HYDRASPEC_PREBUILT=str(pre), HYDRASPEC_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(pre / name)
    assert not (tmp_path / "home" / "kernels").exists()  # nothing compiled on first use


# ---- the AVX2 build's GGUF kernel: AVX2-only CPUs (AMD Zen 2/3) and AVX-512 ones without VNNI run it ----

def _gguf_builds():
    """The AVX2 build of the native kernel and, where this CPU runs it (AVX512_VNNI), the AVX-512 build, for
    comparing their GGUF kernels; skips without AVX2 + FMA or without a C compiler."""
    from hydraspec.cpu import kernels

    if not kernels.cpu_runs("avx2"):
        pytest.skip("no AVX2 + FMA on this CPU")
    avx2 = kernels.build_native("avx2")
    if avx2 is None:
        pytest.skip("no C compiler")
    vnni = None
    if kernels.cpu_runs("avx512") and "avx512_vnni" in kernels._cpu_flags():
        vnni = kernels.build_native("avx512")
    return avx2, vnni


def _kernel_arithmetic(lin: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
    """The native GGUF kernels' arithmetic, operation by operation: exact integer group sums, then per group in
    fp32 the scale product, a fused multiply-add (and for the min form a fused multiply-subtract), bias, bf16.
    Each operation runs in float64 and is rounded to float32: a product of two floats is exact in float64, so
    this is the fused result (but for double-rounding ties, vanishingly rare). GGUFLinear.reference rounds the
    product before adding, and so differs from the kernels by a bf16 step now and then."""
    from hydraspec.cpu.gguf import quantize_rows_grouped

    def r(t):
        return t.float().double()
    q, sx = quantize_rows_grouped(x, lin.group)  # [n, ng, G], [n, ng]
    n, ng, _ = q.shape
    xs = q.sum(-1)
    mxs = (sx * xs).double()  # fp32 product, as make_gguf_rows
    codes = lin.codes().double().view(lin.out_features, ng, lin.group)
    isum = torch.einsum("ngk,ogk->gno", q.double(), codes)  # exact integers
    sc, mn = lin.group_scales()  # fp32: K-quants' d * sub-scale as the kernels multiply them
    f = torch.zeros(n, lin.out_features, dtype=torch.float64)
    for g in range(ng):
        sxg = sx[:, g:g + 1].double()
        if mn is None:
            f = r(f + r((isum[g] - lin.zero * xs[:, g:g + 1].double()) * sc[:, g].double()) * sxg)
        else:
            f = r(f + r(isum[g] * sc[:, g].double()) * sxg)
            f = r(f - mn[:, g].double() * mxs[:, g:g + 1])
    if lin.bias32 is not None:
        f = r(f + lin.bias32.double())
    return f.float().bfloat16()


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (bf16 tensors, same sign or zero), elementwise."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return torch.where((ia < 0) == (ib < 0), (ia - ib).abs(), torch.full_like(ia, 1 << 16))


def _extreme_codes(qw):
    """Output rows 0-2 of a decoded weight at the largest int16 sums the kernels make: every code at its top,
    every code at 0 (8 bits: code - 128 at -128), and the two alternating."""
    top = (1 << qw.bits) - 1
    qw.codes[0], qw.codes[1] = top, 0
    qw.codes[2, 0::2], qw.codes[2, 1::2] = top, 0
    return qw


def _extreme_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows 0-2 of x at the extreme activation codes (every code +127, every code -127, alternating) and a
    row of large values beside small ones."""
    x[0] = 1.0
    if len(x) > 1:
        x[1] = -1.0
    if len(x) > 2:
        x[2, 0::2], x[2, 1::2] = 1.0, -1.0
    if len(x) > 3:
        x[3] *= 40
    return x


def _check_exact(lin: GGUFLinear, x: torch.Tensor, avx2, vnni, monkeypatch) -> torch.Tensor:
    """The AVX2 build's output for x equals the VNNI build's (where it runs) and the arithmetic in torch. With
    a bias, again for a bias that cancels each row's sum in turn: the output is then what bf16 otherwise
    hides, the low bits of that row's fp32 sums (a multiply and an add where the kernels fuse them would
    show there). Returns the output with lin's own bias."""
    import hydraspec.cpu.gguf as gw

    def check(tag):
        monkeypatch.setattr(gw, "_gguf_lib", lambda: avx2)
        y = lin(x)
        assert torch.equal(y, _kernel_arithmetic(lin, x)), tag
        if vnni is not None:
            monkeypatch.setattr(gw, "_gguf_lib", lambda: vnni)
            assert torch.equal(lin(x), y), tag
        return y
    with torch.no_grad():
        y = check(f"{len(x)} rows")
        if lin.bias32 is not None:
            kept = lin.bias32.clone()  # changed in place below: the kernel may keep the buffer's address
            lin.bias32.zero_()
            plain = check(f"{len(x)} rows, zero bias").float()
            for i in range(len(x)):
                lin.bias32.copy_(-plain[i])
                check(f"{len(x)} rows, a bias cancelling row {i}")
            lin.bias32.copy_(kept)
    return y


@pytest.mark.parametrize("type_name", SUPPORTED)
def test_avx2_gguf_kernel_equals_the_vnni_kernel(type_name, monkeypatch):
    """The AVX2 build's GGUF kernel (vpmaddubsw, no VNNI) computes what the AVX-512 VNNI kernel computes, bit
    for bit: every type, 1-13 rows (inside and across its passes of 4 rows), 77 outputs (a partial block),
    with and without bias, codes and activations at their extremes (the largest int16 sums). Without VNNI
    here, it is checked against the same arithmetic in torch; GGUFLinear.reference, which rounds products
    before adding them, is at most a bf16 step away, and on few outputs."""
    avx2, vnni = _gguf_builds()
    qw = _extreme_codes(decode(type_name, random_tensor(type_name, 77, 512, seed=5), 77, 512))
    torch.manual_seed(5)
    for bias in (None, torch.randn(77)):
        lin = GGUFLinear(qw, bias=bias)
        for rows in (1, 2, 3, 5, 7, 13):
            x = _extreme_rows(torch.randn(rows, 512).bfloat16())
            y = _check_exact(lin, x, avx2, vnni, monkeypatch)
            with torch.no_grad():
                steps = _bf16_steps_apart(y, lin.reference(x))
            assert steps.max() <= 1 and (steps > 0).float().mean() < 0.02


@pytest.mark.parametrize("bits,form,group", [(4, "min", 64), (4, "zero", 8), (6, "min", 12), (6, "zero", 16),
                                             (6, "two", 16), (8, "zero", 64), (8, "min", 12), (4, "two", 32)])
def test_avx2_gguf_kernel_any_group_size(bits, form, group, monkeypatch):
    """Group sizes other than GGUF's 16 and 32 (the kernel's general path: int16 sums over several rounds,
    a last round shorter), the 8-bit min form and an 8-bit zero point other than 128 (no GGUF type has
    them, the kernels do), and two-level scales: the AVX2 build equals the VNNI build and the arithmetic
    in torch."""
    from hydraspec.cpu.gguf import QuantWeight

    avx2, vnni = _gguf_builds()
    rng = np.random.default_rng(bits * 100 + group)
    rows, cols = 45, 384
    ng = cols // group
    qw = QuantWeight(rng.integers(0, 1 << bits, size=(rows, cols), dtype=np.uint8), bits, group,
                     rng.uniform(0.001, 0.02, size=(rows, ng)).astype(np.float32), None,
                     {4: 8, 6: 32, 8: 100}[bits])
    if form == "min":
        qw.min, qw.zero = rng.uniform(-0.1, 0.1, size=(rows, ng)).astype(np.float32), 0
    elif form == "two":  # K-quant scales: an fp32 d per 4 groups times an int8 sub-scale
        qw.d = rng.uniform(0.001, 0.01, size=(rows, ng // 4)).astype(np.float32)
        qw.sub_scale = rng.integers(-63, 64, size=(rows, ng), dtype=np.int8)
        qw.scale = np.repeat(qw.d, 4, axis=1) * qw.sub_scale.astype(np.float32)
    qw = _extreme_codes(qw)
    lin = GGUFLinear(qw, bias=torch.randn(rows))
    for n in (1, 4, 6):
        _check_exact(lin, _extreme_rows(torch.randn(n, cols).bfloat16()), avx2, vnni, monkeypatch)


@pytest.mark.parametrize("type_name", SUPPORTED)
def test_avx2_gguf_rows_are_independent(type_name, monkeypatch):
    """With the AVX2 build a row's output is the same whatever rows are computed beside it (alone, in
    passes of 4 rows at any position, split across calls)."""
    import hydraspec.cpu.gguf as gw

    avx2, _ = _gguf_builds()
    monkeypatch.setattr(gw, "_gguf_lib", lambda: avx2)
    lin = GGUFLinear(decode(type_name, random_tensor(type_name, 70, 512, seed=1), 70, 512), bias=torch.randn(70))
    torch.manual_seed(1)
    x = _extreme_rows(torch.randn(16, 512).bfloat16())
    with torch.no_grad():
        full = lin(x)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
        pieces = torch.cat([lin(x[:6]), lin(x[6:9]), lin(x[9:])])
        backwards = lin(x.flip(0)).flip(0)
        for n in range(2, len(x)):
            assert torch.equal(lin(x[:n]), alone[:n]), n
    assert torch.equal(full, alone) and torch.equal(full, pieces) and torch.equal(full, backwards)


def test_a_chosen_library_takes_every_native_call(monkeypatch):
    """Inside kernels.chosen_library(lib) the GGUF layers call ``lib`` (another build being timed against this
    one), and after it the build they had."""
    import hydraspec.cpu.gguf as gw
    from hydraspec.cpu import kernels

    calls = []

    class Fake:
        def hs_gguf_apply(self, x, n, call, y, threads):
            calls.append(n)
            return 0
    lin = GGUFLinear(decode("Q4_K", random_tensor("Q4_K", 32, 256), 32, 256))
    before = gw._gguf_lib()
    with kernels.chosen_library(Fake()):
        assert isinstance(gw._gguf_lib(), Fake) and isinstance(kernels.fused_lib(), Fake)
        with torch.no_grad():
            lin(torch.randn(3, 256).bfloat16())
    assert calls == [3] and gw._gguf_lib() is before
