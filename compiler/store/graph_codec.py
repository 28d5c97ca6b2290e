"""A traced graph and its block map as plain JSON data, and back (the export cache's format).

``torch.export.save``/``load`` keep everything, but loading re-creates a fake tensor with
symbolic sizes for every node (measured on the bundled Gemma: 20 s, longer than the export
itself). The solver needs less: the graph's ops and arguments, each node's module path
(``nn_module_stack``) and the located blocks. This codec keeps exactly that. It refuses, with
:class:`Unstorable`, anything it cannot write back identically; the caller then simply does not
cache. Decoding resolves ops only through ``torch.ops`` and a short list of Python modules,
never by importing a name the file chooses.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib

import torch
from torch import fx

from ctxc.passes.locate import block_map

__all__ = ["Unstorable", "decode_blocks", "decode_graph", "encode_blocks", "encode_graph"]

# Modules whose functions a graph may call besides torch.ops (shape arithmetic, getitem).
_PY_MODULES = frozenset({"_operator", "operator", "math", "builtins", "torch"})
# Types of the block map, by name: the only classes decoding builds.
_TYPES = {
    name: getattr(block_map, name)
    for name in block_map.__all__
    if isinstance(getattr(block_map, name), type)
}
_SCALARS = (torch.dtype, torch.memory_format, torch.layout)


class Unstorable(ValueError):
    """The graph or block map holds something the codec cannot write back identically."""


# -- graph ------------------------------------------------------------------------------------


def encode_graph(gm: fx.GraphModule) -> dict:
    """The graph of ``gm`` (and of its sub-graphs, e.g. autocast regions) as JSON data.

    Raises:
        Unstorable: an op, argument or attribute the codec does not know.
    """
    nodes, subs = [], {}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            raise Unstorable(f"{node.op} node {node.name}")
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if not isinstance(sub, fx.GraphModule):
                raise Unstorable(f"get_attr of a non-graph {node.target}")
            subs[node.target] = encode_graph(sub)
        stack = node.meta.get("nn_module_stack") or {}
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": _encode_target(node),
                "args": _encode_arg(node.args),
                "kwargs": {k: _encode_arg(v) for k, v in node.kwargs.items()},
                "stack": {k: [v[0], _type_name(v[1])] for k, v in stack.items()},
            }
        )
    return {"nodes": nodes, "subs": subs}


def decode_graph(data: dict) -> fx.GraphModule:
    """The ``GraphModule`` of :func:`encode_graph`'s data (node names and module paths kept).

    Raises:
        Unstorable: the data names an unknown op, or a node name could not be kept.
    """
    root = torch.nn.Module()
    for name, sub in data["subs"].items():
        root.add_module(name, decode_graph(sub))
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for item in data["nodes"]:
        op, name = item["op"], item["name"]
        target = item["target"] if op != "call_function" else _decode_target(item["target"])
        args = _decode_arg(item["args"], env)
        kwargs = {k: _decode_arg(v, env) for k, v in item["kwargs"].items()}
        node = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if node.name != name:
            raise Unstorable(f"node {name} would be renamed {node.name}")
        if item["stack"]:
            node.meta["nn_module_stack"] = {k: tuple(v) for k, v in item["stack"].items()}
        env[name] = node
    return fx.GraphModule(root, graph)


def _type_name(typ) -> str:
    if isinstance(typ, type):
        return f"{typ.__module__}.{typ.__qualname__}"
    return str(typ)


def _encode_target(node: fx.Node):
    if node.op != "call_function":
        return node.target
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return {"ns": t.namespace, "op": t._schema.name.split("::")[-1], "ov": t._overloadname}
    if isinstance(t, torch._ops.HigherOrderOperator):
        return {"hop": t.name()}
    module, qual = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
    if module in _PY_MODULES and qual and _resolve_py(module, qual) is t:
        return {"py": module, "qual": qual}
    raise Unstorable(f"call of {t!r}")


def _decode_target(data: dict):
    try:
        if "hop" in data:
            return getattr(torch.ops.higher_order, data["hop"])
        if "py" in data:
            return _resolve_py(data["py"], data["qual"])
        return getattr(getattr(getattr(torch.ops, data["ns"]), data["op"]), data["ov"])
    except (AttributeError, KeyError, RuntimeError) as exc:
        raise Unstorable(f"unknown op {data}") from exc


def _resolve_py(module: str, qual: str):
    if module not in _PY_MODULES:
        raise Unstorable(f"module {module} is not allowed")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_arg(a):
    if isinstance(a, fx.Node):
        return {"n": a.name}
    if a is None or isinstance(a, bool | int | float | str):
        return a
    if isinstance(a, list | tuple):
        return {"t" if isinstance(a, tuple) else "l": [_encode_arg(x) for x in a]}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, _SCALARS):
        return {"torch": str(a).removeprefix("torch.")}
    if isinstance(a, slice):
        return {"slice": [_encode_arg(x) for x in (a.start, a.stop, a.step)]}
    if isinstance(a, dict):
        if not all(isinstance(k, str) for k in a):
            raise Unstorable("a dict argument with non-string keys")
        return {"d": {k: _encode_arg(v) for k, v in a.items()}}
    raise Unstorable(f"argument of type {type(a).__name__}")


def _decode_arg(a, env: dict[str, fx.Node]):
    if not isinstance(a, dict):
        return a
    if "n" in a:
        return env[a["n"]]
    if "t" in a:
        return tuple(_decode_arg(x, env) for x in a["t"])
    if "l" in a:
        return [_decode_arg(x, env) for x in a["l"]]
    if "device" in a:
        return torch.device(a["device"])
    if "torch" in a:
        value = getattr(torch, a["torch"], None)
        if not isinstance(value, _SCALARS):
            raise Unstorable(f"unknown torch constant {a['torch']}")
        return value
    if "slice" in a:
        return slice(*(_decode_arg(x, env) for x in a["slice"]))
    if "d" in a:
        return {k: _decode_arg(v, env) for k, v in a["d"].items()}
    raise Unstorable(f"unknown argument {a}")


# -- block map --------------------------------------------------------------------------------


def encode_blocks(blocks: block_map.BlockMap) -> dict:
    """The block map as JSON data.

    Raises:
        Unstorable: it does not decode back to an equal block map.
    """
    data = _encode_value(blocks)
    if decode_blocks(data) != blocks:
        raise Unstorable("the block map does not survive a round trip")
    return data


def decode_blocks(data) -> block_map.BlockMap:
    """The :class:`BlockMap` of :func:`encode_blocks`'s data (only block map types are built)."""
    blocks = _decode_value(data)
    if not isinstance(blocks, block_map.BlockMap):
        raise Unstorable("not a block map")
    return blocks


def _encode_value(v):
    if isinstance(v, enum.Enum):
        return {"enum": type(v).__name__, "v": v.value}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        if _TYPES.get(type(v).__name__) is not type(v):
            raise Unstorable(f"a {type(v).__name__} in the block map")
        fields = {f.name: _encode_value(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return {"dc": type(v).__name__, "f": fields}
    if isinstance(v, tuple | list):
        return {"t" if isinstance(v, tuple) else "l": [_encode_value(x) for x in v]}
    if isinstance(v, dict):
        return {"d": [[_encode_value(k), _encode_value(x)] for k, x in v.items()]}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise Unstorable(f"a {type(v).__name__} in the block map")


def _decode_value(v):
    if not isinstance(v, dict):
        return v
    if "enum" in v:
        return _known(v["enum"])(v["v"])
    if "dc" in v:
        return _known(v["dc"])(**{k: _decode_value(x) for k, x in v["f"].items()})
    if "t" in v:
        return tuple(_decode_value(x) for x in v["t"])
    if "l" in v:
        return [_decode_value(x) for x in v["l"]]
    if "d" in v:
        return {_decode_value(k): _decode_value(x) for k, x in v["d"]}
    raise Unstorable(f"unknown value {v}")


def _known(name: str) -> type:
    typ = _TYPES.get(name)
    if typ is None:
        raise Unstorable(f"unknown type {name}")
    return typ
