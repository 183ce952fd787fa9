"""One served model of the service: :class:`ModelSlot` holds what belongs to one model -- its
name, its file, its engine, its batcher, its drift monitor, its reload state -- while the
service shares the rest between all of them (admission, thread pools, the model thread, the
results log, the metrics). A service started with one ``--model PATH`` has one slot, named
``default``; ``--model NAME=PATH`` repeated gives one slot each, the first the default one
(the routes without a model name serve it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from anomaly_hooks.serve.batcher import Batcher
from anomaly_hooks.serve.engine import ModelEngine
from anomaly_hooks.serve.monitoring import MonitorRunner


@dataclass(eq=False)
class ModelSlot:
    """What the service keeps for one model (see the module)."""

    name: str
    path: str                              # the file it serves (a reload replaces it)
    default: bool = False                  # the model of the routes without a name
    monitor_object: Any = None             # a drift monitor given to create_app (default model)
    engine: Optional[ModelEngine] = None
    load_error: Optional[str] = None       # why it could not be loaded at start
    last_reload: Optional[Dict[str, Any]] = None
    reloading: bool = False
    batcher: Optional[Batcher] = None
    # (monitor, the engine whose file built it or None for a given monitor), swapped as one so
    # that the batch thread never pairs a new monitor with an old model's batch
    monitoring: Tuple[Optional[MonitorRunner], Optional[ModelEngine]] = field(
        default=(None, None))

    @property
    def monitor(self) -> Optional[MonitorRunner]:
        """The drift monitor fed by this model's batches (None: no monitor)."""
        return self.monitoring[0]
