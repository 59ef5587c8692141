"""``kvtier doctor``: what this box's links and disks mean for reloading KV versus recomputing it.

Box facts (GPU and PCIe link from NVML, the NVMe directory's filesystem, free space and O_DIRECT
support, the memlock limit for pinned memory), measured bandwidths, the model's KV bytes per
token, and, from a running server's cost model, the break-even prompt length per tier; the vLLM
installed (the CLI passes ``kvtier.plugins.vllm.compat``'s view of it and the API check's verdict:
the core never imports the connector). Warnings are plain sentences with the numbers that back them.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path
from typing import Any

from kvtier.control.gpu import gpu_links

__all__ = ["run_doctor", "kv_bytes_per_token"]

REFERENCE_TOKENS = 200_000  # the seed's long code context


def _filesystem(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``path``, from /proc/mounts."""
    best, fstype = "/", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1].rstrip("/") + "/") or \
                    (len(parts) >= 3 and str(path) == parts[1]):
                if len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return best, fstype


def disk_report(directory: Path) -> dict[str, Any]:
    from kvtier.tiers.nvme.store import probe_direct_io

    directory.mkdir(parents=True, exist_ok=True)
    mount, fstype = _filesystem(directory.resolve())
    usage = shutil.disk_usage(directory)
    return {"dir": str(directory), "mount": mount, "filesystem": fstype, "free_bytes": usage.free,
            "total_bytes": usage.total, "o_direct": probe_direct_io(directory)}


def kv_bytes_per_token(model_path: str | None) -> dict[str, Any]:
    """From a model directory's config.json (or the demo model): layers x 2 x kv heads x head dim x
    dtype size."""
    from kvtier.models.demo import ensure_demo_model

    path = Path(model_path) if model_path else ensure_demo_model("tiny", progress=lambda _m: None)
    config_file = path / "config.json"
    if not config_file.is_file():
        from kvtier.errors import UsageError

        raise UsageError(f"{path} has no config.json", hint="give a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    layers = int(config["num_hidden_layers"])
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    size = 4 if "32" in dtype else 2
    return {"model": str(path), "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype,
            "bytes_per_token": 2 * layers * kv_heads * head_dim * size,
            "bytes_per_token_fp8": 2 * layers * kv_heads * head_dim,
            "max_context": config.get("max_position_embeddings")}


def _link_warnings(gpu: dict[str, Any], reload_dram_s: float, name_it: bool) -> list[str]:
    """A GPU's PCIe link below what its card can do, or slow enough that reloading loses."""
    if not gpu.get("present") or not gpu.get("gen"):
        return []
    which = f"GPU {gpu.get('index')}: " if name_it else ""
    out = []
    if gpu.get("max_gen") and (gpu["gen"] < gpu["max_gen"] or (gpu.get("width") or 0) < (gpu.get("max_width") or 0)):
        out.append(f"{which}PCIe runs at gen{gpu['gen']} x{gpu['width']} (the card can do gen{gpu['max_gen']} "
                   f"x{gpu['max_width']}): check the slot and BIOS settings")
    if gpu["gen"] <= 3 and (gpu.get("width") or 16) <= 4:
        out.append(f"{which}PCIe gen{gpu['gen']} x{gpu['width']} is a slow link: reloading a 200k-token session "
                   f"takes {reload_dram_s:.1f} s from DRAM")
    return out


def shared_report(url: str, auth_file: str | None = None, quick: bool = False) -> dict[str, Any]:
    """The shared store measured from here: round trip, read rate of one large value, its memory and
    eviction policy; ``problem`` when it cannot be reached or refuses the credentials."""
    from kvtier.tiers.shared.store import SharedConfig, SharedStore, SharedUnavailable, parse_shared_url

    store = SharedStore(SharedConfig(parse_shared_url(url), timeout_s=2.0, auth_file=auth_file))
    client = store.client
    out: dict[str, Any] = {"url": client.url}
    try:
        bps, rtt = client.measure(nbytes=(4 if quick else 32) << 20)
        out.update(read_gbps=bps / 1e9, rtt_ms=rtt * 1e3, server=client.server_info(), cluster=client.cluster)
    except SharedUnavailable as exc:
        out["problem"] = str(exc)
    finally:
        store.close()
    return out


def drive_reports(drives: list[Path], quick: bool) -> list[dict[str, Any]]:
    """Each drive's filesystem, free space and O_DIRECT; with several, each one's read rate on its
    own (``measure_rates`` then gives all of them at once: the cost model's figure)."""
    reports = [disk_report(d) for d in drives]
    if len(drives) > 1:
        from kvtier.plan.costmodel import measure_nvme_read_bps

        for drive in reports:
            drive["read_gbps"] = measure_nvme_read_bps(drive["dir"], (16 if quick else 64) << 20)[0] / 1e9
    return reports


def _drive_warnings(drives: list[dict[str, Any]]) -> list[str]:
    warnings = []
    for nvme in drives:
        where = nvme["dir"]
        if nvme["filesystem"] in ("tmpfs", "ramfs"):
            warnings.append(f"{where} is on {nvme['filesystem']}: the 'NVMe' tier would use RAM and not survive "
                            "a reboot")
        if not nvme["o_direct"]:
            warnings.append(f"{where} does not support O_DIRECT: kvtier falls back to buffered IO + fsync "
                            "(the page cache then holds a second copy)")
    mounts = [d["mount"] for d in drives]
    if len(set(mounts)) < len(mounts):
        warnings.append("several --nvme-dir directories are on one filesystem: they share one disk's bandwidth")
    return warnings


def run_doctor(nvme_dir: str | None, model_path: str | None, caps: dict[str, float], server: dict | None,
               quick: bool = False, gpus: list[str] | None = None, shared: str | None = None,
               shared_auth_file: str | None = None, codecs: dict[str, str] | None = None,
               vllm: dict[str, Any] | None = None) -> dict[str, Any]:
    """``gpus``: the GPUs to report, as ``CUDA_VISIBLE_DEVICES`` names them (default: that variable,
    else every GPU); the host-to-device rate is measured on the first of them. ``codecs``: the
    configured codec per tier ({"warm": spec, "cold": spec}), checked against the needle figures
    when no server answers (a server's own warnings say it for its codecs and context length).
    ``vllm``: the installed vLLM (version, tested, range, status, note, api_check), reported as is."""
    from kvtier.plan.costmodel import GB, measure_rates

    if gpus is None and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        gpus = [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    links = gpu_links(gpus)
    report: dict[str, Any] = {"gpu": links[0], "gpus": links}
    from kvtier.tiers.nvme.drives import drive_dirs

    drives = [Path(d) for d in drive_dirs(nvme_dir)]  # one --nvme-dir per drive
    if drives:
        report["drives"] = drive_reports(drives, quick)
        report["nvme"] = report["drives"][0]
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    report["memlock_bytes"] = None if soft == resource.RLIM_INFINITY else soft
    rates = measure_rates(nvme_dir if drives else None, caps, quick=quick)
    report["rates"] = {"host_to_device_gbps": rates.host_to_device_bps / GB, "nvme_read_gbps": rates.nvme_read_bps / GB,
                       "sources": rates.source}
    kv = kv_bytes_per_token(model_path)
    report["kv"] = kv
    per_token = kv["bytes_per_token"]
    reload = {"dram": REFERENCE_TOKENS * per_token / rates.host_to_device_bps,
              "nvme": REFERENCE_TOKENS * per_token * (1 / rates.nvme_read_bps + 1 / rates.host_to_device_bps)}
    if shared:
        report["shared"] = shared_report(shared, shared_auth_file, quick)
        if "read_gbps" in report["shared"]:  # one pipeline: one round trip, then the bytes
            reload["shared"] = report["shared"]["rtt_ms"] / 1e3 + REFERENCE_TOKENS * per_token * (
                1 / (report["shared"]["read_gbps"] * GB) + 1 / rates.host_to_device_bps)
    report["reload_200k_s"] = reload
    report["server"] = server
    warnings: list[str] = []
    for link in links:
        warnings += _link_warnings(link, reload["dram"], len(links) > 1)
    gpu = report["gpu"]
    warnings += _drive_warnings(report.get("drives", []))
    if gpu.get("present") and report["memlock_bytes"] is not None and report["memlock_bytes"] < (1 << 30):
        warnings.append(f"memlock limit is {report['memlock_bytes'] >> 20} MiB: pinned DRAM may fail; raise it "
                        "(ulimit -l unlimited, or LimitMEMLOCK=infinity in the service unit)")
    cost = (server or {}).get("costmodel") or {}
    if cost.get("available") and cost.get("prefill"):
        even = cost["break_even_tokens"]
        for tier in ("dram", "nvme"):
            if even.get(tier) is None:
                warnings.append(f"loading from {tier.upper()} never beats recomputing on this box (up to 2M "
                                f"tokens): kvtier will recompute hits held there")
    elif server is None:
        warnings.append("no server: recompute speed is unknown (start `kvtier serve` and serve one prompt, then "
                        "run kvtier doctor again for break-even lengths)")
    shared_info = report.get("shared") or {}
    if shared_info.get("problem"):
        warnings.append(f"{shared_info['problem']}: servers started with --shared serve without it until it answers")
    elif "shared" in reload and reload["shared"] > reload["nvme"]:
        warnings.append(f"the shared store ({shared_info['read_gbps']:.2f} GB/s, {shared_info['rtt_ms']:.2f} ms) is "
                        f"slower than this box's NVMe tier: a 200k-token session reloads in {reload['shared']:.1f} s "
                        f"from it vs {reload['nvme']:.1f} s from NVMe (the cost model still fetches when it beats "
                        "recompute)")
    policy = (shared_info.get("server") or {}).get("maxmemory_policy", "")
    if policy == "noeviction" and (shared_info.get("server") or {}).get("maxmemory"):
        warnings.append("the shared store has a memory cap and maxmemory-policy noeviction: once full it refuses "
                        "new blocks instead of evicting old ones; allkeys-lru suits a cache")
    warnings += recall_warnings(server, codecs, kv.get("max_context"))
    if vllm is not None:
        report["vllm"] = vllm
        warnings += vllm_warnings(vllm)
    report["warnings"] = warnings
    return report


def vllm_warnings(vllm: dict[str, Any]) -> list[str]:
    """A vLLM kvtier was not tested with (older ones are refused at start, newer ones warned), and
    a connector API that does not fit the installed sources."""
    out = []
    if vllm.get("status") in ("too-old", "newer", "untested", "unknown"):
        out.append(vllm["note"])
    api = vllm.get("api_check") or {}
    if api and not api.get("ok"):
        problems = api["problems"]
        out.append(f"kvtier's connector does not fit the installed vLLM's sources: {len(problems)} "
                   f"mismatch{'es' * (len(problems) > 1)}, first {problems[0]} (kvtier doctor --vllm-source "
                   "installed lists them)")
    return out


def recall_warnings(server: dict | None, codecs: dict[str, str] | None, max_context: int | None) -> list[str]:
    """Lossy codecs whose needle figures show recall falling within the contexts served: a running
    server's own (its codecs, its vLLM's max_model_len), else the configured codecs against the
    model's longest context (``kvtier.codecs.recall``)."""
    from kvtier.codecs.recall import load_figures, recall_warning

    if server is not None:
        found = ((server.get("status") or {}).get("warnings")) or {}
        return [text for name, text in sorted(found.items()) if name.endswith("_codec_recall")]
    figures = load_figures()
    return [text for tier, spec in (codecs or {}).items() if (text := recall_warning(spec, max_context, tier, figures))]
