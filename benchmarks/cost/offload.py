"""A compile of the bundled Gemma 3 270M offloaded to disk, against the in-memory compile.

Runs ``ctxc compile`` twice, each in its own process: in memory, and with ``--device-map auto
--max-memory cpu=SIZE`` (accelerate offloads what does not fit to disk). Prints, against the
model's size, each process's peak resident memory and where it was reached, whether the two
patches are byte-identical, and the fidelity of each emitted ``model/`` (reloaded, placed as
compiled) against the full context, with the unpatched control beside it.

What "peak" means here (the same child process throughout):

- peak: the process's VmHWM, the most resident memory it ever held (anonymous pages and the
  file-backed pages it touched, such as a memory-mapped weight it read);
- baseline: its VmRSS after the imports (torch, transformers, accelerate, ctxc's command line
  and the model's Transformers module, resolved from config.json), before the tokenizer or any
  weight is read; "net" is peak less baseline;
- per phase (tokenizer, model load, compile, writing model/, reloading it), the VmHWM within the
  phase (reset at each phase boundary through /proc/self/clear_refs; the largest is the peak);
- net of the tokenizer: the VmHWM from the moment the tokenizer has loaded on, less the VmRSS
  at that moment (the tokenizer does not grow with the model: Gemma 3 1B to 27B share it).

    python -m benchmarks.cost.offload [--context examples/medium.txt] [--max-memory cpu=100MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _status_mib(key: str) -> float:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Phases:
    """The VmHWM of each phase of one process (VmHWM reset at each boundary), and VmRSS after.

    A call inside a phase stays in it (reloading model/ loads a model: that is the reload).
    """

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.stack = ["imports"]
        self.since_tokenizer = 0.0  # the VmHWM of everything after the tokenizer loaded

    def _close(self) -> None:
        name = self.stack[-1]
        peak = _status_mib("VmHWM")
        self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        if "tokenizer" in self.after:
            self.since_tokenizer = max(self.since_tokenizer, peak)
        self.after[name] = _status_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux proc(5))

    def enter(self, name: str) -> None:
        self._close()
        self.stack.append(name)

    def switch(self, name: str) -> None:
        """The current phase ends; ``name`` goes on in its place (the compile's own stages)."""
        self._close()
        self.stack[-1] = name

    def leave(self) -> None:
        self._close()
        self.stack.pop()

    def wrap(self, owner, attr: str, name: str, classmethod_: bool = False) -> None:
        """Make calls of ``owner.attr`` phase ``name``."""
        func = getattr(owner, attr).__func__ if classmethod_ else getattr(owner, attr)

        def phase(*args, **kwargs):
            if self.stack[-1] != "other":
                return func(*args, **kwargs)
            self.enter(name)
            stage = kwargs.get("on_stage")
            if name == "compile" and stage is not None:  # its stages: tracing, full run, ...

                def on_stage(step: str) -> None:
                    self.switch(f"compile: {step}")
                    stage(step)

                kwargs["on_stage"] = on_stage
            try:
                return func(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, attr, classmethod(phase) if classmethod_ else phase)


def child(argv: list[str], out: str) -> None:
    """In a fresh process: the baseline after the imports, then ``ctxc`` by phase."""
    import torch  # noqa: F401
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import ctxc
    import ctxc.backends.torch.check
    from ctxc.cli.app import main
    from ctxc.models.load import bundled_model_dir

    config = transformers.AutoConfig.from_pretrained(str(bundled_model_dir()))
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the model's module (code, no weights)
    phases = _Phases()
    phases.enter("other")  # everything outside the phases below
    baseline = phases.after["imports"]
    phases.wrap(transformers.AutoTokenizer, "from_pretrained", "tokenizer", classmethod_=True)
    phases.wrap(transformers.AutoModelForCausalLM, "from_pretrained", "model load", True)
    phases.wrap(ctxc, "compile", "compile")
    phases.wrap(ctxc.backends.torch.check, "emit_torch", "write model/")
    phases.wrap(ctxc.backends.torch.check, "reload_fidelity", "reload model/")
    rc = main(argv)
    phases.leave()
    figures = {
        "rc": rc,
        "baseline": baseline,
        "peaks": phases.peaks,
        "after": phases.after,
        "since_tokenizer": phases.since_tokenizer,
    }
    Path(out).write_text(json.dumps(figures))


def _run(args: list[str], tmp: Path, name: str) -> dict:
    figures = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "benchmarks.cost.offload", "--child", str(figures), "--", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(figures.read_text())


def _model_mib() -> float:
    """The bundled model's weights in MiB, from its safetensors headers (nothing loaded)."""
    from ctxc.models.load import bundled_model_dir
    from ctxc.models.offload import safetensors_header

    total = 0
    for path in bundled_model_dir().glob("*.safetensors"):
        _, header = safetensors_header(str(path))
        total += sum(
            v["data_offsets"][1] - v["data_offsets"][0] for v in header.values() if "dtype" in v
        )
    return total / 2**20


def _print_run(label: str, fig: dict, report: dict, size: float) -> None:
    peaks = fig["peaks"]
    peak = max(peaks.values())
    where = max(peaks, key=peaks.get)
    net = peak - fig["baseline"]
    tok = fig["after"].get("tokenizer", fig["baseline"])
    later = fig["since_tokenizer"]
    print(f"{label}  placement {report['placement']}")
    print(f"  peak (VmHWM)            {peak:6.0f} MiB = {peak / size:.2f} x model, in {where}")
    print(f"  baseline after imports  {fig['baseline']:6.0f} MiB")
    print(f"  peak - baseline         {net:6.0f} MiB = {net / size:.2f} x model")
    print(
        f"  net of the tokenizer    {later - tok:6.0f} MiB = {(later - tok) / size:.2f} x model "
        f"(peak after the tokenizer loaded less the {tok:.0f} MiB resident then)"
    )
    cells = "; ".join(
        f"{p} {peaks[p]:.0f} (then {fig['after'][p]:.0f})"
        for p in [*(p for p in peaks if p not in ("imports", "other")), "other"]
    )
    print(f"  phase peaks (VmHWM, then VmRSS at its end), MiB: {cells}")
    print(
        f"  emitted model/ reloaded: max |logit diff| {report['max_abs_logit_diff']:.3g}, "
        f"top-1 {report['top1_match']}; the solver's own run "
        f"{report['solver']['max_abs_logit_diff']:.3g}; "
        f"control {report['control']['max_abs_logit_diff']:.3g}; "
        f"compile {sum(report['timings'].values()):.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default=str(ROOT / "examples" / "medium.txt"))
    parser.add_argument("--max-memory", default="cpu=100MiB")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child([a for a in rest if a != "--"], args.child)
        return
    size = _model_mib()
    with tempfile.TemporaryDirectory(prefix="ctxc-offload-bench-") as name:
        tmp = Path(name)
        common = ["compile", "--context", args.context, "--emit", "torch"]
        mem = _run([*common, "--out", str(tmp / "mem")], tmp, "mem")
        placed = ["--device-map", "auto", "--max-memory", args.max_memory]
        off = _run([*common, "--out", str(tmp / "off"), *placed], tmp, "off")
        same = (tmp / "mem" / "patch.safetensors").read_bytes() == (
            tmp / "off" / "patch.safetensors"
        ).read_bytes()
        reports = {k: json.loads((tmp / k / "report.json").read_text()) for k in ("mem", "off")}
    print(f"model: bundled Gemma 3 270M, float32, {size:.0f} MiB of weights")
    print(
        "peak: the compile process's VmHWM; baseline: its VmRSS after the imports (torch, "
        "transformers, accelerate, ctxc, the model's Transformers module), before any weight"
    )
    _print_run("in memory", mem, reports["mem"], size)
    _print_run(f"offloaded ({args.max_memory})", off, reports["off"], size)
    print(f"patch.safetensors byte-identical: {same}")


if __name__ == "__main__":
    main()
