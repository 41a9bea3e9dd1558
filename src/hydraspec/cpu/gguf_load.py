"""A stock transformers model built on the weights of a GGUF file at the file's own precision: every Linear
whose tensor is of a supported block format becomes a :class:`~hydraspec.cpu.gguf.GGUFLinear`, a quantized
embedding a :class:`~hydraspec.cpu.gguf.GGUFEmbedding`; the model is built on the meta device first and the
tensors are read with plain file reads, so no dense copy of the weights is ever made."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import transformers
from gguf import dequantize
from torch import nn
from tqdm.auto import tqdm

from ..draft_vocab import DraftVocabHead, cut_output
from ..errors import HydraspecError
from .gguf import GGUFEmbedding, GGUFLinear
from .gguf_layout import file_layout
from .kernels import release_free_memory

__all__ = ["build_model", "RowReader"]


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """How transformers' tensor processor reorders the rows of GGUF tensor ``name`` (llama's q/k heads are
    stored permuted), as a permutation, or None when it keeps them; anything else it does is refused."""
    probe = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    out = np.asarray(processor.process(weights=probe, name=name).weights).reshape(-1)
    if out.shape == (rows,) and np.array_equal(np.sort(out), probe[:, 0]):
        return None if np.array_equal(out, probe[:, 0]) else out
    raise HydraspecError(f"GGUF tensor {name}: transformers changes its values on loading; "
                         "it cannot be held at the file's precision (load with --quant none)")


class RowReader:
    """Rows [r0, r1) of a tensor in an open file, read when sliced: a large tensor is never held whole."""

    def __init__(self, handle, offset: int, rows: int, row_bytes: int):
        self.handle, self.offset, self.row_bytes = handle, offset, row_bytes
        self.shape = (rows, row_bytes)

    def __getitem__(self, rows: slice) -> np.ndarray:
        r0, r1, _ = rows.indices(self.shape[0])
        self.handle.seek(self.offset + r0 * self.row_bytes)
        data = self.handle.read(max(r1 - r0, 0) * self.row_bytes)
        return np.frombuffer(data, dtype=np.uint8).reshape(-1, self.row_bytes)


def _some_rows(data: RowReader, rows: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """The rows ``rows`` (sorted) of a tensor in a file, read ``chunk`` rows at a time."""
    parts = []
    for r0 in range(0, data.shape[0], chunk):
        sel = rows[(rows >= r0) & (rows < r0 + chunk)]
        if len(sel):
            parts.append(data[r0:r0 + chunk][sel - r0].copy())
    return np.concatenate(parts) if parts else np.zeros((0, data.shape[1]), np.uint8)


@dataclass
class _Skeleton:
    """The model on the meta device, the tensor processor and name map of its architecture, and where each
    of the file's tensors lies."""

    model: nn.Module
    processor: object
    mapping: dict
    tensors: list
    out_name: str | None


def _skeleton(gguf_file, config, dtype: torch.dtype, attn_implementation: str | None) -> _Skeleton:
    from accelerate import init_empty_weights  # heavy
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor  # heavy

    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    def processor_for(arch: str):
        return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    layout = file_layout(gguf_file, model, processor_for)
    processor = processor_for(layout.arch)
    out_name = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    return _Skeleton(model, processor, layout.mapping, layout.tensors, out_name)


def _read_tensors(gguf_file, sk: _Skeleton, progress: bool, output_rows: torch.Tensor | None):
    """The file's tensors: {module name: GGUFLinear} for the quantized Linear / Embedding weights, {parameter
    name: tensor} for the float ones, and whether ``output_rows`` is still to be cut (False: the output layer
    was read for those rows only)."""
    quantized: dict[str, GGUFLinear] = {}  # module name -> its weight at the file's precision
    dense: dict[str, torch.Tensor] = {}  # parameter name -> tensor
    # tensors are read with plain file reads: pages of a memory map would count as resident memory
    with open(gguf_file, "rb") as handle:
        for i, (name, qtype, rows, cols, offset, nbytes, dtype_, shape) in enumerate(
                tqdm(sk.tensors, desc="loading GGUF weights", disable=not progress)):
            if i % 16 == 15:
                release_free_memory()  # the decoding's temporaries, before they add up
            hf = sk.mapping.get(name)
            if hf is None:
                continue
            mod_name, pname = hf.rsplit(".", 1)
            mod = sk.model.get_submodule(mod_name)
            kind = qtype.name
            if pname == "weight" and isinstance(mod, (nn.Linear, nn.Embedding)) and kind not in ("F32", "F16", "BF16"):
                perm = _row_order(sk.processor, name, rows)
                data = RowReader(handle, offset, rows, nbytes // rows)
                if perm is not None:  # rows in another order: read the tensor whole
                    data = data[0:rows]
                if output_rows is not None and mod_name == sk.out_name and perm is None:
                    data, rows = _some_rows(data, output_rows.numpy()), len(output_rows)
                    output_rows = None  # done: the layer holds just these rows
                quantized[mod_name] = GGUFLinear.from_gguf(kind, data, rows, cols, perm)
            else:
                handle.seek(offset)
                data = np.frombuffer(handle.read(nbytes), dtype=np.uint8)
                arr = sk.processor.process(weights=dequantize(data.view(dtype_).reshape(shape), qtype), name=name).weights
                dense[hf] = torch.from_numpy(np.array(arr))
    return quantized, dense, output_rows is not None


def _install(model: nn.Module, quantized: dict, dense: dict, dtype: torch.dtype, out_name: str | None) -> None:
    """Put the file's weights into the model: the GGUF modules in place of Linear / Embedding layers, the float
    tensors as parameters (a GGUF layer's bias in fp32)."""
    for name, mod in list(model.named_modules()):
        if name in quantized:
            table = quantized[name]
            if isinstance(mod, nn.Embedding):
                new = GGUFEmbedding(table, dtype, mod.padding_idx)
            else:
                bias = dense.pop(f"{name}.bias", None)
                table.bias32 = None if bias is None else bias.float().contiguous()
                new = table
            model.set_submodule(name, new)
    in_name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    if out_name and out_name not in quantized and f"{out_name}.weight" not in dense and in_name in quantized:
        model.set_submodule(out_name, quantized[in_name])  # tied embeddings: one copy, read both ways
    for hf, tensor in dense.items():
        mod_name, pname = hf.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        keep = torch.float32 if isinstance(mod, GGUFLinear) else dtype
        setattr(mod, pname, nn.Parameter(tensor.to(keep), requires_grad=False))
    out = model.get_output_embeddings()
    if out_name and out_name not in quantized and f"{out_name}.weight" not in dense and in_name not in quantized:
        out.weight = model.get_input_embeddings().weight  # tied float embeddings (an F16 / BF16 file)


def build_model(gguf_file, config, dtype: torch.dtype, attn_implementation: str | None = None,
                progress: bool = True, output_rows: torch.Tensor | None = None):
    """The stock transformers model for ``config`` with the weights of ``gguf_file``: every Linear whose
    tensor is of a :data:`~hydraspec.cpu.gguf.SUPPORTED` type becomes a GGUFLinear, a quantized embedding a
    GGUFEmbedding; float tensors (norms, biases) are loaded in ``dtype`` (biases fp32 in the kernel). The
    model is built on the meta device first, so no dense copy of the weights is ever made.
    ``output_rows`` (sorted token ids): the output layer covers those ids only (a draft's vocabulary cut,
    :func:`hydraspec.draft_vocab.cut_output`); an output tensor of its own is then read for those rows only."""
    sk = _skeleton(gguf_file, config, dtype, attn_implementation)
    quantized, dense, still_to_cut = _read_tensors(gguf_file, sk, progress, output_rows)
    model = sk.model
    _install(model, quantized, dense, dtype, sk.out_name)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise HydraspecError(f"GGUF file {gguf_file} has no tensor for {', '.join(missing[:5])}")
    if output_rows is not None:
        if not still_to_cut:  # read for those rows only
            vocab = config.get_text_config(decoder=True).vocab_size
            model.set_submodule(sk.out_name, DraftVocabHead(quantized[sk.out_name], output_rows, vocab))
        else:  # tied to the embeddings, or a float tensor: cut from the whole
            cut_output(model, output_rows)
    return model.eval()
