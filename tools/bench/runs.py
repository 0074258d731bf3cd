"""What a benchmark run records besides its figures: the model's work seen from hooks on the
model itself, min and median timings, the exact command line, and the machine with its load.

`ForwardCounter` hooks the top-level model (every forward: the window's encodes, in-context and
conditioned passes, queries, decoding, whole-window passes, and a plain re-prefill) and the vision
tower, so a benchmark can check the window's own counters (`WindowStats`) against what the model
actually ran, and count the work of baselines that do not go through a window.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import torch


def vision_tower(model: Any) -> Any:
    """The vision-tower module of a Qwen-VL model (`model.model.visual`), or None."""
    inner = getattr(model, "model", None)
    return getattr(inner, "visual", None)


class ForwardCounter:
    """Counts the forwards of `model` and the tokens they read, and the vision tower's runs.

    Use as a context manager (hooks are removed on exit); `snapshot()` returns the counts so far
    and `since(snapshot)` the counts after one. Tokens are the token rows each top-level forward
    computes: batch × sequence length of `input_ids` (or of `inputs_embeds`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.forwards = 0
        self.tokens = 0
        self.vision_runs = 0
        self._handles: list[Any] = []

    def _on_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
            n = 0 if ids is None else int(ids.shape[0]) * int(ids.shape[1])
        else:
            n = int(ids.numel())
        self.forwards += 1
        self.tokens += n

    def _on_vision(self, module: Any, args: tuple) -> None:
        self.vision_runs += 1

    def __enter__(self) -> "ForwardCounter":
        self._handles.append(self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        tower = vision_tower(self.model)
        if tower is not None:
            self._handles.append(tower.register_forward_pre_hook(self._on_vision))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def snapshot(self) -> dict[str, int]:
        return {"forwards": self.forwards, "tokens": self.tokens, "vision_runs": self.vision_runs}

    def since(self, before: dict[str, int]) -> dict[str, int]:
        now = self.snapshot()
        return {k: now[k] - before[k] for k in now}


def timing(times: Sequence[float]) -> dict[str, Any]:
    """min and median seconds of repeated runs, with the raw times."""
    if not times:
        raise ValueError("no timed runs")
    return {"min_s": min(times), "median_s": statistics.median(times), "runs": [float(t) for t in times]}


def command_of(prog: str, args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None]) -> str:
    """The command line that reproduces `args`: `prog` plus every option whose value differs from
    its default, in the parser's order."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = [prog]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or action.default == argparse.SUPPRESS:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        else:
            words += [flag, str(value)]
    return " ".join(words)


def machine() -> dict[str, Any]:
    """The machine's CPUs, platform and torch version (load averages are recorded by the caller)."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "torch": torch.__version__}


def bf16_path() -> dict[str, Any]:
    """What the bf16 noise floor depends on here: the oneDNN instruction-set cap (environment),
    whether torch uses oneDNN, torch's CPU capability and the CPU's bf16 / AVX flags."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((set(line.split(":", 1)[1].split()) for line in fh if line.startswith("flags")), set())
    except OSError:
        pass
    return {"onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
            "mkldnn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "cpu_flags": sorted(flags & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"})}


def describe_bf16_path(path: dict[str, Any]) -> str:
    """`bf16_path()` in words for a page: the floor moves with it (AMX and AVX-512 bf16 kernels round
    differently), so a page names the one it ran on. Older results record fewer fields."""
    mkldnn = {True: "on", False: "off"}.get(path.get("mkldnn"), "unrecorded")
    flags = path.get("cpu_flags")
    return (f"oneDNN {mkldnn} with instruction-set cap {path.get('onednn_max_cpu_isa') or 'unset'}, torch's CPU "
            f"capability {path.get('cpu_capability', 'unrecorded')}, CPU flags "
            + ("unrecorded" if flags is None else ", ".join(flags) or "none of the bf16 / AVX ones"))


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def kinds(forward_tokens: dict[str, int]) -> dict[str, int]:
    """Forwarded tokens by kind with zero kinds dropped, in `FORWARD_KINDS` order (then others)."""
    from agentwin.window_stats import FORWARD_KINDS

    order = [k for k in FORWARD_KINDS if forward_tokens.get(k)] + \
        sorted(k for k in forward_tokens if k not in FORWARD_KINDS and forward_tokens[k])
    return {k: int(forward_tokens[k]) for k in order}


def write_results(data: dict, render: Callable[[dict], str], json_path: str | None, page_path: str | None,
                  page_name: str, log: Callable[[str], None] = print) -> str:
    """Print and write a benchmark's results: the page is rendered from the JSON as written (so it
    shows exactly what the file holds); it goes to `page_path`, or to `page_name` beside the JSON
    file when only that is given. Returns the page's text."""
    encoded = json.dumps(data, indent=1)
    text = render(json.loads(encoded))
    log("\n" + text)
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(encoded + "\n")
        log(f"figures written to {json_path}")
    page = page_path or (os.path.join(os.path.dirname(json_path), page_name) if json_path else None)
    if page:
        with open(page, "w") as fh:
            fh.write(text)
        log(f"page written to {page}")
    return text


def device_time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean milliseconds per call (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)
