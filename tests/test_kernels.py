"""Prepacked Linear kernels: same numbers as nn.Linear, and decoding stays exact."""
import copy

import pytest
import torch
from torch import nn

import tiny
from hydraspec import SpeculativeGenerator, make_drafter
from hydraspec.cpu.kernels import PackedLinear, available, prepack

pytestmark = pytest.mark.skipif(not available(), reason="oneDNN not available")


@pytest.mark.parametrize("plain_rows", [None, "1,2,3", ""])  # measured on this CPU; forced either way
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_linear_matches_linear(dtype, tol, plain_rows, monkeypatch):
    if plain_rows is not None:
        monkeypatch.setenv("HYDRASPEC_FP32_PLAIN_ROWS", plain_rows)
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(dtype)
    packed = PackedLinear(lin)
    if dtype == torch.float32:
        expect = {"1,2,3": (1, 2, 3), "": ()}.get(plain_rows)
        assert set(packed.plain_rows) <= {1, 2, 3} and (expect is None or packed.plain_rows == expect)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 7, 16):
            x = torch.randn(1, rows, 64, dtype=dtype)
            torch.testing.assert_close(packed(x).float(), lin(x).float(), atol=tol, rtol=tol)


def test_prepacked_model_decodes_exactly(tok):
    model = copy.deepcopy(tiny.cached_model("llama", "sdpa", 1))
    ref = tiny.hf_greedy(model, [4, 8, 15, 16, 23, 42], 16)
    assert prepack(model) == 2 * 7 + 1  # 7 projections per layer + lm_head
    assert isinstance(model.lm_head, PackedLinear)
    for drafter in (make_drafter("ar"), make_drafter("pld"), make_drafter("draft", draft_model=model, widths=[2, 1])):
        res = SpeculativeGenerator(model, tok, drafter).generate(input_ids=[4, 8, 15, 16, 23, 42], max_new_tokens=16)
        assert res.token_ids == ref


native = pytest.mark.skipif(__import__("hydraspec.cpu.kernels", fromlist=["native_lib"]).native_lib() is None,
                            reason="native bf16 kernel not built here (no AVX-512 or no C compiler)")


@pytest.fixture(params=["fp32", "bf16-dot"])
def kernel_path(request, monkeypatch):
    """Both paths of the bf16 kernel: fp32 FMA, and vdpbf16ps where the CPU has AVX512_BF16."""
    from hydraspec.cpu import kernels
    want = request.param == "bf16-dot"
    if want and not (kernels.native_lib() is not None and "avx512_bf16" in kernels._cpu_flags()):
        pytest.skip("no AVX512_BF16 on this CPU")
    monkeypatch.setattr(kernels, "bf16_dot", lambda: want)
    return request.param


@native
@pytest.mark.parametrize("in_features", [64, 40, 7])  # multiples of 16 and masked tails
def test_native_bf16_kernel_matches_fp32_reference(in_features, kernel_path):
    from hydraspec.cpu.kernels import native_linear_bf16
    torch.manual_seed(1)
    w = torch.randn(37, in_features).bfloat16()
    b = torch.randn(37)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40):
        x = torch.randn(rows, in_features).bfloat16()
        ref = x.double() @ w.double().T + b.double()
        torch.testing.assert_close(native_linear_bf16(x, w, b).double(), ref.bfloat16().double(), atol=1e-6, rtol=8e-3)
        torch.testing.assert_close(native_linear_bf16(x, w, None).double(), (ref - b.double()).bfloat16().double(), atol=1e-6, rtol=8e-3)


@native
def test_native_bf16_rows_do_not_depend_on_their_neighbours(kernel_path):
    """A verify step computes a token beside others; with this kernel its projection is bit-identical
    to computing it alone, which keeps bf16 speculative output closer to plain decoding."""
    from hydraspec.cpu.kernels import native_linear_bf16
    torch.manual_seed(2)
    w = torch.randn(300, 1536).bfloat16()
    x = torch.randn(33, 1536).bfloat16()
    together = native_linear_bf16(x, w, None)
    for i in (0, 5, 16, 32):
        assert torch.equal(native_linear_bf16(x[i:i + 1], w, None)[0], together[i])
        assert torch.equal(native_linear_bf16(x[i:i + 3], w, None)[0], together[i])


@native
def test_packed_linear_uses_native_kernel_for_bf16(kernel_path):
    torch.manual_seed(3)
    lin = nn.Linear(48, 24, bias=True).to(torch.bfloat16)
    packed = PackedLinear(lin)
    # one zero-padded block of 32 outputs, in input pairs for vdpbf16ps
    assert packed.native and packed.packed.shape == ((1, 48, 32) if kernel_path == "fp32" else (1, 24, 32, 2))
    with torch.inference_mode():
        for rows in (1, 6, 13, 250):  # one row block, a partial one, many
            x = torch.randn(2, rows, 48, dtype=torch.bfloat16)
            torch.testing.assert_close(packed(x).float(), lin(x).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("use_native", [True, False])
def test_int8_linear_matches_its_dequantized_weight(use_native, monkeypatch):
    from hydraspec.cpu import kernels
    from hydraspec.cpu.quantized import Int8Linear
    if use_native and kernels.native_lib() is None:
        pytest.skip("native kernel not built here")
    if not use_native:
        monkeypatch.setattr(kernels, "native_lib", lambda: None)
    torch.manual_seed(4)
    lin = nn.Linear(40, 45, bias=True).to(torch.bfloat16)  # 45 outputs: a padded second block
    q = Int8Linear(lin)
    deq = q.dequantized()
    # absmax/127 per output: every weight within half a step of its int8 value
    assert (deq - lin.weight.float()).abs().max() <= q.scale.max() / 2 + 1e-6
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (2, 40, 32)
    with torch.inference_mode():
        for rows in (1, 5, 12, 13, 30):
            x = torch.randn(rows, 40).bfloat16()
            ref = x.double() @ deq.double().T + lin.bias.double()
            torch.testing.assert_close(q(x).double(), ref.bfloat16().double(), atol=1e-6, rtol=8e-3)


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_w8a8_native_kernel_is_the_integer_arithmetic(isa, monkeypatch):
    """The int8-activation kernel quantises each row to int8 and sums exactly in int32: bit-equal to the
    same integer arithmetic in torch, for row counts inside and across the row blocks (12 rows with VNNI,
    3 with AVX2) and an input size that is not a multiple of 4; and close to the unquantised product.
    "avx2" forces the AVX2 build (vpmaddubsw), which AVX-512 CPUs run too."""
    from hydraspec.cpu import kernels
    from hydraspec.cpu.quantized import W8A8Linear
    lib = _int8_dot_build(isa, monkeypatch)
    torch.manual_seed(7)
    lin = nn.Linear(130, 45, bias=True).to(torch.bfloat16)
    q = W8A8Linear(lin)
    assert q.qweight.shape == (2, 33, 32, 4) and q.int_weight().shape == (45, 130)
    assert (q.dequantized() - lin.weight.float()).abs().max() <= q.scale.max() / 2 + 1e-6
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 12, 13, 30):
            x = torch.randn(rows, 130).bfloat16()
            x[0, :7] = torch.tensor([127.0, -127.0, 1.0, -1.0, 0.0, 127.0, -127.0])  # extreme codes of row 0
            native = q(x)
            monkeypatch.setattr(kernels, "int8_dot_lib", lambda: None)
            emulated = q(x)
            monkeypatch.setattr(kernels, "int8_dot_lib", lambda: lib)
            assert torch.equal(native, emulated)
            ref = x.float() @ lin.weight.float().T + lin.bias.float()
            assert (native.float() - ref).abs().max() < 0.03 * ref.abs().max()
        together = q(x)
        for i in (0, 12, 29):
            assert torch.equal(q(x[i:i + 1])[0], together[i])


def _int8_dot_build(isa, monkeypatch):
    """The w8a8/w4a8 kernel build for a test: this CPU's choice ("native") or the AVX2 build; skips where
    it cannot run, and makes the Linear modules use it."""
    from hydraspec.cpu import kernels
    if isa == "native":
        lib = kernels.int8_dot_lib()
    else:
        lib = kernels.build_native("avx2") if kernels.cpu_runs("avx2") else None
    if lib is None:
        pytest.skip(f"no {isa} int8 dot-product kernel here")
    monkeypatch.setattr(kernels, "int8_dot_lib", lambda: lib)
    return lib


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("group", [32, 64])
def test_w4a8_linear_is_its_integer_arithmetic(isa, group, monkeypatch):
    """4-bit weights in groups times int8 rows: the native kernel and the same integer arithmetic in torch
    agree, weights sit within half a step of their 4-bit value, rows do not depend on their neighbours.
    Groups of 64 inputs take two int16 rounds of the AVX2 kernel, groups of 32 one.
    (The torch path alone runs in the draft-model test below: tiny fp32 models do not take the kernel.)"""
    from hydraspec.cpu import kernels
    from hydraspec.cpu.quantized import W4A8Linear
    lib = _int8_dot_build(isa, monkeypatch)
    torch.manual_seed(8)
    lin = nn.Linear(128, 45, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight[3, :group] = 1.0  # every code of a group at 15 (q = 7): the largest int16 sums
    q = W4A8Linear(lin, group=group)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (2, 32, 16, 4)  # two outputs a byte
    assert q.scale.shape == (2, 128 // group, 32)
    step = q.group_scales().repeat_interleave(group, dim=1)
    assert ((q.dequantized() - lin.weight.float()).abs() <= step / 2 + 1e-6).all()
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 30):  # inside and across the kernels' 3- and 6-row blocks
            x = torch.randn(rows, 128).bfloat16()
            x[0] = 1.0  # row 0: every code at 127
            native = q(x)
            monkeypatch.setattr(kernels, "int8_dot_lib", lambda: None)
            emulated = q(x)
            monkeypatch.setattr(kernels, "int8_dot_lib", lambda: lib)
            torch.testing.assert_close(native.float(), emulated.float(), atol=1e-6, rtol=8e-3)
            ref = x.float() @ lin.weight.float().T + lin.bias.float()
            assert (native.float() - ref).abs().max() < 0.1 * ref.abs().max()
        together = q(x)
        for i in (0, 6, 29):
            assert torch.equal(q(x[i:i + 1])[0], together[i])


@pytest.mark.parametrize("how", ["int8", "w8a8", "w4a8"])
def test_quantised_draft_model_keeps_output_exact(how, tok):
    """Quantising the drafter may change acceptance, never the output (fp32 target, greedy)."""
    from hydraspec.cpu import quantized
    kind = {"int8": quantized.Int8Linear, "w8a8": quantized.W8A8Linear, "w4a8": quantized.W4A8Linear}[how]
    target = tiny.make_model("llama", seed=11, hidden=96, heads=4, kv_heads=2, init_range=0.05)
    draft = copy.deepcopy(target)
    assert getattr(quantized, f"quantize_{how}")(draft) == 2 * 7 + 1
    assert isinstance(draft.lm_head, kind)
    prompt = [4, 8, 15, 16, 23, 42]
    ref = tiny.hf_greedy(target, prompt, 24)
    for kw in ({}, {"widths": [2, 1]}):
        res = SpeculativeGenerator(target, tok, make_drafter("draft", draft_model=draft, confidence=0.0, **kw)).generate(
            input_ids=prompt, max_new_tokens=24)
        assert res.token_ids == ref
        assert res.stats.mean_accepted > 1.0  # a close copy of the target keeps proposing accepted tokens


def test_w4a8_group_sizes_and_fallback():
    from hydraspec.cpu.quantized import W4A8Linear, W8A8Linear, quantize_w4a8
    draft = tiny.make_model("llama", seed=11, hidden=96, heads=4, kv_heads=2)
    quantize_w4a8(draft)
    assert {m.group for m in draft.modules() if isinstance(m, W4A8Linear)} == {32, 64}  # 96 and 192 inputs
    odd = tiny.make_model("llama", seed=12, hidden=40, heads=4, kv_heads=2)
    quantize_w4a8(odd)
    assert isinstance(odd.lm_head, W8A8Linear)  # 40 inputs: no 4-bit group fits


@pytest.mark.parametrize("in_features", [1536, 40, 7])
def test_avx2_kernel_sums_like_the_avx512_kernel(in_features, monkeypatch):
    """The AVX2 build (CPUs without AVX-512) keeps the AVX-512 build's layout and summation order: on a
    CPU that runs both, their bf16 and int8 results are bit-identical for every row count (1-2 rows
    take its whole-block pass, more rows its half-block passes); on an AVX2-only CPU it matches the
    float64 product."""
    from hydraspec.cpu import kernels
    from hydraspec.cpu.kernels import native_linear_bf16
    from hydraspec.cpu.quantized import Int8Linear
    if not kernels.cpu_runs("avx2"):
        pytest.skip("no AVX2 + FMA on this CPU")
    avx2 = kernels.build_native("avx2")
    if avx2 is None:
        pytest.skip("no C compiler")
    avx512 = kernels.build_native("avx512") if kernels.cpu_runs("avx512") else None
    monkeypatch.setattr(kernels, "bf16_dot", lambda: False)
    torch.manual_seed(7)
    lin = nn.Linear(in_features, 77, bias=True).to(torch.bfloat16)  # 77 outputs: a partial third block
    for rows in (1, 2, 3, 6, 7, 13, 40):
        x = torch.randn(rows, in_features).bfloat16()
        got = {}
        for name, lib in (("avx2", avx2), ("avx512", avx512)):
            if lib is None:
                continue
            monkeypatch.setattr(kernels, "native_lib", lambda lib=lib: lib)
            q = Int8Linear(lin)
            with torch.inference_mode():
                got[name] = (native_linear_bf16(x, lin.weight, lin.bias.float()), q(x), q.dequantized())
        y, yq, deq = got["avx2"]
        ref = x.double() @ lin.weight.double().T + lin.bias.double()
        torch.testing.assert_close(y.double(), ref.bfloat16().double(), atol=1e-6, rtol=8e-3)
        refq = x.double() @ deq.double().T + lin.bias.double()
        torch.testing.assert_close(yq.double(), refq.bfloat16().double(), atol=1e-6, rtol=8e-3)
        for i in range(rows):  # a row's result does not depend on the rows beside it
            monkeypatch.setattr(kernels, "native_lib", lambda: avx2)
            assert torch.equal(native_linear_bf16(x[i:i + 1], lin.weight, lin.bias.float())[0], y[i])
        if "avx512" in got:
            assert torch.equal(got["avx512"][0], y) and torch.equal(got["avx512"][1], yq)


def test_reports_name_the_cpu_kernel(monkeypatch):
    """Bench reports say which native build ran (a CPU model name does not tell Zen 3 from Zen 4)."""
    from hydraspec.cpu import kernels
    from hydraspec.bench.report import machine_info, machine_line
    expected = "torch" if kernels.native_lib() is None else (
        "avx512-bf16dot" if kernels.bf16_dot() else kernels.native_isa())
    assert kernels.describe() == expected
    ahead = kernels.prefetch_now(kernels.native_lib()) if expected != "torch" else None
    tail = "" if ahead is None else f", weights prefetched {ahead} B ahead"
    assert machine_line(machine_info("bfloat16", "cpu")).endswith(f"CPU kernel {expected}{tail}")
    if expected != "torch":  # a run with HYDRASPEC_FUSED=0 says so
        monkeypatch.setattr(kernels, "fused_lib", lambda: None)
        assert machine_line(machine_info("bfloat16", "cpu")).endswith(f"CPU kernel {expected}, fused ops off{tail}")
    monkeypatch.setattr(kernels, "native_lib", lambda: None)
    assert kernels.describe() == "torch"


def test_w4a8_draft_refused_without_an_int8_dot_kernel(monkeypatch):
    """--draft-quant w8a8/w4a8 needs the native int8 dot-product kernel (AVX512_VNNI or AVX2): without it
    the request is refused with a message that names the way out, and nothing is quantised."""
    from hydraspec.cpu import kernels, quantized
    from hydraspec.errors import HydraspecError
    from hydraspec.quantize import quantize_draft
    draft = tiny.make_model("llama", seed=11, hidden=96, heads=4, kv_heads=2)
    monkeypatch.setattr(kernels, "int8_dot_lib", lambda: None)
    for how in ("w8a8", "w4a8"):
        with pytest.raises(HydraspecError, match="use int8"):
            quantize_draft(draft, how)
    assert not any(isinstance(m, (quantized.W4A8Linear, quantized.W8A8Linear)) for m in draft.modules())
    quantize_draft(draft, "int8")  # int8 weights need no int8 dot products
    assert isinstance(draft.lm_head, quantized.Int8Linear)


def test_w4a8_built_chunk_by_chunk_equals_built_whole(monkeypatch):
    """Re-quantising a weight a chunk of rows at a time (so no dense copy of a large weight is made) gives the
    same codes and scales as one pass over all rows, for a plain Linear and for a GGUF weight."""
    import hydraspec.cpu.quantized as k
    from hydraspec.cpu.gguf import GGUFLinear, decode
    from test_gguf import random_tensor

    torch.manual_seed(0)
    plain = torch.nn.Linear(128, 200)
    gguf = GGUFLinear(decode("Q4_K", random_tensor("Q4_K", 200, 256), 200, 256))
    for lin in (plain, gguf):
        whole = k.W4A8Linear(lin, 32)
        monkeypatch.setattr(k, "_CHUNK_ROWS", 64)
        chunked = k.W4A8Linear(lin, 32)
        monkeypatch.setattr(k, "_CHUNK_ROWS", 2048)
        assert torch.equal(whole.qweight, chunked.qweight) and torch.equal(whole.scale, chunked.scale)


@pytest.mark.parametrize("native", [True, False])
def test_w4a8_draft_joins_sibling_projections_exactly(native, monkeypatch):
    """quantize_draft(w4a8) joins q/k/v and gate/up into one 4-bit weight each; every output equals the
    separate weight's, with the native kernel and with its torch reference."""
    from hydraspec.cpu import kernels, quantized
    from hydraspec.quantize import quantize_draft
    from hydraspec.shared_input import Projection, SharedInput

    if not native:
        monkeypatch.setattr(kernels, "int8_dot_lib", lambda: None)
    base = tiny.make_model("qwen2", seed=5, hidden=128, heads=4, kv_heads=2, init_range=0.05).to(torch.bfloat16)
    separate = copy.deepcopy(base)
    quantized.quantize_w4a8(separate)
    if native and kernels.int8_dot_lib() is None:
        pytest.skip("no int8 dot-product kernel on this machine")
    joined = quantize_draft(base, "w4a8") if native else _quantize_draft_with_reference(base, monkeypatch)
    shared = [m for m in joined.modules() if isinstance(m, SharedInput)]
    assert len(shared) == 2 * 2  # q/k/v and gate/up of both layers
    assert all(isinstance(m.joined, quantized.W4A8Linear) for m in shared)
    assert isinstance(joined.model.layers[0].self_attn.v_proj, Projection)
    ids = torch.tensor([[3, 17, 44, 9, 61, 2, 30]])
    with torch.inference_mode():
        assert torch.equal(joined(ids).logits, separate(ids).logits)


def _quantize_draft_with_reference(model, monkeypatch):
    """quantize_draft needs the kernel to allow w4a8; build with it claimed, then run the torch reference."""
    from hydraspec.cpu import kernels
    from hydraspec.quantize import quantize_draft

    monkeypatch.setattr(kernels, "int8_dot_lib", lambda: object())
    quantize_draft(model, "w4a8")
    monkeypatch.setattr(kernels, "int8_dot_lib", lambda: None)
    return model
