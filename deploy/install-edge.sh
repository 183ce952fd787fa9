#!/usr/bin/env bash
# Install the edge inspection service into a new virtual environment DIR, without PyTorch:
#
#     deploy/install-edge.sh /opt/anomaly-hooks
#     /opt/anomaly-hooks/bin/anomaly-hooks serve --model model.onnx
#
# It installs anomaly_hooks with --no-deps (its core dependencies would pull in torch) and
# then deploy/edge-requirements.txt, checks that the edge import path is complete and that
# torch is absent, and prints the installed size.
#
# Environment:
#   PYTHON                  the interpreter that makes the venv (default: python3, >= 3.10)
#   ANOMALY_HOOKS_SOURCE    what to install: a source tree or a wheel (default: this checkout)
#   PIP_ARGS                extra pip arguments (an index, --no-cache-dir, ...), split on spaces
set -euo pipefail

if [ "$#" -ne 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: $0 DIR   (a new virtual environment for the edge service)" >&2
    exit 2
fi
dir=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source=${ANOMALY_HOOKS_SOURCE:-$(dirname "$here")}
python=${PYTHON:-python3}
read -r -a pip_args <<< "${PIP_ARGS:-}"

if [ -e "$dir/bin/python" ]; then
    echo "$dir: a virtual environment is already there; installing into it" >&2
else
    "$python" -m venv "$dir"
fi
pip=("$dir/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet "${pip_args[@]}" -r "$here/edge-requirements.txt"
"${pip[@]}" install --quiet --no-deps "${pip_args[@]}" "$source"

# the whole edge path imports, and torch is not there
"$dir/bin/python" - <<'PY'
import importlib.util
import sys

if importlib.util.find_spec("torch") is not None:
    sys.exit("error: torch is installed in this environment: not an edge install")
import anomaly_hooks.cli  # noqa: F401  (the command)
import anomaly_hooks.runtime  # noqa: F401  (score of an .onnx model)
import anomaly_hooks.serve.app  # noqa: F401  (the service)
import anomaly_hooks.serve.engine_onnx  # noqa: F401
import anomaly_hooks.serve.server  # noqa: F401
import onnxruntime  # noqa: F401
import python_multipart  # noqa: F401

assert "torch" not in sys.modules
PY
"$dir/bin/anomaly-hooks" serve --help > /dev/null
echo "edge service installed in $dir ($(du -sh "$dir" | cut -f1)): $dir/bin/anomaly-hooks serve --model MODEL.onnx"
