"""The host half of ``kvtier check --probe``: gpu devices, and capacities against RAM, GPU memory and free disk.

Memory tiers (cpu, and gpu tiers on ``device: cpu``) reserve their address space here the way they do at start
(a private anonymous mapping each, all held at once, never written, then released): a reservation the host
refuses is a failure, the tier would not start. Then they are compared with ``MemAvailable`` of
``/proc/meminfo``: pinned (page-locked) cpu tiers are allocated whole at start, so more than that fails too;
pageable ones are backed as they fill, so more than that is a warning (the host swaps or runs out later). Gpu
tiers are allocated whole on their device: more than its free memory fails. Disk quotas (summed per file system)
are compared with the space free to this user there (``os.statvfs``): more is a warning, a disk tier then fills
its file system before its quota.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from kvtier.config import CpuTierConfig, DiskTierConfig, GpuTierConfig, KvtierConfig, TierConfig, TierKind
from kvtier.config.parse import format_size
from kvtier.ops.probe import FAIL, OK, WARN, Finding

HUGE_PAGE = 2 << 20  # the slack a pageable pool maps beyond its capacity (kvtier.tiers.memory.arena.HUGE_PAGE)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty where there is none."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _keys(tiers: Sequence[tuple[int, TierConfig]]) -> str:
    return " + ".join(f"tiers[{i}].capacity" for i, _ in tiers)


def _names(tiers: Sequence[tuple[int, TierConfig]]) -> str:
    return ", ".join(t.name for _, t in tiers)


def host_capacity(cfg: KvtierConfig) -> list[Finding]:
    """Warnings where the config's memory tiers or disk quotas exceed what this host has."""
    findings = []
    memory = [(i, t) for i, t in enumerate(cfg.tiers) if t.kind is TierKind.CPU or
              (isinstance(t, GpuTierConfig) and t.device.startswith("cpu"))]
    if memory:
        findings.append(_ram(memory))
    by_fs: dict[int, list[tuple[int, DiskTierConfig]]] = {}
    for i, t in enumerate(cfg.tiers):
        if isinstance(t, DiskTierConfig):
            at = _existing(Path(t.path))
            by_fs.setdefault(os.stat(at).st_dev, []).append((i, t))
    findings.extend(_disk_space(tiers) for tiers in by_fs.values())
    return findings


def reserve(sizes: Sequence[int]) -> tuple[int, OSError] | None:
    """Reserve ``sizes`` bytes of address space at once, as pageable memory tiers do at start (nothing written,
    nothing made resident), then release them; the index of the first the host refuses, and why, or None."""
    held: list[mmap.mmap] = []
    try:
        for i, size in enumerate(sizes):
            try:
                held.append(mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
            except (OSError, OverflowError) as exc:
                return i, exc if isinstance(exc, OSError) else OSError(str(exc))
        return None
    finally:
        for m in held:
            m.close()


def _ram(tiers: Sequence[tuple[int, TierConfig]]) -> Finding:
    info = meminfo()
    want = sum(t.capacity for _, t in tiers)
    key, name = _keys(tiers), _names(tiers)
    have = (f"{format_size(info['MemAvailable'])} available of {format_size(info.get('MemTotal', 0))}, "
            f"swap {format_size(info.get('SwapTotal', 0))}") if "MemAvailable" in info else "RAM unknown"
    refused = reserve([t.capacity for _, t in tiers])
    if refused is not None:
        i, t = tiers[refused[0]]
        return Finding(f"tiers[{i}].capacity", t.name, FAIL, f"this host refuses to reserve "
                       f"{format_size(t.capacity)} for tier {t.name!r} ({refused[1].strerror or refused[1]}; "
                       f"{have}): the tier would not start; lower the capacity")
    if "MemAvailable" not in info:
        return Finding(key, name, WARN, "cannot read /proc/meminfo: memory capacity not checked")
    avail = info["MemAvailable"]
    if want <= avail:
        return Finding(key, name, OK, f"memory tiers take {format_size(want)} of RAM ({have})")
    pinned = _pinned(tiers)
    if sum(t.capacity for _, t in pinned) > avail:
        return Finding(_keys(pinned), _names(pinned), FAIL, f"pinned cpu tiers take "
                       f"{format_size(sum(t.capacity for _, t in pinned))}, allocated whole at start: more than "
                       f"this host's RAM ({have}), the tier would not start; lower the capacity or set pin_memory: "
                       f"false")
    return Finding(key, name, WARN, f"memory tiers take {format_size(want)}, more than this host's RAM ({have}); "
                   f"they start (memory is used as they fill) but the host swaps or runs out: lower the capacity")


def _pinned(tiers: Sequence[tuple[int, TierConfig]]) -> list[tuple[int, TierConfig]]:
    """The cpu tiers that pin their memory here (pin_memory true or unset, and CUDA present: torch decides)."""
    maybe: list[tuple[int, TierConfig]] = [(i, t) for i, t in tiers
                                           if isinstance(t, CpuTierConfig) and t.pin_memory is not False]
    if not maybe:
        return []
    try:
        import torch
    except ImportError:
        return []
    return maybe if torch.cuda.is_available() else []


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (a disk tier creates its directory at start)."""
    at = path
    while not at.exists() and at.parent != at:
        at = at.parent
    return at


def _disk_space(tiers: Sequence[tuple[int, DiskTierConfig]]) -> Finding:
    """Quotas of the disk tiers on one file system against its space free to this user."""
    at = _existing(Path(tiers[0][1].path))
    st = os.statvfs(at)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    want = sum(t.capacity for _, t in tiers)
    key, name = _keys(tiers), _names(tiers)
    have = f"{format_size(free)} free of {format_size(size)} at {at}"
    if want > free:
        return Finding(key, name, WARN, f"disk quota {format_size(want)} is more than the free space ({have}; "
                       f"records already there count as used): lower the capacity or free some space")
    return Finding(key, name, OK, f"disk quota {format_size(want)} fits ({have})")


def probe_gpus(tiers: Sequence[tuple[str, GpuTierConfig]]) -> list[Finding]:
    """Each gpu tier's device exists, and the tiers on one CUDA device fit its free memory."""
    from kvtier.ops.progress import loading

    try:
        with loading("kvtier check --probe", "torch", transient=True):  # seconds: say so on a terminal
            import torch
    except ImportError:
        return [Finding(f"{p}.device", t.name, FAIL, "torch is not installed: a gpu tier needs it "
                        "(pip install torch)") for p, t in tiers]
    findings: list[Finding] = []
    per_device: dict[int, list[tuple[str, GpuTierConfig]]] = {}
    for path, tier in tiers:
        key = f"{path}.device"
        try:
            dev = torch.device(tier.device)
        except RuntimeError as exc:
            findings.append(Finding(key, tier.name, FAIL, f"bad device {tier.device!r}: {exc} (use e.g. cuda:0)"))
            continue
        if dev.type == "cpu":
            findings.append(Finding(key, tier.name, OK, "device cpu: a gpu tier in host memory (counted as RAM)"))
        elif dev.type != "cuda":
            findings.append(Finding(key, tier.name, WARN, f"device type {dev.type} is not probed"))
        elif not torch.cuda.is_available():
            findings.append(Finding(key, tier.name, FAIL, f"device {dev} does not exist: torch {torch.__version__} "
                                    "sees no CUDA GPU here (run on a GPU host, or use a cpu tier)"))
        elif (dev.index or 0) >= torch.cuda.device_count():
            findings.append(Finding(key, tier.name, FAIL, f"device {dev} does not exist: this host has "
                                    f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                                    f"cuda:{torch.cuda.device_count() - 1} (set {key})"))
        else:
            findings.append(Finding(key, tier.name, OK, f"device {dev}: {torch.cuda.get_device_name(dev)}"))
            per_device.setdefault(dev.index or 0, []).append((path, tier))
    for index, on_device in per_device.items():
        findings.append(_gpu_memory(index, on_device))
    return findings


def _gpu_memory(index: int, tiers: Sequence[tuple[str, GpuTierConfig]]) -> Finding:
    import torch

    free, total = torch.cuda.mem_get_info(index)
    want = sum(t.capacity for _, t in tiers)
    key = " + ".join(f"{p}.capacity" for p, _ in tiers)
    name = ", ".join(t.name for _, t in tiers)
    have = f"{format_size(free)} free of {format_size(total)} on cuda:{index}"
    if want > free:  # allocated whole at start
        return Finding(key, name, FAIL, f"gpu tiers take {format_size(want)}, more than the device has free "
                       f"({have}): the tier would not start; lower the capacity")
    return Finding(key, name, OK, f"gpu tiers take {format_size(want)} ({have})")
