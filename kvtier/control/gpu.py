"""The GPU as NVML sees it (nvidia-ml-py), for the clients: ``kvtier doctor`` and ``kvtier top``.
Never imports torch; on a box without NVML every answer says why instead of failing."""
from __future__ import annotations

from typing import Any

__all__ = ["open_gpu", "gpu_link"]


def open_gpu() -> tuple[Any, Any, str | None]:
    """``(pynvml, handle of GPU 0, None)``, or ``(None, None, why not)``."""
    try:
        import pynvml
    except ImportError:
        return None, None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), None
    except Exception as exc:  # noqa: BLE001 - no driver or no device: a CPU box
        return None, None, f"no NVIDIA GPU or driver ({type(exc).__name__})"


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
