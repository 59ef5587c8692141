"""Render docs/top.svg (the README's screenshot) from the app itself, replaying the recording in
tests/tui/data/top.jsonl (a real admin server, recorded with tests/tui/data/make_top_replay.py).

    python examples/top_screenshot.py [OUT.svg] [WIDTH HEIGHT]
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from kvtier.tui.app import TopApp
from kvtier.tui.collector import replay

ROOT = Path(__file__).resolve().parents[1]


async def main(out: Path, size: tuple[int, int]) -> None:
    last = list(replay(str(ROOT / "tests" / "tui" / "data" / "top.jsonl")))[-1]  # rates need two samples
    app = TopApp(lambda: None, interval=3600, first=last)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.2)
        out.write_text(app.export_screenshot())
    print(f"wrote {out}")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "top.svg"
    dims = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (100, 30)
    asyncio.run(main(target, dims))
