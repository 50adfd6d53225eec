"""What the engine process reports about where it runs, and what it asks of the kernel (AMX).

It reports the hardware, the peak memory, the model snapshot it loaded and how busy the rest of
the machine was while it loaded; the one thing it asks of the kernel, before the engine starts,
is AMX.

Runs inside the candidate's environment: standard library only (torch is looked at only when
the engine already imported it).
"""

from __future__ import annotations

import os
import platform
import resource
import sys

from regress.engine.protocol import Hardware, MemoryUsage


def hardware() -> Hardware:
    """CPU, RAM, GPUs and platform of this machine."""
    cpu_model = None
    memory_gib = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    memory_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    gpus: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_model": cpu_model or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpus": gpus,
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


def cpu_seconds() -> tuple[float | None, float]:
    """(The whole machine's busy CPU seconds since boot, all CPUs, from ``/proc/stat``: None
    where it cannot be read; this process's own CPU seconds, all its threads)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    mine = own.ru_utime + own.ru_stime
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
        # cpu  user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
        ticks = [int(v) for v in fields[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None, mine
    return busy, mine


def cores_beside(before: tuple[float | None, float], after: tuple[float | None, float], wall_s: float) -> float | None:
    """How many cores the rest of the machine kept busy between two :func:`cpu_seconds`
    readings ``wall_s`` apart: its busy time less this process's own, over the wall time (None
    where the machine's time is unknown or no time passed)."""
    if before[0] is None or after[0] is None or wall_s <= 0:
        return None
    return round(max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s, 2)


def memory() -> MemoryUsage:
    """Peak resident memory of this process, and peak GPU memory when on a GPU."""
    peak_gpu = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        peak_gpu = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    # ru_maxrss is in KiB on Linux.
    return {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "peak_gpu_mib": peak_gpu}


def resolve_hub_snapshot(model: str, revision: str | None) -> str | None:
    """The local directory of ``model``: itself, or its Hugging Face cache snapshot (None if not cached)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:
        return None


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile permission before the engine runs (x86 CPUs with AMX only).

    vLLM's CPU attention kernel executes AMX tile instructions (bf16, block size a multiple
    of 32) without requesting the permission itself (arch_prctl ARCH_REQ_XCOMP_PERM); it only
    works when oneDNN happened to request it first. Otherwise the process dies with SIGILL at
    ``tilezero`` (seen deterministically for a batch holding one short prompt). Requesting the
    permission changes no numerics: the same kernel runs, it just no longer faults.
    Set REGRESS_INIT_AMX=0 to skip.
    """
    if os.environ.get("REGRESS_INIT_AMX", "1") == "0":
        return False
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            return bool(torch.cpu._init_amx())
    except Exception:  # older torch without these helpers, or not x86
        return False
    return False
