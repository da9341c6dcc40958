"""bunsan's quantized DDP communication hook inside other trainers: Lightning's
``bunsan.integrations.lightning.QuantizedDDPStrategy``, Fabric's
``bunsan.integrations.fabric.QuantizedFabricStrategy`` and the Hugging Face Trainer's
``bunsan.integrations.transformers.QuantizedHookCallback`` (docs/how-to/ddp-hooks.md).

Each integration lives in a module of its own and imports its framework only when one of its
names is used, so that ``import bunsan.integrations`` needs neither::

    from bunsan.integrations.lightning import QuantizedDDPStrategy       # pip install 'bunsan[lightning]'
    from bunsan.integrations.fabric import QuantizedFabricStrategy       # the same extra
    from bunsan.integrations.transformers import QuantizedHookCallback   # pip install 'bunsan[transformers]'

Each registers :func:`bunsan.algorithms.quantized_hook` on the DDP-wrapped model before the first
backward and keep every rank's hook state (its residuals differ by rank) with the framework's
checkpoints. How to use them: docs/how-to/ddp-hooks.md.
"""

from __future__ import annotations

__all__: list[str] = []
