#!/usr/bin/env bash
# Build llama.cpp, outside the repo, as the speed peer for `meshnet bench`.
#
# The source is the copy vendored in the llama-cpp-python sdist (PyPI is the one
# registry we can reach). The peer gets every vector extension this host has, as
# meshnet's kernels do: each GGML_* ISA option below is ON exactly when
# /proc/cpuinfo lists its flags (AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16,
# AVX-VNNI, ...). GGML_NATIVE stays OFF and AMX stays off: the -march=native
# build segfaulted on this CPU, so the flags are passed one by one.
#
# The options chosen are recorded in $home/build-flags (default home
# ~/.cache/meshnet/llama.cpp, or $LLAMACPP_HOME; binaries in $home/bin). A run
# whose options match that record and whose binaries exist is a no-op; any
# difference (another host, an old build without the record) rebuilds.
# `meshnet bench` reads the record to say which extensions its peer has.
#
# LLAMACPP_ISA=avx2 builds the peer an AVX2-only CPU would get (the host's
# AVX-512, AVX-VNNI and AMX flags ignored) into ~/.cache/meshnet/llama.cpp-avx2:
# the benchmarks race it when run with MESHNET_ISA=avx2 (our AVX2 kernels), so an
# AVX-512 host can measure both kinds of CPU.
set -euo pipefail

version="${LLAMACPP_PY_VERSION:-0.3.36}"
isa="${LLAMACPP_ISA:-host}"
case "$isa" in
  host) default_home="$HOME/.cache/meshnet/llama.cpp" ;;
  avx2) default_home="$HOME/.cache/meshnet/llama.cpp-avx2" ;;
  *)
    echo "LLAMACPP_ISA=$isa: expected host or avx2" >&2
    exit 2
    ;;
esac
home="${LLAMACPP_HOME:-$default_home}"
python="${PYTHON:-python3}"
cpuinfo="${CPUINFO:-/proc/cpuinfo}"
# llama-quantize makes the K-quant bench model; llama-tokenize and llama-server are the
# tokenizer and logits oracles of scripts/record_arch_oracles.py.
targets=(llama-bench llama-batched-bench llama-server ggml-rpc-server llama-cli llama-quantize llama-tokenize)

# The host's CPU flags, one per line (the first "flags" line: all cores are alike).
host_flags="$(grep -m1 '^flags' "$cpuinfo" | cut -d: -f2 | tr ' ' '\n' | grep -v '^$' || true)"
if [ "$isa" = avx2 ]; then # what an AVX2-only CPU lacks
  host_flags="$(grep -v -E '^(avx512|avx_vnni|amx)' <<<"$host_flags" || true)"
fi
has() {
  local f
  for f in "$@"; do grep -qx "$f" <<<"$host_flags" || return 1; done
}

# GGML option -> the /proc/cpuinfo flags it needs. GGML_AVX512 compiles with
# -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw, so it needs all five.
isa_options=(
  "GGML_SSE42:sse4_2"
  "GGML_AVX:avx"
  "GGML_AVX2:avx2"
  "GGML_FMA:fma"
  "GGML_F16C:f16c"
  "GGML_BMI2:bmi2"
  "GGML_AVX_VNNI:avx_vnni"
  "GGML_AVX512:avx512f avx512cd avx512vl avx512dq avx512bw"
  "GGML_AVX512_VBMI:avx512f avx512vbmi"
  "GGML_AVX512_VNNI:avx512f avx512_vnni"
  "GGML_AVX512_BF16:avx512f avx512_bf16"
)
flags=(-DGGML_NATIVE=OFF)
for entry in "${isa_options[@]}"; do
  option="${entry%%:*}"
  # shellcheck disable=SC2086 # the needed flags are space-separated on purpose
  if has ${entry#*:}; then flags+=("-D$option=ON"); else flags+=("-D$option=OFF"); fi
done
flags+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
record="llama-cpp-python $version ${flags[*]}"

built=1
for t in "${targets[@]}"; do [ -x "$home/bin/$t" ] || built=0; done
if [ "$built" = 1 ] && [ "$(cat "$home/build-flags" 2>/dev/null)" = "$record" ]; then
  echo "llama.cpp already built in $home/bin with: ${flags[*]}"
  exit 0
fi
echo "building llama.cpp with: ${flags[*]}"

mkdir -p "$home/src"
cd "$home/src"
sdist="llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d .
fi
[ -d "llama_cpp_python-$version" ] || tar xzf "$sdist"
src="$home/src/llama_cpp_python-$version/vendor/llama.cpp"

# The old record goes before the build starts: a build that fails half-way
# leaves binaries that match neither the old options nor the new ones.
rm -f "$home/build-flags"
cmake -S "$src" -B "$home/build" \
  -DCMAKE_BUILD_TYPE=Release "${flags[@]}" \
  -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$home/build" --config Release -j "$(nproc)" --target "${targets[@]}"

mkdir -p "$home/bin"
# Copied then renamed: a peer still running from the old binary keeps its file.
for t in "${targets[@]}"; do
  if cp "$home/build/bin/$t" "$home/bin/.$t.new" 2>/dev/null; then
    mv -f "$home/bin/.$t.new" "$home/bin/$t"
  else
    echo "note: $t was not built"
  fi
done
echo "$record" >"$home/build-flags"
echo "llama.cpp built in $home/bin"
