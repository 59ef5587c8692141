"""Random-weight demo models, so kvtier can be tried without downloading anything.

:func:`ensure_demo_model` builds a Llama with random (but deterministic, ``torch.manual_seed(0)``)
weights and a byte-level BPE tokenizer trained locally on the Python stdlib, once per cache
directory, and returns its path; vLLM loads it like any Hugging Face model.  It generates
gibberish: it exists to exercise KV caching (its KV geometry is real), not to answer questions.

A build happens in a temp dir beside the final one, under an exclusive ``fcntl.flock``, and is
renamed into place with its ``.complete`` marker already written, so a crashed or concurrent
build never leaves a directory that looks complete.  torch, transformers and tokenizers are
imported lazily: importing this module (the CLI does) stays cheap.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config import default_cache_dir
from kvtier.errors import KvtierError, UsageError

__all__ = ["DEMO_SIZES", "DEMO_VERSION", "build_once", "demo_model_dir", "ensure_demo_model", "import_hf",
           "is_demo_model", "seal"]

DEMO_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 512},  # 3.4M params
    # 184.5M params with the ~2k-token vocab (247M with a 32k one); KV per token =
    # layers*2*kv_heads*head_dim*2 bytes = 16*2*4*64*2 = 16 KiB in bf16
    "mid": {"hidden": 1024, "layers": 16, "heads": 16, "kv_heads": 4, "intermediate": 2816},
}
DEMO_VERSION = 1
MAX_POSITIONS = 32768
VOCAB_TARGET = 2000
TOKENIZER_FILES = 60  # first N stdlib *.py files, sorted: same tokenizer on every run
MARKER = ".complete"
INFO_FILE = "kvtier-demo.json"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
TORCHVISION_HINT = "pip uninstall -y torchvision torchaudio torchcodec"


def demo_model_dir(size: str = "tiny", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the ``size`` demo model lives: ``<cache_dir or default_cache_dir()/models>/kvtier-demo-<size>-v1``."""
    if size not in DEMO_SIZES:
        raise UsageError(f"unknown demo model size {size!r}", hint=f"choose one of: {', '.join(DEMO_SIZES)}")
    base = Path(cache_dir) if cache_dir is not None else Path(default_cache_dir()) / "models"
    return base.expanduser() / f"kvtier-demo-{size}-v{DEMO_VERSION}"


def is_demo_model(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a model directory written by :func:`ensure_demo_model`."""
    try:
        info = json.loads((Path(path) / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("kvtier_demo") is True


def ensure_demo_model(
    size: str = "tiny",
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Return the path of the ``size`` demo model, building it first if no complete copy exists."""
    return build_once(demo_model_dir(size, cache_dir), lambda out, say: _build(out, size, say), progress)


def build_once(final: Path, build: Callable[[Path, Callable[[str], None]], None],
               progress: Callable[[str], None] | None = None) -> Path:
    """``final`` if it holds a complete build, else ``build(tmp_dir, say)`` into a temp dir beside it
    (which must end by writing ``.complete``) renamed into place, under an exclusive lock: a crashed
    or concurrent build never leaves a directory that looks complete."""
    if (final / MARKER).is_file():
        return final
    say = progress or (lambda _msg: None)
    base = final.parent
    try:
        base.mkdir(parents=True, exist_ok=True)
        lock = open(base / f".{final.name}.lock", "w")  # noqa: SIM115 - held for the whole build
    except OSError as exc:
        raise KvtierError(f"cannot create the model directory {base}: {exc}",
                          hint="pass a writable cache_dir or set XDG_CACHE_HOME") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process is building: wait until its rename is done
            say(f"waiting for another process to finish building {final}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / MARKER).is_file():
            return final
        # We hold the lock, so any temp or unmarked directory is left over from a crashed build.
        for stale in glob.glob(str(base / f".{final.name}.tmp-*")) + ([str(final)] if final.exists() else []):
            say(f"removing incomplete build {stale}")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=base))
        try:
            build(tmp, say)
            if not (tmp / MARKER).is_file():
                raise KvtierError(f"building {final.name} did not complete", hint="report this as a bug")
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp made it 0700; the model is not secret
            os.rename(tmp, final)
            _fsync_dir(base)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    say(f"model ready at {final}")
    return final


def import_hf() -> tuple[Any, Any, Any]:
    """Import torch, tokenizers and transformers; turn known install problems into KvtierErrors."""
    try:
        import tokenizers
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401
    except Exception as exc:
        if _mentions(exc, "torchvision"):
            raise KvtierError(
                "transformers cannot load: the installed torchvision is a CUDA build that breaks it "
                f"({type(exc).__name__}: {_root(exc)})", hint=TORCHVISION_HINT) from exc
        if isinstance(exc, ImportError):
            raise KvtierError(f"building a demo model needs torch, transformers and tokenizers: {exc}",
                              hint="pip install 'kvtier[cpu]' (or 'kvtier[gpu]')") from exc
        raise
    return torch, tokenizers, transformers


def _mentions(exc: BaseException, word: str) -> bool:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if word in str(e):
            return True
        todo += [e.__cause__, e.__context__]
    return False


def _root(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return str(exc)


def _build(out: Path, size: str, say: Callable[[str], None]) -> None:
    """Write tokenizer, config, weights, ``kvtier-demo.json`` and finally ``.complete`` into ``out``."""
    torch, tk, transformers = import_hf()
    geo = DEMO_SIZES[size]
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:TOKENIZER_FILES]
    if not files:
        raise KvtierError(f"no Python stdlib sources found in {stdlib} to train the demo tokenizer",
                          hint="install the Python standard library sources (e.g. the python3 package)")
    say(f"training a byte-level BPE tokenizer on {len(files)} stdlib files")
    tok = tk.Tokenizer(tk.models.BPE(unk_token=None))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=["<s>", "</s>", "<pad>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    tok.train(files, trainer)
    tok.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    say(f"initialising a random-weight {size} Llama (seed 0)")
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=geo["hidden"], intermediate_size=geo["intermediate"],
        num_hidden_layers=geo["layers"], num_attention_heads=geo["heads"], num_key_value_heads=geo["kv_heads"],
        max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    say(f"saving {params / 1e6:.1f}M parameters")
    model.save_pretrained(out, safe_serialization=True)
    info = {"kvtier_demo": True, "size": size, "params": params, "version": DEMO_VERSION,
            "note": "random weights: output is gibberish; for trying kvtier's KV caching only"}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    seal(out)


def seal(out: Path) -> None:
    """fsync every file of a finished build, then write its ``.complete`` marker (last: the build is whole)."""
    for path in out.rglob("*"):
        if path.is_file():
            _fsync_file(path)
    (out / MARKER).write_text(f"built by {sys.executable}\n")
    _fsync_file(out / MARKER)
    _fsync_dir(out)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
