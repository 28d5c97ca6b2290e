"""What vLLM accepts as a LoRA adapter, checked structurally on a written PEFT folder.

Not a vLLM run: the rules vLLM applies when it loads an adapter, read from its source
(vllm-project/vllm):

- ``vllm/lora/peft_helper.py`` (``PEFTHelper``): ``r``, ``lora_alpha`` and ``target_modules``
  are required; ``modules_to_save`` must be None ("vLLM only supports modules_to_save being
  None"); no DoRA; a ``bias`` other than ``none`` is refused; ``r`` above the server's
  ``max_lora_rank`` is refused. Every module is scaled by ``lora_alpha / r``: vLLM reads no
  ``rank_pattern``/``alpha_pattern``, so a module of another rank would be scaled wrongly.
- ``vllm/config/lora.py``: ``max_lora_rank`` is one of ``MaxLoRARanks`` (1 ... 512).
- ``vllm/lora/lora_model.py`` (``from_local_checkpoint``/``check_unexpected_modules``): every
  tensor name parses as ``base_model.model.<module>.lora_A|lora_B.weight``
  (``vllm/lora/utils.py`` ``parse_fine_tuned_lora_name``) and the module's last name is one
  of the model's LoRA modules, its ``packed_modules_mapping`` unpacked (for Llama, Mistral,
  Qwen 2/3, Gemma 1-3 and OLMo 2: ``qkv_proj`` -> q/k/v_proj, ``gate_up_proj`` ->
  gate/up_proj, and ``o_proj``, ``down_proj``; ``vllm/model_executor/models/llama.py``,
  ``gemma3.py``, ``olmo2.py`` (``Olmo2ForCausalLM(nn.Module, SupportsPP, SupportsLoRA)``)).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ctxc.backends.peft.facts import MAX_LORA_RANKS
from ctxc.core.errors import CtxcError

__all__ = ["MAX_LORA_RANKS", "VLLM_MODULES", "VllmCheck", "check_vllm_adapter"]

_DENSE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
VLLM_MODULES = {
    t: _DENSE
    for t in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "olmo2",
    )
}
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class VllmCheck:
    """The adapter as vLLM would see it.

    Attributes:
        r: the adapter's rank (every module's).
        max_lora_rank: the smallest ``--max-lora-rank`` a vLLM server needs to load it.
        modules: LoRA modules (each an A/B pair).
        module_names: the distinct last names of the modules (``down_proj``, ...).
        rules: the rules checked, in words.
    """

    r: int
    max_lora_rank: int
    modules: int
    module_names: tuple[str, ...]
    rules: str

    def to_dict(self) -> dict:
        return asdict(self)


def _fail(why: str) -> CtxcError:
    return CtxcError(f"the LoRA adapter breaks vLLM's adapter rules: {why}")


def check_vllm_adapter(folder: Path, model: torch.nn.Module) -> VllmCheck:
    """Check ``folder`` (``adapter_config.json``, ``adapter_model.safetensors``) against vLLM's
    adapter rules for ``model``'s architecture.

    Args:
        folder: a PEFT adapter folder.
        model: its base model (module shapes, ``config.model_type``).

    Returns:
        the :class:`VllmCheck`.

    Raises:
        CtxcError: the first rule broken, named.
    """
    from safetensors import safe_open

    cfg = json.loads((folder / "adapter_config.json").read_text())
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in VLLM_MODULES:
        raise _fail(f"ctxc does not know vLLM's LoRA module names for model type {model_type!r}")
    r = cfg.get("r")
    if (
        not isinstance(r, int)
        or r < 1
        or not cfg.get("lora_alpha")
        or not cfg.get("target_modules")
    ):
        raise _fail("r, lora_alpha and target_modules are required (PEFTHelper)")
    for key, ok in (
        ("modules_to_save", not cfg.get("modules_to_save")),
        ("bias", cfg.get("bias", "none") == "none"),
        ("use_dora", not cfg.get("use_dora")),
        ("rank_pattern", not cfg.get("rank_pattern")),
        ("alpha_pattern", not cfg.get("alpha_pattern")),
        ("target_parameters", not cfg.get("target_parameters")),
    ):
        if not ok:
            raise _fail(f"{key} is {cfg.get(key)!r}; vLLM needs it empty or none")
    if r > MAX_LORA_RANKS[-1]:
        raise _fail(f"rank {r} exceeds vLLM's largest max_lora_rank {MAX_LORA_RANKS[-1]}")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            m = _KEY.match(key)
            if m is None:
                raise _fail(f"tensor {key} is not a lora_A/lora_B weight")
            pairs.setdefault(m["module"], {})[m["ab"]] = tuple(f.get_slice(key).get_shape())
    allowed = VLLM_MODULES[model_type]
    for module, ab in pairs.items():
        last = module.rsplit(".", 1)[-1]
        if last not in allowed:
            raise _fail(f"module {module}: {last} is not a {model_type} LoRA module in vLLM")
        out_f, in_f = model.get_parameter(f"{module}.weight").shape
        if ab.get("A") != (r, in_f) or ab.get("B") != (out_f, r):
            raise _fail(
                f"module {module}: lora_A {ab.get('A')}, lora_B {ab.get('B')}, "
                f"want ({r}, {in_f}) and ({out_f}, {r})"
            )
    return VllmCheck(
        r=r,
        max_lora_rank=next(k for k in MAX_LORA_RANKS if k >= r),
        modules=len(pairs),
        module_names=tuple(sorted({m.rsplit(".", 1)[-1] for m in pairs})),
        rules="structural (not a vLLM run): no modules_to_save, bias none, no DoRA, one rank "
        "(no rank/alpha pattern), r <= 512, only lora_A/lora_B tensors of vLLM's module names",
    )
