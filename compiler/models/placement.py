"""Running a graph over a model dispersed across devices and disk: weights stay where they live.

A model loaded with accelerate's big-model inference (``device_map``, ``max_memory``) keeps each
block on its own GPU, on the CPU, or offloaded to disk (its parameters on the ``meta`` device,
the values in a store read at use). The graph of such a model is traced on a meta skeleton
(``compiler/models/offload.py``); its runs get their weights from here:

- a weight that lives on a device is the model's own tensor, used where it is;
- an offloaded weight is a :class:`LazyWeight`, read from its store at the op that uses it and
  dropped after it, so a run holds about one block's weights at a time;
- an op whose tensors are on several devices runs on the device of its largest tensor (a weight
  matrix): the activations move to the weights, never the weights to the activations
  (:class:`Placer`), and a device named in the graph (``arange(device=...)``, traced on the
  skeleton's ``meta``) becomes the device the run is on.

A huge offloaded matrix (Gemma 3's 262k-row embedding, tied to the head) is never read whole:
an embedding lookup reads the rows it needs and the head reads its rows in chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import torch
from torch import fx
from torch.fx.node import map_aggregate

__all__ = ["LazyWeight", "Placer", "PlacingInterpreter", "materialize"]

aten = torch.ops.aten

# Rows of an offloaded head read at once: 8192 x d_model floats (20 MB at d = 640).
_HEAD_ROWS = 8192


@dataclass(frozen=True)
class LazyWeight:
    """A weight kept out of the run's memory, read from its store when an op uses it.

    Attributes:
        name: the parameter or buffer name in ``model.state_dict()``.
        shape: its shape; ``dtype`` its dtype.
        device: where the ops that read it run (its block's execution device).
        fetch: ``fetch(rows)`` -> the tensor on ``device``; ``rows`` is None for all of it, or
            a ``(start, stop)`` range of its first dimension.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    fetch: Callable[[tuple[int, int] | None], torch.Tensor]

    def get(self) -> torch.Tensor:
        """The whole tensor, read now (the caller drops it after use)."""
        return self.fetch(None)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the first dimension, without reading the others."""
        return self.fetch((start, stop))


def materialize(value):
    """``value`` itself, or the tensor a :class:`LazyWeight` stands for (read now)."""
    return value.get() if isinstance(value, LazyWeight) else value


class Placer:
    """Puts one op's arguments where it runs; one per run (it remembers the current device).

    Args:
        start: the device the run starts on (the input ids' device).
    """

    def __init__(self, start: torch.device) -> None:
        self.current = torch.device(start)

    def special(self, target, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """An embedding lookup or a head over an offloaded weight, read by rows; else None."""
        if target == aten.embedding.default and isinstance(args[0], LazyWeight):
            weight, ids = args[0], args[1]
            rows = torch.unique(ids)  # [m]: read only the rows the ids name
            picked = torch.stack([weight.rows(int(r), int(r) + 1)[0] for r in rows])  # [m, d]
            self.current = weight.device
            index = torch.searchsorted(rows, ids).to(weight.device)  # ids -> rows of picked
            return picked[index]
        if (
            target == aten.linear.default
            and isinstance(args[1], LazyWeight)
            and args[1].shape[0] > 2 * _HEAD_ROWS
        ):
            weight = args[1]
            x = self._to(args[0], weight.device)  # [.., d]
            bias = self._to(materialize(args[2]) if len(args) > 2 else None, weight.device)
            out = [
                torch.nn.functional.linear(
                    x, weight.rows(i, min(i + _HEAD_ROWS, weight.shape[0])), None
                )
                for i in range(0, weight.shape[0], _HEAD_ROWS)
            ]  # each [.., rows]
            self.current = weight.device
            y = torch.cat(out, dim=-1)  # [.., vocab]
            return y if bias is None else y + bias
        return None

    def place(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Read the lazy weights, move every tensor to the device of the largest one, and turn
        the ``meta`` device named in the graph into the run's current device."""
        args = map_aggregate(args, materialize)
        kwargs = dict(map_aggregate(kwargs, materialize))
        tensors: list[torch.Tensor] = []
        map_aggregate((args, kwargs), lambda a: tensors.append(a) if _is_tensor(a) else None)
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            self.current = max(tensors, key=lambda t: t.numel()).device
            args = map_aggregate(args, lambda a: self._to(a, self.current))
            kwargs = dict(map_aggregate(kwargs, lambda a: self._to(a, self.current)))
        elif devices:
            self.current = next(iter(devices))
        # The skeleton's trace named ``meta`` wherever the activations were: the run's device.
        args = map_aggregate(args, self._device)
        kwargs = dict(map_aggregate(kwargs, self._device))
        return args, kwargs

    def _device(self, value):
        is_meta = isinstance(value, torch.device) and value.type == "meta"
        return self.current if is_meta else value

    @staticmethod
    def _to(value, device: torch.device):
        return value.to(device) if _is_tensor(value) and value.device != device else value


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor)


class PlacingInterpreter(fx.Interpreter):
    """An interpreter whose ops run through a :class:`Placer` when it has one.

    Args:
        gm: the graph module.
        placer: the run's placer (a dispersed model), or None: plain interpretation.
        garbage_collect_values: as for ``fx.Interpreter``.
    """

    def __init__(
        self, gm: fx.GraphModule, placer: Placer | None, garbage_collect_values: bool = True
    ) -> None:
        super().__init__(gm, garbage_collect_values=garbage_collect_values)
        self.placer = placer

    def call_function(self, target, args, kwargs):
        placer = self.placer
        if placer is None:
            return super().call_function(target, args, kwargs)
        value = placer.special(target, args, kwargs)
        if value is None:
            args, kwargs = placer.place(args, kwargs)
            value = super().call_function(target, args, kwargs)
        return value
