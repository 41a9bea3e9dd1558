#!/usr/bin/env bash
# Build llama.cpp's command-line tools from the sources that the llama-cpp-python sdist on PyPI vendors,
# for the llama.cpp baselines of `hydraspec bench` (llamacpp-ar / llamacpp-draft / llamacpp-ngram), for
# llama-perplexity and for llama-quantize (benchmarks/gguf_types.py). Nothing of llama.cpp is kept here.
#   scripts/build_llamacpp.sh [DEST]      DEST defaults to ~/.cache/hydraspec/llama.cpp
# About 15 minutes on two cores. The binaries land in DEST/build/bin; `hydraspec bench` finds them there
# (or through $HYDRASPEC_LLAMACPP_BIN).
set -euo pipefail
dest=${1:-${HYDRASPEC_HOME:-$HOME/.cache/hydraspec}/llama.cpp}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$dest"
cd "$dest"
if [ ! -d src ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d sdist
  tar xzf sdist/llama_cpp_python-"$version".tar.gz
  mv llama_cpp_python-"$version"/vendor/llama.cpp src
  rm -rf llama_cpp_python-"$version" sdist
fi
# On CPUs with AMX a -march=native build (llama.cpp's AMX code) died with a general protection fault at the
# first batch of two or more tokens (2026-11-28, Xeon family 6 model 167): build for AVX-512 without AMX there.
isa="-DGGML_NATIVE=ON"
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  isa="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
       -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON"
fi
# shellcheck disable=SC2086
cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release $isa -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF
cmake --build build -j "$(nproc)" --target llama-completion llama-speculative-simple llama-perplexity \
  llama-server llama-bench llama-quantize
echo "llama.cpp tools in $dest/build/bin"
