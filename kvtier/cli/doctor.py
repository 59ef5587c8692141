"""`kvtier doctor`'s report as a table: links, drives, rates, break-even lengths and warnings."""
from __future__ import annotations

import typer

from kvtier.cli.output import human_bytes, print_table


def print_doctor(report: dict) -> None:
    rows = [(f"GPU {gpu['index']}" if len(report["gpus"]) > 1 else "GPU",
             f"{gpu['name']} PCIe gen{gpu.get('gen')} x{gpu.get('width')} (max gen{gpu.get('max_gen')} "
             f"x{gpu.get('max_width')})" if gpu.get("present") else f"none: {gpu['why']}") for gpu in report["gpus"]]
    drives = report.get("drives") or ([report["nvme"]] if "nvme" in report else [])
    for i, n in enumerate(drives):
        rate = f", reads {n['read_gbps']:.2f} GB/s" if "read_gbps" in n else ""
        rows.append((f"NVMe drive {i}" if len(drives) > 1 else "NVMe dir",
                     f"{n['dir']} on {n['filesystem']} ({n['mount']}), {human_bytes(n['free_bytes'])} free, "
                     f"O_DIRECT {'yes' if n['o_direct'] else 'no'}{rate}"))
    rows.append(("memlock", "unlimited" if report["memlock_bytes"] is None else human_bytes(report["memlock_bytes"])))
    r = report["rates"]
    rows.append(("host->device", f"{r['host_to_device_gbps']:.2f} GB/s ({r['sources'].get('host_to_device_bps')})"))
    rows.append(("NVMe reads" + (", all drives" if len(drives) > 1 else ""),
                 f"{r['nvme_read_gbps']:.2f} GB/s ({r['sources'].get('nvme_read_bps')})"))
    kv = report["kv"]
    rows.append(("KV per token", f"{human_bytes(kv['bytes_per_token'])} ({kv['layers']} layers x {kv['kv_heads']} kv "
                                 f"heads x {kv['head_dim']}, {kv['dtype']}; fp8 halves it)"))
    shared = report.get("shared")
    if shared:
        rows.append(("shared store", f"{shared['url']}: " + (shared["problem"] if shared.get("problem") else
                     f"{shared['read_gbps']:.2f} GB/s reads, {shared['rtt_ms']:.2f} ms round trip"
                     + (", cluster" if shared.get("cluster") else ""))))
    reload = report["reload_200k_s"]
    rows.append(("reload 200k tokens", f"{reload['dram']:.2f} s from DRAM, {reload['nvme']:.2f} s from NVMe"
                 + (f", {reload['shared']:.2f} s from the shared store" if "shared" in reload else "")))
    cost = ((report.get("server") or {}).get("costmodel")) or {}
    if cost.get("prefill"):
        even = cost["break_even_tokens"]
        rows.append(("break-even", f"load beats recompute from {even['dram'] or 'never'} tokens (DRAM), "
                                   f"{even['nvme'] or 'never'} tokens (NVMe)"))
    print_table("kvtier doctor", ["", ""], rows)
    for warning in report["warnings"]:
        typer.echo(f"warning: {warning}", err=True)

