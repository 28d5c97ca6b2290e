"""The ``--device``, ``--device-map`` and ``--max-memory`` options every model command takes.

No torch import at module level (``ctxc --help`` stays fast); the values are checked by
:meth:`ctxc.models.devices.Placement.parse` before an output folder or a model is touched.
"""

from __future__ import annotations

import typer

from ctxc.core.errors import CtxcError
from ctxc.models.devices import Placement

__all__ = ["DEVICE", "DEVICE_MAP", "MAX_MEMORY", "placement_for"]

DEVICE = typer.Option(None, "--device", help="cpu (default), cuda, cuda:N or mps.")
DEVICE_MAP = typer.Option(
    None,
    "--device-map",
    help="auto, balanced or sequential: disperse the model over GPUs, CPU and disk (accelerate).",
)
MAX_MEMORY = typer.Option(
    None, "--max-memory", help="With --device-map: memory per device, e.g. 0=20GiB,cpu=60GiB."
)


def placement_for(
    device: str | None, device_map: str | None, max_memory: str | None, kinds=()
) -> Placement:
    """The checked placement of the options; a CtxcError names the bad one.

    Args:
        kinds: the artefacts asked for: ONNX and PEFT need the model in one place.
    """
    placement = Placement.parse(device, device_map, max_memory)
    other = [k for k in kinds if k != "torch"]
    if placement.device_map is not None and other:
        raise CtxcError(
            f"--device-map writes the torch model folder only, not {', '.join(other)}: "
            "those exporters need the whole model in one place"
        )
    return placement
