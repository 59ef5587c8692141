"""The ``kvtier`` command. Imports stay lazy: ``kvtier --help`` loads neither torch nor vLLM."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtier.cli.output import emit_json, handle_errors, human_bytes, print_table

__all__ = ["app", "main"]

app = typer.Typer(
    name="kvtier",
    help="Tiered KV cache for vLLM: GPU HBM, host DRAM and NVMe, with per-session control.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks; every figure is a ratio against a same-process reference.",
                        no_args_is_help=True)
snapshot_app = typer.Typer(help="Session snapshot files (offline tools work with no server).",
                           no_args_is_help=True)
config_app = typer.Typer(help="Settings: flag > KVTIER_* env > kvtier.toml > defaults.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
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
) -> None:
    """Tiered KV cache for vLLM."""


# ---- bench --------------------------------------------------------------------------------------
@bench_app.command("tiers")
@handle_errors
def bench_tiers(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quick: bool = typer.Option(False, "--quick", help="Smaller sizes; finishes in under a minute."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write (default: the current dir)."),
) -> None:
    """DRAM, NVMe, snapshot and index speed vs memcpy / raw direct IO."""
    from kvtier.bench.tiers import TIERS_KEYS, run_tiers_bench

    if directory is not None and not directory.is_dir():
        from kvtier.errors import UsageError

        raise UsageError(f"{directory} is not a directory", hint="pass --dir an existing directory on the disk to test")
    say = (lambda _msg: None) if json_out else (lambda msg: typer.echo(f"… {msg}", err=True))
    results = run_tiers_bench(quick=quick, directory=str(directory) if directory else None, progress=say)
    if json_out:
        emit_json({key: round(results[key], 4) for key in TIERS_KEYS})
        return
    rows = [(key, f"{results[key]:.3f}") for key in TIERS_KEYS]
    rows += [(key.lstrip("_"), f"{value:.3f}" if isinstance(value, float) else value)
             for key, value in results.items() if key.startswith("_")]
    print_table("kvtier bench tiers", ["figure", "value"], rows)


# ---- snapshot (offline) ---------------------------------------------------------------------------
@snapshot_app.command("inspect")
@handle_errors
def snapshot_inspect(
    file: Path = typer.Argument(..., help="A .kvsnap file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a snapshot's header: model, session, tokens, blocks, codec (reads no payload)."""
    from kvtier.snapshot import open_snapshot

    info = open_snapshot(file)
    if json_out:
        emit_json(info.to_dict())
        return
    fp = info.fingerprint
    print_table(str(file), ["field", "value"], [
        ("session", info.session_id),
        ("model", f"{fp.model_id} ({fp.hex[:12]})"),
        ("geometry", f"{fp.geometry.num_layers} layers x {fp.geometry.num_kv_heads} kv heads x "
                     f"{fp.geometry.head_dim} dims, {fp.geometry.block_tokens} tokens/block, {fp.geometry.dtype}"),
        ("tokens", info.num_tokens),
        ("blocks", len(info.blocks)),
        ("payload", human_bytes(info.payload_bytes)),
        ("codec", info.codec),
    ])


@snapshot_app.command("verify")
@handle_errors
def snapshot_verify(
    file: Path = typer.Argument(..., help="A .kvsnap file."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check a snapshot's header and every block checksum."""
    from rich.progress import Progress

    from kvtier.snapshot import verify_snapshot

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


def main() -> None:
    app(prog_name="kvtier")


if __name__ == "__main__":
    main()
