"""The GPU as NVML sees it (nvidia-ml-py), for the clients: ``kvtier doctor`` and ``kvtier top``.
Never imports torch; on a box without NVML every answer says why instead of failing."""
from __future__ import annotations

from typing import Any

__all__ = ["open_gpu", "open_gpus", "gpu_link", "gpu_links", "select_gpus"]


def open_gpus() -> tuple[Any, list[Any], str | None]:
    """``(pynvml, [handle of every GPU, by NVML index], None)``, or ``(None, [], why not)``."""
    try:
        import pynvml
    except ImportError:
        return None, [], "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)], None
    except Exception as exc:  # noqa: BLE001 - no driver or no device: a CPU box
        return None, [], f"no NVIDIA GPU or driver ({type(exc).__name__})"


def open_gpu() -> tuple[Any, Any, str | None]:
    """``(pynvml, handle of GPU 0, None)``, or ``(None, None, why not)``."""
    nvml, handles, why = open_gpus()
    if not handles:
        return None, None, why or "no NVIDIA GPU"
    return nvml, handles[0], None


def select_gpus(nvml: Any, handles: list[Any], visible: list[str] | tuple[str, ...] | None) -> list[int]:
    """NVML indexes of the GPUs ``CUDA_VISIBLE_DEVICES`` names (indexes, ``GPU-<uuid>`` or a
    prefix of one, ``MIG-...`` mapped to nothing); every GPU when ``visible`` is None.  NVML counts
    GPUs in PCI bus order; so does CUDA with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (set it on multi-GPU
    boxes, as vLLM's docs advise) -- otherwise CUDA's "fastest first" order may differ."""
    if visible is None:
        return list(range(len(handles)))
    uuids: list[str] = []
    for handle in handles:
        try:
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        except Exception:  # noqa: BLE001 - no UUID: match by index only
            uuids.append("")
    chosen: list[int] = []
    for entry in visible:
        entry = entry.strip()
        if entry.isdigit():
            index = int(entry)
            if index < len(handles) and index not in chosen:
                chosen.append(index)
            continue
        for index, uuid in enumerate(uuids):
            if uuid and entry.startswith("GPU-") and uuid.startswith(entry) and index not in chosen:
                chosen.append(index)
                break
    return chosen


def gpu_link(nvml: Any = None, handle: Any = None) -> dict[str, Any]:
    """GPU name and PCIe link (current and max), or ``{"present": False, "why": ...}``."""
    why = None
    if handle is None:
        nvml, handle, why = open_gpu()
    if handle is None:
        return {"present": False, "why": why}
    try:
        name = nvml.nvmlDeviceGetName(handle)
    except Exception as exc:  # noqa: BLE001 - a GPU that went away
        return {"present": False, "why": f"NVML error ({type(exc).__name__})"}
    info: dict[str, Any] = {"present": True, "name": name.decode() if isinstance(name, bytes) else name}
    for key, fn in (("gen", "nvmlDeviceGetCurrPcieLinkGeneration"), ("width", "nvmlDeviceGetCurrPcieLinkWidth"),
                    ("max_gen", "nvmlDeviceGetMaxPcieLinkGeneration"), ("max_width", "nvmlDeviceGetMaxPcieLinkWidth")):
        try:
            info[key] = int(getattr(nvml, fn)(handle))
        except Exception:  # noqa: BLE001 - some boards hide their link
            info[key] = None
    return info


def gpu_links(visible: list[str] | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """:func:`gpu_link` of each GPU ``visible`` names (``CUDA_VISIBLE_DEVICES`` entries; None: every
    GPU), each with its NVML ``index``; one ``{"present": False, "why": ...}`` on a box without any."""
    nvml, handles, why = open_gpus()
    if not handles:
        return [{"present": False, "why": why}]
    chosen = select_gpus(nvml, handles, visible)
    if not chosen:
        return [{"present": False, "why": f"CUDA_VISIBLE_DEVICES={','.join(visible or ())} names no GPU NVML sees"}]
    return [{"index": index, **gpu_link(nvml, handles[index])} for index in chosen]
