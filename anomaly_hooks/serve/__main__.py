"""``python -m anomaly_hooks.serve --model m.safetensors`` (same as ``anomaly-hooks serve``)."""
import sys

from anomaly_hooks.serve.cli import main

sys.exit(main())
