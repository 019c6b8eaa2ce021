#!/usr/bin/env bash
# Build llama.cpp once, outside the repo, as the speed peer for `meshnet bench`.
#
# The source is the copy vendored in the llama-cpp-python sdist (PyPI is the one
# registry we can reach). GGML_NATIVE=OFF and AMX off: the default -march=native
# build segfaults on this CPU. The binaries land in $LLAMACPP_HOME/bin
# (default ~/.cache/meshnet/llama.cpp/bin); a second run is a no-op.
set -euo pipefail

version="${LLAMACPP_PY_VERSION:-0.3.36}"
home="${LLAMACPP_HOME:-$HOME/.cache/meshnet/llama.cpp}"
python="${PYTHON:-python3}"
# llama-quantize makes the K-quant bench model; llama-tokenize and llama-server are the
# tokenizer and logits oracles of scripts/record_arch_oracles.py.
targets=(llama-bench llama-batched-bench llama-server ggml-rpc-server llama-cli llama-quantize llama-tokenize)

built=1
for t in "${targets[@]}"; do [ -x "$home/bin/$t" ] || built=0; done
if [ "$built" = 1 ]; then
  echo "llama.cpp already built in $home/bin"
  exit 0
fi

mkdir -p "$home/src"
cd "$home/src"
sdist="llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d .
fi
[ -d "llama_cpp_python-$version" ] || tar xzf "$sdist"
src="$home/src/llama_cpp_python-$version/vendor/llama.cpp"

cmake -S "$src" -B "$home/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$home/build" --config Release -j "$(nproc)" --target "${targets[@]}"

mkdir -p "$home/bin"
for t in "${targets[@]}"; do
  cp "$home/build/bin/$t" "$home/bin/" 2>/dev/null || echo "note: $t was not built"
done
echo "llama.cpp built in $home/bin"
