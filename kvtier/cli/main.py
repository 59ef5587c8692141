"""The ``kvtier`` command. Imports stay lazy: ``kvtier --help`` loads neither torch nor vLLM."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from kvtier.cli.bench import bench_app
from kvtier.cli.output import (
    emit_json,
    handle_errors,
    human_bytes,
    print_table,
)

__all__ = ["app", "main"]

app = typer.Typer(
    name="kvtier",
    help="Tiered KV cache for vLLM: GPU HBM, host DRAM and NVMe, with per-session control.",
    epilog="Exit codes: 0 ok, 1 failure, 2 bad usage or input, 3 no kvtier server reachable, 4 not found.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # every subcommand inherits it
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: `kvtier --help` must not load rich's markdown stack
)
class _SnapshotGroup(TyperGroup):
    """``kvtier snapshot SESSION`` (take one, through the server) beside ``snapshot inspect|verify FILE``."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            return "take", self.commands["take"], args
        return super().resolve_command(ctx, args)

    def format_usage(self, ctx, formatter) -> None:
        formatter.write_usage("kvtier snapshot", "SESSION [--out FILE] | inspect FILE | verify FILE")


snapshot_app = typer.Typer(cls=_SnapshotGroup, no_args_is_help=True, rich_markup_mode=None,
                           help="kvtier snapshot SESSION [--out FILE]: save a session to a portable file "
                                "(through the server). inspect / verify FILE work with no server.")
config_app = typer.Typer(help="Settings: flag > KVTIER_* env > kvtier.toml > defaults.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(bench_app, name="bench")  # kvtier/cli/bench.py
app.add_typer(snapshot_app, name="snapshot")
app.add_typer(config_app, name="config")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"kvtier {version('kvtier')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    no_color: bool = typer.Option(False, "--no-color", help="Plain text, no colors (as NO_COLOR=1 does)."),
) -> None:
    """Tiered KV cache for vLLM."""
    if no_color:
        os.environ["NO_COLOR"] = "1"  # rich (tables, spinners) and Textual (kvtier top) both honor it


# ---- serve --------------------------------------------------------------------------------------
_AUTO_DRAM = "Default auto: a quarter of the RAM available less other instances' budgets, at most 4GiB."
_AUTO_NVME = "Default auto: half the disk's free space less other instances' budgets, at most 64GiB."


@app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@handle_errors
def serve(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(
        None, help="A local model directory (with config.json) or a Hugging Face id (org/name). "
                   "Omit it to serve kvtier's demo model."),
    revision: Optional[str] = typer.Option(
        None, "--revision", help="Branch, tag or commit of a Hugging Face model (passed to vLLM)."),
    instance: Optional[str] = typer.Option(
        None, "--instance", help="Name of this server on the box (default: its --port). A named instance keeps "
                                 "its cold tier in NVME_DIR/instances/NAME, so several share one --nvme-dir."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the API listens on."),
    port: int = typer.Option(8000, "--port", help="Port the API listens on."),
    dram: Optional[str] = typer.Option(None, "--dram", help=f"Warm tier (host DRAM) budget, e.g. 8GiB. {_AUTO_DRAM}"),
    nvme_dir: Optional[list[str]] = typer.Option(
        None, "--nvme-dir", help="Cold tier directory (on an SSD); once per drive to use several drives."),
    nvme: Optional[str] = typer.Option(None, "--nvme", help=f"Cold tier (NVMe) budget, e.g. 64GiB. {_AUTO_NVME}"),
    policy: Optional[str] = typer.Option(None, "--policy", help="Eviction policy: lru or arc."),
    kv_cache_dtype: Optional[str] = typer.Option(
        None, "--kv-cache-dtype", help="vLLM's KV cache dtype (auto, fp8, ...); passed through."),
    warm_codec: Optional[str] = typer.Option(
        None, "--warm-codec", help="Codec of the DRAM tier: none, fp8, int8, int4, int4-lc (default none)."),
    cold_codec: Optional[str] = typer.Option(
        None, "--cold-codec", help="Codec of the NVMe tier, e.g. fp8+zstd or int4-lc (default none)."),
    link_gbps: Optional[str] = typer.Option(
        None, "--link-gbps", help="Cap measured links for the cost model, GB/s: pcie=3.9,nvme=1.5 (slow-link demo)."),
    write_behind: Optional[str] = typer.Option(
        None, "--write-behind", help="Seconds a DRAM-only block waits for its NVMe copy (default 10), or off."),
    stop_timeout: Optional[float] = typer.Option(
        None, "--stop-timeout", help="Seconds the flush on Ctrl-C/SIGTERM may take before vLLM stops (default 60)."),
    shared: Optional[str] = typer.Option(
        None, "--shared", help="Shared tier across boxes: a Valkey/Redis URL (redis://host:6379/0, rediss://, "
                               "unix:///path; a cluster is detected). Credentials: --shared-auth-file or "
                               "$KVTIER_SHARED_PASSWORD, never the URL."),
    shared_policy: Optional[str] = typer.Option(
        None, "--shared-policy", help="When blocks go to the shared tier: write-through (when stored, default) "
                                      "or demote (when they get their NVMe copy)."),
    shared_codec: Optional[str] = typer.Option(
        None, "--shared-codec", help="Codec of blocks in the shared tier (default none+zstd; fp8 halves the bytes)."),
    shared_ttl: Optional[float] = typer.Option(
        None, "--shared-ttl", help="Seconds a published block or session lives in the store (default 86400)."),
    shared_auth_file: Optional[str] = typer.Option(
        None, "--shared-auth-file",
        help="File (mode 600): the store's password, or a user name line then the password."),
    shared_ca_file: Optional[str] = typer.Option(
        None, "--shared-ca-file", help="CA certificate of a rediss:// store."),
    demo_size: str = typer.Option("tiny", "--demo-size", help="Demo model size when no MODEL: tiny or mid."),
    admin_tcp: Optional[str] = typer.Option(
        None, "--admin-tcp", help="Also serve the admin API on loopback TCP, e.g. 127.0.0.1:8100; its bearer token "
                                  "comes from $KVTIER_ADMIN_TOKEN or --admin-token-file, never the command line."),
    admin_token_file: Optional[str] = typer.Option(
        None, "--admin-token-file", help="File (mode 600) holding the admin TCP bearer token."),
    admin_socket: Optional[str] = typer.Option(
        None, "--admin-socket",
        help="Admin API socket (default $KVTIER_ADMIN_SOCKET, else $XDG_RUNTIME_DIR/kvtier/instances/NAME.sock); "
                                     "one per server when several run on a box."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check, print the vLLM command, start nothing."),
) -> None:
    """Run vLLM's OpenAI server with kvtier's tiered KV cache. vLLM flags go after `--`.

    Example: kvtier serve ./models/llama --dram 16GiB --nvme-dir /mnt/nvme/kvtier -- --max-model-len 16384
    """
    from kvtier.launch import serve as srv

    flags = {key: value for key, value in locals().items() if key in _SETTINGS_FLAGS}
    flags["nvme_dir"] = nvme_dir or None  # given once per drive
    model, extra = _model_and_vllm_args(model, ctx.args, demo_size)
    settings, sources, name = _instance_settings(flags, instance, port)
    sock = os.path.abspath(os.path.expanduser(admin_socket)) if admin_socket else srv.admin_socket_path(instance=name)
    token = _admin_tcp_token(admin_tcp, admin_token_file)
    checks = {"sources": sources, "host": host, "port": port, "create_dirs": not dry_run,
              "kv_cache_dtype": kv_cache_dtype, "admin_socket": sock, "instance": name}
    source, settings = _checked_model(model, revision, settings, extra, checks)
    plan = srv.launch_plan(source.arg if source else _demo_model_path(demo_size, dry_run), settings, host, port,
                           kv_cache_dtype, extra, admin_socket=sock, token=token, revision=revision, instance=name,
                           admin_tcp=admin_tcp.replace("[::1]", "::1") if admin_tcp else None,
                           commit=source.commit if source else None)
    if dry_run:
        return _print_dry_run(plan)
    raise typer.Exit(_run_instance(plan, revision=(source.commit or revision) if source else None,
                                   admin_tcp=admin_tcp))


# the serve options that are settings (flag > KVTIER_* env > kvtier.toml > defaults)
_SETTINGS_FLAGS = ("dram", "nvme_dir", "nvme", "policy", "warm_codec", "cold_codec", "link_gbps", "write_behind",
                   "stop_timeout", "shared", "shared_policy", "shared_codec", "shared_ttl", "shared_auth_file",
                   "shared_ca_file")


def _model_and_vllm_args(model: Optional[str], args: list[str], demo_size: str) -> tuple[Optional[str], list[str]]:
    """MODEL (None: the demo model) and vLLM's own arguments (those after `--`)."""
    from kvtier.errors import UsageError
    from kvtier.launch.serve import DEMO_SIZES

    extra = list(args)
    if model is not None and model.startswith("-"):  # `kvtier serve -- --flag ...` with no MODEL
        extra.insert(0, model)
        model = None
    if demo_size not in DEMO_SIZES:
        raise UsageError(f"unknown --demo-size {demo_size!r}", hint=f"choose one of: {', '.join(DEMO_SIZES)}")
    return model, extra


def _instance_settings(flags: dict, instance: Optional[str], port: int):
    """The settings of this instance (a named one keeps its cold tier in NVME_DIR/instances/NAME), where
    each came from (automatic budgets are sized by the checks) and its name."""
    from dataclasses import replace

    from kvtier.config import load_settings
    from kvtier.control.instances import valid_name
    from kvtier.launch.serve import instance_store_dir

    settings, sources = load_settings(flags=flags)
    name = valid_name(instance) if instance is not None else str(port)
    if instance is not None:
        from kvtier.tiers.nvme.drives import drive_dirs, join_drives

        settings = replace(settings, nvme_dir=join_drives(instance_store_dir(d, name)
                                                          for d in drive_dirs(settings.nvme_dir)))
    return settings, sources, name


def _checked_model(model: Optional[str], revision: Optional[str], settings, extra: list[str], checks: dict):
    """Size the automatic budgets and refuse, before vLLM spends ~20 s starting, what would fail later
    (``check_serve``; its warnings and the budgets line are printed); then MODEL resolved (a directory
    or a hub id in the local cache; None for the demo model) and the settings to launch with."""
    from kvtier.errors import UsageError
    from kvtier.launch import serve as srv

    if revision is not None and model is None:
        raise UsageError("--revision needs a hub MODEL",
                         hint="e.g. kvtier serve Qwen/Qwen2.5-0.5B-Instruct --revision main")
    checked = srv.check_serve(settings, None, extra_args=extra, **checks)
    for warning in checked.warnings:
        typer.echo(f"warning: {warning}", err=True)
    source = srv.resolve_model(model, revision, extra) if model is not None else None
    typer.echo(f"kvtier: {checked.budgets}")
    return source, checked.settings


def _admin_tcp_token(admin_tcp: Optional[str], admin_token_file: Optional[str]) -> Optional[str]:
    """The admin TCP bearer token (None without --admin-tcp); refuses a non-loopback address."""
    from kvtier.errors import UsageError

    if admin_tcp:
        host_part, _, port_part = admin_tcp.rpartition(":")
        if host_part not in ("127.0.0.1", "::1", "[::1]", "localhost") or not port_part.isdigit():
            raise UsageError(f"--admin-tcp {admin_tcp!r} is not a loopback HOST:PORT",
                             hint="e.g. --admin-tcp 127.0.0.1:8100 (the admin API never listens beyond this box)")
        from kvtier.persist.secrets import admin_token

        return admin_token(admin_token_file)
    if admin_token_file:
        raise UsageError("--admin-token-file needs --admin-tcp", hint="add --admin-tcp 127.0.0.1:PORT")
    return None


def _demo_model_path(demo_size: str, dry_run: bool) -> str:
    """The demo model's directory, built unless this is a dry run (which builds nothing)."""
    from kvtier.errors import UsageError
    from kvtier.launch.serve import DEMO_BANNER, NO_MODEL_HINT

    typer.echo(DEMO_BANNER, err=True)
    try:
        from kvtier.models.demo import demo_model_dir, ensure_demo_model
    except ImportError:
        raise UsageError("the demo model is not available in this install", hint=NO_MODEL_HINT) from None
    if dry_run:
        return str(demo_model_dir(demo_size))
    return str(ensure_demo_model(demo_size, progress=lambda msg: typer.echo(f"… {msg}", err=True)))


def _print_dry_run(plan) -> None:
    """The vLLM command (with the VLLM_* variables kvtier adds), its connector config, where it would listen."""
    import shlex

    added = {key: value for key, value in plan.env.items() if key.startswith("VLLM_") and os.environ.get(key) != value}
    typer.echo("vLLM command:")
    typer.echo("  " + " ".join(f"{key}={shlex.quote(value)}" for key, value in added.items())
               + (" " if added else "") + shlex.join(plan.argv))
    typer.echo("kv-transfer-config:")
    typer.echo(json.dumps(plan.kv_transfer_config, indent=2))
    typer.echo(f"API would be at {plan.url}, instance {plan.instance}, admin socket {plan.admin_socket}")


def _run_instance(plan, revision: Optional[str], admin_tcp: Optional[str]) -> int:
    """Run the planned server, registered as an instance of this box while it runs; its exit status."""
    from kvtier.control.instances import Instance, Registration
    from kvtier.launch import serve as srv

    def say(msg: str) -> None:
        typer.echo(f"kvtier: {msg}")

    settings = plan.settings
    record = Instance(name=plan.instance, pid=os.getpid(), port=plan.port, host=plan.host, api_url=plan.url,
                      admin_socket=plan.admin_socket, model=plan.served_model, revision=revision, admin_tcp=admin_tcp,
                      nvme_dir=str(settings.nvme_dir), nvme_bytes=int(settings.nvme_bytes),
                      dram_bytes=int(settings.dram_bytes), gpus=srv.visible_gpus(plan.env))
    with Registration(record):
        say(f"instance {plan.instance} (`kvtier sessions --instance {plan.instance}` reaches it when several run)")
        return srv.run_server(plan.argv, plan.env, plan.url, plan.admin_socket, say=say,
                              before_stop=lambda: srv.flush_before_stop(plan.admin_socket, settings.stop_timeout, say),
                              stop_timeout_s=settings.stop_timeout)


@app.command("demo")
@handle_errors
def demo(
    tokens: int = typer.Option(8192, "--tokens", min=256, max=32000, help="Length of the agent's context."),
    size: str = typer.Option("tiny", "--size", help="Demo model: tiny or mid."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON at the end."),
) -> None:
    """The overnight scenario on real kvtier serve processes: long session, snapshot, Ctrl-C, a new
    server on the same NVMe dir, the session listed at once, its next turn loads instead of recomputing."""
    import contextlib
    import sys

    from kvtier.launch.demo import run_demo

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; keep the story readable
        results = run_demo(tokens=tokens, size=size, say=lambda msg: typer.echo(msg, err=True))
    if json_out:
        emit_json(results)


# ---- snapshot (offline) ---------------------------------------------------------------------------
@snapshot_app.command("inspect")
@handle_errors
def snapshot_inspect(
    file: Path = typer.Argument(..., help="A .kvsnap file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a snapshot's header: model, session, tokens, blocks, codec (reads no payload)."""
    from kvtier.persist.snapshot import open_snapshot
    from kvtier.persist.trust import keys_file, load_keys

    info = open_snapshot(file, trusted_keys=load_keys())
    if json_out:
        emit_json({**info.to_dict(), "signed_by_trusted_key": info.signed})
        return
    fp = info.fingerprint
    print_table(str(file), ["field", "value"], [
        ("session", info.session_id),
        ("model", f"{fp.model_id} ({fp.hex[:12]})"),
        ("weights", fp.weights or "unknown (not in the fingerprint)"),
        ("geometry", f"{fp.geometry.num_layers} layers x {fp.geometry.num_kv_heads} kv heads x "
                     f"{fp.geometry.head_dim} dims, {fp.geometry.block_tokens} tokens/block, {fp.geometry.dtype}"),
        ("tokens", info.num_tokens),
        ("blocks", len(info.blocks)),
        ("payload", human_bytes(info.payload_bytes)),
        ("codec", info.codec),
        ("signature", "by a key this box trusts" if info.signed else
         f"none this box trusts (keys: {keys_file()}); restore needs --trust-unsigned"),
    ])


@snapshot_app.command("verify")
@handle_errors
def snapshot_verify(
    file: Path = typer.Argument(..., help="A .kvsnap file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check a snapshot's header and every block checksum."""
    from rich.progress import Progress

    from kvtier.persist.snapshot import verify_snapshot

    if json_out:
        info = verify_snapshot(file)
    else:
        with Progress(transient=True) as bar:
            task = bar.add_task("verifying", total=None)
            info = verify_snapshot(file, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if json_out:
        emit_json({"ok": True, "path": str(file), "blocks": len(info.blocks), "bytes": info.payload_bytes})
    else:
        typer.echo(f"ok: {file}: {len(info.blocks)} blocks, {human_bytes(info.payload_bytes)} verified")


# ---- config -------------------------------------------------------------------------------------
@config_app.command("show")
@handle_errors
def config_show(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every setting with the place its value came from."""
    from dataclasses import asdict

    from kvtier.config import load_settings

    settings, sources = load_settings()
    values = asdict(settings)
    if json_out:
        emit_json({key: {"value": value, "source": sources[key]} for key, value in values.items()})
        return
    print_table("kvtier settings", ["setting", "value", "source"],
                [(key, value, sources[key]) for key, value in values.items()])


from kvtier.cli.admin import INSTANCE_OPTION, selected_instance  # noqa: E402
from kvtier.cli.admin import register as _register_admin  # noqa: E402

_register_admin(app, snapshot_app)

from kvtier.cli.top import register as _register_top  # noqa: E402


@app.command("instances")
@handle_errors
def instances(json_out: bool = typer.Option(False, "--json", help="Print JSON."),
              probe: bool = typer.Option(True, "--probe/--no-probe",
                                         help="Ask each instance for its sessions (1 s timeout each).")) -> None:
    """The kvtier servers running on this box (for this user): name, port, model, GPUs, admin socket."""
    import time

    from kvtier.control.client import AdminClient
    from kvtier.control.instances import list_instances, registry_dir
    from kvtier.errors import KvtierError

    found = []
    for inst in list_instances():
        doc = inst.to_dict()
        doc["uptime_s"] = round(time.time() - inst.started, 1)
        if probe:
            try:
                status = AdminClient(inst.admin_socket, timeout=1.0).get("/v1/status")
                doc["sessions"] = sum(status.get("sessions", {}).values())
                doc["reachable"] = True
            except KvtierError:
                doc["reachable"] = False
        found.append(doc)
    if json_out:
        emit_json({"instances": found, "registry": str(registry_dir())})
        return
    if not found:
        typer.echo(f"no kvtier instance is running (registry: {registry_dir()})")
        return
    print_table(f"kvtier instances ({len(found)})",
                ["name", "port", "pid", "model", "GPUs", "sessions", "up", "admin socket"],
                [(d["name"], d["port"], d["pid"], d["model"] + (f"@{d['revision'][:12]}" if d.get("revision") else ""),
                  ",".join(d["gpus"]) if d.get("gpus") is not None else "all",
                  "-" if "sessions" not in d else (d["sessions"] if d["reachable"] else "starting"),
                  f"{d['uptime_s']:.0f}s", d["admin_socket"]) for d in found])


@app.command("doctor")
@handle_errors
def doctor(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    nvme_dir: Optional[list[str]] = typer.Option(
        None, "--nvme-dir", help="NVMe tier directory (default: from config); once per drive: each is measured."),
    model: Optional[str] = typer.Option(None, "--model", help="Model directory for KV geometry (default: the demo)."),
    link_gbps: Optional[str] = typer.Option(None, "--link-gbps", help="Cap links, GB/s: pcie=3.9,nvme=1.5."),
    socket: Optional[str] = typer.Option(None, "--socket", help="Admin socket of a running server (optional)."),
    _instance: Optional[str] = INSTANCE_OPTION,
    quick: bool = typer.Option(False, "--quick", help="Smaller bandwidth measurements."),
    shared: Optional[str] = typer.Option(None, "--shared", help="Also measure this shared store (default: the "
                                                                "configured one, if any)."),
    vllm_source: Optional[str] = typer.Option(
        None, "--vllm-source", metavar="DIR", help="Only check kvtier's connector against the vLLM sources in DIR "
        "(a vllm package directory, e.g. an unpacked wheel's; 'installed': the installed one). Exit 1 on a mismatch."),
) -> None:
    """Links, disks, the load-or-recompute break-even and the vLLM on this box, with plain warnings."""
    from kvtier.cli.doctor import run_vllm_check, vllm_section
    from kvtier.config import load_settings
    from kvtier.control.client import connect
    from kvtier.diagnose.doctor import run_doctor
    from kvtier.errors import KvtierError
    from kvtier.plan.costmodel import parse_link_caps

    if vllm_source is not None:
        run_vllm_check(vllm_source, json_out)
        return
    settings, _ = load_settings()
    caps = parse_link_caps(link_gbps)
    server = None
    try:
        client = connect(socket, selected_instance(), timeout=5)
        server = {"status": client.get("/v1/status"), "costmodel": client.get("/v1/costmodel")}
    except KvtierError:
        server = None
    gpus = None
    if selected_instance() and "CUDA_VISIBLE_DEVICES" not in os.environ:
        from kvtier.control.instances import find_instance

        chosen = find_instance(selected_instance())
        if chosen is not None and chosen.gpus is not None:
            gpus = chosen.gpus  # that instance's GPUs: its links, and the rate measured on its first
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    drives = os.pathsep.join(nvme_dir) if nvme_dir else settings.nvme_dir
    report = run_doctor(drives, model, caps, server, quick=quick, gpus=gpus,
                        shared=shared or settings.shared or None, shared_auth_file=settings.shared_auth_file or None,
                        codecs={"warm": settings.warm_codec, "cold": settings.cold_codec}, vllm=vllm_section())
    if json_out:
        emit_json(report)
        return
    from kvtier.cli.doctor import print_doctor

    print_doctor(report)


_register_top(app)


def main() -> None:
    app(prog_name="kvtier")


if __name__ == "__main__":
    main()
