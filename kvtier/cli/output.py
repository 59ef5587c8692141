"""One way to print: tables for people, ``--json`` for scripts, errors as ``error:`` / ``hint:``.

Every command runs under ``handle_errors`` so a ``KvtierError`` becomes two lines on stderr and
its exit code (see ``kvtier.errors``), never a traceback.
"""
from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable, Iterable, Sequence

import typer

from kvtier.errors import KvtierError, exit_code_for, render_error
from kvtier.units import human_bytes  # noqa: F401 - the CLI's commands import it from here

__all__ = ["handle_errors", "emit_json", "print_table", "human_bytes", "emit_bench", "bench_progress"]


def handle_errors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvtierError as exc:
            typer.echo(render_error(exc), err=True)
            raise typer.Exit(exit_code_for(exc)) from None
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    Console(file=sys.stdout).print(table)


def bench_progress(json_out: bool) -> Callable[[str], None]:
    """Progress lines on stderr for a benchmark (silent with --json)."""
    return (lambda _msg: None) if json_out else (lambda msg: typer.echo(f"… {msg}", err=True))


def run_vllm_bench(title: str, keys: Sequence[str], run: Callable[[Callable[[str], None]], dict],
                   json_out: bool) -> None:
    """Run a benchmark that loads vLLM, ``run(progress)``, then print its figures. vLLM logs to
    stdout, which is for the results: it goes to stderr meanwhile."""
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        results = run(bench_progress(json_out))
    emit_bench(title, keys, results, json_out)


def emit_bench(title: str, keys: Sequence[str], results: dict, json_out: bool) -> None:
    """A benchmark's figures: exactly ``keys`` as JSON, or a table with the context figures too."""
    if json_out:
        emit_json({key: None if results[key] is None else round(results[key], 4) for key in keys})
        return
    rows = [(key, str(results[key]) if isinstance(results[key], int) or results[key] is None
             else f"{results[key]:.4f}") for key in keys]
    rows += [(key.lstrip("_"), f"{value:.3f}" if isinstance(value, float) else value)
             for key, value in results.items() if key.startswith("_")]
    print_table(title, ["figure", "value"], rows)
