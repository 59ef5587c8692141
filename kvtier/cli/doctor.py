"""`kvtier doctor`'s report as a table: links, drives, rates, break-even lengths, the vLLM it would
run with and warnings; and ``--vllm-source DIR``, the vLLM API check alone."""
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
    rows += _vllm_rows(report.get("vllm"))
    print_table("kvtier doctor", ["", ""], rows)
    for warning in report["warnings"]:
        typer.echo(f"warning: {warning}", err=True)


def _vllm_rows(vllm: dict | None) -> list[tuple[str, str]]:
    if not vllm:
        return []
    rows = [("vLLM", f"{vllm['version'] or 'not installed'}"
                     + (f" ({vllm['distribution']})" if vllm.get("distribution") else "")
                     + f": {'tested' if vllm['tested'] else vllm['status']} (kvtier supports {vllm['range']})")]
    api = vllm.get("api_check")
    if api:
        rows.append(("vLLM API check", "kvtier's connector fits its sources" if api["ok"] else
                     f"{len(api['problems'])} mismatch{'es' * (len(api['problems']) > 1)}, first "
                     f"{api['problems'][0]}"))
    return rows


# ---- vLLM: which one, and does kvtier's connector fit it ------------------------------------------------
def installed_vllm_dir() -> str | None:
    """The installed ``vllm`` package's directory, found without importing it (that costs seconds
    and loads torch)."""
    from importlib.util import find_spec

    try:
        spec = find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def vllm_section() -> dict:
    """doctor's ``vllm`` object: the installed version, whether kvtier was tested against it
    (``kvtier.plugins.vllm.compat``), and the API check of its sources (``kvtier.diagnose.vllm_api``)."""
    from kvtier.diagnose.vllm_api import check_api
    from kvtier.plugins.vllm.compat import api_spec, vllm_info

    info = vllm_info()
    source = installed_vllm_dir() if info["version"] else None
    if source is not None:
        report = check_api(source, api_spec())
        info["api_check"] = {key: report[key] for key in ("source", "ok", "problems", "new_hooks")}
    return info


def run_vllm_check(source: str, json_out: bool) -> None:
    """``kvtier doctor --vllm-source DIR``: the API check alone; exits 1 on a mismatch (2: DIR is no
    vLLM package)."""
    from kvtier.cli.output import emit_json
    from kvtier.diagnose.vllm_api import check_api
    from kvtier.errors import KvtierError, UsageError
    from kvtier.plugins.vllm.compat import PIP_HINT, api_spec, version_status

    if source == "installed":
        source = installed_vllm_dir() or ""
        if not source:
            raise UsageError("vLLM is not installed here", hint=f"{PIP_HINT}, or give --vllm-source DIR")
    report = check_api(source, api_spec())
    report["status"], report["note"] = version_status(report["version"])
    if json_out:
        emit_json(report)
    else:
        print_vllm_check(report)
    if not report["ok"]:
        problems = report["problems"]
        raise KvtierError(f"kvtier's connector does not fit vLLM {report['version'] or '?'} at {report['source']}: "
                          f"{len(problems)} problem{'s' * (len(problems) > 1)}, first {problems[0]}",
                          hint=f"use a vLLM kvtier supports ({PIP_HINT}), or update plugins/vllm/compat.py and "
                               "the connector for this one")


def print_vllm_check(report: dict) -> None:
    rows = [(row["what"], row["name"], "ok" if row["ok"] else "MISMATCH", row["detail"]) for row in report["rows"]
            if not row["ok"] or row["what"] in ("new hook", "abstract") or "never called" in row["detail"]]
    passed = sum(row["ok"] for row in report["rows"])
    rows.append(("", f"{passed} of {len(report['rows'])} checks pass", "", report.get("note", "")))
    print_table(f"kvtier's connector vs vLLM {report['version'] or '?'} ({report['source']})",
                ["check", "name", "", "detail"], rows)
