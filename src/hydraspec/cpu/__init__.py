"""The CPU backend: native kernels and the layers that run on them.

* :mod:`.build`: compiling ``csrc/`` with the system C compiler (at install time into ``prebuilt/``, or on
  first use) and which instruction set this CPU runs;
* :mod:`.kernels`: Linear layers on prepacked bf16 / fp32 weights and on int8 / w8a8 / w4a8 draft weights;
* :mod:`.norm`, :mod:`.rope`, :mod:`.mlp`: the RMSNorm, rotary embedding and gated MLP of the stock decoder
  layers as one native call each;
* :mod:`.attention`: few-query attention for verify steps;
* :mod:`.gguf`: GGUF weights at the file's own precision (the quant formats).

The core does not need this package: it reaches it through :mod:`hydraspec.backend` and where a model is
loaded on the CPU, and with ``HYDRASPEC_NATIVE=0``, without a C compiler, or on CPUs without AVX2, every layer
here runs its stock torch computation (the same arithmetic, slower).
"""
