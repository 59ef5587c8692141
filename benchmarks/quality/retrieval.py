"""A small Llama that has learned something: key-value retrieval from long filler text.

The demo models have random weights, so their next-token distributions are flat and cannot rank
codecs. This one is trained here, deterministically, on CPU in minutes, on one task: a haystack
of random filler words holds a few ``KEY k v1 v2`` records (distinct keys, random values); after
it, ``KEY k`` asks for one key again and the answer is its two value tokens. To answer, the model
must find the one earlier position whose key matches and copy the two tokens after it (an
induction circuit) -- precise recall, what 4-bit keys lose at long context (mission trap 2).

* **Vocabulary** (word level, so vLLM serves it with a real tokenizer): ``<s> </s> <pad> KEY
  QUERY`` (``QUERY`` is reserved, unused), 256 filler words ``w0..``, 256 keys ``k0..``, 256 values ``v0..``.
* **Model**: Llama, 2 layers, hidden 128, 2 heads of 64 (2 KV heads), tied embeddings (copying a
  token is then nearly the identity map), ``rope_theta`` 1e6 so the
  low-frequency RoPE channels barely turn within the longest contexts it is asked about (content
  matching over long distances rides on them).
* **Training**: AdamW, a fixed number of steps with a fixed seed and lengths growing from 64 to
  4096 tokens; 1-8 records per haystack, 1-4 queries after it (loss on the answers only). While
  sequences are short, half of each batch is a random run repeated (loss on the copy): a dense
  signal that forms the induction circuit quickly (without it the loss sat at chance for
  hundreds of steps), and the retrieval rows are dense (records back to back, 4-8 queries).
  Training data comes from one seed stream, evaluation from another (``EVAL_STREAM``): no
  haystack of an evaluation was ever trained on.
* **Built once** per cache directory, like the demo models (``demo_model.build_once``), with its
  training record and its own accuracy per length (HF, float32, no kvtier) in
  ``kvtier-retrieval.json``.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtier.config import default_cache_dir
from kvtier.models.demo import build_once, import_hf, seal

__all__ = ["BOS", "KEY", "QUERY", "RETRIEVAL_VERSION", "Haystack", "accuracy", "ensure_retrieval_model",
           "make_haystack", "model_info", "retrieval_model_dir", "save", "train"]

RETRIEVAL_VERSION = 2
BOS, EOS, PAD, KEY, QUERY = 0, 1, 2, 3, 4
FILLER0, N_FILLER = 5, 256
KEY0, N_KEYS = FILLER0 + N_FILLER, 256
VALUE0, N_VALUES = KEY0 + N_KEYS, 256
VOCAB = VALUE0 + N_VALUES
RECORD = 4  # KEY k v1 v2
MAX_POSITIONS = 131072
GEOMETRY = {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 2, "intermediate": 256, "rope_theta": 1e6}
TRAIN_SEED = 0
EVAL_STREAM = 1  # evaluation haystacks: seeds from another stream than training's
# (length, steps, batch): short dense sequences first (cheap steps; the retrieval circuit forms after
# ~500 of them), then longer haystacks with fewer sequences per step (about the same tokens per step)
SCHEDULE = ((64, 1200, 32), (256, 600, 16), (1024, 300, 8), (2048, 100, 4), (4096, 150, 2))
LR = 2e-3
INFO_FILE = "kvtier-retrieval.json"
EVAL_LENGTHS = (256, 1024, 4096)  # measured at build time (HF, float32); the benchmark goes further via vLLM


def retrieval_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    base = Path(cache_dir) if cache_dir is not None else Path(default_cache_dir()) / "models"
    return base.expanduser() / f"kvtier-retrieval-v{RETRIEVAL_VERSION}"


# ---- the task ---------------------------------------------------------------------------------------
@dataclass
class Haystack:
    tokens: list[int]  # BOS + filler with the records in it (no query)
    records: list[tuple[int, int, int, int]]  # (position of KEY, key, v1, v2), in position order

    def question(self, which: int) -> list[int]:
        """The haystack followed by the query for record ``which``."""
        return self.tokens + [KEY, self.records[which][1]]

    def answer(self, which: int) -> list[int]:
        return list(self.records[which][2:])


def make_haystack(rng: Any, length: int, records: int = 4, depths: Sequence[float] | None = None) -> Haystack:
    """A haystack of ``length`` tokens with ``records`` records at random places, or at ``depths``
    (fractions of the haystack, one record each). ``rng``: a numpy Generator."""
    if depths is not None:
        records = len(depths)
    slots = (length - 1) // RECORD
    if records > slots:
        raise ValueError(f"{records} records do not fit in {length} tokens")
    if depths is None:
        chosen = sorted(rng.choice(slots, size=records, replace=False).tolist())
    else:
        chosen = sorted({min(int(d * slots), slots - 1) for d in depths})
        if len(chosen) < records:
            raise ValueError(f"depths {list(depths)} collide in {length} tokens")
    tokens = (FILLER0 + rng.integers(0, N_FILLER, size=length)).tolist()
    tokens[0] = BOS
    keys = (KEY0 + rng.choice(N_KEYS, size=records, replace=False)).tolist()
    values = (VALUE0 + rng.integers(0, N_VALUES, size=(records, 2))).tolist()
    placed = []
    for slot, key, (v1, v2) in zip(chosen, keys, values):
        at = 1 + slot * RECORD
        tokens[at:at + RECORD] = [KEY, key, v1, v2]
        placed.append((at, key, v1, v2))
    return Haystack(tokens, placed)


def _batch(rng: Any, length: int, size: int) -> tuple[Any, Any]:
    """(input ids, labels) of ``size`` training sequences of ``length`` tokens: a haystack, then
    queries with their answers; labels only on the answers. Short sequences are dense (records
    nearly back to back, many queries: many answers per step while the retrieval circuit forms);
    long ones are a few records in filler, as evaluated."""
    import torch

    ids = torch.full((size, length), PAD, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    dense = length <= 128
    for row in range(size):
        if dense and row % 2:  # a random run, filler, the same run again: every token of the copy is
            # predictable from the first by content only (run and gap lengths vary, so no fixed
            # offset answers): the induction circuit retrieval needs
            run_len = int(rng.integers(6, (length - 1) // 2 + 1))
            gap = int(rng.integers(0, length - 1 - 2 * run_len + 1))
            run = (FILLER0 + rng.integers(0, N_FILLER + N_KEYS + N_VALUES, size=run_len)).tolist()
            fill = (FILLER0 + rng.integers(0, N_FILLER, size=length - 1 - 2 * run_len)).tolist()
            seq = [BOS] + run + fill[:gap] + run + fill[gap:]
            ids[row] = torch.tensor(seq)
            second = 1 + run_len + gap
            labels[row, second + 1:second + run_len] = ids[row, second + 1:second + run_len]
            continue
        n_queries = int(rng.integers(4, min(8, (length - 1) // (2 * RECORD)) + 1)) if dense else \
            int(rng.integers(1, 5))
        body = length - n_queries * RECORD
        slots = (body - 1) // RECORD
        n_records = int(rng.integers(max(n_queries, slots // 2), slots + 1)) if dense else \
            int(rng.integers(n_queries, 9))
        stack = make_haystack(rng, body, n_records)
        seq = list(stack.tokens)
        for which in rng.choice(n_records, size=n_queries, replace=False).tolist():
            _, key, v1, v2 = stack.records[which]
            labels[row, len(seq) + 2:len(seq) + 4] = torch.tensor([v1, v2])
            seq += [KEY, key, v1, v2]
        ids[row] = torch.tensor(seq)
    return ids, labels


# ---- the model ---------------------------------------------------------------------------------------
def _config(transformers: Any, geometry: dict) -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=geometry["hidden"], intermediate_size=geometry["intermediate"],
        num_hidden_layers=geometry["layers"], num_attention_heads=geometry["heads"],
        num_key_value_heads=geometry["kv_heads"], max_position_embeddings=MAX_POSITIONS, bos_token_id=BOS,
        eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=True, rope_theta=geometry["rope_theta"])


def train(schedule: Sequence[tuple[int, int, int]] = SCHEDULE, seed: int = TRAIN_SEED,
          progress: Callable[[str], None] | None = None, lr: float = LR) -> tuple[Any, dict]:
    """Train a fresh model; (model in float32, training record). ``schedule``: (length, steps, batch)
    phases. Deterministic for a given seed and schedule on a given torch build and thread count."""
    import numpy as np
    import torch

    _, _, transformers = import_hf()
    say = progress or (lambda _msg: None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config(transformers, GEOMETRY))
    model.config._attn_implementation = "sdpa"
    rng = np.random.default_rng([seed, 0])
    total = sum(steps for _, steps, _ in schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, min(100, total // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
    started = time.perf_counter()
    step, losses = 0, []
    model.train()
    for length, steps, batch in schedule:
        for _ in range(steps):
            ids, labels = _batch(rng, length, batch)
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if step % 100 == 0 or step == total:
                say(f"step {step}/{total} at {length} tokens: loss {np.mean(losses[-100:]):.3f} "
                    f"({time.perf_counter() - started:.0f} s)")
    model.eval()
    record = {"steps": total, "schedule": [list(s) for s in schedule], "lr": lr, "seed": seed,
              "final_loss": round(float(np.mean(losses[-50:])), 4), "train_s": round(time.perf_counter() - started, 1)}
    return model, record


def accuracy(model: Any, length: int, trials: int, seed: int, records: int = 4) -> float:
    """Exact-match accuracy of both answer tokens, greedy, on ``trials`` fresh haystacks (seed stream
    ``EVAL_STREAM``, never trained on), one query per haystack, at a random record."""
    import numpy as np
    import torch

    rng = np.random.default_rng([seed, EVAL_STREAM, length])
    hits = 0
    with torch.no_grad():
        for _ in range(trials):
            stack = make_haystack(rng, length, records)
            which = int(rng.integers(0, records))
            ids = torch.tensor([stack.question(which)])
            out = model(input_ids=ids, use_cache=True)
            first = int(out.logits[0, -1].argmax())
            second = int(model(input_ids=torch.tensor([[first]]), past_key_values=out.past_key_values)
                         .logits[0, -1].argmax())
            hits += [first, second] == stack.answer(which)
    return hits / trials


# ---- built once, cached --------------------------------------------------------------------------------
def ensure_retrieval_model(cache_dir: str | os.PathLike[str] | None = None,
                           progress: Callable[[str], None] | None = None) -> Path:
    """The retrieval model's directory, training it first (minutes on CPU) if no complete copy exists."""
    return build_once(retrieval_model_dir(cache_dir), _build, progress)


def model_info(path: str | os.PathLike[str]) -> dict | None:
    """The training record and measured accuracies of a retrieval model directory (None: not one)."""
    return read_info(path, INFO_FILE, "kvtier_retrieval")


def read_info(path: str | os.PathLike[str], name: str, marker: str) -> dict | None:
    """The JSON record ``name`` of a model directory when it is a dict carrying ``marker``; None when
    it is missing, unreadable or another model's."""
    try:
        info = json.loads((Path(path) / name).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get(marker) else None


def _tokenizer(out: Path) -> None:
    tk, transformers = import_hf()[1:]
    words = ["<s>", "</s>", "<pad>", "KEY", "QUERY"] + [f"w{i}" for i in range(N_FILLER)] + \
        [f"k{i}" for i in range(N_KEYS)] + [f"v{i}" for i in range(N_VALUES)]
    tok = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tk.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", model_max_length=MAX_POSITIONS)
    fast.save_pretrained(out)


def save(model: Any, out: Path, record: dict, measured: dict | None = None) -> None:
    """Write a trained model as a directory vLLM serves: tokenizer, bf16 weights, and the training
    record with its measured accuracies (``kvtier-retrieval.json``)."""
    import torch

    _tokenizer(out)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    info = {"kvtier_retrieval": True, "version": RETRIEVAL_VERSION, "geometry": GEOMETRY, "vocab": VOCAB,
            "params": sum(p.numel() for p in model.parameters()), "training": record,
            "hf_accuracy": measured or {}, "eval_trials": 50,
            "note": "trained on synthetic key-value retrieval; see benchmarks/quality/retrieval.py"}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _build(out: Path, say: Callable[[str], None]) -> None:
    say(f"training the retrieval model ({sum(s for _, s, _ in SCHEDULE)} steps, a few minutes on CPU)")
    model, record = train(progress=say)
    measured = {}
    for length in EVAL_LENGTHS:
        measured[str(length)] = accuracy(model, length, trials=50, seed=12345)
        say(f"accuracy at {length} tokens (HF, float32, no kvtier): {measured[str(length)]:.2f}")
    save(model, out, record, measured)
    seal(out)
