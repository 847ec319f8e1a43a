#!/usr/bin/env bash
# Create .venv and install lora-merge with its test oracles.
#
# Torch is installed first, pinned, and from PyTorch's CPU index where that index answers: on Linux the
# default index (PyPI) serves the CUDA build, which pulls several GB of CUDA, cuDNN, NCCL and triton onto a
# host that merges on CPU. Where the CPU index cannot be reached (no network to it, a mirror-only host) the
# default index is used, and the script says which build that gave.
#
# Environment:
#   PYTHON             the interpreter for .venv (default: python3)
#   TORCH_CPU_INDEX    PyTorch's CPU wheel index (default: https://download.pytorch.org/whl/cpu)
#   TORCH_PROBE_TIMEOUT  seconds to wait for that index before falling back (default: 10)
#   SETUP_DRY_RUN=1    probe the index and print the install commands, without running them
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_PROBE_TIMEOUT=${TORCH_PROBE_TIMEOUT:-10}
DRY_RUN=${SETUP_DRY_RUN:-}

say() { echo "setup.sh: $*"; }
run() {
    if [ -n "$DRY_RUN" ]; then
        echo "setup.sh: would run: $*"
    else
        "$@"
    fi
}

# Whether the CPU index answers and lists this torch version (its simple-index page for torch, fetched with a
# timeout; proxies from the environment are honoured). A listing is a few MB: no wheel is downloaded here.
cpu_index_has_torch() {
    "$PYTHON" - "$TORCH_CPU_INDEX" "$TORCH_VERSION" "$TORCH_PROBE_TIMEOUT" <<'EOF'
import sys
import urllib.request

index, version, timeout = sys.argv[1].rstrip("/"), sys.argv[2], float(sys.argv[3])
try:
    with urllib.request.urlopen(f"{index}/torch/", timeout=timeout) as response:
        page = response.read().decode("utf-8", "replace")
except Exception as exc:  # DNS, refused, timeout, HTTP error: all mean "not reachable from here"
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(1)
if f"torch-{version}" not in page.replace("%2B", "+"):
    print(f"it lists no torch {version}")
    sys.exit(1)
EOF
}

[ -x .venv/bin/python ] || run "$PYTHON" -m venv .venv
if [ -z "$DRY_RUN" ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    say "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') is already in .venv; not reinstalled"
elif why=$(cpu_index_has_torch); then
    say "PyTorch's CPU index $TORCH_CPU_INDEX answers: installing torch $TORCH_VERSION (CPU build) from it"
    run .venv/bin/pip install -q --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
else
    say "PyTorch's CPU index $TORCH_CPU_INDEX is not reachable ($why): installing torch $TORCH_VERSION from the" \
        "default index (on Linux x86_64, PyPI's wheel is the CUDA build)"
    run .venv/bin/pip install -q "torch==$TORCH_VERSION"
fi
run .venv/bin/pip install -q -e ".[test]"
if [ -z "$DRY_RUN" ]; then  # after the dependencies: torch warns when imported without numpy
    say ".venv has $(.venv/bin/python -c 'import torch
print(f"torch {torch.__version__}, " + (f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"))')"
fi
