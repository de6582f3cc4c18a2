"""The llama.cpp engine: a `.gguf` model served by llama.cpp (the `llama-cpp-python` bindings),
driven through its batch API by the same step loop, drafters and policy as the torch engine.

One llama.cpp context per replica holds every running row as a sequence (`seq_id`), each in a
KV stream of its own. A row's tokens must not depend on how they were computed — alone or beside
other rows, verified in a block of k + 1 or decoded one by one, its prompt in one chunk or
several — or speculation would not return plain decoding's tokens. Measured here (`bench
invariance --engine llamacpp`), llama.cpp gives that only with flash attention over a KV cache
quantized to 8 bits (Q8_0, as `-ctk q8_0 -ctv q8_0`): over its default F16 cache, a pass of one
token and a pass of several round attention differently (without flash attention at every
context, with it from ~250 cached tokens, and prompts cut into other chunks differ from ~100), and
one unified cache for all rows did once rows left and their cells were reused. Q8_0 also halves
the cache's bytes; it is part of the numerical model whose quality is measured against the float
target. A pass is one `llama_decode` of a batch whose tokens carry explicit positions
and sequence ids, with logits requested only where the loop reads them (every position of a
verified block, the last token of a prompt chunk); rejected drafts are cut with
`llama_memory_seq_rm`. Weights keep the file's own quantization types and llama.cpp's kernels
(which quantize activations to 8 bits in the dot products), so this is a different numerical
model from the float torch target: its output is exact *to itself* — speculation on this engine
returns the tokens its plain decoding returns (checked by the tests and `bench invariance`).

The weights are the file's own, or the file requantized by llama.cpp to one type (`requantized`,
`LoopSettings.gguf_weights`). Whether a type's kernels give a row the same logits whatever the
pass's width and batch depends on the type and the CPU — types with repacked matrix-matrix kernels
switch paths by a pass's token count — so it is measured where the engine runs (`pass_variance`,
a probe of a few seconds, once per process); speculation is refused on weights where the probe
found a difference, with what it found (on an AVX2 EPYC: the file's Q4_1, Q4_0, Q5_0 and Q8_0 are
invariant; IQ4_NL, F16 and BF16 are not).

Memory is split evenly: each of `max_sequences` rows may hold `max_tokens / max_sequences` tokens,
rounded up to a multiple of 256 (llama-server's slots); a request whose prompt + max_tokens exceeds
its row's share is refused at once (`sequence_tokens`), and every admitted row fits.

Drafters that need more of the target than tokens — its hidden states (EAGLE, Medusa), its own
layers (early exit), tree-shaped blocks (lookahead) — are refused with the reason (`refusal`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..embedded import specroute_home
from ..errors import ModelLoadError
from ..kv import BLOCK_TOKENS, BlockStructure, CacheFull, PrefixStats

if TYPE_CHECKING:
    from policies.engines import GgufWeights

    from ..speculative.drafters import Drafter
    from . import EngineName

log = logging.getLogger("specroute.llamacpp")
INSTALL_HINT = (
    "install it with `pip install llama-cpp-python` (a source build with the system's C compiler and cmake, "
    "several minutes on 2 cores; `make install` does it)"
)
FLASH_ATTENTION_ON = 1  # llama.cpp's LLAMA_FLASH_ATTN_TYPE_ENABLED
KV_TYPE_Q8_0 = 8  # ggml's GGML_TYPE_Q8_0
CONTEXT_PAD = 256  # llama.cpp rounds a context's size up to a multiple of this
PROBE_CONTEXT = 64  # tokens per row in the step-cost probe, as the torch engine's probe
_LOAD = threading.Lock()


@functools.cache
def llama_unavailable() -> str | None:
    """Why llama.cpp cannot run in this process (None: it can)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # an import of a native library can fail in many ways: say which
        return f"llama.cpp is unavailable: `import llama_cpp` failed ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def _llama() -> Any:
    """The `llama_cpp` module, its backend initialised once and its log kept to warnings."""
    reason = llama_unavailable()
    if reason is not None:
        raise ModelLoadError(reason)
    import llama_cpp

    _init_backend(llama_cpp)
    return llama_cpp


@functools.cache
def _init_backend(llama_cpp: Any) -> None:
    global _LOG_CALLBACK
    # llama.cpp prints every tensor and buffer it sets up; only its warnings and errors go to our log.
    _LOG_CALLBACK = llama_cpp.llama_log_callback(_forward_log)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()


_LOG_CALLBACK: Any = None  # kept referenced: llama.cpp calls it for the life of the process


def _forward_log(level: int, text: bytes, _user_data: Any) -> None:
    if level in (3, 4):  # ggml's GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        log.log(logging.WARNING if level == 3 else logging.ERROR, "%s", text.decode(errors="replace").rstrip())


@functools.cache
def _model(path: str) -> Any:
    """The llama.cpp model at `path`, loaded once per process and shared by every context."""
    llama_cpp = _llama()
    with _LOAD:
        params = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {path}: is it a GGUF file of an architecture it supports?")
    return model


def requantized(source: Path, weights: GgufWeights) -> Path:
    """`source` requantized by llama.cpp to `weights` (`llama_model_quantize`, requantizing a quantized
    file as `llama-quantize --allow-requantize` does; a tensor the type cannot hold, such as a row
    length its blocks do not divide, keeps llama.cpp's fallback type); `file`: `source` itself. Made
    once per source file's content and kept under SPECROUTE_HOME; replicas starting together never
    read half a file."""
    if weights == "file":
        return source
    stat = source.stat()
    digest = _content_digest(str(source), stat.st_size, stat.st_mtime_ns)
    target = specroute_home() / "cache" / "gguf" / f"{source.stem}.{weights}.{digest}.gguf"
    if not target.is_file():
        _quantize(source, weights, target)
    return target


@functools.cache
def _content_digest(source: str, _size: int, _mtime_ns: int) -> str:
    """A file's content hash, read once per process and file version (it reads the whole file)."""
    digest = hashlib.sha256()
    with open(source, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _quantize(source: Path, weights: str, target: Path) -> None:
    llama_cpp = _llama()
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{weights}")
    params.allow_requantize = True
    params.nthread = max(torch.get_num_threads(), 1)
    try:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(staged).encode(), ctypes.byref(params))
        if status != 0:
            raise ModelLoadError(f"llama.cpp could not requantize {source.name} to {weights} (status {status})")
        staged.replace(target)
    finally:
        staged.unlink(missing_ok=True)


def gguf_weight_types(path: Path) -> str:
    """llama.cpp's description of the model at `path`, e.g. 'llama ?B Q4_1' (architecture, size, weight type)."""
    llama_cpp = _llama()
    buffer = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(_model(str(path)), buffer, len(buffer))
    return buffer.value.decode()


class LlamaCppEngine:
    """The step loop's engine over one llama.cpp context (see the module docstring)."""

    name: EngineName = "llamacpp"
    device = torch.device("cpu")

    def __init__(self, path: Path, max_tokens: int, max_sequences: int, threads: int, batch_tokens: int = 512):
        """`max_tokens`: the most tokens the KV cache holds over all sequences; `max_sequences`: the
        most rows at once; `batch_tokens`: the most tokens one pass feeds (the step's budget)."""
        llama_cpp = self._api = _llama()
        if not 1 <= max_sequences <= llama_cpp.llama_max_parallel_sequences():
            raise ModelLoadError(
                f"llama.cpp runs at most {llama_cpp.llama_max_parallel_sequences()} sequences in one context; "
                f"{max_sequences} were asked for: lower max_batch"
            )
        self.path = Path(path)
        self.model = _model(str(self.path))
        # Each row's share in whole blocks of CONTEXT_PAD tokens: llama.cpp pads n_ctx to a multiple of
        # it, then splits n_ctx evenly over the sequences (rounding down, with a warning, where uneven).
        share = max(math.ceil(max_tokens / max_sequences / CONTEXT_PAD), 1) * CONTEXT_PAD
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = share * max_sequences
        params.n_batch = params.n_ubatch = max(batch_tokens, 1)
        params.n_seq_max = max_sequences
        params.n_threads = params.n_threads_batch = max(threads, 1)
        params.kv_unified = False  # a stream per row: see the module docstring
        params.flash_attn_type = FLASH_ATTENTION_ON  # with a Q8_0 cache: width- and batch-invariant
        params.type_k = params.type_v = KV_TYPE_Q8_0
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {params.n_ctx} tokens for {self.path}")
        self.batch_tokens = params.n_batch
        self.sequence_tokens = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self._vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self._batch = llama_cpp.llama_batch_init(self.batch_tokens, 0, 1)
        self.max_sequences = max_sequences
        self.threads = max(threads, 1)
        self._free_ids = list(range(max_sequences - 1, -1, -1))
        self.lengths: dict[int, int] = {}
        self.prefix_stats = PrefixStats()  # no prefix cache on this engine yet: every prompt is prefilled

    # -- sequences --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab

    def add(self, reserve: int = 0, prefix: Sequence[int] = (), salt: str | None = None) -> int:
        """A new empty sequence; `reserve` tokens are promised to it (see `can_reserve`). This
        engine keeps no prefix cache: `prefix` and `salt` find nothing."""
        if not self._free_ids:
            raise CacheFull("every llama.cpp sequence of this context is in use")
        if not self.can_reserve(reserve):
            raise CacheFull(f"no room to reserve {reserve} tokens")
        seq = self._free_ids.pop()
        self.lengths[seq] = 0
        return seq

    def remove(self, seq: int) -> None:
        self._api.llama_memory_seq_rm(self.memory, seq, -1, -1)
        del self.lengths[seq]
        self._free_ids.append(seq)

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` tokens (rejected drafts are forgotten)."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"truncate can only shorten a sequence ({self.lengths[seq]} → {length})")
        if length < self.lengths[seq]:
            self._api.llama_memory_seq_rm(self.memory, seq, length, -1)
        self.lengths[seq] = length

    def keep_branch(self, seq: int, start: int, kept: Sequence[int]) -> None:
        raise NotImplementedError("the llama.cpp engine verifies chains only (see refusal)")

    def cached_tokens(self, seq: int) -> int:
        return 0

    def commit(self, seq: int, tokens: Sequence[int]) -> None:
        """Nothing is cached for later sequences on this engine."""

    def adopt(self, seq: int, prefix: Sequence[int]) -> int:
        return 0  # no prefix cache

    def next_key(self, seq: int, prefix: Sequence[int]) -> bytes | None:
        return None

    def spare_blocks(self) -> int:
        """Nothing is shared to grow into: each sequence owns a fixed share of the context."""
        return 0

    def growth_blocks(self, seq: int, tokens: int) -> int:
        return 0  # its share holds every request `check` admitted

    def can_reserve(self, tokens: int, prefix: Sequence[int] = (), salt: str | None = None, growing: int = 0) -> bool:
        """A free row whose share holds `tokens` (every sequence has its own share to grow in)."""
        return bool(self._free_ids) and tokens <= self.sequence_tokens

    @property
    def usage(self) -> float:
        """Share of the KV cache held by sequences now (vLLM's kv_cache_usage_perc, as 0..1)."""
        return sum(self.lengths.values()) / (self.sequence_tokens * self.max_sequences)

    def refusal(self, drafter: Drafter) -> str | None:
        needs = _needs_more_than_tokens(drafter)
        if needs is not None:
            return f"{needs}: serve it with engine torch, or pick a drafter that needs only tokens (ngram, model)"
        variance = pass_variance(str(self.path), self.threads)
        if variance is not None:
            return (
                f"speculation would not return these weights' plain tokens: {variance}; serve them plain, or pick "
                "weights whose passes are invariant here (on an AVX2 EPYC the probe found Q4_1, Q4_0, Q5_0 and Q8_0 so)"
            )
        return None

    # -- passes -----------------------------------------------------------------------------
    def logits(
        self,
        seqs: Sequence[int],
        blocks: Sequence[Sequence[int]],
        width: int | None = None,
        structures: Sequence[BlockStructure | None] | None = None,
    ) -> torch.Tensor:
        """Logits at every block position, (B, W, V), W = max(width, longest block); positions past a
        row's block are zeros (llama.cpp computes no padding: a pass costs its real tokens)."""
        if structures is not None and any(s is not None for s in structures):
            raise NotImplementedError("the llama.cpp engine verifies chains only (see refusal)")
        counts = [len(b) for b in blocks]
        rows = self._decode(seqs, blocks, [list(range(c)) for c in counts])
        out = torch.zeros((len(seqs), max([width or 0, *counts, 1]), self._vocab), dtype=torch.float32)
        start = 0
        for row, count in enumerate(counts):
            out[row, :count] = rows[start : start + count]
            start += count
        return out

    def last_logits(self, seqs: Sequence[int], blocks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits after each sequence's last new token, (B, V)."""
        return self._decode(seqs, blocks, [[len(b) - 1] for b in blocks])

    def features(self, layers: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError("the llama.cpp engine exposes no hidden states (see refusal)")

    def _decode(self, seqs: Sequence[int], blocks: Sequence[Sequence[int]], wanted: list[list[int]]) -> torch.Tensor:
        """Feed every row its block at its next positions in passes of at most `batch_tokens`
        tokens; the logits at the `wanted` block indices, in row order, (outputs, V)."""
        items = [
            (seq, self.lengths[seq] + i, token, i in want)
            for seq, block, want in zip(seqs, blocks, wanted, strict=True)
            for i, token in enumerate(block)
        ]
        parts = [self._pass(items[i : i + self.batch_tokens]) for i in range(0, len(items), self.batch_tokens)]
        for seq, block in zip(seqs, blocks, strict=True):
            self.lengths[seq] += len(block)
        if not parts:
            return torch.zeros((0, self._vocab))
        return torch.cat(parts)

    def _pass(self, items: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        batch = self._batch
        batch.n_tokens = len(items)
        for i, (seq, position, token, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.logits[i] = token, position, want
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
        status = self._api.llama_decode(self.ctx, batch)
        if status == 1:
            raise CacheFull(f"llama.cpp found no room in a row's KV cache of {self.sequence_tokens} tokens")
        if status != 0:
            raise RuntimeError(f"llama.cpp failed a pass of {len(items)} tokens (llama_decode returned {status})")
        outputs = sum(1 for item in items if item[3])
        if not outputs:
            return torch.zeros((0, self._vocab))
        pointer = self._api.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(outputs, self._vocab)).copy())

    def fill(self, seqs: Sequence[int], count: int, generator: np.random.Generator) -> None:
        """`count` tokens of random context in each of `seqs`, fed together (real passes: llama.cpp
        has no placeholder keys), for timing passes, whose cost depends on how long the context is,
        not on what it holds."""
        blocks = [generator.integers(0, self._vocab, count).tolist() for _ in seqs]
        self._decode(seqs, blocks, [[] for _ in seqs])

    def copy(self, source: int, target: int) -> None:
        """Make the empty sequence `target` hold what `source` holds (llama.cpp copies the KV
        stream: no pass runs)."""
        if self.lengths[target]:
            raise ValueError(f"sequence {target} is not empty")
        self._api.llama_memory_seq_cp(self.memory, source, target, -1, -1)
        self.lengths[target] = self.lengths[source]

    def close(self) -> None:
        """Free the context now rather than when the garbage collector gets to it."""
        if self.ctx:
            self._api.llama_batch_free(self._batch)
            self._api.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


def _needs_more_than_tokens(drafter: Drafter) -> str | None:
    if drafter.feature_layers:
        return "it reads the target's hidden states, which llama.cpp does not expose per layer"
    if drafter.widest_block:
        return "it verifies tree-shaped blocks, and llama.cpp's batches are causal chains per sequence"
    if drafter.reads_target_layers:
        return "it runs the target's own layers in torch, a different numerical model from llama.cpp's"
    return None


PROBE_WIDTHS = (1, 2, 5, 9)  # a decode step, and verify passes of 1, 4 and 8 drafts
PROBE_ROWS = 8  # the batch a row is also computed in
PROBE_CHUNK = 240  # a prompt chunk sharing a pass with a row's block (a pass of ~250 tokens)


@functools.cache
def pass_variance(path: str, threads: int) -> str | None:
    """Whether llama.cpp's kernels for the weights at `path` give a row's logits independent of how
    they are computed on this machine, measured: random tokens after a 16-token context, fed in
    blocks of each probe width — alone, among `PROBE_ROWS` rows, and beside another row's
    `PROBE_CHUNK`-token prompt chunk — against the same tokens fed one at a time alone (bit for
    bit). None: no difference; else where the first one was and how large. Which kernels run
    depends on the weight type, the CPU and a pass's token count (types with repacked matrix-matrix
    kernels switch paths by it), so it is measured where it runs, once per process. Tokens and
    contexts other than the probe's could still differ; the tests and `bench invariance` check
    real prompts."""
    context, longest = 16, max(PROBE_WIDTHS)
    row_tokens = context + PROBE_CHUNK + longest
    batch_tokens = PROBE_ROWS * longest + PROBE_CHUNK
    engine = LlamaCppEngine(Path(path), PROBE_ROWS * row_tokens, PROBE_ROWS, threads, batch_tokens=batch_tokens)
    try:
        generator = np.random.default_rng(7)
        rows = [generator.integers(0, engine.vocab_size, context + longest).tolist() for _ in range(PROBE_ROWS)]
        chunk = generator.integers(0, engine.vocab_size, PROBE_CHUNK).tolist()
        seqs = [engine.add() for _ in rows]
        engine.logits(seqs, [r[:context] for r in rows])
        reference = torch.cat([engine.logits([seqs[0]], [[t]])[0] for t in rows[0][context:]])
        cases = [(w, b, False) for w in PROBE_WIDTHS for b in (1, PROBE_ROWS)] + [(w, 2, True) for w in (1, 5)]
        for width, batch, beside_chunk in cases:
            for seq in seqs:
                engine.truncate(seq, context)
            blocks = [r[context : context + width] for r in rows[:batch]]
            if beside_chunk:
                blocks[1] = chunk
            delta = float((engine.logits(seqs[:batch], blocks)[0, :width] - reference[:width]).abs().max())
            if delta > 0:
                where = "beside a prompt chunk" if beside_chunk else f"in a batch of {batch}"
                return (
                    f"a block of {width} token(s) {where} changed a logit by {delta:.3g} against the same tokens fed "
                    f"one at a time (llama.cpp's kernels for {Path(path).name} on this CPU)"
                )
        return None
    finally:
        engine.close()


def measure_llamacpp_step_times(
    path: Path,
    batch: int,
    widths: Sequence[int],
    threads: int,
    context: int = PROBE_CONTEXT,
    repeats: int = 3,
) -> dict[int, float]:
    """Best-of-`repeats` seconds of a llama.cpp pass of each width (new tokens per row) for `batch`
    rows over `context` cached tokens each (`measure_llamacpp_curve` of one batch)."""
    return measure_llamacpp_curve(path, [batch], widths, threads, context, repeats)[batch]


def measure_llamacpp_curve(
    path: Path,
    batches: Sequence[int],
    widths: Sequence[int],
    threads: int,
    context: int = PROBE_CONTEXT,
    repeats: int = 3,
) -> dict[int, dict[int, float]]:
    """Best-of-`repeats` seconds of a llama.cpp pass of each width for each batch (in the order
    given) over `context` cached tokens a row, in a context of its own on the same model: one row is
    filled and copied into the widest batch's other rows (llama.cpp has no placeholder keys, and a
    pass's cost depends on how long its rows' contexts are, not on what they hold: filling 32 rows
    of 192 tokens on one thread here took a minute, copying them a millisecond), and a batch of b
    passes over the first b rows (each row its own KV stream, so the rows left out cost nothing).
    Rounds go round all widths in turn, as the torch probe's."""
    rows = max(batches)
    tokens = rows * (context + max(widths)) + BLOCK_TOKENS
    engine = LlamaCppEngine(path, tokens, rows, threads, batch_tokens=max(rows * max(widths), BLOCK_TOKENS))
    generator = np.random.default_rng(0)
    try:
        seqs = [engine.add() for _ in range(rows)]
        engine.fill(seqs[:1], context, generator)
        for seq in seqs[1:]:
            engine.copy(seqs[0], seq)
        engine.logits(seqs, [[0] for _ in seqs])  # llama.cpp copies streams at the next pass: not one timed
        for seq in seqs:
            engine.truncate(seq, context)
        measured: dict[int, dict[int, float]] = {}
        for batch in batches:
            seconds = measured.setdefault(batch, dict.fromkeys(widths, float("inf")))
            for _ in range(repeats):
                for width in widths:
                    blocks = [generator.integers(0, engine.vocab_size, width).tolist() for _ in seqs[:batch]]
                    begun = time.perf_counter()
                    engine.logits(seqs[:batch], blocks)
                    seconds[width] = min(seconds[width], time.perf_counter() - begun)
                    for seq in seqs[:batch]:
                        engine.truncate(seq, context)
        return measured
    finally:
        engine.close()


def measure_llamacpp_prefill(path: Path, length: int, threads: int, repeats: int = 3) -> float:
    """Best-of-`repeats` seconds to prefill one prompt of `length` random tokens and read the logits
    after it (the time to first token), in a one-row context of its own; the prompt is fed in one
    pass, as the step loop feeds a chunk."""
    size = max(math.ceil(length / BLOCK_TOKENS), 1) * BLOCK_TOKENS
    engine = LlamaCppEngine(path, size, 1, threads, batch_tokens=size)
    generator = np.random.default_rng(0)
    try:
        best = float("inf")
        for _ in range(repeats):
            seq = engine.add()
            prompt = generator.integers(0, engine.vocab_size, length).tolist()
            begun = time.perf_counter()
            engine.last_logits([seq], [prompt])
            best = min(best, time.perf_counter() - begun)
            engine.remove(seq)
        return best
    finally:
        engine.close()


def kv_bytes_per_token(values_per_token: int) -> int:
    """Bytes one cached token takes in this engine's cache: its keys and values (`values_per_token`
    over every layer) in Q8_0, 34 bytes per block of 32."""
    return math.ceil(values_per_token * 34 / 32)


def score_sequence(path: Path, tokens: Sequence[int], threads: int) -> torch.Tensor:
    """The logits after every position of `tokens`, (len, V), read in one pass of a one-row context
    of its own (teacher forcing, for the quality measured against the float target)."""
    size = max(math.ceil(len(tokens) / BLOCK_TOKENS), 1) * BLOCK_TOKENS
    engine = LlamaCppEngine(path, size, 1, threads, batch_tokens=size)
    try:
        seq = engine.add()
        return engine.logits([seq], [list(tokens)])[0, : len(tokens)]
    finally:
        engine.close()
