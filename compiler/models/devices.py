"""Where a model runs: one device (``--device``), or dispersed by accelerate (``--device-map``).

A device is checked before anything loads: ``cuda`` on a machine without one, ``cuda:7`` on a
machine with two GPUs, or a name torch does not know is a :class:`~ctxc.core.errors.CtxcError` (one
line, exit 2). ``--device-map auto|balanced|sequential`` and ``--max-memory 0=20GiB,cpu=60GiB``
are accelerate's big-model inference, passed to ``from_pretrained`` (``device_map``,
``max_memory``, ``offload_folder``); sizes are parsed by accelerate's own
``convert_file_size_to_int``. No torch import at module level: the CLI parses these first.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field

from ctxc.core.errors import CtxcError, OptionError

__all__ = [
    "DEVICE_MAPS",
    "Placement",
    "block_device_map",
    "check_on_device",
    "describe",
    "fix_mmap_threshold",
    "parse_max_memory",
    "placement_of",
    "resolve_device",
]

# accelerate's device_map strategies that ctxc exposes (accelerate also has balanced_low_0).
DEVICE_MAPS = ("auto", "balanced", "sequential")
_FORMS = "cpu, cuda, cuda:N or mps"


def resolve_device(name: str):
    """``cpu`` | ``cuda`` | ``cuda:N`` | ``mps`` -> a torch.device that is present here.

    Raises:
        CtxcError: a name torch does not take, or a device this machine does not have.
    """
    import torch

    text = str(name).strip().lower()
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise CtxcError(f"unknown device {name!r}; expected {_FORMS}")
    if kind == "cpu" and index:
        raise CtxcError(f"unknown device {name!r}; expected {_FORMS}")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CtxcError(f"device {name!r} is not available: this machine has no CUDA GPU")
        if index and int(index) >= count:
            raise CtxcError(
                f"device {name!r} is not available: this machine has {count} CUDA GPU(s) "
                f"(cuda:0 to cuda:{count - 1})"
            )
        return torch.device(f"cuda:{int(index) if index else torch.cuda.current_device()}")
    if kind == "mps" and not (torch.backends.mps.is_available()):
        raise CtxcError(f"device {name!r} is not available: this machine has no MPS device")
    return torch.device(kind)


def parse_max_memory(text: str) -> dict[int | str, int]:
    """accelerate's ``max_memory`` from ``0=20GiB,cpu=60GiB`` (GPU index, ``cpu``, ``mps``).

    Returns:
        ``{0: bytes, "cpu": bytes}``, as ``from_pretrained(max_memory=...)`` takes it.

    Raises:
        CtxcError: a malformed part (named), a GPU this machine does not have, a repeated key.
    """
    from accelerate.utils import convert_file_size_to_int

    out: dict[int | str, int] = {}
    for part in text.split(","):
        key, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not key or not size:
            raise OptionError("{max_memory}: malformed part {!r} (expected KEY=SIZE)", part.strip())
        if not (key.isdigit() or key in ("cpu", "mps")):
            raise OptionError(
                "{max_memory}: unknown device {!r} in {!r} (a GPU index, cpu or mps)",
                key,
                part.strip(),
            )
        try:
            value = convert_file_size_to_int(int(size) if size.isdigit() else size)
        except ValueError:
            value = -1
        if value <= 0:
            raise OptionError(
                "{max_memory}: bad size {!r} in {!r} (bytes, or e.g. 20GiB, 500MB)",
                size,
                part.strip(),
            )
        name: int | str = int(key) if key.isdigit() else key
        if name in out:
            raise OptionError("{max_memory}: {!r} is given twice", key)
        if isinstance(name, int):
            try:
                resolve_device(f"cuda:{name}")
            except CtxcError as exc:
                raise OptionError("{max_memory}: {!r}: {}", part.strip(), exc) from None
        out[name] = value
    return out


@dataclass(frozen=True)
class Placement:
    """How a model is loaded: on one device, or dispersed by accelerate.

    Attributes:
        device: the device name (``cpu``, ``cuda:0``...); None with a ``device_map``.
        device_map: ``auto`` | ``balanced`` | ``sequential``, or None.
        max_memory: accelerate's ``max_memory`` (GPU index or ``cpu`` -> bytes), or None.
    """

    device: str | None = None
    device_map: str | None = None
    max_memory: dict[int | str, int] | None = None
    _folder: list[str] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def parse(
        cls, device: str | None, device_map: str | None = None, max_memory: str | dict | None = None
    ) -> Placement:
        """The placement the options name, checked (a CtxcError names the bad option).

        ``max_memory``: ``0=20GiB,cpu=60GiB``, or accelerate's dict as is.
        """
        if device is not None and device_map is not None:
            raise OptionError("{device} and {device_map} are exclusive: give one")
        if max_memory is not None and device_map is None:
            raise OptionError("{max_memory} applies to {device_map}")
        if device_map is not None and device_map not in DEVICE_MAPS:
            raise OptionError(
                "{device_map}: unknown strategy {!r}; expected {}",
                device_map,
                ", ".join(DEVICE_MAPS),
            )
        name = None if device is None else str(resolve_device(device))
        memory = parse_max_memory(max_memory) if isinstance(max_memory, str) else max_memory
        return cls(name, device_map, memory)

    def load_kwargs(self) -> dict:
        """The ``from_pretrained`` keyword arguments of this placement."""
        if self.device_map is None:
            return {} if self.device in (None, "cpu") else {"device_map": self.device}
        kwargs: dict = {"device_map": self.device_map, "offload_folder": self.offload_folder()}
        if self.max_memory is not None:
            kwargs["max_memory"] = dict(self.max_memory)
        return kwargs

    def offload_folder(self) -> str:
        """A folder of this process for the weights accelerate re-saves (removed at exit)."""
        if not self._folder:
            folder = tempfile.mkdtemp(prefix="ctxc-offload-")
            atexit.register(shutil.rmtree, folder, True)
            self._folder.append(folder)
        return self._folder[0]


def fix_mmap_threshold(limit: int = 1 << 20) -> bool:
    """Make glibc's allocator hand every freed block over ``limit`` bytes back to the system.

    glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), so the
    solver's per-block weights (5 MB each on Gemma 3 270M) land in the heap, where a small
    allocation above them keeps them resident after they are freed: on some runs (it depends
    on the layout, so on the hash seed) a dispersed compile held every block's patched weights
    at once, +450 MiB. A fixed threshold turns the dynamic adjustment off (mallopt(3),
    ``M_MMAP_THRESHOLD``). Process-wide; only the placement of memory changes, no result.

    Returns:
        whether it was set (False off glibc).
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, int(limit)))


def placement_of(model) -> Placement:
    """The :class:`Placement` ``model`` was loaded with (``ctxc.load_model`` records it)."""
    return getattr(model, "ctxc_placement", None) or Placement()


def describe(model) -> tuple[str, dict[str, int]]:
    """(the device the input goes to, parameters per device: ``{"cuda:0": n, "disk": m}``).

    Offloaded parameters (on the meta device) count as ``disk``.
    """
    from ctxc.models.offload import input_device

    counts: dict[str, int] = {}
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())  # counted at their source
    for name, p in model.named_parameters():
        if name in tied:
            continue
        where = "disk" if p.device.type == "meta" else str(p.device)
        counts[where] = counts.get(where, 0) + p.numel()
    return str(input_device(model)), counts


def check_on_device(model, device: str) -> None:
    """Refuse to run ``model`` on ``device`` when it is elsewhere (one line, no move).

    Raises:
        CtxcError: the device is not present, or the model's input goes to another device.
    """
    from ctxc.models.offload import input_device

    want = resolve_device(device)
    have = input_device(model)
    if have != want and not (want.type == have.type and want.index in (None, have.index)):
        raise CtxcError(
            f"the model is on {have}, not {want}: load it there "
            f"(ctxc.load_model(..., device={str(want)!r}))"
        )


def block_device_map(directory, dtype, strategy: str, max_memory: dict | None) -> dict:
    """accelerate's device map for ``strategy``, kept at one entry per block.

    Transformers infers the map as accelerate does but merges entries that share a device: a
    model wholly offloaded becomes ``{"": "disk"}``, one hook that reads every weight at each
    forward. Kept per block (``clean_result=False``), each block's hook reads only its own.

    Args:
        directory: the model folder (its config is read; no weight is).
        dtype: the torch dtype it loads in.
        strategy: ``auto`` | ``balanced`` | ``sequential``.
        max_memory: accelerate's ``max_memory``, or None (what the machine has).

    Returns:
        module name -> device (a GPU index, ``cpu`` or ``disk``).
    """
    from accelerate import init_empty_weights
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory))
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    skeleton.tie_weights()  # a tied head goes where its embedding goes
    no_split = skeleton._no_split_modules
    if strategy == "sequential":
        memory = get_max_memory(max_memory)
    else:  # as Transformers does for auto and balanced
        memory = get_balanced_memory(
            skeleton, max_memory=max_memory, no_split_module_classes=no_split
        )
    return infer_auto_device_map(
        skeleton, max_memory=memory, no_split_module_classes=no_split, clean_result=False
    )
