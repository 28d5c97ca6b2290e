#!/usr/bin/env bash
# Puts llama.cpp itself (prebuilt CPU libllama from the PyPI wheel llama-cpp-py-sync, which has
# llama_adapter_lora_init, llama_set_adapters_lora, llama_get_logits_ith and llama_model_quantize)
# into a Python environment, so GGUF artefacts can be run in the runtime their users serve with.
#
# Usage: bash tools/llamacpp/install.sh [PYTHON]      (default: python3 on PATH, e.g. a venv's)
#
# On a machine whose glibc is 2.38 or newer the wheel works as installed. On an older glibc (Debian
# 12 has 2.36) the wheel's libraries ask for four C23 symbols of 2.38 (__isoc23_strtol, strtoul,
# strtoull, sscanf): the script then marks that version need weak in the wheel's .so files, builds
# a tiny shim that defines the four symbols, and adds a .pth line that loads the shim (RTLD_GLOBAL)
# at interpreter start. Nothing outside that environment changes. Check:
#   PYTHON -c "from llama_cpp_py_sync._cffi_bindings import get_lib; get_lib()"
set -euo pipefail
PY=${1:-python3}
here=$(cd "$(dirname "$0")" && pwd)
"$PY" -m pip install -q cffi numpy "llama-cpp-py-sync==0.11739"
if "$PY" -c "from llama_cpp_py_sync._cffi_bindings import get_lib; get_lib()" >/dev/null 2>&1; then echo "llama.cpp loads as installed"; exit 0; fi
pkg=$("$PY" -c "import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec('llama_cpp_py_sync').origin).parent)")
site=$(dirname "$pkg")
for l in "$pkg"/*.so*; do "$PY" "$here/elf_weaken.py" "$l" >/dev/null; done
gcc -O2 -shared -fPIC -o "$pkg/libc23shim.so" "$here/c23shim.c"
echo "import ctypes, os; ctypes.CDLL(os.path.join(r'$pkg', 'libc23shim.so'), mode=ctypes.RTLD_GLOBAL)" >"$site/llama_cpp_glibc_shim.pth"
"$PY" -c "from llama_cpp_py_sync._cffi_bindings import get_lib; get_lib(); import llama_cpp_py_sync as l; print('llama.cpp', l.__llama_cpp_tag__, 'loads (glibc shim)')"
